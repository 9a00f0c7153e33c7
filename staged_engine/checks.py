"""Small helpers every layer shares: argument checks that name the argument, atomic file writes."""
from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager


def is_int(value) -> bool:
    """A Python integer that is not a bool (True is an int, but never a valid count)."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_int(name: str, value, low: int = 1) -> int:
    """``value`` if it is an integer >= ``low``, else ValueError naming ``name``."""
    if not is_int(value) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    return value


@contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[str]:
    """Yields a temporary path beside ``path``; when the block succeeds it replaces ``path`` in
    one rename, so a reader never sees a half-written file. The temporary is removed either way."""
    target = os.fspath(path)
    tmp = f"{target}.tmp{os.getpid()}"
    try:
        yield tmp
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
