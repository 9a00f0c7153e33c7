"""The n-gram file format and the token-id inputs both n-gram backends share.

The format (version 1) is laid out at the top of csrc/ngram.h: a 128-byte header (magic, version,
order, vocabulary size, section sizes, CRC-32 of the body and of the header) and the ranked
lists. The Python twin (``reference.py``) reads and writes it with the helpers below; the C++
backend has its own reader, and tests/ngram/test_ngram_loader_fuzz.py holds both to the same
verdict on every corrupted file.
"""
from __future__ import annotations

import numbers
import struct
import sys
from array import array
from itertools import chain
from typing import Any

MAX_ORDER = 4  # contexts of at most 3 ids
MAX_VOCAB = 1 << 21  # ids must lie in [0, 2^21): three ids pack into one 64-bit key
FORMAT_VERSION = 1

MAGIC = b"SENGRAM\0"
HEADER_SIZE = 128
HEADER = struct.Struct("<8sIIIIQQ3Q4QQII16s")  # layout of csrc/ngram.h, 128 bytes
COUNT_MAX = 0xFFFFFFFF  # counts saturate here, as in C++
ID_BITS = 21
ID_MASK = MAX_VOCAB - 1
LITTLE = sys.byteorder == "little"


# ----------------------------------------------------------------------------------------------
# Input conversion


def int64_array(values: Any, what: str) -> Any:
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


def flatten_documents(token_ids: Any) -> tuple[Any, array]:
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
            return int64_array(arr.reshape(-1), "token_ids"), array(
                "q", range(0, rows * cols + 1, cols) if cols else [0] * (rows + 1)
            )
        if arr.ndim != 1:
            raise ValueError(f"token_ids: expected a 1-D or 2-D array, got shape {arr.shape}")
        flat = int64_array(arr, "token_ids")
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
        flat = int64_array(chain([first], it), "token_ids")
        return flat, array("q", [0, len(flat)])
    tokens = array("q")
    offsets = array("q", [0])
    for doc in chain([first], it):
        if hasattr(doc, "__array__"):
            tokens.frombytes(int64_array(doc, "token_ids").tobytes())
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


def positive_int(value: Any, what: str, allow_none: bool = False) -> int | None:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{what}: expected an integer >= 1, got {value!r}")
    return int(value)


def pack_context(ctx: tuple[int, ...]) -> int:
    key = 0
    for t in ctx:
        key = (key << ID_BITS) | t
    return key


def swapped(a: array) -> bytes:
    b = array(a.typecode, a)
    b.byteswap()
    return b.tobytes()


def read_array(data: bytes, pos: int, typecode: str, n: int) -> array:
    a = array(typecode)
    a.frombytes(data[pos:pos + n * a.itemsize])
    if not LITTLE:
        a.byteswap()
    return a


def check_list(flat: array, off: int, n: int, vocab: int) -> list[tuple[int, int]]:
    """Entries off..off+n of a flat (token, count) array, checked: ids < vocab, counts > 0,
    strictly ranked (count descending, then token ascending), no token twice."""
    out = []
    prev_t, prev_c = -1, COUNT_MAX + 1
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
