"""Token healing: the prompt's last token is removed and the first new token must start with it.

A prompt cut at an arbitrary byte ends in a token that training text rarely ended there: "x."
ends in "." although the text would have gone on as ".append", and a prompt ending in eight
spaces ends in a token that training text follows with " return" only after seven. Healing
backs up one token and lets the model choose the first new token among those whose bytes start
with the removed token's bytes, so the boundary is the model's, not the prompt's.

The reference is HF transformers' ``generate(token_healing=True)``, which biases those
candidates; here the constraint is hard (every other token is masked), and the first token is
chosen by the engine's one sampling rule at its absolute position, so every strategy returns
exactly plain decoding's tokens with healing on, greedy or seeded.
"""
from __future__ import annotations

import bisect

import torch


def _byte_decoder() -> dict[str, int]:
    """GPT-2 byte-level BPE: the printable character that stands for each byte, inverted."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


class TokenHealer:
    """Byte strings of a byte-level BPE vocabulary and prefix queries over them."""

    def __init__(self, tokenizer, vocab_size: int) -> None:
        dec = tokenizer.decoder
        if dec is None or type(dec).__name__ != "ByteLevel":
            raise ValueError("token_healing needs a byte-level BPE tokenizer (tokenizer.json with a "
                             f"ByteLevel decoder); this one has {type(dec).__name__ if dec else 'none'}")
        table = _byte_decoder()
        special = {t.content for t in tokenizer.get_added_tokens_decoder().values()}
        self.token_bytes: list[bytes | None] = [None] * vocab_size
        for piece, i in tokenizer.get_vocab().items():
            if i >= vocab_size or piece in special:
                continue
            try:
                self.token_bytes[i] = bytes(table[ch] for ch in piece)
            except KeyError:  # not a byte-level symbol: leave the token out of healing
                continue
        order = sorted((b, i) for i, b in enumerate(self.token_bytes) if b is not None)
        self._sorted = [b for b, _ in order]
        self._ids = [i for _, i in order]

    def extensions(self, token: int) -> list[int]:
        """Ids of every (non-special) token whose bytes start with ``token``'s bytes, itself included;
        empty when ``token`` is special."""
        prefix = self.token_bytes[token] if 0 <= token < len(self.token_bytes) else None
        if not prefix:
            return []
        lo = bisect.bisect_left(self._sorted, prefix)
        out = []
        for j in range(lo, len(self._sorted)):
            if not self._sorted[j].startswith(prefix):
                break
            out.append(self._ids[j])
        return sorted(out)

    def text_after(self, removed: int, tokens: list[int]) -> str:
        """Text of ``tokens`` (whose first token extends ``removed``) minus ``removed``'s bytes."""
        data = b"".join(self.token_bytes[t] or b"" for t in tokens)
        return data[len(self.token_bytes[removed] or b""):].decode("utf-8", errors="replace")

    @staticmethod
    def mask(logits: torch.Tensor, allowed: list[int]) -> torch.Tensor:
        """``logits`` (V,) with every token outside ``allowed`` at -inf."""
        out = torch.full_like(logits, float("-inf"))
        idx = torch.tensor(allowed, dtype=torch.int64, device=logits.device)
        return out.index_copy_(0, idx, logits.index_select(0, idx))
