"""Synthetic Markov "language models" for exact-law tests (ALGORITHMS.md sec. 10).

``MarkovLM``: p(v | prefix) = T[prefix[-1], v] with a (V, V) float64 transition matrix, so the
probability of any continuation is a closed-form product of matrix entries (the DSBD core tests).
``Markov2Model``: a second-order chain p(v | a, b) = T[a, b, v] behind GPT-2's forward contract
over a real KVCache, so the real ``Engine`` drives it unchanged (the speculative law tests).
"""
from __future__ import annotations

import math
from typing import Sequence

import torch

from staged_engine.beam.core import CachelessLM


class MarkovLM(CachelessLM):
    """BeamLM over a (V, V) row-stochastic float64 matrix; counts its calls."""

    def __init__(self, transition: torch.Tensor) -> None:
        if transition.dtype != torch.float64 or transition.dim() != 2:
            raise ValueError("transition must be a (V, V) float64 tensor")
        if not torch.allclose(transition.sum(1), torch.ones(transition.shape[0], dtype=torch.float64)):
            raise ValueError("transition rows must sum to 1")
        self.transition = transition
        self.calls = 0

    @property
    def vocab(self) -> int:
        return self.transition.shape[0]

    def probs(self, prefixes: Sequence[tuple[int, ...]]) -> torch.Tensor:
        """(n, V) float64: the next-token distribution after each prefix."""
        self.calls += 1
        return self.transition[[prefix[-1] for prefix in prefixes]]

    def log_prob(self, seq: Sequence[int], start: int) -> float:
        """Closed form: log of the probability of seq[start:] given seq[:start]."""
        total = 0.0
        for t in range(start, len(seq)):
            p = float(self.transition[seq[t - 1], seq[t]])
            total += math.log(p) if p > 0 else -math.inf
        return total


def random_markov(vocab: int, seed: int, zero_frac: float = 0.0, sharpness: float = 1.0) -> MarkovLM:
    """A random chain; each entry is zeroed with probability ``zero_frac`` (every row keeps at
    least one positive entry); ``sharpness`` > 1 makes rows peakier."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.rand(vocab, vocab, dtype=torch.float64, generator=g) ** sharpness
    zeros = torch.rand(vocab, vocab, dtype=torch.float64, generator=g) < zero_frac
    keep = torch.randint(vocab, (vocab,), generator=g)
    zeros[torch.arange(vocab), keep] = False
    rows = torch.where(zeros, torch.zeros_like(rows), rows + 1e-3)
    return MarkovLM(rows / rows.sum(1, keepdim=True))


# --------------------------------------------------------------------------------------------
# A second-order Markov LM that the real engine drives like a GPT-2 (ALGORITHMS.md sec. 7, 10)
# --------------------------------------------------------------------------------------------
def random_markov2(vocab: int, seed: int, zero_frac: float = 0.0, sharpness: float = 1.0) -> torch.Tensor:
    """A random (V, V, V) float64 second-order transition tensor, T[a, b, v] = p(v | a, b).

    Each entry is zeroed with probability ``zero_frac`` (every row keeps at least one positive
    entry); ``sharpness`` > 1 makes rows peakier."""
    g = torch.Generator().manual_seed(seed)
    shape = (vocab, vocab, vocab)
    rows = torch.rand(shape, dtype=torch.float64, generator=g) ** sharpness
    zeros = torch.rand(shape, dtype=torch.float64, generator=g) < zero_frac
    keep = torch.randint(vocab, (vocab, vocab), generator=g)
    a, b = torch.meshgrid(torch.arange(vocab), torch.arange(vocab), indexing="ij")
    zeros[a, b, keep] = False
    rows = torch.where(zeros, torch.zeros_like(rows), rows + 1e-3)
    return rows / rows.sum(-1, keepdim=True)


class _Config:
    """The fields of GPT2Config the engine reads from a model."""

    def __init__(self, vocab_size: int, n_positions: int) -> None:
        self.vocab_size = vocab_size
        self.n_positions = n_positions
        self.eos_token_id = None
        self.n_layer, self.n_head, self.head_dim = 1, 1, 2
        self.weight_bytes_fp32 = 4 * vocab_size ** 3


class _Embedding:
    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight


class Markov2Model:
    """A second-order Markov "LM" p(v | a, b) = T[a, b, v] behind GPT2's forward contract.

    Usable as ``Engine(oracle=..., draft=...)``: ``new_cache`` returns a real KVCache (1 layer,
    1 head, head_dim 2, float64) and ``__call__(tokens, positions, cache, tree_mask, last_only)``
    writes each new token's (token, position) as its "K" (and "V") at the slots the cache gives
    (``cache.append``), then finds each node's context the way attention would: committed
    slots [0, lengths[b]) plus the pending entries the node may see (``tree_mask[i, j]``, or
    the chain rule j <= M - N + i when the mask is None). The logits of a node holding token b
    at position t are log T[a, b, :], a being the visible entry at position t - 1 (``bos`` at
    t = 0). Its entries become pending like the real model's.

    With ``strict`` (default) every node must see exactly one entry per position 0..t, itself
    at t, and committed slot s must hold position s: any mask or commit bug that would feed a
    real transformer a wrong context raises instead of passing silently. ``ignore_mask`` makes
    the model treat every pass as a chain (a deliberate bug for mutation checks; it implies
    ``strict=False`` and then takes the latest visible entry at t - 1).
    """

    def __init__(self, transition: torch.Tensor, n_positions: int = 64, bos: int = 0,
                 strict: bool = True, ignore_mask: bool = False) -> None:
        if transition.dtype != torch.float64 or transition.dim() != 3 or len(set(transition.shape)) != 1:
            raise ValueError("transition must be a (V, V, V) float64 tensor")
        if not torch.allclose(transition.sum(-1), torch.ones(transition.shape[:2], dtype=torch.float64)):
            raise ValueError("transition rows must sum to 1")
        vocab = transition.shape[0]
        self.transition = transition
        self.log_t = transition.log()  # -inf where T is 0
        self.config = _Config(vocab, n_positions)
        self.wte = _Embedding(torch.zeros(vocab, 2, dtype=torch.float64))
        self.bos = bos
        self.strict = strict and not ignore_mask
        self.ignore_mask = ignore_mask
        self.calls = 0
        self.nodes = 0

    @property
    def vocab(self) -> int:
        return self.transition.shape[0]

    def new_cache(self, batch: int = 1, max_len: int | None = None):
        from staged_engine.model.kv_cache import KVCache

        c = self.config
        return KVCache(c.n_layer, batch, c.n_head, max_len or c.n_positions, c.head_dim, torch.float64, "cpu")

    def weight_bytes(self) -> int:
        return self.config.weight_bytes_fp32

    def _visibility(self, tree_mask: torch.Tensor | None, b: int, n: int, m: int) -> torch.Tensor:
        """(B, N, M) bool: may new token i of row b see uncommitted entry j."""
        if tree_mask is None or self.ignore_mask:
            chain = torch.ones(n, m, dtype=torch.bool).tril_(m - n)
            return chain.expand(b, n, m)
        mask = tree_mask.to("cpu", torch.bool)
        return mask.expand(b, n, m) if mask.dim() == 2 else mask

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, cache, tree_mask=None,
                 last_only: bool = False, backend=None) -> torch.Tensor:
        b, n = tokens.shape
        if tuple(positions.shape) != (b, n):
            raise ValueError(f"positions must be {(b, n)}, got {tuple(positions.shape)}")
        m = cache.pending + n
        if tree_mask is not None:
            if tuple(tree_mask.shape[-2:]) != (n, m) or tree_mask.dim() not in (2, 3) \
                    or (tree_mask.dim() == 3 and tree_mask.shape[0] != b):
                raise ValueError(f"tree_mask must be ({n}, {m}) for {n} new tokens after "
                                 f"{cache.pending} pending entries, got {tuple(tree_mask.shape)}")
            if tree_mask.dtype != torch.bool:
                raise ValueError(f"tree_mask must be bool, got {tree_mask.dtype}")
        writes, _, m = cache.append(n)
        self.calls += 1
        self.nodes += b * n
        kv = cache.k[0, :, 0]  # (B, S, 2): [..., 0] token, [..., 1] position
        vv = cache.v[0, :, 0]
        for row, s in enumerate(writes):
            entry = torch.stack([tokens[row], positions[row]], dim=-1).to(torch.float64)
            kv[row, s:s + n] = entry
            vv[row, s:s + n] = entry
        visible = self._visibility(tree_mask, b, n, m)
        pos = positions.tolist()
        prev = [[0] * n for _ in range(b)]
        for row in range(b):
            length = cache.lengths[row]
            committed = [int(x) for x in kv[row, :length, 1].tolist()]
            pend = kv[row, length:length + m].tolist()  # [[token, position], ...]
            vis_rows = visible[row].tolist()
            if self.strict and committed != list(range(length)):
                raise AssertionError(f"committed slots hold positions {committed}, want 0..{length - 1}")
            for i in range(n):
                p = pos[row][i]
                seen = [(int(t), int(q)) for j, (t, q) in enumerate(pend) if vis_rows[i][j]]
                if self.strict:
                    if not vis_rows[i][m - n + i]:
                        raise AssertionError(f"row {row} node {i} cannot see itself")
                    got = sorted(committed + [q for _, q in seen])
                    if got != list(range(p + 1)):
                        raise AssertionError(f"row {row} node {i} at position {p} sees positions {got}")
                if p == 0:
                    prev[row][i] = self.bos
                elif p - 1 < length:
                    prev[row][i] = int(kv[row, p - 1, 0])
                else:
                    cands = [t for t, q in seen if q == p - 1]
                    if not cands:
                        raise AssertionError(f"row {row} node {i} at position {p} sees no position {p - 1}")
                    prev[row][i] = cands[-1]
        a = torch.tensor(prev, dtype=torch.int64)
        logits = self.log_t[a, tokens]  # (B, N, V)
        return logits[:, -1:] if last_only else logits


def sample_markov2(transition: torch.Tensor, length: int, seed: int,
                   start: tuple[int, int] = (0, 0)) -> list[int]:
    """A token stream of ``length`` ids drawn from the chain T (for building n-gram models)."""
    g = torch.Generator().manual_seed(seed)
    a, b = start
    out = []
    for _ in range(length):
        v = int(torch.multinomial(transition[a, b], 1, generator=g))
        out.append(v)
        a, b = b, v
    return out
