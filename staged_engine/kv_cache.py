"""A static, preallocated KV cache with per-row lengths (gpt-fast style).

Layout: ``k`` and ``v`` are (n_layer, B, H, S, D): layer, batch row, head, slot, head dim.
Row b has committed slots [0, lengths[b]). Forward passes append *pending* entries after
them: a pass over N new tokens writes slots [lengths[b] + pending, + N) and adds N to
``pending`` (a drafter may run several passes per round; the oracle runs one). The caller
then either ``advance``s (keep every pending entry, in order) or ``commit_path``s the accepted
tree path (ALGORITHMS.md sec. 7), or ``discard``s. Nothing is zeroed: slots past the
committed length are garbage by contract and masked out of attention.
"""
from __future__ import annotations

import torch

from .backend import Backend


class KVCache:
    def __init__(self, n_layer: int, batch: int, n_head: int, max_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str, backend: Backend) -> None:
        if batch < 1 or max_len < 1:
            raise ValueError(f"KVCache needs batch >= 1 and max_len >= 1, got {batch}, {max_len}")
        shape = (n_layer, batch, n_head, max_len, head_dim)  # (L, B, H, S, D)
        self.k = torch.empty(shape, dtype=dtype, device=device)
        self.v = torch.empty(shape, dtype=dtype, device=device)
        self.max_len = max_len
        self.backend = backend
        self.lengths: list[int] = [0] * batch  # committed slots per row (host copy, authoritative)
        self.pending = 0  # entries written after lengths[b] by forward passes, not yet committed

    @property
    def batch(self) -> int:
        return self.k.shape[1]

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2

    def room(self) -> int:
        """Free slots in the fullest row."""
        return self.max_len - max(self.lengths)

    def reset(self) -> None:
        self.lengths = [0] * self.batch
        self.pending = 0

    def write_starts(self, n: int) -> list[int]:
        """Slots where a pass of n new tokens goes, checked against the cache size."""
        starts = [length + self.pending for length in self.lengths]
        if max(starts) + n > self.max_len:
            raise ValueError(f"KV cache overflow: {max(starts) + n} slots needed, max_len {self.max_len}")
        return starts

    def advance(self) -> None:
        """Keep every pending entry (they were a chain in position order)."""
        self.lengths = [length + self.pending for length in self.lengths]
        self.pending = 0

    def discard(self) -> None:
        """Forget the pending entries."""
        self.pending = 0

    def truncate(self, length: int) -> None:
        """Forget everything past ``length`` in every row."""
        self.lengths = [min(length, x) for x in self.lengths]
        self.pending = 0

    def commit_path(self, path: list[int], row: int = 0) -> None:
        """Keep the pending entries ``path`` (strictly increasing, path[0] == 0) of ``row``.

        Moves the entry at slot L + path[m] to slot L + m in every layer, then sets the row's
        length to L + len(path) and drops the other pending entries. Safe because path[m] >= m.
        """
        start = self.lengths[row]
        if not path or path[0] != 0 or path[-1] >= self.pending:
            raise ValueError(f"commit path must start at pending entry 0 and stay below "
                             f"{self.pending}, got {path}")
        if path[-1] != len(path) - 1:  # not already in place (a chain prefix needs no move)
            self.backend.commit(self.k, self.v, row, start, path)
        self.lengths[row] = start + len(path)
        if self.batch == 1:
            self.pending = 0

    def select_rows(self, rows: list[int]) -> None:
        """Reorder/duplicate batch rows in place (beam reselection): row i <- old row rows[i]."""
        if len(rows) != self.batch:
            raise ValueError(f"select_rows needs {self.batch} indices, got {len(rows)}")
        if rows == list(range(self.batch)):
            return
        idx = torch.tensor(rows, device=self.k.device)
        span = max(self.lengths[r] for r in rows)
        self.k[:, :, :, :span] = self.k[:, idx, :, :span]
        self.v[:, :, :, :span] = self.v[:, idx, :, :span]
        self.lengths = [self.lengths[r] for r in rows]
