"""The seam between the model and its kernels.

The model calls a backend for the four operations that touch the KV cache or dominate small-
batch cost; everything else is plain torch. ``TorchBackend`` is the reference and the CPU
production path; ``TritonBackend`` runs the kernels in ``kernels/`` (CUDA, or CPU tensors
under TRITON_INTERPRET=1 in tests).

Shapes: B rows, N new tokens per row, H heads, D head dim, S cache slots, C = H * D.
``append_qkv`` writes new token i of row b at slot write_starts[b] + i. ``attention`` takes
the committed lengths ``starts`` and a visibility mask over the M >= N uncommitted entries
[starts[b], starts[b] + M) (earlier passes' pending entries, then this pass's N): ``tree_mask``
is bool (N, M) / (B, N, M), mask[i, j] true when entry j is an ancestor of (or is) new token
i; None means all M entries form one chain ending in the new tokens (j <= M - N + i).
"""
from __future__ import annotations

import operator
import os
import warnings
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from staged_engine.model.kv_cache import move_entries

try:
    from staged_engine import _cpu
except ImportError:  # the C++ extension is not built: pure torch, same results up to rounding
    _cpu = None

def native_enabled() -> bool:
    """Whether the ``_cpu`` extension is built and not switched off (``STAGED_ENGINE_NATIVE=0``):
    the one switch for every native path (the backend's kernels, the beam core's draws)."""
    return _cpu is not None and os.environ.get("STAGED_ENGINE_NATIVE", "1") != "0"


NATIVE_MAX_ROWS = 64  # a pass over more rows runs the stock GEMM and SDPA; runners prefill in pieces of this size
_VERSION = operator.attrgetter("_version")  # a tensor's in-place modification counter


class Backend:
    name = "base"

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x (..., in) @ weight(out, in).T + bias -> (..., out)."""
        return F.linear(x, weight, bias)

    def append_qkv(self, qkv: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   starts: list[int], n_head: int) -> torch.Tensor:
        raise NotImplementedError

    def attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  starts: list[int], n_uncommitted: int, tree_mask: torch.Tensor | None,
                  scale: float) -> torch.Tensor:
        raise NotImplementedError

    def commit(self, k: torch.Tensor, v: torch.Tensor, row: int, start: int, path: list[int]) -> None:
        raise NotImplementedError

    def copy_rows(self, k: torch.Tensor, v: torch.Tensor, sources: list[int], lows: list[int], span: int) -> bool:
        """Beam reselection's row copies in one call (row i <- row sources[i] over slots
        [lows[i], span), as a parallel move), if this backend has a kernel for them; False: the
        caller copies (``KVCache.reselect``)."""
        return False

    def refresh(self, model) -> None:
        """Called once per generation: pick up weights modified in place since the last one."""

    def native_rows(self, model):
        """A packed model with ``forward_ids`` (one cache row, lists of ids) for ``model`` as it
        is now, or None: then every pass goes through ``model.forward``. ``ModelRunner`` asks once
        per generation, after ``refresh``."""
        return None

    def pair(self, draft, oracle) -> None:
        """Say that ``draft`` drafts for ``oracle``: its passes run right after the oracle's, in
        whatever caches the oracle's pass left it (the Engine says so before either runs)."""

    def wide_rows_model(self, model) -> tuple[Any, int | None]:
        """A second packed model for passes of many rows (the same bits as ``native_rows``'s) and
        the row count from which passes take it, or (None, None)."""
        return None, None

    def packed_bytes(self, model) -> int:
        """Bytes of the packings of ``model``'s weights this backend has built so far (beside the
        model's own tensors), 0 where it keeps none."""
        return 0

    def forward_model(self, model, tokens: torch.Tensor, positions: torch.Tensor, k: torch.Tensor,
                      v: torch.Tensor, writes: list[int], starts: list[int], m: int,
                      tree_mask: torch.Tensor | None, last_only: bool) -> torch.Tensor | None:
        """A whole forward pass of ``model`` (a GPT2) in one call: logits (B, N, V) or (B, 1, V)
        with ``last_only``, the new tokens' K/V written to slots writes[b]..; or None, and the
        model runs its own loop with the operations above. k, v: the whole cache (L, B, H, S, D)."""
        return None

    def top_children(self, scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The k best entries of each row of scores (N, V) and their log-softmax values:
        (ids (N, k) int64, log r (N, k) float32), best first. Drafters rank children with it."""
        vals, idx = torch.topk(torch.log_softmax(scores.float(), dim=-1), k, dim=-1)
        return idx, vals

    # The sampling rule in one native call where the backend has one (else None, and the
    # caller runs the torch reference in sampling.py). ``rule``: (temperature, top_k, top_p, seed).
    def choose_rows(self, logits: torch.Tensor, positions: list[int], rule: tuple) -> list[int] | None:
        """The choice of each row of (N, V) logits for the token at positions[i]."""
        return None

    def verify_tree(self, logits: torch.Tensor, tokens: list[int], parents: list[int], positions: list[int],
                    rule: tuple) -> tuple[list[int], list[int]] | None:
        """ALGORITHMS.md sec. 4 over a tree's (N, V) logits, node i at positions[i]: (path, emitted)."""
        return None

    def perturbed_children(self, logits: torch.Tensor, positions: list[int], rule: tuple,
                           k: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """At T > 0: each row's k best children by perturbed score and their log r."""
        return None

    def processed_probs(self, logits: torch.Tensor, rule: tuple) -> torch.Tensor | None:
        """p' of each row of (N, V) logits, float64 on the CPU (beam sampling's conditionals;
        the reference is ``sampling.processed_probs``); the seed in ``rule`` is not used."""
        return None


def chain_mask(n: int, m: int, device) -> torch.Tensor:
    """(N, M) bool: new token i sees uncommitted entries j <= M - N + i."""
    return torch.ones(n, m, dtype=torch.bool, device=device).tril_(m - n)


class _Packed(NamedTuple):
    """A model packed for ``_cpu.NativeGPT2`` and what it was packed from: repacked when the model
    object, its layer tensors, their version counters (in-place updates) or its head rows change."""
    model: Any
    layers: list
    versions: int
    native: Any
    tensors: list
    head_rows: int | None
    wide: Any = None  # the float32 packing of a float16-packed model, for passes of many rows
    wide_from: int | None = None  # the row count from which passes take it


def packing_for(rows: int, native, wide, wide_from: int | None):
    """The packing a pass over ``rows`` rows takes: the float32 one (``wide``, see
    ``TorchBackend.wide_rows``) from ``wide_from`` rows on where the model has one, else ``native``."""
    return wide if wide is not None and rows >= wide_from else native


_warned_unbuilt = False


def _warn_once_unbuilt() -> None:
    """Say once a process that the extension is not built (a CPU without AVX2 does not build it:
    setup.py). Python's own once-per-place rule is not enough: any library that touches the
    warning filters resets it, and two engines warned twice."""
    global _warned_unbuilt
    if not _warned_unbuilt:
        _warned_unbuilt = True
        warnings.warn("staged_engine._cpu is not built: using stock torch kernels on CPU", stacklevel=3)


class TorchBackend(Backend):
    """PyTorch on any device. On CPU in float32 (``native``) a pass over at most 64 rows runs in
    one call of the ``_cpu`` extension (``NativeGPT2``, csrc/cpu_forward.cpp), whose per-row
    results do not depend on the row count, so a speculative round writes the same K/V bits as
    plain decoding. Otherwise (no extension, STAGED_ENGINE_NATIVE=0, another dtype, a longer
    prefill) the model's own loop runs on stock torch (SDPA with an explicit mask): the
    reference, identical up to rounding.
    """

    name = "torch"

    def __init__(self, native: bool | None = None, wide_weights: bool | None = None,
                 wide_rows: int | None = 0) -> None:
        if wide_rows is not None and (isinstance(wide_rows, bool) or not isinstance(wide_rows, int)
                                      or wide_rows < 0 or wide_rows == 1):
            raise ValueError(f"wide_rows must be None (never), 0 (measured at load) or a row count >= 2, got "
                             f"{wide_rows!r} (wide_weights=True packs float32 for every pass)")
        if native and _cpu is None:
            raise ValueError("native=True needs the staged_engine._cpu extension "
                             "(pip install --no-build-isolation -e .)")
        if native is None:
            native = native_enabled()
            if _cpu is None:
                _warn_once_unbuilt()
        self.native = bool(native)
        # Float16-valued weights packed as float32 (True), as float16 (False), or whichever runs a
        # one-row pass faster here (None: ``_pack``). The bits out of a pass are the same.
        self.wide_weights = wide_weights
        # Passes over at least this many rows of a model packed float16 run on a second, float32
        # packing of the same values (the same bits): twice the bytes, no widening, which on a
        # core whose widening takes the FMAs' pipes is faster once the rows' FMAs outweigh the
        # stream (the demo oracle on an AVX2 Zen 1: 0.80-0.89x the time at 6-64 rows, 1.29x at
        # 3). None: never; 0 (the default): from the row count it measures faster from at load
        # (``wide_crossover``), where the float32 copy takes at most ``wide_memory_cap()``;
        # n >= 2: from n rows, always.
        self.wide_rows = wide_rows
        self.packing: dict[int, dict] = {}  # by id(model): how its weights were packed, and why
        self._natives: dict[int, _Packed] = {}  # by id(model)
        self._oracles: dict[int, tuple] = {}  # by id(draft): (draft, the model it drafts for) (``pair``)
        self._warned_dtype = False

    def native_model(self, model):
        """The model packed for ``_cpu.NativeGPT2``, built at first use (see ``refresh``)."""
        entry = self._natives.get(id(model))
        if entry is None or entry.model is not model or entry.layers is not model._layer_tensors() \
                or entry.head_rows != model.head_rows:
            entry = self._pack(model)
        return entry.native

    def pair(self, draft, oracle) -> None:
        if draft is oracle or self._oracle_of(draft) is oracle:
            return
        self._oracles[id(draft)] = (draft, oracle)
        self._natives.pop(id(draft), None)  # packed before it was paired: packed again at next use

    def _oracle_of(self, model):
        """The model ``model`` drafts for (``pair``), or None. Keyed by id, as ``_natives`` is, and
        checked to be the same object, so that a model given a collected draft's id is no draft."""
        pair = self._oracles.get(id(model))
        return pair[1] if pair is not None and pair[0] is model else None

    def refresh(self, model) -> None:
        """Re-pack ``model`` if a weight was modified in place since it was packed (checked once
        per generation, by ``ModelRunner.reset``: reading 100 version counters costs ~30 us)."""
        entry = self._natives.get(id(model))
        if entry is None:  # pack now, not inside the first timed decode step
            if self.native and model.wte.weight.device.type == "cpu" and model.wte.weight.dtype == torch.float32:
                self._pack(model)
        elif entry.model is not model or entry.versions != sum(map(_VERSION, entry.tensors)) \
                or entry.head_rows != model.head_rows:
            self._pack(model)

    def _pack(self, model) -> _Packed:
        """Pack ``model`` for the native path. Weights that float16 holds exactly (checkpoints
        stored in fp16), or else bfloat16 (stored in bf16, whose tiniest values float16 cannot
        hold), are streamed at 16 bits and widened in registers, half the bytes; where
        their float32 copy fits in the last-level cache, the widening, not the stream, can set a
        pass's time (the demo draft on an AVX2 Zen 1: 1.3x faster in float32, whose two copies
        of 1.8 MB both stay in its 8 MB L3), so both are packed and one-row passes timed, and the
        faster is kept (``compare_packings``). The same values either way: the same bits.

        A draft (``pair``) is timed as a round runs it: each pass right after a pass of its
        oracle, which streams its own weights through the caches the draft's were in. There the
        bytes to fetch again count, not only the widening: the demo draft's one-row pass after
        the oracle's took 1.23x as long in float32 as in float16 (warm, back to back: 0.77x). Nor
        does a draft get a second, float32 packing for passes of many rows (``wide_rows`` 0, the
        measured crossover; a pinned row count still holds): a round would fetch both copies
        again. Timed after the oracle's pass too, such a copy won from 3-4 rows on the demo draft,
        and runs with and without it were level within their noise (one process, alternating:
        DSBD at 8 beams, top-p, 1.39x and 1.34x beam sampling, again 1.42x and 1.46x; staged,
        greedy, 1.24x and 1.25x plain), so a draft keeps one packing. The demo draft, float32
        before and float16 now, on the Zen 1 (12 held-out prompts x 3, the two engines
        alternating, median speed over plain): chains of one 1.09x -> 1.13x greedy and 0.94x ->
        0.97x at T 0.8, top-p 0.95; of two 1.22x -> 1.25x and 0.96x -> 0.98x; staged 1.35x ->
        1.37x and 1.00x -> 0.99x (its planner played mostly plain steps there)."""
        tensors = self._model_tensors(model)
        wte, wpe, lnf_w, lnf_b, *blocks = tensors
        cfg = model.config

        def make(half: bool):
            return _cpu.NativeGPT2(wte, wpe, blocks, lnf_w, lnf_b, cfg.n_head, cfg.layer_norm_epsilon,
                                   model.act_kind, model.head_rows or 0, half)

        native = make(self.wide_weights is not True)
        fmt = native.weight_format  # float16 / bfloat16 where the checkpoint's values fit, else float32
        how = {"packed": fmt, "why": "fixed" if self.wide_weights is not None else "float32 weights"}
        llc = last_level_cache_bytes()
        oracle = self._oracle_of(model)
        if self.wide_weights is None and native.half:
            if 2 * native.weight_bytes <= llc:
                wide = make(False)
                before = self._oracle_pass(oracle) if oracle is not None else None
                if before is not None:
                    ratio = compare_packings(wide, native, cfg, before=before)
                    how = {"packed": fmt, "why": "timed after the oracle's pass"}
                else:
                    ratio = compare_packings(wide, native, cfg)
                    how = {"packed": fmt, "why": "timed"}
                how[f"float32_over_{fmt}"] = round(ratio, 3)
                if ratio < 1.0 - WIDE_MARGIN:
                    native, how["packed"] = wide, "float32"
            elif llc:
                how["why"] = f"float32 copy ({2 * native.weight_bytes} bytes) outgrows the last-level cache ({llc})"
            else:
                how["why"] = "the last-level cache's size is unknown here"
        # Weights that outgrow the last-level cache stream through it on every pass: prefetched
        # non-temporally, they leave it to what it can hold (``NativeGPT2.set_streaming``).
        native.set_streaming(bool(llc) and native.weight_bytes > llc)
        how["streaming"] = native.streaming
        wide, wide_from = None, None
        if oracle is not None and self.wide_rows == 0:
            how["float32_from_rows"] = None  # a draft keeps one packing (see above) unless pinned
        elif native.half and self.wide_rows is not None and (self.wide_rows or 2 * native.weight_bytes <= wide_memory_cap()):
            wide = make(False)
            wide.set_streaming(bool(llc) and wide.weight_bytes > llc)
            if self.wide_rows:
                wide_from = self.wide_rows
            else:
                wide_from, how[f"float32_over_{fmt}_by_rows"] = wide_crossover(wide, native, cfg)
            if wide_from is None:
                wide = None
            how["float32_from_rows"] = wide_from
        self.packing[id(model)] = how
        entry = _Packed(model, model._layer_tensors(), sum(map(_VERSION, tensors)), native, tensors, model.head_rows,
                        wide, wide_from)
        self._natives[id(model)] = entry
        return entry

    def _oracle_pass(self, oracle, context: int = 32):
        """A one-row pass of ``oracle`` (packed for this backend) after ``context`` entries of a
        scratch cache, as a callable: what comes before each of its draft's passes in a round.
        None where the oracle does not run on the native path."""
        native = self.native_rows(oracle)
        if native is None:
            return None
        cfg = oracle.config
        context = min(context, cfg.n_positions - 1)
        k, v = scratch_cache(cfg, context + 1)
        return lambda: native.forward_ids([0], [context], k, v, context, 1, None, False)

    @staticmethod
    def _model_tensors(model) -> list[torch.Tensor]:
        """wte, wpe, ln_f weight and bias, then the 12 tensors of every block."""
        flat = [t for layer in model._layer_tensors() for t in layer]
        return [model.wte.weight, model.wpe.weight, model.ln_f.weight, model.ln_f.bias, *flat]

    def native_rows(self, model):
        w = model.wte.weight
        if self.native and w.device.type == "cpu" and w.dtype == torch.float32:
            return self.native_model(model)
        return None

    def wide_rows_model(self, model):
        """(the float32 packing of ``model``, the row count from which passes take it), or
        (None, None) where passes of every size take ``native_rows(model)`` (see ``wide_rows``)."""
        if self.native_rows(model) is None:
            return None, None
        entry = self._natives[id(model)]
        return entry.wide, entry.wide_from

    def packed_bytes(self, model):
        entry = self._natives.get(id(model))
        if entry is None or entry.model is not model:
            return 0
        return entry.native.weight_bytes + (entry.wide.weight_bytes if entry.wide is not None else 0)

    def forward_model(self, model, tokens, positions, k, v, writes, starts, m, tree_mask, last_only):
        b, n = tokens.shape
        if not (self.native and b * n <= NATIVE_MAX_ROWS and k.device.type == "cpu"):
            return None
        if model.wte.weight.dtype != torch.float32 or k.dtype not in (torch.float32, torch.float16):
            if not self._warned_dtype:
                self._warned_dtype = True
                warnings.warn(f"the native decode path runs float32 models; this one is {model.wte.weight.dtype}, "
                              "so it runs on stock torch kernels (load it with dtype=torch.float32 for the fast path: weights "
                              "that are float16 or bfloat16 values are still streamed at 2 bytes each)",
                              stacklevel=2)
            return None
        mask = tree_mask.contiguous() if tree_mask is not None else None
        native = packing_for(b * n, self.native_model(model), *self.wide_rows_model(model))
        return native.forward(tokens, positions, k, v, writes, starts, m, mask, last_only)

    def top_children(self, scores, k):
        if self.native and scores.dtype == torch.float32 and scores.device.type == "cpu" and scores.dim() == 2 \
                and k <= 64:
            idx, logr = _cpu.top_children(scores.contiguous(), k)
            return idx, logr
        return super().top_children(scores, k)

    def _native_rows(self, logits: torch.Tensor) -> bool:
        return self.native and logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2

    def choose_rows(self, logits, positions, rule):
        if not self._native_rows(logits):
            return None
        t, top_k, top_p, seed = rule
        return _cpu.choose_rows(logits.contiguous(), seed or 0, positions, t, top_k, top_p)

    def verify_tree(self, logits, tokens, parents, positions, rule):
        if not self._native_rows(logits):
            return None
        t, top_k, top_p, seed = rule
        return _cpu.verify_tree(logits.contiguous(), tokens, parents, seed or 0, positions, t, top_k, top_p)

    def perturbed_children(self, logits, positions, rule, k):
        t, top_k, top_p, seed = rule
        if not self._native_rows(logits) or t == 0 or k > 64:
            return None
        idx, logr = _cpu.perturbed_children(logits.contiguous(), seed, positions, t, top_k, k, top_p)
        return idx, logr

    def processed_probs(self, logits, rule):
        if not self._native_rows(logits):
            return None
        t, top_k, top_p, _ = rule
        return _cpu.processed_probs(logits.contiguous(), t, top_k, top_p)

    def append_qkv(self, qkv, k_cache, v_cache, starts, n_head):
        # qkv: (B, N, 3C) -> q, k, v each (B, H, N, D)
        b, n, c3 = qkv.shape
        d = c3 // (3 * n_head)
        q, k, v = qkv.view(b, n, 3, n_head, d).permute(2, 0, 3, 1, 4).unbind(0)
        if all(s == starts[0] for s in starts):
            s = starts[0]
            k_cache[:, :, s:s + n] = k
            v_cache[:, :, s:s + n] = v
        else:
            for row, s in enumerate(starts):
                k_cache[row, :, s:s + n] = k[row]
                v_cache[row, :, s:s + n] = v[row]
        return q

    def attention(self, q, k_cache, v_cache, starts, n_uncommitted, tree_mask, scale):
        # q: (B, H, N, D); k_cache/v_cache: (B, H, S, D)
        b, _, n, _ = q.shape
        m = n_uncommitted
        span = max(starts) + m
        keys, values = k_cache[:, :, :span], v_cache[:, :, :span]  # (B, H, span, D)
        if keys.dtype != q.dtype:  # a float16 cache under a float32 model: entries widen exactly
            keys, values = keys.to(q.dtype), values.to(q.dtype)
        if n == 1 and tree_mask is None and all(s == starts[0] for s in starts):
            return F.scaled_dot_product_attention(q, keys, values, scale=scale)
        visible = chain_mask(n, m, q.device) if tree_mask is None else tree_mask  # (N, M) or (B, N, M)
        mask = torch.zeros(b, 1, n, span, dtype=torch.bool, device=q.device)  # (B, 1, N, span)
        for row, s in enumerate(starts):
            mask[row, 0, :, :s] = True
            mask[row, 0, :, s:s + m] = visible if visible.dim() == 2 else visible[row]
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale)

    @staticmethod
    def _native_cache(k: torch.Tensor, v: torch.Tensor) -> bool:
        return k.device.type == "cpu" and k.dtype in (torch.float32, torch.float16) and k.is_contiguous() \
            and v.is_contiguous()

    def commit(self, k, v, row, start, path):
        if self.native and self._native_cache(k, v):
            _cpu.kv_move(k, v, row, start, path)
        else:
            move_entries(k, v, row, start, path)

    def copy_rows(self, k, v, sources, lows, span):
        if not (self.native and self._native_cache(k, v)):
            return False
        _cpu.kv_copy_rows(k, v, sources, lows, span)
        return True


class TritonBackend(Backend):
    """The Triton kernels of ``kernels/``; imported lazily so CPU users never need triton."""

    name = "triton"

    def __init__(self) -> None:
        from staged_engine.kernels import kv_cache as kv_kernels  # noqa: PLC0415 (optional dependency)
        from staged_engine.kernels import tree_attention as attn_kernels  # noqa: PLC0415

        self._kv = kv_kernels
        self._attn = attn_kernels

    def _starts(self, starts, device):
        return torch.tensor(starts, dtype=torch.int64, device=device)

    def append_qkv(self, qkv, k_cache, v_cache, starts, n_head):
        return self._kv.kv_append(qkv.contiguous(), k_cache, v_cache, self._starts(starts, qkv.device),
                                  max_start=max(starts))

    def attention(self, q, k_cache, v_cache, starts, n_uncommitted, tree_mask, scale):
        b = q.shape[0]
        if tree_mask is not None and tree_mask.dim() == 2:
            tree_mask = tree_mask.unsqueeze(0).expand(b, -1, -1)
        mask = tree_mask.contiguous() if tree_mask is not None else None
        return self._attn.tree_attention(q.contiguous(), k_cache, v_cache, self._starts(starts, q.device),
                                         mask, scale, n_uncommitted=n_uncommitted, max_prefix=max(starts))

    def commit(self, k, v, row, start, path):
        path_t = torch.tensor([path], dtype=torch.int64, device=k.device)  # (1, M)
        self._kv.kv_commit(k, v, torch.tensor([row], device=k.device),
                           self._starts([start], k.device), path_t,
                           torch.tensor([len(path)], dtype=torch.int64, device=k.device))


# A float32 packing is kept only when its one-row passes run at most this fraction of the float16
# packing's (median of alternating rounds): a tie keeps the smaller stream.
WIDE_MARGIN = 0.03


def last_level_cache_bytes() -> int:
    """The largest data cache this machine reports (Linux sysfs of cpu0), 0 when unknown."""
    base = "/sys/devices/system/cpu/cpu0/cache"
    best = 0
    try:
        entries = os.listdir(base)
    except OSError:
        return 0
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    for name in entries:
        try:
            with open(os.path.join(base, name, "type"), encoding="ascii") as f:
                kind = f.read().strip()
            with open(os.path.join(base, name, "size"), encoding="ascii") as f:
                size = f.read().strip()
            if kind != "Instruction" and size:
                best = max(best, int(size.rstrip("KMG")) * units.get(size[-1], 1))
        except (OSError, ValueError):
            continue
    return best


def scratch_cache(cfg, slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Zeroed K and V of one cache row of ``slots`` slots for a model of config ``cfg``: what the
    packings' timed passes (``compare_packings``, ``wide_crossover``, a draft's oracle pass) write."""
    shape = (cfg.n_layer, 1, cfg.n_head, slots, cfg.n_embd // cfg.n_head)
    return torch.zeros(shape), torch.zeros(shape)


def _pass_ratios(a, b, run, rounds: int, before=None) -> list[float]:
    """a's seconds over b's for ``run(model)`` (one timed unit of passes), ``rounds`` rounds after
    a warm-up, the two in alternating order; ``before()``, where given, runs untimed before each
    unit."""
    import time

    ratios = []
    for r in range(rounds + 1):
        seconds = {}
        for model in (a, b) if r % 2 else (b, a):
            if before is not None:
                before()
            t0 = time.perf_counter()
            run(model)
            seconds[id(model)] = time.perf_counter() - t0
        if r:
            ratios.append(seconds[id(a)] / seconds[id(b)])
    return ratios


def _median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def compare_packings(a, b, cfg, rounds: int = 9, passes: int = 4, context: int = 32, before=None) -> float:
    """Median over ``rounds`` of the seconds of a one-row pass of packed model ``a`` over those
    of ``b`` (``_cpu.NativeGPT2``s of one model), ``passes`` of each in turn per round, after
    ``context`` cached entries of a scratch cache, the first round a warm-up. With ``before``
    (a draft's oracle pass, ``TorchBackend._pack``), each timed pass is one pass right after a
    call of it, the pass a round finds cold, over twice the rounds (one pass is a noisier unit)."""
    if before is not None:
        passes, rounds = 1, 2 * rounds
    context = min(context, cfg.n_positions - 1)
    k, v = scratch_cache(cfg, context + 1)

    def run(model):
        for i in range(passes):
            model.forward_ids([i], [context], k, v, context, 1, None, False)

    return _median(_pass_ratios(a, b, run, rounds, before))


WIDE_LADDER = (2, 3, 4, 6, 8, 12, 16, 32, 64)  # row counts ``wide_crossover`` times, in order


def wide_crossover(wide, narrow, cfg, rows=WIDE_LADDER, rounds: int = 8, context: int = 32,
                   budget: float = 2.0, least: int = 6) -> tuple[int | None, dict[str, float]]:
    """The first row count of ``rows`` at which a pass of ``wide`` ran faster than one of
    ``narrow`` by more than WIDE_MARGIN, and so did the next count's (the last count alone), or
    None if none did before ``budget`` seconds of measuring ran out; and each measured count's
    median ratio of seconds, over ``rounds`` alternating rounds after a warm-up, on a scratch
    cache of ``context`` entries. Counts go up, so a model whose wide passes win early stops early
    (the demo oracle on the Zen 1: about 0.2 s).

    The budget bounds what a slow model's later counts cost; its first ``least`` counts (2-12
    rows on the ladder) are timed whatever they take. GPT-2-small's passes take 13-25 ms on the
    Zen 1, so its first four or five counts spend the 2 s: in one roofline run it measured 6
    rows 0.88x, 8 rows 1.07x (noise: three loads in another sitting measured 0.80-0.81x there),
    ran out, and every pass of it stayed float16: 1.10x the time at 8 rows, 1.23-1.27x at 16-64.

    ``rounds`` is even so that each model runs first in half of them: which one goes first moves
    a pass's time. With 3 rounds (two with ``wide`` first) the demo oracle on the Zen 1 was given
    the float32 packing from 4 rows at 4 of 8 loads in one sitting, where 15 rounds measure it
    1.15-1.21x the time of float16's; with 8, at none of 24 loads in two sittings (6, 8 or 12 rows,
    0.90-0.95x), but in a third it measured 0.970x at 4 rows and took it there, and the roofline's
    4-node pass, 2.13x its one-node pass, ran slower than float16's had (1.79-1.92x). So a win by
    less than three margins is timed again over twice the rounds, and stands only if the median of
    all of them still wins."""
    import time

    context = min(context, cfg.n_positions // 2)
    rows = [n for n in rows if context + n <= cfg.n_positions]
    ratios: dict[str, float] = {}
    if not rows:
        return None, ratios
    k, v = scratch_cache(cfg, context + max(rows))
    began = time.perf_counter()
    won = None  # the previous count, where it won
    for n in rows:
        ids, pos = [i % cfg.vocab_size for i in range(n)], list(range(context, context + n))

        def run(model, ids=ids, pos=pos, n=n):
            model.forward_ids(ids, pos, k, v, context, n, None, False)

        seen = _pass_ratios(wide, narrow, run, rounds)
        if 1.0 - 3 * WIDE_MARGIN < _median(seen) < 1.0 - WIDE_MARGIN:  # a narrow win: confirmed over more rounds
            seen += _pass_ratios(wide, narrow, run, 2 * rounds)
        ratios[str(n)] = _median(seen)
        wins = ratios[str(n)] < 1.0 - WIDE_MARGIN
        if wins and (won is not None or n == rows[-1]):
            return (won if won is not None else n), ratios
        won = n if wins else None
        if len(ratios) >= least and time.perf_counter() - began > budget:
            break
    return None, ratios


def device_memory(device: torch.device) -> int:
    """Bytes of memory the device has (physical memory for the CPU), 0 when unknown."""
    try:
        if device.type == "cuda":
            return torch.cuda.get_device_properties(device).total_memory
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError, RuntimeError):
        return 0


def wide_memory_cap() -> int:
    """Bytes a second, float32 packing of a model may take: an eighth of physical memory (0 when
    the OS does not say)."""
    return device_memory(torch.device("cpu")) // 8


def make_backend(name: str, device: torch.device) -> Backend:
    """``"auto"``: Triton on CUDA, torch on CPU. ``"triton"`` on CPU needs TRITON_INTERPRET=1."""
    if name not in ("auto", "torch", "triton"):
        raise ValueError(f"backend must be 'auto', 'torch' or 'triton', got {name!r}")
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    if name == "torch":
        return TorchBackend()
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            "backend='triton' on a CPU device needs TRITON_INTERPRET=1 set before triton is imported "
            "(the interpreter is for tests); use backend='torch' for CPU inference"
        )
    try:
        return TritonBackend()
    except ImportError as exc:
        raise ValueError(f"backend='triton' needs the triton package and kernels/ ({exc})") from exc
