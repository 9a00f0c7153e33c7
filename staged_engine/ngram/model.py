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

import errno
import numbers
import os
import warnings
from array import array
from typing import Any, Sequence

from staged_engine.checks import atomic_path
from staged_engine.ngram.format import (
    FORMAT_VERSION,
    MAX_ORDER,
    MAX_VOCAB,
    flatten_documents,
    int64_array,
    positive_int,
)
from staged_engine.ngram.reference import ReferenceNGram

try:
    from staged_engine import _ngram
except ImportError:  # the extension links libc10/libtorch_cpu, which `import torch` loads
    try:
        import torch  # noqa: F401

        from staged_engine import _ngram
    except ImportError:
        _ngram = None
        warnings.warn(
            "staged_engine._ngram is not built: the n-gram model uses its pure-Python fallback "
            "(same results, far slower). Build it with `pip install --no-build-isolation -e .`.",
            RuntimeWarning,
            stacklevel=2,
        )

__all__ = ["NGramModel", "MAX_ORDER", "MAX_VOCAB", "FORMAT_VERSION", "BACKEND_ENV", "cpp_available"]
BACKEND_ENV = "STAGED_ENGINE_NGRAM_BACKEND"


def cpp_available() -> bool:
    """True when the C++ backend (``staged_engine._ngram``) is built."""
    return _ngram is not None


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
            positive_int(vocab_size, "vocab_size")
            if vocab_size > MAX_VOCAB:
                raise ValueError(f"vocab_size: must be <= 2^21 = {MAX_VOCAB}, got {vocab_size}")
        top = positive_int(top_m, "top_m", allow_none=True) or 0
        mc = positive_int(min_count, "min_count")
        tokens, offsets = flatten_documents(token_ids)
        vocab = int(vocab_size) if vocab_size is not None else 0
        if vocab == 0 and len(tokens) == 0:
            raise ValueError("token_ids: empty, so vocab_size cannot be inferred; pass it")
        if be == "cpp":  # vocab 0: inferred as max id + 1
            impl = _ngram.Model.build(tokens, offsets, int(order), vocab, top, mc)
        else:
            impl = ReferenceNGram.build(tokens, offsets, int(order), vocab, top, mc)
        return cls(impl, be)

    @classmethod
    def from_bytes(cls, data: bytes, backend: str | None = None) -> "NGramModel":
        """Parse a file image (see csrc/ngram.h); ValueError if it is corrupt or not one."""
        be = _resolve_backend(backend)
        impl = _ngram.Model.from_bytes(data) if be == "cpp" else ReferenceNGram.from_bytes(data)
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
        data = self._impl.to_bytes()
        with atomic_path(path) as tmp, open(tmp, "wb") as f:
            f.write(data)

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
        buf = int64_array(head, "context")
        new = int64_array(tokens, "tokens")
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
