"""The pure-Python n-gram backend: the reference twin of csrc/ngram.h (same ranks, same file).

Used when the C++ extension is not built (one warning), or on request (``backend="python"`` or
``STAGED_ENGINE_NGRAM_BACKEND=python``); the tests hold the two backends to identical answers.
"""
from __future__ import annotations

import numbers
import operator
import struct
import zlib
from array import array
from typing import Any, Iterable

from staged_engine.ngram.format import (
    COUNT_MAX,
    FORMAT_VERSION,
    HEADER,
    HEADER_SIZE,
    ID_BITS,
    ID_MASK,
    LITTLE,
    MAGIC,
    MAX_ORDER,
    MAX_VOCAB,
    check_list,
    pack_context,
    read_array,
    swapped,
)

# ----------------------------------------------------------------------------------------------
# Pure-Python backend (the reference twin of csrc/ngram.h)


def _as_index(x: Any, what: str) -> int:
    if isinstance(x, numbers.Integral):
        return int(x)
    try:
        return int(x.__index__())
    except (AttributeError, TypeError):
        raise ValueError(f"{what}: items must be integers") from None


def _rank(entries: Iterable[tuple[int, int]], top_m: int) -> list[tuple[int, int]]:
    ranked = sorted(entries, key=lambda e: (-e[1], e[0]))
    return ranked[:top_m] if top_m else ranked


class ReferenceNGram:
    """Pure-Python n-gram model with the interface and results of the C++ ``_ngram.Model``.

    lists[L] maps a context tuple of length L (L = 0: the empty tuple) to its ranked
    [(token, count), ...]; top_m = 0 means no cut.
    """

    def __init__(self, order: int, vocab_size: int, top_m: int, min_count: int,
                 lists: list[dict[tuple[int, ...], list[tuple[int, int]]]]) -> None:
        self.order = order
        self.vocab_size = vocab_size
        self.top_m = top_m
        self.min_count = min_count
        self._lists = lists

    # -- construction -------------------------------------------------------------------------

    @classmethod
    def build(cls, tokens: Any, doc_offsets: Any, order: int, vocab_size: int, top_m: int,
              min_count: int) -> "ReferenceNGram":
        toks = [int(t) for t in tokens]
        offs = [int(o) for o in doc_offsets]
        if vocab_size == 0:  # infer
            if not toks:
                raise ValueError("token_ids: empty, so vocab_size cannot be inferred; pass it")
            vocab_size = max(max(toks) + 1, 1)
            if min(toks) < 0 or vocab_size > MAX_VOCAB:
                vocab_size = MAX_VOCAB  # the range check below names the offending id
        if not 1 <= order <= MAX_ORDER:
            raise ValueError(f"order: must be in 1..4, got {order}")
        if not 1 <= vocab_size <= MAX_VOCAB:
            raise ValueError(f"vocab_size: must be in 1..2097152 (2^21), got {vocab_size}")
        for i, t in enumerate(toks):
            if not 0 <= t < vocab_size:
                raise ValueError(
                    f"token_ids: token id {t} at position {i} is outside [0, {vocab_size})")
        counts: list[dict[tuple[int, ...], dict[int, int]]] = [{} for _ in range(order)]
        for d in range(len(offs) - 1):
            doc = toks[offs[d]:offs[d + 1]]
            for i, t in enumerate(doc):
                for L in range(min(i, order - 1) + 1):
                    c = counts[L].setdefault(tuple(doc[i - L:i]), {})
                    c[t] = c.get(t, 0) + 1
        lists: list[dict[tuple[int, ...], list[tuple[int, int]]]] = [{} for _ in range(order)]
        for L in range(order):
            for ctx, c in counts[L].items():
                kept = [(t, min(n, COUNT_MAX)) for t, n in c.items() if n >= min_count]
                if kept:
                    lists[L][ctx] = _rank(kept, top_m)
        return cls(order, vocab_size, top_m, min_count, lists)

    # -- queries ------------------------------------------------------------------------------

    def _tail(self, context: Any, want: int) -> tuple[int, ...]:
        if isinstance(context, str):
            raise ValueError("context: must be a sequence of token ids")
        try:
            n = len(context)
        except TypeError:
            raise ValueError("context: must be a sequence of token ids") from None
        out = []
        for j in range(n - min(n, want), n):
            v = _as_index(context[j], "context")
            if not 0 <= v < self.vocab_size:
                raise ValueError(
                    f"context: token id {v} is outside [0, {self.vocab_size})")
            out.append(v)
        return tuple(out)

    def _topk(self, ctx: tuple[int, ...], k: int) -> list[int]:
        k = min(k, self.vocab_size)
        out: list[int] = []
        seen: set[int] = set()
        for L in range(len(ctx), -1, -1):
            for t, _ in self._lists[L].get(ctx[len(ctx) - L:], ()):
                if len(out) == k:
                    return out
                if t not in seen:
                    seen.add(t)
                    out.append(t)
        return out

    def topk(self, context: Any, k: int) -> list[int]:
        k = operator.index(k)
        if k < 1:
            raise ValueError(f"k: must be >= 1, got {k}")
        return self._topk(self._tail(context, self.order - 1), k)

    def propose(self, context: Any, widths: Any) -> tuple[list[int], list[int]]:
        ctx = self._tail(context, self.order - 1)
        if isinstance(widths, str) or not hasattr(widths, "__len__"):
            raise ValueError("widths: must be a sequence of positive integers")
        ws = [_as_index(w, "widths") for w in widths]
        for w in ws:
            if w < 1:
                raise ValueError(f"widths: every width must be >= 1, got {w}")
        tokens: list[int] = []
        parents: list[int] = []
        parent = -1
        keep = self.order - 1
        for w in ws:
            level = self._topk(ctx, w)
            if not level:
                break
            first = len(tokens)
            tokens.extend(level)
            parents.extend([parent] * len(level))
            parent = first
            ctx = (ctx + (level[0],))[max(0, len(ctx) + 1 - keep):] if keep else ()
        return tokens, parents

    def continuations(self, context: Any) -> list[tuple[int, int]]:
        if isinstance(context, str) or not hasattr(context, "__len__"):
            raise ValueError("context: must be a sequence of token ids")
        if len(context) > self.order - 1:
            raise ValueError(f"context: at most order-1 = {self.order - 1} ids")
        ctx = self._tail(context, self.order - 1)
        return list(self._lists[len(ctx)].get(ctx, ()))

    def num_contexts(self, L: int) -> int:
        if not 0 <= L < MAX_ORDER:
            raise ValueError("L: must be in 0..3")
        return len(self._lists[L]) if L < self.order else 0

    def num_entries(self, L: int) -> int:
        if not 0 <= L < MAX_ORDER:
            raise ValueError("L: must be in 0..3")
        return sum(map(len, self._lists[L].values())) if L < self.order else 0

    # -- online update ------------------------------------------------------------------------

    def update(self, tokens: Any, skip: int) -> None:
        toks = [int(t) for t in tokens]
        if skip < 0:
            raise ValueError("skip: must be >= 0")
        for t in toks:
            if not 0 <= t < self.vocab_size:
                raise ValueError(f"tokens: token id {t} is outside [0, {self.vocab_size})")
        for L in range(self.order):
            inc: dict[tuple[int, ...], dict[int, int]] = {}
            for i in range(max(skip, L), len(toks)):
                c = inc.setdefault(tuple(toks[i - L:i]), {})
                c[toks[i]] = c.get(toks[i], 0) + 1
            lists = self._lists[L]
            for ctx, c in inc.items():
                cur = dict(lists.get(ctx, ()))
                for t, n in c.items():
                    cur[t] = min(cur.get(t, 0) + n, COUNT_MAX)
                lists[ctx] = _rank(cur.items(), self.top_m)

    def fold(self) -> None:
        """No-op: the Python backend has no separate overlay."""

    # -- file format --------------------------------------------------------------------------

    def to_bytes(self) -> bytes:
        order = self.order
        uni = array("I")
        for t, c in self._lists[0].get((), ()):
            uni.extend((t, c))
        sections = [uni.tobytes() if LITTLE else swapped(uni)]
        n_ctx = [0, 0, 0]
        n_ent = [len(uni) // 2, 0, 0, 0]
        for L in range(1, order):
            keys, lens, ents = array("Q"), array("I"), array("I")
            for ctx in sorted(self._lists[L], key=pack_context):
                lst = self._lists[L][ctx]
                keys.append(pack_context(ctx))
                lens.append(len(lst))
                for t, c in lst:
                    ents.extend((t, c))
            n_ctx[L - 1] = len(keys)
            n_ent[L] = len(ents) // 2
            sections += [a.tobytes() if LITTLE else swapped(a) for a in (keys, lens, ents)]
        body = b"".join(sections)
        head = HEADER.pack(MAGIC, FORMAT_VERSION, HEADER_SIZE, order, self.vocab_size,
                            self.top_m, self.min_count, *n_ctx, *n_ent, len(body),
                            zlib.crc32(body), 0, bytes(16))
        head = head[:108] + struct.pack("<I", zlib.crc32(head[:108])) + head[112:]
        return head + body

    @classmethod
    def from_bytes(cls, data: Any) -> "ReferenceNGram":
        data = bytes(data)
        size = len(data)
        if size < HEADER_SIZE:
            raise ValueError(f"n-gram file: truncated ({size} bytes, the header alone is 128)")
        (magic, version, hsize, order, vocab, top_m, min_count, c1, c2, c3, e0, e1, e2, e3, body,
         body_crc, head_crc, reserved) = HEADER.unpack_from(data, 0)
        if magic != MAGIC:
            raise ValueError("n-gram file: bad magic (not a staged-engine n-gram file)")
        if version != FORMAT_VERSION:
            raise ValueError(f"n-gram file: unsupported version {version}")
        if hsize != HEADER_SIZE:
            raise ValueError("n-gram file: bad header size")
        if zlib.crc32(data[:108]) != head_crc:
            raise ValueError("n-gram file: header checksum mismatch")
        if any(reserved):
            raise ValueError("n-gram file: reserved header bytes are not zero")
        if not 1 <= order <= MAX_ORDER:
            raise ValueError(f"n-gram file: order {order} outside 1..4")
        if not 1 <= vocab <= MAX_VOCAB:
            raise ValueError(f"n-gram file: vocab size {vocab} outside 1..2^21")
        if min_count < 1:
            raise ValueError("n-gram file: min_count is 0")
        if body != size - HEADER_SIZE:
            raise ValueError(f"n-gram file: body size {body} in the header, "
                             f"{size - HEADER_SIZE} bytes in the file (truncated?)")
        n_ctx = [0, c1, c2, c3]
        n_ent = [e0, e1, e2, e3]
        for L in range(MAX_ORDER):
            if L >= order and (n_ctx[L] or n_ent[L]):
                raise ValueError("n-gram file: sections beyond the order are not empty")
        if sum(12 * c + 8 * e for c, e in zip(n_ctx, n_ent)) != body:
            raise ValueError("n-gram file: section sizes do not add up to the body size")
        if e0 > vocab:
            raise ValueError("n-gram file: more unigrams than the vocabulary")
        if zlib.crc32(data[HEADER_SIZE:]) != body_crc:
            raise ValueError("n-gram file: body checksum mismatch (corrupt file)")
        max_len = min(vocab, top_m) if top_m else vocab
        pos = HEADER_SIZE
        if e0 > max_len:
            raise ValueError("n-gram file: unigram list longer than top_m")
        uni = read_array(data, pos, "I", 2 * e0)
        pos += 8 * e0
        lists: list[dict[tuple[int, ...], list[tuple[int, int]]]] = [{} for _ in range(order)]
        if e0:
            lists[0][()] = check_list(uni, 0, e0, vocab)
        for L in range(1, order):
            nc, ne = n_ctx[L], n_ent[L]
            keys = read_array(data, pos, "Q", nc)
            lens = read_array(data, pos + 8 * nc, "I", nc)
            ents = read_array(data, pos + 12 * nc, "I", 2 * ne)
            pos += 12 * nc + 8 * ne
            off = 0
            prev = -1
            for key, n in zip(keys, lens):
                if key <= prev:
                    raise ValueError("n-gram file: context keys not ascending")
                prev = key
                if key >> (ID_BITS * L):
                    raise ValueError("n-gram file: context key out of range")
                ctx = tuple((key >> (ID_BITS * j)) & ID_MASK for j in range(L - 1, -1, -1))
                if max(ctx) >= vocab:
                    raise ValueError("n-gram file: context token id outside the vocabulary")
                if not 1 <= n <= max_len:
                    raise ValueError("n-gram file: bad continuation list length")
                if n > ne - off:
                    raise ValueError("n-gram file: list lengths exceed the entries")
                lists[L][ctx] = (off, n)  # type: ignore[assignment]  # resolved below
                off += n
            if off != ne:
                raise ValueError("n-gram file: list lengths do not cover the entries")
            for ctx, (o, n) in lists[L].items():  # type: ignore[misc]
                lists[L][ctx] = check_list(ents, o, n, vocab)
        return cls(order, vocab, top_m, min_count, lists)
