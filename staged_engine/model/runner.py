"""A model with its KV cache: the only place that turns token lists into forward passes.

Strategies drive runners; runners drive the model. Positions and cache slots follow
ALGORITHMS.md sec. 7: the runner's committed tokens fill slots [0, L); a batch of new nodes
with depths d_i is written at slots L + i and placed at positions L + d_i.
"""
from __future__ import annotations

import time

import torch

from staged_engine.model.backend import NATIVE_MAX_ROWS, Backend, _cpu, packing_for
from staged_engine.model.gpt2 import GPT2
from staged_engine.model.kv_cache import KVCache


class ModelRunner:
    """One model, its kernels (``backend``) and its KV cache (one row by default, ``max_len``
    slots, default the context window); counts its forward passes and their time."""

    def __init__(self, model: GPT2, backend: Backend, batch: int = 1, max_len: int | None = None) -> None:
        self.model = model
        self.backend = backend
        self.cache: KVCache = model.new_cache(batch=batch, max_len=max_len)
        self.device = model.wte.weight.device
        self.calls = 0
        self.forward_seconds = 0.0
        self.nodes = 0
        self._native = None  # set by reset()
        self._wide, self._wide_from = None, None  # passes of many rows: a float32 packing (reset())

    @property
    def length(self) -> int:
        """Committed tokens in row 0."""
        return self.cache.lengths[0]

    @property
    def max_len(self) -> int:
        return self.cache.max_len

    def reset(self) -> None:
        self.cache.reset()
        self.backend.refresh(self.model)
        # Passes of one cache row and few nodes skip the module call and the id tensors (about
        # 30 us a pass, as much as a small draft's whole forward): one native call from lists.
        self._native = self.backend.native_rows(self.model) if self.cache.batch == 1 else None
        self._wide, self._wide_from = self.backend.wide_rows_model(self.model) if self._native is not None \
            else (None, None)
        self.calls = 0
        self.forward_seconds = 0.0
        self.nodes = 0

    def run(self, tokens: torch.Tensor, positions: torch.Tensor, tree_mask: torch.Tensor | None,
            last_only: bool = False, cache: KVCache | None = None) -> torch.Tensor:
        """One counted forward pass: tokens, positions (B, N) -> logits (B, N, V), over this
        runner's cache or over ``cache`` (a ``view`` of it)."""
        t0 = time.perf_counter()
        logits = self.model(tokens, positions, self.cache if cache is None else cache, tree_mask, last_only,
                            self.backend)
        self._count(t0, tokens.numel())
        return logits

    def _count(self, t0: float, nodes: int) -> None:
        self.count(1, time.perf_counter() - t0, nodes)

    def count(self, calls: int, seconds: float, nodes: int) -> None:
        """Add forward passes run elsewhere (a native round) to this runner's counters."""
        self.forward_seconds += seconds
        self.calls += calls
        self.nodes += nodes

    @property
    def native(self):
        """The model packed for one native call per pass (``_cpu.NativeGPT2``), or None when this
        runner takes the tensor path."""
        return self._native

    def packing(self, rows: int):
        """The native packing a pass over ``rows`` rows of row 0 takes (``backend.packing_for``:
        the float32 one from the model's ``wide_from`` rows on), or None on the tensor path."""
        if self._native is None or rows > NATIVE_MAX_ROWS:
            return None
        return packing_for(rows, self._native, self._wide, self._wide_from)

    def region_passes(self, tokens: list[int], passes: int) -> list[float] | None:
        """``passes`` passes over the chain ``tokens`` (1-9) after row 0's committed slots, back to
        back in one native step region (``NativeGPT2.region_passes``: as plain decoding's steps
        run), for the benches that time passes there; their entries are left pending and then
        discarded, the cache as it was. Returns each pass's seconds (the first with the threads'
        fork), or None off the native path."""
        native = self.packing(len(tokens))
        if native is None:
            return None
        start = self.reserve(len(tokens))
        try:
            return native.region_passes(self.cache.k, self.cache.v, start, tokens, passes)
        finally:
            self.discard()

    def reserve(self, n: int) -> int:
        """Reserve ``n`` pending slots of row 0 for passes run elsewhere (a native round writes
        them as ``forward_ids`` would); returns the row's committed length, their start."""
        self.cache.append(n)
        return self.length

    def prefill_chunk(self, chunk: int = 512) -> int:
        """Prompt tokens per prefill pass: at most ``NATIVE_MAX_ROWS`` where a one-row pass runs
        natively (a third faster than the stock GEMMs over 512 rows on the demo pair), else
        ``chunk``. A multi-row cache asks too: beams prefill the prompt into one row."""
        return min(chunk, NATIVE_MAX_ROWS) if self.backend.native_rows(self.model) is not None else chunk

    def prefill(self, tokens: list[int], chunk: int = 512) -> None:
        """Process and commit ``tokens`` after what is already cached (no logits kept), in pieces
        of ``prefill_chunk(chunk)``."""
        chunk = self.prefill_chunk(chunk)
        for i in range(0, len(tokens), chunk):
            part = tokens[i:i + chunk]
            start = self.length
            if self._run_ids(part, list(range(start, start + len(part))), None, True) is None:
                ids = torch.tensor([part], dtype=torch.int64, device=self.device)
                pos = torch.arange(start, start + len(part), device=self.device)[None]
                self.run(ids, pos, None, last_only=True)
            self.cache.advance()

    def _run_ids(self, tokens: list[int], positions: list[int], tree_mask: torch.Tensor | None,
                 last_only: bool) -> torch.Tensor | None:
        """``run`` on the native fast path for row 0 of a one-row cache: (N, V) or (1, V) logits, or
        None when it does not apply (then the caller takes the tensor path)."""
        n = len(tokens)
        native = self.packing(n)
        if native is None:
            return None
        cache = self.cache
        t0 = time.perf_counter()
        _, starts, m = cache.append(n, tree_mask)
        logits = native.forward_ids(tokens, positions, cache.k, cache.v, starts[0], m, tree_mask, last_only)
        self._count(t0, n)
        return logits

    def step(self, token: int) -> torch.Tensor:
        """Forward one token at the next position and commit it; returns (V,) logits."""
        start = self.length
        logits = self._run_ids([token], [start], None, False)
        if logits is None:
            ids = torch.tensor([[token]], dtype=torch.int64, device=self.device)
            pos = torch.tensor([[start]], dtype=torch.int64, device=self.device)
            logits = self.run(ids, pos, None, last_only=False)[0]
        self.cache.advance()
        return logits[0]

    def steps(self, root: int, n: int, rule: tuple, stop_token: int | None = None) -> list[int] | None:
        """Up to ``n`` plain decoding steps in one native call, committed: a pass over ``root`` at
        the next position, the sampling ``rule`` (temperature, top_k, top_p, seed) choosing the
        next token, fed back, until ``n`` tokens or ``stop_token``. The tokens and cache entries
        of ``step`` and ``sampling.choose`` in a Python loop, without the interpreter between
        passes. None off the native path (then the caller loops over ``step``)."""
        got = self.lookup_steps(root, n, rule, [], 0, 1, stop_token)
        return None if got is None else got[0]

    def lookup_steps(self, root: int, n: int, rule: tuple, history: list[int], depth: int, min_order: int,
                     stop_token: int | None = None, max_passes: int | None = None
                     ) -> tuple[list[int], list[int], int, int] | None:
        """``steps`` with prompt lookup riding along (``_cpu.lookup_steps``): each pass also verifies
        up to ``depth`` tokens that followed the latest earlier occurrence of the context's last
        3 (down to ``min_order``) tokens in ``history`` (every token before ``root``) and what
        the call emits; depth 0 is plain steps. At most ``n`` tokens (the cache must have room
        for n) in at most ``max_passes`` passes (None: no limit but n). The same tokens and cache
        entries as ``steps``, committed. Returns (tokens, tokens emitted by each pass, tokens
        proposed, proposed tokens kept), or None off the native path."""
        native = self._native  # set only where the extension is built
        if native is None or self.cache.pending:
            return None
        start = self.length
        self.cache.append(n)  # checks the room for n entries
        t, top_k, top_p, seed = rule
        try:
            tokens, seconds, lengths, proposed, kept = _cpu.lookup_steps(
                native, self.cache.k, self.cache.v, start, history, root, n, t, top_k, top_p, seed or 0,
                -1 if stop_token is None else stop_token, depth, min_order, -1 if max_passes is None else max_passes)
        except BaseException:
            self.cache.discard()
            raise
        self.count(len(lengths), seconds, len(lengths) + proposed)  # a pass's rows: its root and guesses
        self.cache.commit(list(range(len(tokens))))
        return tokens, lengths, proposed, kept

    @property
    def pending(self) -> int:
        """Entries written by ``forward_nodes`` since the last commit."""
        return self.cache.pending

    def forward_nodes(self, tokens: list[int], positions: list[int],
                      tree_mask: torch.Tensor | None) -> torch.Tensor:
        """Forward N new nodes at absolute ``positions``; returns (N, V) logits.

        They become pending entries pending..pending+N-1. ``tree_mask`` is (N, pending + N)
        bool, or None when all pending entries and the new nodes form one chain. Nothing is
        committed: follow with ``commit(path)`` or ``discard()``.
        """
        logits = self._run_ids(tokens, positions, tree_mask, False)
        if logits is not None:
            return logits
        ids = torch.tensor([tokens], dtype=torch.int64, device=self.device)
        pos = torch.tensor([positions], dtype=torch.int64, device=self.device)
        return self.run(ids, pos, tree_mask, last_only=False)[0]

    def commit(self, path: list[int]) -> None:
        """Keep the pending entries ``path`` (increasing, starting at 0), drop the rest."""
        self.cache.commit(path, 0, self.backend.commit)

    def discard(self) -> None:
        self.cache.discard()

    def rollback(self, length: int) -> None:
        self.cache.truncate(length)
