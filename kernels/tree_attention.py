"""Tree attention over a KV cache: committed prefix + tree-masked uncommitted entries, one softmax.

Row b has committed slots [0, prefix_len[b]) and M >= N uncommitted entries after them, at
slots prefix_len[b] + j, j < M: entries pending from earlier passes, then this pass's N new
tokens (new token i is entry M - N + i; staged_engine/backend.py). Query i attends to the whole
committed prefix and to entry j when tree_mask[b, i, j] (None: a chain, j <= M - N + i).
ALGORITHMS.md sec. 7 is the M = N case. One online softmax covers both parts; scores, softmax
statistics and the accumulator are fp32 whatever the input dtype (fp32, fp16, bf16).

When the grid over (query blocks, rows, heads) is too small to fill the GPU (few new tokens, a
long prefix: decoding) the prefix is split across programs (flash-decoding): each split writes
its partial max / sum / unnormalised output in fp32 and a second kernel combines them. The
tree part is its own split. The split count is planned from the cache size S (or the caller's
``max_prefix``), never from ``prefix_len``'s values, so planning needs no device sync; splits
that start past a row's prefix do no work.
"""
from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from . import _check_device, _check_shape, _check_tensor, interpreting

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
_LOG2E = 1.4426950408889634
_BLOCK_KV = 64
_MIN_SPLIT = 256  # fewest prefix slots worth a split of their own


@triton.jit
def _cast(x, dtype: tl.constexpr, INTERP_BF16: tl.constexpr):
    """fp32 -> dtype, rounding to nearest even. The interpreter truncates fp32 -> bf16, so under
    it the rounding is done by hand on the bits first (then the truncation is exact)."""
    if INTERP_BF16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        x = bits.to(tl.float32, bitcast=True)
    return x.to(dtype)


@triton.jit
def _attend_block(q, k, v, visible, m_i, l_i, acc, qk_scale,
                  INTERP_BF16: tl.constexpr, PRECISION: tl.constexpr):
    """One online-softmax step over a block of keys. q (BN, BD), k/v (BKV, BD), visible (BN, BKV)."""
    if INTERP_BF16:  # the interpreter's bf16 dot is wrong; fp32 over bf16 values is what the MMA does
        k = k.to(tl.float32)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # (BN, BKV), log2 units
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_base = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw nothing yet: no NaN
    alpha = tl.exp2(m_i - m_base)
    p = tl.exp2(s - m_base[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    p = _cast(p, v.dtype, INTERP_BF16)  # the P @ V operand in the input precision, as on the MMA
    if INTERP_BF16:
        p = p.to(tl.float32)
        v = v.to(tl.float32)
    acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def _tree_attention_kernel(
    q_ptr, k_ptr, v_ptr, prefix_ptr, mask_ptr, out_ptr, part_acc_ptr, part_ml_ptr,
    qk_scale, N, M, H, S, split_size, num_splits,
    stride_qb, stride_qh, stride_qn,  # q and out (B, H, N, D), last stride 1
    stride_kb, stride_kh, stride_ks,  # k and v caches (B, H, S, D), last stride 1
    stride_mb, stride_mi,  # tree mask (B, N, M), last stride 1
    D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_KV: tl.constexpr, BLOCK_D: tl.constexpr,
    CAUSAL: tl.constexpr, SPLIT: tl.constexpr, INTERP_BF16: tl.constexpr, PRECISION: tl.constexpr,
):
    # grid: (query blocks, B * H, splits). With SPLIT, program z < num_splits takes prefix slots
    # [z * split_size, +split_size) and program z == num_splits the tree part; without SPLIT one
    # program does everything and writes the normalised output. M - N entries precede the N
    # new tokens among the uncommitted ones.
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    pid_s = tl.program_id(2)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    prefix = tl.load(prefix_ptr + b)

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_kv = tl.arange(0, BLOCK_KV)
    n_ok = offs_n < N
    d_ok = offs_d < D
    q_off = b * stride_qb + h * stride_qh + offs_n[:, None] * stride_qn + offs_d[None, :]
    q = tl.load(q_ptr + q_off, mask=n_ok[:, None] & d_ok[None, :], other=0.0)
    if INTERP_BF16:
        q = q.to(tl.float32)
    k_base = k_ptr + b * stride_kb + h * stride_kh
    v_base = v_ptr + b * stride_kb + h * stride_kh

    m_i = tl.full([BLOCK_N], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_N], tl.float32)
    acc = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)

    # --- committed prefix: slots [lo, hi) -------------------------------------------------
    if SPLIT:
        lo = pid_s * split_size
        hi = tl.minimum(lo + split_size, prefix)
        hi = tl.where(pid_s == num_splits, lo, hi)  # the tree program reads no prefix
    else:
        lo = 0
        hi = prefix
    for start in range(lo, hi, BLOCK_KV):
        slots = start + offs_kv
        ok = slots < hi
        kv_off = slots[:, None] * stride_ks + offs_d[None, :]
        kv_mask = ok[:, None] & d_ok[None, :]
        k = tl.load(k_base + kv_off, mask=kv_mask, other=0.0)
        v = tl.load(v_base + kv_off, mask=kv_mask, other=0.0)
        visible = (offs_n * 0 == 0)[:, None] & ok[None, :]  # (BN, BKV)
        m_i, l_i, acc = _attend_block(q, k, v, visible, m_i, l_i, acc, qk_scale, INTERP_BF16, PRECISION)

    # --- the uncommitted entries: slots prefix + j, visible per tree_mask (or a chain) ---------
    if CAUSAL:
        j_end = tl.minimum(M, (pid_n + 1) * BLOCK_N + (M - N))  # this block sees j <= M - N + i
    else:
        j_end = M
    if SPLIT:
        j_end = tl.where(pid_s == num_splits, j_end, 0)
    for j0 in range(0, j_end, BLOCK_KV):
        offs_j = j0 + offs_kv
        slots = prefix + offs_j
        ok = (offs_j < M) & (slots < S)
        kv_off = slots[:, None] * stride_ks + offs_d[None, :]
        kv_mask = ok[:, None] & d_ok[None, :]
        k = tl.load(k_base + kv_off, mask=kv_mask, other=0.0)
        v = tl.load(v_base + kv_off, mask=kv_mask, other=0.0)
        if CAUSAL:
            visible = (offs_j[None, :] <= offs_n[:, None] + (M - N)) & ok[None, :]
        else:
            m_off = b * stride_mb + offs_n[:, None] * stride_mi + offs_j[None, :]
            tm = tl.load(mask_ptr + m_off, mask=n_ok[:, None] & ok[None, :], other=0)
            visible = (tm != 0) & ok[None, :]
        m_i, l_i, acc = _attend_block(q, k, v, visible, m_i, l_i, acc, qk_scale, INTERP_BF16, PRECISION)

    if SPLIT:
        # partials: acc (B*H, T, N, D) fp32 and (max, sum) (B*H, T, 2, N) fp32, T = splits + 1
        t_idx = pid_bh.to(tl.int64) * (num_splits + 1) + pid_s
        a_off = (t_idx * N + offs_n[:, None]) * D + offs_d[None, :]
        tl.store(part_acc_ptr + a_off, acc, mask=n_ok[:, None] & d_ok[None, :])
        tl.store(part_ml_ptr + t_idx * 2 * N + offs_n, m_i, mask=n_ok)
        tl.store(part_ml_ptr + t_idx * 2 * N + N + offs_n, l_i, mask=n_ok)
    else:
        l_i = tl.where(l_i == 0.0, 1.0, l_i)  # padding rows only: every real query sees itself
        out = _cast(acc / l_i[:, None], out_ptr.dtype.element_ty, INTERP_BF16)
        tl.store(out_ptr + q_off, out, mask=n_ok[:, None] & d_ok[None, :])


@triton.jit
def _tree_attention_combine_kernel(
    part_acc_ptr, part_ml_ptr, out_ptr, N, H, T,
    stride_ob, stride_oh, stride_on,
    D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, INTERP_BF16: tl.constexpr,
):
    # Merge the T partial softmaxes of one (query block, row, head). The tree split always holds
    # each query's own key, so the running max is finite for every real query.
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    n_ok = offs_n < N
    mask = n_ok[:, None] & (offs_d < D)[None, :]
    m_tot = tl.full([BLOCK_N], float("-inf"), tl.float32)
    l_tot = tl.zeros([BLOCK_N], tl.float32)
    acc = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    for t in range(0, T):
        t_idx = pid_bh.to(tl.int64) * T + t
        m_t = tl.load(part_ml_ptr + t_idx * 2 * N + offs_n, mask=n_ok, other=float("-inf"))
        l_t = tl.load(part_ml_ptr + t_idx * 2 * N + N + offs_n, mask=n_ok, other=0.0)
        a_t = tl.load(part_acc_ptr + (t_idx * N + offs_n[:, None]) * D + offs_d[None, :],
                      mask=mask, other=0.0)
        m_new = tl.maximum(m_tot, m_t)
        m_base = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_tot - m_base)
        beta = tl.exp2(m_t - m_base)
        l_tot = l_tot * alpha + l_t * beta
        acc = acc * alpha[:, None] + a_t * beta[:, None]
        m_tot = m_new
    l_tot = tl.where(l_tot == 0.0, 1.0, l_tot)  # padding rows only
    out = acc / l_tot[:, None]
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    o_off = b * stride_ob + h * stride_oh + offs_n[:, None] * stride_on + offs_d[None, :]
    tl.store(out_ptr + o_off, _cast(out, out_ptr.dtype.element_ty, INTERP_BF16), mask=mask)


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _plan_splits(device: torch.device, programs: int, max_prefix: int, num_splits: int | None,
                 interpret: bool, block_kv: int) -> tuple[int, int]:
    """(prefix splits, slots per split); 1 split means the single-kernel path."""
    if max_prefix <= 0:
        return 1, block_kv
    if num_splits is None:
        if interpret or device.type != "cuda":
            num_splits = 1
        else:
            target = 2 * _sm_count(device.index if device.index is not None else 0)
            num_splits = 1 if programs >= target else min(triton.cdiv(target, programs),
                                                          triton.cdiv(max_prefix, _MIN_SPLIT))
    num_splits = max(1, min(num_splits, triton.cdiv(max_prefix, block_kv)))
    split_size = triton.cdiv(triton.cdiv(max_prefix, num_splits), block_kv) * block_kv
    return triton.cdiv(max_prefix, split_size), split_size


def tree_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   prefix_len: torch.Tensor, tree_mask: torch.Tensor | None, scale: float, *,
                   n_uncommitted: int | None = None, max_prefix: int | None = None,
                   num_splits: int | None = None) -> torch.Tensor:
    """Attention of N new tokens per row over the committed prefix and the visible uncommitted
    entries (tree nodes).

    q: (B, H, N, D) contiguous, fp32 / fp16 / bf16; N >= 1, D <= 256 (any D: padded + masked).
    k_cache, v_cache: (B, H, S, D) contiguous, q's dtype; the M uncommitted entries' K/V are at
        slots prefix_len[b] + j, j < M, the N new tokens last (kv_append wrote them).
    prefix_len: (B,) int64, committed length of each row; prefix_len[b] + M <= S is the caller's
        contract (kv_append checked it); out-of-range slots are never read, whatever the values.
    tree_mask: (B, N, M) bool contiguous, M >= N, tree_mask[b, i, j] = entry j is visible to new
        token i (an ancestor, or i itself: entry M - N + i must be visible), or None for a
        chain (j <= M - N + i).
    scale: softmax scale (1 / sqrt(D) for GPT-2).
    n_uncommitted: M; taken from tree_mask when given (must agree), else defaults to N.
    max_prefix: optional host-known bound on prefix_len, used only to plan splits (default S - M).
    num_splits: force the number of prefix splits (default: enough programs to fill the GPU;
        1 on CPU / in the interpreter).
    Returns (B, H, N, D), q's dtype.
    """
    _check_tensor("q", q, ndim=4, dtypes=_FLOATS)
    _check_tensor("k_cache", k_cache, ndim=4, dtypes=_FLOATS)
    _check_tensor("v_cache", v_cache, ndim=4, dtypes=_FLOATS)
    _check_tensor("prefix_len", prefix_len, ndim=1, dtypes=(torch.int64,))
    if tree_mask is not None:
        _check_tensor("tree_mask", tree_mask, ndim=3, dtypes=(torch.bool,))
    _check_device(_tree_attention_kernel, "q", q, k_cache=k_cache, v_cache=v_cache,
                  prefix_len=prefix_len, tree_mask=tree_mask)
    b, h, n, d = q.shape
    s = k_cache.shape[2]
    _check_shape("k_cache", k_cache, (b, h, s, d))
    _check_shape("v_cache", v_cache, (b, h, s, d))
    _check_shape("prefix_len", prefix_len, (b,))
    if n_uncommitted is not None and (isinstance(n_uncommitted, bool)
                                      or not isinstance(n_uncommitted, int) or n_uncommitted < n):
        raise ValueError(f"n_uncommitted must be an integer >= N = {n}, got {n_uncommitted!r}")
    m = n_uncommitted if n_uncommitted is not None else n
    if tree_mask is not None:
        m = tree_mask.shape[2] if n_uncommitted is None else m
        _check_shape("tree_mask", tree_mask, (b, n, m))
        if m < n:
            raise ValueError(f"tree_mask must be (B, N, M) with M >= N = {n} uncommitted entries, "
                             f"got {tuple(tree_mask.shape)}")
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError(f"k_cache and v_cache must have q's dtype {q.dtype}, got {k_cache.dtype} "
                         f"and {v_cache.dtype}")
    if n < 1 or m > s:
        raise ValueError(f"q must hold N >= 1 new tokens and the M >= N uncommitted entries must "
                         f"fit the cache, got N = {n}, M = {m}, S = {s}")
    if not 1 <= d <= 256:
        raise ValueError(f"head dim D must be in [1, 256], got {d}")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise ValueError(f"scale must be a finite float, got {scale!r}")
    if max_prefix is None:
        max_prefix = s - m
    elif isinstance(max_prefix, bool) or not isinstance(max_prefix, int) or not 0 <= max_prefix <= s - m:
        raise ValueError(f"max_prefix must be an integer in [0, S - M] = [0, {s - m}], got {max_prefix!r}")
    if num_splits is not None and (isinstance(num_splits, bool) or not isinstance(num_splits, int)
                                   or num_splits < 1):
        raise ValueError(f"num_splits must be an integer >= 1 or None, got {num_splits!r}")

    out = torch.empty_like(q)
    if b == 0 or h == 0:
        return out
    interpret = interpreting(_tree_attention_kernel)
    interp_bf16 = interpret and q.dtype == torch.bfloat16
    block_n = min(64, max(16, triton.next_power_of_2(n)))
    block_d = max(16, triton.next_power_of_2(d))
    # fp32 tiles are twice as large and its ieee dot stages through shared memory: smaller KV
    # blocks and two pipeline stages keep D = 128 under 100 KB of shared memory (sm_86 / sm_89).
    fp32 = q.dtype == torch.float32
    block_kv = 32 if fp32 and block_d >= 128 else _BLOCK_KV
    n_blocks = triton.cdiv(n, block_n)
    splits, split_size = _plan_splits(q.device, b * h * n_blocks, max_prefix, num_splits, interpret,
                                      block_kv)
    split = splits > 1
    mask_arg = tree_mask.view(torch.uint8) if tree_mask is not None else q  # q: unused placeholder
    stride_mb, stride_mi = (tree_mask.stride(0), tree_mask.stride(1)) if tree_mask is not None else (0, 0)
    if split:
        t = splits + 1
        part_acc = torch.empty((b * h, t, n, d), dtype=torch.float32, device=q.device)
        part_ml = torch.empty((b * h, t, 2, n), dtype=torch.float32, device=q.device)
    else:
        part_acc = part_ml = out  # unused
    meta = dict(
        D=d, BLOCK_N=block_n, BLOCK_KV=block_kv, BLOCK_D=block_d,
        CAUSAL=tree_mask is None, SPLIT=split,
        INTERP_BF16=interp_bf16,
        PRECISION="ieee" if q.dtype == torch.float32 or interpret else "tf32",
        num_warps=8 if block_d >= 128 else 4, num_stages=2 if fp32 else 3,
    )
    grid = (n_blocks, b * h, splits + 1 if split else 1)
    _tree_attention_kernel[grid](
        q, k_cache, v_cache, prefix_len, mask_arg, out, part_acc, part_ml,
        float(scale) * _LOG2E, n, m, h, s, split_size, splits,
        q.stride(0), q.stride(1), q.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        stride_mb, stride_mi,
        **meta,
    )
    if split:
        _tree_attention_combine_kernel[(n_blocks, b * h)](
            part_acc, part_ml, out, n, h, splits + 1,
            out.stride(0), out.stride(1), out.stride(2),
            D=d, BLOCK_N=block_n, BLOCK_D=block_d, INTERP_BF16=interp_bf16,
        )
    return out


def tree_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       prefix_len: torch.Tensor, tree_mask: torch.Tensor | None, scale: float,
                       upcast: bool = True, n_uncommitted: int | None = None) -> torch.Tensor:
    """Plain-PyTorch tree attention, one row at a time over exactly the visible slots.

    q: (B, H, N, D); k_cache, v_cache: (B, H, S, D); prefix_len: (B,) int64;
    tree_mask: (B, N, M) bool, or None (a chain over M = n_uncommitted or N entries);
    scale: float.
    upcast=True computes in fp32 (the accuracy reference); upcast=False is PyTorch's own
    low-precision path: Q @ K^T and P @ V in the input dtype, softmax in fp32.
    Slots outside [0, prefix_len[b] + M) are never read (they may hold garbage or NaN).
    Returns (B, H, N, D) in q's dtype.
    """
    b, h, n, d = q.shape
    m = tree_mask.shape[2] if tree_mask is not None else (n_uncommitted or n)
    dt = torch.float32 if upcast else q.dtype
    out = torch.empty_like(q)
    chain = torch.ones(n, m, dtype=torch.bool, device=q.device).tril_(m - n)  # (N, M)
    for row, p in enumerate(prefix_len.tolist()):
        keys = k_cache[row, :, :p + m].to(dt)  # (H, P + M, D)
        values = v_cache[row, :, :p + m].to(dt)  # (H, P + M, D)
        tree = chain if tree_mask is None else tree_mask[row]  # (N, M)
        visible = torch.cat([torch.ones(n, p, dtype=torch.bool, device=q.device), tree], 1)  # (N, P+M)
        scores = (q[row].to(dt) @ keys.transpose(-1, -2)).float() * scale  # (H, N, P + M)
        scores = scores.masked_fill(~visible, float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(dt)  # (H, N, P + M)
        out[row] = (probs @ values).to(q.dtype)  # (H, N, D)
    return out
