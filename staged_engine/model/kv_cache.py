"""A static, preallocated KV cache with per-row lengths (gpt-fast style): storage with methods.

Layout: ``k`` and ``v`` are (n_layer, B, H, S, D): layer, batch row, head, slot, head dim.
Row b has committed slots [0, lengths[b]). A forward pass over N new tokens first ``append``s:
it reserves slots [lengths[b] + pending, + N) and adds N to ``pending`` (a drafter may run
several passes per round; the oracle runs one). The caller then either ``advance``s (keep every
pending entry, in order), ``commit``s the accepted tree path (ALGORITHMS.md sec. 7), or
``discard``s. Nothing is zeroed: slots past the committed length are garbage by contract and
masked out of attention.

Beams use the rest: ``view(rows, length)`` (the first rows as a cache of their own, sharing the
storage), ``reselect`` (rows take other rows' contents plus a committed path), ``compact`` (keep
some pending entries as a tree, commit their common trunk) and ``grow``. Only this class assigns
its fields. Moving entries between slots is a kernel (``Backend.commit``): the methods that move
take it as ``move``; without one they use the torch copy below.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

Move = Callable[[torch.Tensor, torch.Tensor, int, int, list[int]], None]
# Row copies of a reselection (k, v, sources, lows, span) -> whether it made them (Backend.copy_rows).
CopyRows = Callable[[torch.Tensor, torch.Tensor, list[int], list[int], int], bool]


def move_entries(k: torch.Tensor, v: torch.Tensor, row: int, start: int, path: list[int]) -> None:
    """Entry at slot start + path[m] -> slot start + m, in every layer of ``row`` (path[m] >= m)."""
    src = torch.tensor(path, device=k.device) + start
    dst = slice(start, start + len(path))
    k[:, row, :, dst] = k[:, row, :, src]  # advanced indexing on the right copies first
    v[:, row, :, dst] = v[:, row, :, src]


class KVCache:
    def __init__(self, n_layer: int, batch: int, n_head: int, max_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        if batch < 1 or max_len < 1:
            raise ValueError(f"KVCache needs batch >= 1 and max_len >= 1, got {batch}, {max_len}")
        shape = (n_layer, batch, n_head, max_len, head_dim)  # (L, B, H, S, D)
        self.k = torch.empty(shape, dtype=dtype, device=device)
        self.v = torch.empty(shape, dtype=dtype, device=device)
        self.lengths: list[int] = [0] * batch  # committed slots per row (host copy, authoritative)
        self.pending = 0  # entries written after lengths[b] by forward passes, not yet committed
        # The first rows of k and v as tensors of their own, per row count (``view``): beams take
        # a view every step, and slicing both anew cost 5.8 us against 1.5 us for a view of kept
        # slices (timeit, AMD EPYC Zen 4; more right after a forward pass). Emptied when the
        # storage is replaced (``grow``).
        self._rows: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    @property
    def batch(self) -> int:
        return self.k.shape[1]

    @property
    def max_len(self) -> int:
        return self.k.shape[3]

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2

    def room(self) -> int:
        """Free slots in the fullest row."""
        return self.max_len - max(self.lengths)

    def reset(self) -> None:
        self.lengths = [0] * self.batch
        self.pending = 0

    # ------------------------------------------------------------------ one forward pass
    def append(self, n: int, tree_mask=None) -> tuple[list[int], list[int], int]:
        """Reserve slots for a pass of ``n`` new tokens per row: (write starts per row, committed
        lengths per row, uncommitted entries M = pending + n once written). Checked against the
        cache size, and ``tree_mask`` (if any) against (..., n, M); the entries become pending."""
        if tree_mask is not None and tuple(tree_mask.shape[-2:]) != (n, self.pending + n):
            raise ValueError(f"tree_mask must be ({n}, {self.pending + n}) for {n} new tokens after "
                             f"{self.pending} pending entries, got {tuple(tree_mask.shape)}")
        starts = [length + self.pending for length in self.lengths]
        if max(starts) + n > self.max_len:
            raise ValueError(f"KV cache overflow: {max(starts) + n} slots needed, max_len {self.max_len}")
        self.pending += n
        return starts, list(self.lengths), self.pending

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

    def commit(self, path: list[int], row: int = 0, move: Move | None = None) -> None:
        """Keep the pending entries ``path`` (strictly increasing, path[0] == 0) of ``row``.

        Moves the entry at slot L + path[m] to slot L + m in every layer, then sets the row's
        length to L + len(path) and drops the other pending entries. Safe because path[m] >= m.
        """
        start = self.lengths[row]
        if not path or path[0] != 0 or path[-1] >= self.pending:
            raise ValueError(f"commit path must start at pending entry 0 and stay below "
                             f"{self.pending}, got {path}")
        if any(b <= a for a, b in zip(path, path[1:])):
            raise ValueError(f"commit path must be strictly increasing, got {path}")
        if path[-1] != len(path) - 1:  # not already in place (a chain prefix needs no move)
            (move or move_entries)(self.k, self.v, row, start, path)
        self.lengths[row] = start + len(path)
        if self.batch == 1:
            self.pending = 0

    # ------------------------------------------------------------------ beams
    def view(self, rows: int, length: int) -> "KVCache":
        """Rows [0, rows) as a cache of their own, sharing this one's storage, each with
        ``length`` committed slots and nothing pending."""
        if not 1 <= rows <= self.batch:
            raise ValueError(f"{rows} beams need {rows} cache rows, the cache has {self.batch}")
        if not 0 <= length <= self.max_len:
            raise ValueError(f"view length must be in [0, {self.max_len}], got {length}")
        view = KVCache.__new__(KVCache)
        kv = self._rows.get(rows)
        if kv is None:
            kv = self._rows[rows] = (self.k[:, :rows], self.v[:, :rows])  # (L, rows, H, S, D)
        view.k, view.v = kv
        view.lengths = [length] * rows
        view.pending = 0
        view._rows = {}
        return view

    def set_committed(self, rows: int, length: int) -> None:
        """Rows [0, rows) hold ``length`` committed slots, the others none; nothing pending."""
        if not 1 <= rows <= self.batch or not 0 <= length <= self.max_len:
            raise ValueError(f"set_committed needs 1 <= rows <= {self.batch} and 0 <= length <= "
                             f"{self.max_len}, got {rows}, {length}")
        self.lengths = [length] * rows + [0] * (self.batch - rows)
        self.pending = 0

    def reselect(self, sources: list[int], paths: list[list[int]], length: int, pending: int,
                 low: int | Sequence[int] = 0, move: Move | None = None, copy_rows: CopyRows | None = None) -> int:
        """Row i <- row sources[i], all rows holding ``length`` committed slots and ``pending``
        entries after them: slots [low, length + pending) are copied (slots below ``low`` are
        equal in every row involved; a list gives each destination row its own), then row i
        keeps its pending entries ``paths[i]`` (all the same length m, paths[i][0] == 0) in
        order. ``copy_rows`` (a backend's kernel) may make the copies in one call. Returns the
        new committed length, length + m."""
        if len(sources) > self.batch or any(not 0 <= s < self.batch for s in sources):
            raise ValueError(f"reselect sources must be rows of the {self.batch}-row cache, got {sources}")
        if len(paths) != len(sources) or len({len(p) for p in paths}) != 1:
            raise ValueError("reselect needs one path per source row, all of the same length")
        span = length + pending
        if span > self.max_len:
            raise ValueError(f"reselect span {span} exceeds max_len {self.max_len}")
        lows = [low] * len(sources) if isinstance(low, int) else list(low)
        if len(lows) != len(sources) or any(not 0 <= lo <= span for lo in lows):
            raise ValueError(f"reselect low must be one slot in [0, {span}] or one per source row, got {low}")
        # Row i <- row sources[i] as a parallel move: a row is overwritten only once no copy
        # still to come reads it (a chain 1 <- 0, 2 <- 1, 3 <- 2 runs from its end), so each
        # changed row costs one copy; only a cycle (a swap) saves one row aside first. Per-row
        # copies beat one advanced-index gather/scatter here.
        done = copy_rows is not None and copy_rows(self.k, self.v, list(sources), lows, span)
        todo = {} if done else {i: (self.k[:, s, :, lows[i]:span], self.v[:, s, :, lows[i]:span])
                                for i, s in enumerate(sources) if s != i and lows[i] < span}
        reads = {i: sources[i] for i in todo}  # the row each pending copy reads
        while todo:
            read = set(reads.values())
            free = [i for i in todo if i not in read]
            if not free:  # every pending destination is read by another: a cycle, each read once
                i = next(iter(todo))
                j = next(j for j, s in reads.items() if s == i)
                todo[j] = (self.k[:, i, :, lows[j]:span].clone(), self.v[:, i, :, lows[j]:span].clone())
                reads[j] = -1
                continue
            for i in free:
                k_src, v_src = todo.pop(i)
                del reads[i]
                self.k[:, i, :, lows[i]:span].copy_(k_src)
                self.v[:, i, :, lows[i]:span].copy_(v_src)
        for row, path in enumerate(paths):
            if path and (path[0] != 0 or path[-1] >= pending):
                raise ValueError(f"reselect path {path} is not within the {pending} pending entries")
            if path != list(range(len(path))):
                (move or move_entries)(self.k, self.v, row, length, path)
        new_length = length + len(paths[0])
        self.set_committed(len(sources), new_length)
        return new_length

    def compact(self, keep: list[int], common: int, move: Move | None = None) -> None:
        """One row: keep the pending entries ``keep`` (increasing) in that order, of which the
        first ``common`` become committed and the rest stay pending."""
        if self.batch != 1:
            raise ValueError("compact works on a one-row cache")
        if any(b <= a for a, b in zip(keep, keep[1:])) or (keep and not 0 <= keep[0] <= keep[-1] < self.pending):
            raise ValueError(f"compact needs increasing pending entries below {self.pending}, got {keep}")
        if not 0 <= common <= len(keep):
            raise ValueError(f"compact: common must be in [0, {len(keep)}], got {common}")
        if keep != list(range(len(keep))):
            (move or move_entries)(self.k, self.v, 0, self.lengths[0], keep)
        self.lengths = [self.lengths[0] + common]
        self.pending = len(keep) - common

    def grow(self, slots: int) -> None:
        """Make room for ``slots`` slots per row (a copy of what is used; rare, amortised)."""
        if slots <= self.max_len:
            return
        used = max(self.lengths) + self.pending
        shape = (*self.k.shape[:3], slots, self.k.shape[4])
        k = torch.empty(shape, dtype=self.k.dtype, device=self.k.device)
        v = torch.empty(shape, dtype=self.v.dtype, device=self.v.device)
        k[:, :, :, :used] = self.k[:, :, :, :used]
        v[:, :, :, :used] = self.v[:, :, :, :used]
        self.k, self.v = k, v
        self._rows = {}

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
