"""Back-off n-gram draft model: the lowest stage of the drafter cascade (ALGORITHMS.md sec. 6).

``NGramModel`` counts the n-grams of orders 1..n (n <= 4) of a token-id corpus and ranks, for a
context, the continuations of its last n-1 tokens by count (descending, ties by smaller id),
filling from shorter contexts (back-off one order at a time) and finally from unigram counts,
never repeating a token and never inventing an unseen one. ``propose`` returns a whole n-gram
mini-tree (widths such as [12, 7, 4, 1, 1, 1]) in one call, so a drafter never loops in Python.

Two backends give identical results and read and write the same file format:

- ``cpp``: ``staged_engine._ngram`` (csrc/ngram.h, csrc/ngram.cpp), built by setup.py;
- ``python``: the pure-Python twin below, used when the extension is not built (one warning)
  or when asked for, with ``backend="python"`` or ``STAGED_ENGINE_NGRAM_BACKEND=python``.

The file format (version 1) is described at the top of csrc/ngram.h: a 128-byte header (magic,
version, order, vocabulary size, section sizes, CRC-32 of the body and of the header) and the
ranked lists. Loading checks every size, key, id and ranking and raises ValueError on anything
inconsistent.
"""
from __future__ import annotations

import argparse
import errno
import numbers
import operator
import os
import struct
import sys
import time
import warnings
import zlib
from array import array
from itertools import chain
from typing import Any, Iterable, Iterator, Sequence

try:
    from . import _ngram
except ImportError:  # the extension links libc10/libtorch_cpu, which `import torch` loads
    try:
        import torch  # noqa: F401

        from . import _ngram
    except ImportError:
        _ngram = None
        warnings.warn(
            "staged_engine._ngram is not built: the n-gram model uses its pure-Python fallback "
            "(same results, far slower). Build it with `pip install --no-build-isolation -e .`.",
            RuntimeWarning,
            stacklevel=2,
        )

__all__ = ["NGramModel", "register_cli", "MAX_ORDER", "MAX_VOCAB", "FORMAT_VERSION"]

MAX_ORDER = 4  # contexts of at most 3 ids
MAX_VOCAB = 1 << 21  # ids must lie in [0, 2^21): three ids pack into one 64-bit key
FORMAT_VERSION = 1
BACKEND_ENV = "STAGED_ENGINE_NGRAM_BACKEND"

_MAGIC = b"SENGRAM\0"
_HEADER_SIZE = 128
_HEADER = struct.Struct("<8sIIIIQQ3Q4QQII16s")  # layout of csrc/ngram.h, 128 bytes
_COUNT_MAX = 0xFFFFFFFF  # counts saturate here, as in C++
_ID_BITS = 21
_ID_MASK = MAX_VOCAB - 1
_LITTLE = sys.byteorder == "little"


def _resolve_backend(backend: str | None) -> str:
    """'cpp' or 'python' from an argument, the environment variable, or what is built."""
    if backend is None:
        backend = os.environ.get(BACKEND_ENV, "") or "auto"
    if backend not in ("auto", "cpp", "python"):
        raise ValueError(f"backend: expected 'auto', 'cpp' or 'python', got {backend!r}")
    if backend == "auto":
        return "cpp" if _ngram is not None else "python"
    if backend == "cpp" and _ngram is None:
        raise ImportError(
            "backend='cpp' but staged_engine._ngram is not built "
            "(run `pip install --no-build-isolation -e .`)"
        )
    return backend


# ----------------------------------------------------------------------------------------------
# Input conversion


def _int64_array(values: Any, what: str) -> Any:
    """A contiguous 1-D int64 buffer (array.array('q') or numpy array) of one token sequence."""
    if isinstance(values, (str, bytes, bytearray)):
        raise ValueError(f"{what}: expected a sequence of token ids, got {type(values).__name__}")
    if hasattr(values, "__array__") and not isinstance(values, array):
        import numpy as np

        arr = np.asarray(values)
        if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iub"):
            raise ValueError(f"{what}: expected a 1-D integer array, got {arr.dtype} {arr.shape}")
        if arr.dtype.kind == "u" and arr.size and int(arr.max()) >= MAX_VOCAB:
            raise ValueError(f"{what}: token id {int(arr.max())} is outside [0, {MAX_VOCAB})")
        return np.ascontiguousarray(arr, dtype=np.int64)
    try:
        return array("q", values)
    except (TypeError, OverflowError) as exc:
        raise ValueError(f"{what}: expected integer token ids ({exc})") from None


def _flatten_documents(token_ids: Any) -> tuple[Any, array]:
    """(tokens, doc_offsets): one int64 buffer of all tokens and D+1 int64 document offsets.

    token_ids is one sequence of ids (one document) or an iterable of sequences (documents);
    a 2-D array counts as one document per row.
    """
    if isinstance(token_ids, (str, bytes, bytearray)):
        raise ValueError("token_ids: expected token ids, got text; tokenize it first")
    if hasattr(token_ids, "__array__") and not isinstance(token_ids, array):
        import numpy as np

        arr = np.asarray(token_ids)
        if arr.ndim == 2:
            rows, cols = arr.shape
            return _int64_array(arr.reshape(-1), "token_ids"), array(
                "q", range(0, rows * cols + 1, cols) if cols else [0] * (rows + 1)
            )
        if arr.ndim != 1:
            raise ValueError(f"token_ids: expected a 1-D or 2-D array, got shape {arr.shape}")
        flat = _int64_array(arr, "token_ids")
        return flat, array("q", [0, len(flat)])
    try:
        it = iter(token_ids)
    except TypeError:
        raise ValueError("token_ids: expected a sequence of ids or an iterable of sequences") from None
    end = object()
    first = next(it, end)
    if first is end:
        return array("q"), array("q", [0, 0])
    if isinstance(first, numbers.Integral):
        flat = _int64_array(chain([first], it), "token_ids")
        return flat, array("q", [0, len(flat)])
    tokens = array("q")
    offsets = array("q", [0])
    for doc in chain([first], it):
        if hasattr(doc, "__array__"):
            tokens.frombytes(_int64_array(doc, "token_ids").tobytes())
        else:
            if isinstance(doc, (str, bytes, bytearray)) or isinstance(doc, numbers.Integral):
                raise ValueError("token_ids: mixes ids and documents, or holds text")
            try:
                tokens.extend(doc.tolist() if isinstance(doc, array) and doc.typecode != "q"
                              else doc)
            except (TypeError, OverflowError) as exc:
                raise ValueError(f"token_ids: expected integer token ids ({exc})") from None
        offsets.append(len(tokens))
    return tokens, offsets


def _positive_int(value: Any, what: str, allow_none: bool = False) -> int | None:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{what}: expected an integer >= 1, got {value!r}")
    return int(value)


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


class _PyModel:
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
              min_count: int) -> "_PyModel":
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
                kept = [(t, min(n, _COUNT_MAX)) for t, n in c.items() if n >= min_count]
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
                    cur[t] = min(cur.get(t, 0) + n, _COUNT_MAX)
                lists[ctx] = _rank(cur.items(), self.top_m)

    def fold(self) -> None:
        """No-op: the Python backend has no separate overlay."""

    # -- file format --------------------------------------------------------------------------

    def to_bytes(self) -> bytes:
        order = self.order
        uni = array("I")
        for t, c in self._lists[0].get((), ()):
            uni.extend((t, c))
        sections = [uni.tobytes() if _LITTLE else _swapped(uni)]
        n_ctx = [0, 0, 0]
        n_ent = [len(uni) // 2, 0, 0, 0]
        for L in range(1, order):
            keys, lens, ents = array("Q"), array("I"), array("I")
            for ctx in sorted(self._lists[L], key=_pack):
                lst = self._lists[L][ctx]
                keys.append(_pack(ctx))
                lens.append(len(lst))
                for t, c in lst:
                    ents.extend((t, c))
            n_ctx[L - 1] = len(keys)
            n_ent[L] = len(ents) // 2
            sections += [a.tobytes() if _LITTLE else _swapped(a) for a in (keys, lens, ents)]
        body = b"".join(sections)
        head = _HEADER.pack(_MAGIC, FORMAT_VERSION, _HEADER_SIZE, order, self.vocab_size,
                            self.top_m, self.min_count, *n_ctx, *n_ent, len(body),
                            zlib.crc32(body), 0, bytes(16))
        head = head[:108] + struct.pack("<I", zlib.crc32(head[:108])) + head[112:]
        return head + body

    @classmethod
    def from_bytes(cls, data: Any) -> "_PyModel":
        data = bytes(data)
        size = len(data)
        if size < _HEADER_SIZE:
            raise ValueError(f"n-gram file: truncated ({size} bytes, the header alone is 128)")
        (magic, version, hsize, order, vocab, top_m, min_count, c1, c2, c3, e0, e1, e2, e3, body,
         body_crc, head_crc, reserved) = _HEADER.unpack_from(data, 0)
        if magic != _MAGIC:
            raise ValueError("n-gram file: bad magic (not a staged-engine n-gram file)")
        if version != FORMAT_VERSION:
            raise ValueError(f"n-gram file: unsupported version {version}")
        if hsize != _HEADER_SIZE:
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
        if body != size - _HEADER_SIZE:
            raise ValueError(f"n-gram file: body size {body} in the header, "
                             f"{size - _HEADER_SIZE} bytes in the file (truncated?)")
        n_ctx = [0, c1, c2, c3]
        n_ent = [e0, e1, e2, e3]
        for L in range(MAX_ORDER):
            if L >= order and (n_ctx[L] or n_ent[L]):
                raise ValueError("n-gram file: sections beyond the order are not empty")
        if sum(12 * c + 8 * e for c, e in zip(n_ctx, n_ent)) != body:
            raise ValueError("n-gram file: section sizes do not add up to the body size")
        if e0 > vocab:
            raise ValueError("n-gram file: more unigrams than the vocabulary")
        if zlib.crc32(data[_HEADER_SIZE:]) != body_crc:
            raise ValueError("n-gram file: body checksum mismatch (corrupt file)")
        max_len = min(vocab, top_m) if top_m else vocab
        pos = _HEADER_SIZE
        if e0 > max_len:
            raise ValueError("n-gram file: unigram list longer than top_m")
        uni = _read(data, pos, "I", 2 * e0)
        pos += 8 * e0
        lists: list[dict[tuple[int, ...], list[tuple[int, int]]]] = [{} for _ in range(order)]
        if e0:
            lists[0][()] = _check_list(uni, 0, e0, vocab)
        for L in range(1, order):
            nc, ne = n_ctx[L], n_ent[L]
            keys = _read(data, pos, "Q", nc)
            lens = _read(data, pos + 8 * nc, "I", nc)
            ents = _read(data, pos + 12 * nc, "I", 2 * ne)
            pos += 12 * nc + 8 * ne
            off = 0
            prev = -1
            for key, n in zip(keys, lens):
                if key <= prev:
                    raise ValueError("n-gram file: context keys not ascending")
                prev = key
                if key >> (_ID_BITS * L):
                    raise ValueError("n-gram file: context key out of range")
                ctx = tuple((key >> (_ID_BITS * j)) & _ID_MASK for j in range(L - 1, -1, -1))
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
                lists[L][ctx] = _check_list(ents, o, n, vocab)
        return cls(order, vocab, top_m, min_count, lists)


def _pack(ctx: tuple[int, ...]) -> int:
    key = 0
    for t in ctx:
        key = (key << _ID_BITS) | t
    return key


def _swapped(a: array) -> bytes:
    b = array(a.typecode, a)
    b.byteswap()
    return b.tobytes()


def _read(data: bytes, pos: int, typecode: str, n: int) -> array:
    a = array(typecode)
    a.frombytes(data[pos:pos + n * a.itemsize])
    if not _LITTLE:
        a.byteswap()
    return a


def _check_list(flat: array, off: int, n: int, vocab: int) -> list[tuple[int, int]]:
    """Entries off..off+n of a flat (token, count) array, checked: ids < vocab, counts > 0,
    strictly ranked (count descending, then token ascending), no token twice."""
    out = []
    prev_t, prev_c = -1, _COUNT_MAX + 1
    for i in range(off, off + n):
        t, c = flat[2 * i], flat[2 * i + 1]
        if t >= vocab:
            raise ValueError("n-gram file: token id outside the vocabulary")
        if c == 0:
            raise ValueError("n-gram file: zero count")
        if not (c < prev_c or (c == prev_c and t > prev_t)):
            raise ValueError("n-gram file: continuation list not ranked")
        prev_t, prev_c = t, c
        out.append((t, c))
    if len({t for t, _ in out}) != n:
        raise ValueError("n-gram file: a token repeats in a list")
    return out


# ----------------------------------------------------------------------------------------------
# Public model


class NGramModel:
    """A back-off n-gram model over token ids (orders 1..4, ids < 2^21).

    Make one with ``NGramModel.build`` or ``NGramModel.load``. Queries read only the last
    ``order - 1`` ids of a context. Not thread-safe for concurrent update and query.
    """

    def __init__(self, impl: Any, backend: str) -> None:
        """Wrap a backend model; use ``build`` or ``load`` instead of calling this."""
        self._impl = impl
        self._backend = backend

    # -- construction -------------------------------------------------------------------------

    @classmethod
    def build(cls, token_ids: Any, order: int = 3, vocab_size: int | None = None,
              top_m: int | None = None, min_count: int = 1,
              backend: str | None = None) -> "NGramModel":
        """Count the n-grams of orders 1..order of a corpus.

        token_ids: a sequence of ids (one document) or an iterable of sequences (documents; no
            n-gram crosses a document boundary); numpy arrays (1-D, or 2-D = one row per
            document) and array.array('q') are read without a Python loop.
        order: 1..4; contexts hold order-1 ids.
        vocab_size: ids must lie in [0, vocab_size), vocab_size <= 2^21; default max id + 1.
        top_m: keep at most this many continuations per context (None = all).
        min_count: drop n-grams seen fewer times than this in token_ids.
        backend: 'auto' (default; or $STAGED_ENGINE_NGRAM_BACKEND), 'cpp' or 'python'.
        """
        be = _resolve_backend(backend)
        if isinstance(order, bool) or not isinstance(order, numbers.Integral) \
                or not 1 <= order <= MAX_ORDER:
            raise ValueError(f"order: must be an integer in 1..4, got {order!r}")
        if vocab_size is not None:
            _positive_int(vocab_size, "vocab_size")
            if vocab_size > MAX_VOCAB:
                raise ValueError(f"vocab_size: must be <= 2^21 = {MAX_VOCAB}, got {vocab_size}")
        top = _positive_int(top_m, "top_m", allow_none=True) or 0
        mc = _positive_int(min_count, "min_count")
        tokens, offsets = _flatten_documents(token_ids)
        vocab = int(vocab_size) if vocab_size is not None else 0
        if vocab == 0 and len(tokens) == 0:
            raise ValueError("token_ids: empty, so vocab_size cannot be inferred; pass it")
        if be == "cpp":  # vocab 0: inferred as max id + 1
            impl = _ngram.Model.build(tokens, offsets, int(order), vocab, top, mc)
        else:
            impl = _PyModel.build(tokens, offsets, int(order), vocab, top, mc)
        return cls(impl, be)

    @classmethod
    def from_bytes(cls, data: bytes, backend: str | None = None) -> "NGramModel":
        """Parse a file image (see csrc/ngram.h); ValueError if it is corrupt or not one."""
        be = _resolve_backend(backend)
        impl = _ngram.Model.from_bytes(data) if be == "cpp" else _PyModel.from_bytes(data)
        return cls(impl, be)

    @classmethod
    def load(cls, path: str | os.PathLike, backend: str | None = None) -> "NGramModel":
        """Load a file written by ``save``. FileNotFoundError if missing; ValueError naming the
        file if it is truncated, corrupt or not an n-gram file."""
        p = os.fspath(path)
        if not os.path.isfile(p):
            raise FileNotFoundError(errno.ENOENT, "n-gram file not found", p)
        with open(p, "rb") as f:
            data = f.read()
        try:
            return cls.from_bytes(data, backend=backend)
        except ValueError as exc:
            raise ValueError(f"{p}: {exc}") from None

    def to_bytes(self) -> bytes:
        """The model as a version-1 file image (both backends write identical bytes)."""
        return self._impl.to_bytes()

    def save(self, path: str | os.PathLike) -> None:
        """Write the model to path (atomically: a temporary file, then rename)."""
        p = os.fspath(path)
        data = self._impl.to_bytes()
        tmp = f"{p}.tmp{os.getpid()}"
        try:
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, p)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)

    # -- queries ------------------------------------------------------------------------------

    def topk(self, context: Sequence[int], k: int) -> list[int]:
        """At most k token ids ranked for the last order-1 ids of context (ALGORITHMS.md sec. 6):
        continuations by count descending, ties by smaller id; back-off fill; no repeats; fewer
        than k when the model knows fewer tokens."""
        return self._impl.topk(context, k)

    def propose(self, context: Sequence[int], widths: Sequence[int]) -> tuple[list[int], list[int]]:
        """An n-gram mini-tree below the tip of context, in one call.

        Level j holds topk(context + [first token of levels 1..j-1], widths[j]) and hangs below
        the first (most likely) token of level j-1. Returns (tokens, parents), same length,
        topological order; parents[i] is an index into tokens or -1 (child of the context tip).
        Stops at the first level that yields nothing.
        """
        return self._impl.propose(context, widths)

    def update(self, tokens: Sequence[int], context: Sequence[int] = ()) -> None:
        """Add the n-gram counts of new text (e.g. the prompt, then each accepted chunk).

        context: the tokens just before `tokens` in the same text (its last order-1 ids are
        used), so n-grams that straddle two updates are counted once. Per touched context the
        counts are summed, re-ranked and cut to top_m; min_count is not applied.
        """
        keep = self.order - 1
        if isinstance(context, str) or not hasattr(context, "__len__"):
            raise ValueError("context: must be a sequence of token ids")
        n = len(context)
        head = [context[j] for j in range(n - min(n, keep), n)]
        buf = _int64_array(head, "context")
        new = _int64_array(tokens, "tokens")
        if len(new) == 0:
            return
        if isinstance(buf, array):
            buf.frombytes(new.tobytes())
        self._impl.update(buf, len(head))

    def continuations(self, context: Sequence[int]) -> list[tuple[int, int]]:
        """The stored ranked [(token, count)] of exactly this context (len <= order-1), no
        back-off; [] if the context is not stored."""
        return self._impl.continuations(context)

    # -- properties ---------------------------------------------------------------------------

    @property
    def order(self) -> int:
        """n: the longest n-gram counted (contexts of order-1 ids)."""
        return int(self._impl.order)

    @property
    def vocab_size(self) -> int:
        """Token ids lie in [0, vocab_size)."""
        return int(self._impl.vocab_size)

    @property
    def top_m(self) -> int | None:
        """Continuations kept per context, or None for all."""
        return int(self._impl.top_m) or None

    @property
    def min_count(self) -> int:
        """Minimum n-gram count kept at build time."""
        return int(self._impl.min_count)

    @property
    def num_contexts(self) -> int:
        """Distinct stored contexts of every length 0..order-1 (the empty one included)."""
        return sum(self._impl.num_contexts(L) for L in range(self.order))

    @property
    def num_entries(self) -> int:
        """Stored (context, token, count) entries over all context lengths."""
        return sum(self._impl.num_entries(L) for L in range(self.order))

    def contexts_per_length(self) -> list[int]:
        """[number of stored contexts of length L for L in 0..order-1]."""
        return [int(self._impl.num_contexts(L)) for L in range(self.order)]

    @property
    def backend(self) -> str:
        """'cpp' or 'python'."""
        return self._backend

    def __repr__(self) -> str:
        top = self.top_m
        return (f"NGramModel(order={self.order}, vocab_size={self.vocab_size}, top_m={top}, "
                f"min_count={self.min_count}, num_contexts={self.num_contexts}, "
                f"num_entries={self.num_entries}, backend={self.backend!r})")


# ----------------------------------------------------------------------------------------------
# CLI: `staged-engine ngram-build`

_ID_SUFFIXES = (".ids", ".tokens")


def register_cli(subparsers: Any) -> None:
    """Add the ``ngram-build`` subcommand to an argparse subparsers object.

    The parser's default ``func`` is ``run_ngram_build(args) -> int`` (exit status).
    """
    p = subparsers.add_parser(
        "ngram-build",
        help="build an n-gram draft table (.ngram) from a corpus",
        description=(
            "Count the n-grams of a corpus and write a staged-engine n-gram file.\n\n"
            "Inputs are directories (every file matching --glob below them, one document per\n"
            "file), source/text files (tokenized with --tokenizer, one document per file),\n"
            "token-id files (*.ids / *.tokens: whitespace-separated integers, one document\n"
            "per line) or *.npy integer arrays (1-D: one document; 2-D: one per row)."
        ),
        epilog=(
            "examples:\n"
            "  staged-engine ngram-build --tokenizer tokenizer.json src/ -o code.ngram\n"
            "  staged-engine ngram-build corpus.ids --order 4 --top-m 32 --min-count 2 -o c.ngram"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("inputs", nargs="+", metavar="INPUT",
                   help="directories, text/source files, token-id files (*.ids, *.tokens, *.npy)")
    p.add_argument("--tokenizer", metavar="TOKENIZER_JSON",
                   help="HuggingFace tokenizers file used for text inputs (any tokenizer.json)")
    p.add_argument("--glob", default="*.py", help="file pattern inside directories (default: *.py)")
    p.add_argument("--order", type=int, default=3, help="n, 1..4 (default: 3)")
    p.add_argument("--top-m", type=int, default=None,
                   help="keep at most M continuations per context (default: all)")
    p.add_argument("--min-count", type=int, default=1,
                   help="drop n-grams seen fewer times than this (default: 1)")
    p.add_argument("--vocab-size", type=int, default=None,
                   help="default: the tokenizer's vocabulary size, else max id + 1")
    p.add_argument("--backend", choices=("auto", "cpp", "python"), default=None,
                   help="n-gram backend (default: auto)")
    p.add_argument("--output", "-o", required=True, help="path of the .ngram file to write")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress output")
    p.set_defaults(func=run_ngram_build)


def _expand_inputs(inputs: Sequence[str], pattern: str) -> list[str]:
    from pathlib import Path

    files: list[str] = []
    for item in inputs:
        path = Path(item)
        if path.is_dir():
            files.extend(str(f) for f in sorted(path.rglob(pattern)) if f.is_file())
        elif path.is_file():
            files.append(str(path))
        else:
            raise FileNotFoundError(errno.ENOENT, "input not found", item)
    return files


def _read_documents(files: Sequence[str], tokenizer: Any, log: Any) -> Iterator[Any]:
    """Yield one int sequence per document (text files are tokenized 64 at a time); `log`
    (or None) gets a progress line about every 2 seconds and at the end."""
    batch: list[str] = []
    n_tokens = 0
    t0 = last = time.perf_counter()

    def flush() -> Iterator[list[int]]:
        nonlocal n_tokens
        for enc in tokenizer.encode_batch(batch, add_special_tokens=False) if batch else ():
            n_tokens += len(enc.ids)
            yield enc.ids
        batch.clear()

    for i, f in enumerate(files):
        if f.endswith(".npy"):
            import numpy as np

            arr = np.load(f, allow_pickle=False)
            for row in arr if arr.ndim == 2 else [arr]:
                n_tokens += len(row)
                yield row
        elif f.endswith(_ID_SUFFIXES):
            with open(f, encoding="ascii") as fh:
                for lineno, line in enumerate(fh, 1):
                    if line.strip():
                        try:
                            ids = [int(x) for x in line.split()]
                        except ValueError:
                            raise ValueError(f"{f}:{lineno}: expected integers") from None
                        n_tokens += len(ids)
                        yield ids
        else:
            if tokenizer is None:
                raise ValueError(f"--tokenizer: needed to tokenize the text file {f}")
            with open(f, encoding="utf-8", errors="replace") as fh:
                batch.append(fh.read())
            if len(batch) >= 64:
                yield from flush()
        if log and time.perf_counter() - last > 2.0:
            last = time.perf_counter()
            log(f"read {i + 1 - len(batch)}/{len(files)} files, {n_tokens / 1e6:.2f}M tokens "
                f"({last - t0:.1f} s)")
    yield from flush()
    if log:
        log(f"read {len(files)} files, {n_tokens / 1e6:.2f}M tokens "
            f"({time.perf_counter() - t0:.1f} s)")


def run_ngram_build(args: argparse.Namespace) -> int:
    """Run ``ngram-build`` from parsed arguments; returns the exit status."""

    def log(msg: str) -> None:
        if not args.quiet:
            print(f"ngram-build: {msg}", file=sys.stderr, flush=True)

    tokenizer = None
    vocab_size = args.vocab_size
    if args.tokenizer:
        if not os.path.isfile(args.tokenizer):
            raise FileNotFoundError(errno.ENOENT, "tokenizer file not found", args.tokenizer)
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(args.tokenizer)
        if vocab_size is None:
            vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        log(f"tokenizer {args.tokenizer}: vocabulary {vocab_size}")
    files = _expand_inputs(args.inputs, args.glob)
    if not files:
        raise ValueError(f"inputs: no files found (pattern {args.glob!r})")
    log(f"{len(files)} input files")
    docs = list(_read_documents(files, tokenizer, log))
    n_tokens = sum(len(d) for d in docs)
    t0 = time.perf_counter()
    model = NGramModel.build(docs, order=args.order, vocab_size=vocab_size, top_m=args.top_m,
                             min_count=args.min_count, backend=args.backend)
    del docs
    dt = time.perf_counter() - t0
    log(f"built order-{model.order} model over {n_tokens / 1e6:.2f}M tokens in {dt:.2f} s: "
        f"{model.num_contexts} contexts, {model.num_entries} entries")
    model.save(args.output)
    log(f"wrote {args.output} ({os.path.getsize(args.output) / 1e6:.1f} MB)")
    return 0
