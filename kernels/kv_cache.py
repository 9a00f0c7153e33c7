"""Fused KV-cache kernels: append (head split + cache write) and commit (accepted path move).

Cache layout (ALGORITHMS.md sec. 7, staged_engine/kv_cache.py): ``k`` and ``v`` are
(L, B, H, S, D); one layer's view is (B, H, S, D). A pass writes new token i of row b at slot
starts[b] + i (kv_append); after verification the accepted entries move down to sit right after
the committed prefix (kv_commit). Both kernels only move bits, so they match their references
exactly (torch.equal), in every dtype.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _check_device, _check_shape, _check_tensor

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
_I64 = (torch.int64,)


# ---------------------------------------------------------------------------------------------
# kv_append
# ---------------------------------------------------------------------------------------------

@triton.jit
def _kv_append_kernel(
    qkv_ptr, k_ptr, v_ptr, q_ptr, starts_ptr,
    N, H, S, n_tblocks,
    stride_xb, stride_xn,  # qkv (B, N, 3C), last stride 1
    stride_cb, stride_ch, stride_cs,  # k/v cache (B, H, S, D), last stride 1
    stride_qb, stride_qh, stride_qn,  # q out (B, H, N, D), last stride 1
    D: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
):
    # One program: tokens [BLOCK_T * tb, +BLOCK_T) of row b, columns [BLOCK_C * pid1, +BLOCK_C)
    # of each of the q / k / v thirds; column c is head c // D, element c % D.
    pid = tl.program_id(0)
    b = (pid // n_tblocks).to(tl.int64)
    offs_t = (pid % n_tblocks) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    C = H * D
    head = (offs_c // D)[None, :]
    elem = (offs_c % D)[None, :]
    t_ok = offs_t < N
    mask = t_ok[:, None] & (offs_c < C)[None, :]  # (BLOCK_T, BLOCK_C)

    src = qkv_ptr + b * stride_xb + offs_t[:, None] * stride_xn + offs_c[None, :]
    q = tl.load(src, mask=mask)
    k = tl.load(src + C, mask=mask)
    v = tl.load(src + 2 * C, mask=mask)

    q_dst = q_ptr + b * stride_qb + head * stride_qh + offs_t[:, None] * stride_qn + elem
    tl.store(q_dst, q, mask=mask)

    slots = tl.load(starts_ptr + b) + offs_t  # (BLOCK_T,) int64
    # slot < S is checked on the host; the mask only keeps a bad call from writing out of bounds.
    c_mask = mask & (slots < S)[:, None]
    c_off = b * stride_cb + head * stride_ch + slots[:, None] * stride_cs + elem
    tl.store(k_ptr + c_off, k, mask=c_mask)
    tl.store(v_ptr + c_off, v, mask=c_mask)


def kv_append(qkv: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
              starts: torch.Tensor, *, max_start: int | None = None) -> torch.Tensor:
    """Split ``qkv`` into heads, write its K and V into the cache, return Q.

    qkv: (B, N, 3C) contiguous, C = H * D, laid out [q | k | v] with heads contiguous in each.
    k_cache, v_cache: (B, H, S, D) contiguous (one layer of an (L, B, H, S, D) cache), qkv's dtype.
    starts: (B,) int64, row b's first free slot (committed length + pending entries); token i
        goes to slot starts[b] + i.
    max_start: optional host-known max(starts); without it the bound check
        ``max(starts) + N <= S`` reads ``starts`` back (a device sync on CUDA).
    Returns q: (B, H, N, D) contiguous, qkv's dtype.
    """
    _check_tensor("qkv", qkv, ndim=3, dtypes=_FLOATS)
    _check_tensor("k_cache", k_cache, ndim=4, dtypes=_FLOATS)
    _check_tensor("v_cache", v_cache, ndim=4, dtypes=_FLOATS)
    _check_tensor("starts", starts, ndim=1, dtypes=_I64)
    _check_device(_kv_append_kernel, "qkv", qkv, k_cache=k_cache, v_cache=v_cache, starts=starts)
    b, n, c3 = qkv.shape
    bc, h, s, d = k_cache.shape
    if bc != b:
        raise ValueError(f"k_cache has {bc} rows but qkv has {b}")
    _check_shape("v_cache", v_cache, tuple(k_cache.shape))
    _check_shape("starts", starts, (b,))
    if c3 != 3 * h * d:
        raise ValueError(f"qkv last dim must be 3 * H * D = {3 * h * d} for a cache with H={h}, "
                         f"D={d}; got {c3}")
    if k_cache.dtype != qkv.dtype or v_cache.dtype != qkv.dtype:
        raise ValueError(f"k_cache and v_cache must have qkv's dtype {qkv.dtype}, got "
                         f"{k_cache.dtype} and {v_cache.dtype}")
    if n < 1:
        raise ValueError("qkv must hold at least one token (N >= 1)")
    if max_start is None:
        max_start = int(starts.max()) if b > 0 else 0
        min_start = int(starts.min()) if b > 0 else 0
        if min_start < 0:
            raise ValueError(f"starts must be >= 0, got min {min_start}")
    if max_start + n > s:
        raise ValueError(f"starts + N exceeds the cache: max(starts) = {max_start}, N = {n}, S = {s}")

    q = torch.empty((b, h, n, d), dtype=qkv.dtype, device=qkv.device)  # (B, H, N, D)
    if b == 0:
        return q
    block_c = min(triton.next_power_of_2(h * d), 1024)
    block_t = min(triton.next_power_of_2(n), max(1, 4096 // block_c))
    n_tblocks = triton.cdiv(n, block_t)
    grid = (b * n_tblocks, triton.cdiv(h * d, block_c))
    _kv_append_kernel[grid](
        qkv, k_cache, v_cache, q, starts,
        n, h, s, n_tblocks,
        qkv.stride(0), qkv.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        q.stride(0), q.stride(1), q.stride(2),
        D=d, BLOCK_T=block_t, BLOCK_C=block_c,
    )
    return q


def kv_append_ref(qkv: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  starts: torch.Tensor) -> torch.Tensor:
    """Plain-PyTorch kv_append.

    qkv: (B, N, 3 * H * D); k_cache, v_cache: (B, H, S, D), written in place at slots
    [starts[b], starts[b] + N) of row b; starts: (B,) int64. Returns q: (B, H, N, D).
    """
    b, n, c3 = qkv.shape
    h, d = k_cache.shape[1], k_cache.shape[3]
    q, k, v = qkv.view(b, n, 3, h, d).permute(2, 0, 3, 1, 4).unbind(0)  # each (B, H, N, D)
    for row, s in enumerate(starts.tolist()):
        k_cache[row, :, s:s + n] = k[row]
        v_cache[row, :, s:s + n] = v[row]
    return q.contiguous()


# ---------------------------------------------------------------------------------------------
# kv_commit
# ---------------------------------------------------------------------------------------------

@triton.jit
def _kv_commit_kernel(
    k_ptr, v_ptr, rows_ptr, starts_ptr, path_ptr, path_len_ptr,
    R, H,
    stride_l, stride_b, stride_h, stride_s,  # k/v (L, B, H, S, D), last stride 1
    stride_pr,  # path (R, M), last stride 1
    D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # One program owns the (layer, row, head, d-block) slice, so no other program touches its
    # memory. Inside, path entries are handled in chunks of BLOCK_M in increasing order: chunk c
    # writes slots [c*BM, (c+1)*BM) and reads slots path[m] >= m, so later chunks never read
    # what an earlier chunk wrote; within a chunk every thread's load is done before any store
    # (the barrier), which makes the overlap inside the chunk safe too.
    pid = tl.program_id(0)
    hh = pid % H
    r = (pid // H) % R
    layer = pid // (H * R)
    row = tl.load(rows_ptr + r)
    start = tl.load(starts_ptr + r)
    plen = tl.load(path_len_ptr + r)
    base = layer.to(tl.int64) * stride_l + row * stride_b + hh.to(tl.int64) * stride_h
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_mask = offs_d < D
    for m0 in range(0, plen, BLOCK_M):
        offs_m = m0 + tl.arange(0, BLOCK_M)
        m_mask = offs_m < plen
        src = tl.load(path_ptr + r * stride_pr + offs_m, mask=m_mask, other=0)
        moves = m_mask & (src != offs_m)  # entries already in place need no copy
        mask = moves[:, None] & d_mask[None, :]  # (BLOCK_M, BLOCK_D)
        src_off = base + (start + src)[:, None] * stride_s + offs_d[None, :]
        dst_off = base + (start + offs_m)[:, None] * stride_s + offs_d[None, :]
        k = tl.load(k_ptr + src_off, mask=mask)
        v = tl.load(v_ptr + src_off, mask=mask)
        tl.debug_barrier()
        tl.store(k_ptr + dst_off, k, mask=mask)
        tl.store(v_ptr + dst_off, v, mask=mask)


def kv_commit(k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor, starts: torch.Tensor,
              path: torch.Tensor, path_len: torch.Tensor) -> None:
    """Keep the accepted tree path of each listed row: for r < R and m < path_len[r],
    ``k[:, rows[r], :, starts[r] + m] = k[:, rows[r], :, starts[r] + path[r, m]]`` (v likewise),
    in every layer and head, in place.

    k, v: (L, B, H, S, D) contiguous, same shape and dtype.
    rows: (R,) int64, distinct rows in [0, B).
    starts: (R,) int64, each row's committed length L_r (the root's slot).
    path: (R, M) int64 contiguous; path[r, :path_len[r]] strictly increasing, path[r, 0] == 0.
    path_len: (R,) int64 in [0, M].
    The values are checked on the host (one small read-back; a device sync on CUDA).
    """
    _check_tensor("k", k, ndim=5, dtypes=_FLOATS)
    _check_tensor("v", v, ndim=5, dtypes=_FLOATS)
    for name, t in (("rows", rows), ("starts", starts), ("path_len", path_len)):
        _check_tensor(name, t, ndim=1, dtypes=_I64)
    _check_tensor("path", path, ndim=2, dtypes=_I64)
    _check_device(_kv_commit_kernel, "k", k, v=v, rows=rows, starts=starts, path=path,
                  path_len=path_len)
    _check_shape("v", v, tuple(k.shape))
    if v.dtype != k.dtype:
        raise ValueError(f"v must have k's dtype {k.dtype}, got {v.dtype}")
    n_layer, b, h, s, d = k.shape
    r = rows.shape[0]
    _check_shape("starts", starts, (r,))
    _check_shape("path_len", path_len, (r,))
    if path.shape[0] != r:
        raise ValueError(f"path must have {r} rows (one per entry of rows), got {tuple(path.shape)}")
    m = path.shape[1]
    if r == 0 or m == 0:
        return
    _check_commit_values(rows.cpu(), starts.cpu(), path.cpu(), path_len.cpu(), b, s)

    block_d = min(triton.next_power_of_2(d), 128)
    block_m = min(triton.next_power_of_2(m), max(1, 4096 // block_d), 64)
    grid = (n_layer * r * h, triton.cdiv(d, block_d))
    _kv_commit_kernel[grid](
        k, v, rows, starts, path, path_len,
        r, h,
        k.stride(0), k.stride(1), k.stride(2), k.stride(3),
        path.stride(0),
        D=d, BLOCK_M=block_m, BLOCK_D=block_d,
    )


def _check_commit_values(rows: torch.Tensor, starts: torch.Tensor, path: torch.Tensor,
                         path_len: torch.Tensor, batch: int, slots: int) -> None:
    if bool(((rows < 0) | (rows >= batch)).any()):
        raise ValueError(f"rows must lie in [0, {batch}), got {rows.tolist()}")
    if rows.unique().numel() != rows.numel():
        raise ValueError(f"rows must be distinct, got {rows.tolist()}")
    m = path.shape[1]
    if bool(((path_len < 0) | (path_len > m)).any()):
        raise ValueError(f"path_len must lie in [0, {m}], got {path_len.tolist()}")
    if bool((starts < 0).any()):
        raise ValueError(f"starts must be >= 0, got {starts.tolist()}")
    for i in range(rows.numel()):
        n = int(path_len[i])
        if n == 0:
            continue
        p = path[i, :n]
        if int(p[0]) != 0 or bool((p[1:] <= p[:-1]).any()):
            raise ValueError(f"path[{i}] must start at 0 and strictly increase, got {p.tolist()}")
        if int(starts[i]) + int(p[-1]) >= slots:
            raise ValueError(f"path[{i}] reaches slot {int(starts[i]) + int(p[-1])} but the cache "
                             f"has S = {slots} slots")


def kv_commit_ref(k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor, starts: torch.Tensor,
                  path: torch.Tensor, path_len: torch.Tensor) -> None:
    """Plain-PyTorch kv_commit (in place).

    k, v: (L, B, H, S, D); rows, starts, path_len: (R,) int64; path: (R, M) int64. For each r
    moves slot starts[r] + path[r, m] to slot starts[r] + m for m < path_len[r].
    """
    for row, start, p, n in zip(rows.tolist(), starts.tolist(), path.tolist(), path_len.tolist()):
        src = torch.tensor(p[:n], dtype=torch.int64, device=k.device) + start
        dst = slice(start, start + n)
        k[:, row, :, dst] = k[:, row, :, src]  # advanced indexing on the right copies first
        v[:, row, :, dst] = v[:, row, :, src]
