"""Tree verification on the device: choice() at every node, then the tree walk.

ALGORITHMS.md sec. 3-4 and staged_engine/sampling.py define what is computed:

    choice = argmax_v z[v]                                   (T = 0; ties -> smallest id)
    choice = argmax_v (log p'[v] + g(key)[v])                (T > 0)

with p' = softmax(z / T) (then top-k / top-p) and g the position-keyed Gumbel noise of
sampling.py: ``key = noise_key(seed, position)`` (computed on the host, one per node), then
per token v: ``salt = mix32(v * GOLDEN + VOCAB_SALT)``, ``h = mix32(mix32(salt ^ key) + key)``,
``u = ((h >> 9) + 0.5) / 2^23``, ``g = -log(-log(u))``. The kernels compute the hash in uint32
arithmetic, bit for bit the same as ``sampling._hash_reference``.

Top-k / top-p: sorting a 50k vocabulary per node is what torch.sort already does well, so the
wrapper builds log p' with ``sampling.processed_logprobs`` (torch, on the device) and the kernel
adds the noise and takes the argmax. Temperature-only sampling and greedy run entirely in the
kernel (log-softmax fused: one pass for max / sum, one for the argmax).

The walk (node = root; y = choice[node]; go to the child of node whose token is y, else y is the
bonus token) is a one-program kernel; the result is packed into one small int64 tensor so the
host reads it back in a single transfer (``unpack_verify``).

Floating point: the hash bits are exact. The Gumbel values, the log-softmax and the division by
T follow the same operation order as the torch code, but ``log`` / ``exp`` and the softmax sum
may differ from torch's in the last bit, so a choice can differ from ``sampling.choose`` only
when two perturbed scores tie to within float32 rounding. Use one implementation (this kernel,
or the torch path) for every strategy of a run to keep drafter invariance exact.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from staged_engine.sampling import (
    SamplingParams,
    mix32_tensor,
    processed_logprobs,
    uniform_from_hash,
    vocab_salt,
)

from . import _check_device, _check_shape, _check_tensor

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
_BLOCK_V = 2048
_GREEDY, _TEMPERATURE, _LOGPROBS = 0, 1, 2  # choice kernel modes


# ---------------------------------------------------------------------------------------------
# the noise: sampling.py's hash in uint32
# ---------------------------------------------------------------------------------------------

@triton.jit
def _mix32(x):
    """lowbias32 on uint32 (products wrap mod 2^32)."""
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    return x ^ (x >> 16)


@triton.jit
def _noise(key, tok):
    """key: uint32 scalar; tok: int32 token ids -> (hash uint32, Gumbel noise fp32)."""
    salt = _mix32(tok.to(tl.uint32) * 0x9E3779B9 + 0x632BE5AB)
    h = _mix32(_mix32(salt ^ key) + key)
    u = ((h >> 9).to(tl.float32) + 0.5) * 1.1920928955078125e-07  # exact: (h >> 9) < 2^23
    return h, -tl.log(-tl.log(u))


@triton.jit
def _gumbel_noise_kernel(keys_ptr, hash_ptr, g_ptr, V, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    ok = offs < V
    key = tl.load(keys_ptr + row).to(tl.uint32)
    h, g = _noise(key, offs)
    tl.store(hash_ptr + row * V + offs, h.to(tl.int64), mask=ok)
    tl.store(g_ptr + row * V + offs, g, mask=ok)


def gumbel_noise(keys: torch.Tensor, vocab_size: int, bits: bool = False) -> torch.Tensor:
    """The noise rows g(key) for N keys.

    keys: (N,) int64 noise keys in [0, 2^32) (``sampling.noise_key(seed, position)``).
    vocab_size: V >= 1.
    Returns (N, V) float32 Gumbel noise, or with ``bits`` the (N, V) int64 32-bit hashes.
    """
    _check_tensor("keys", keys, ndim=1, dtypes=(torch.int64,))
    _check_device(_gumbel_noise_kernel, "keys", keys)
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
        raise ValueError(f"vocab_size must be an integer >= 1, got {vocab_size!r}")
    n = keys.shape[0]
    h = torch.empty((n, vocab_size), dtype=torch.int64, device=keys.device)
    g = torch.empty((n, vocab_size), dtype=torch.float32, device=keys.device)
    if n > 0:
        grid = (n, triton.cdiv(vocab_size, _BLOCK_V))
        _gumbel_noise_kernel[grid](keys, h, g, vocab_size, BLOCK_V=_BLOCK_V)
    return h if bits else g


def gumbel_noise_ref(keys: torch.Tensor, vocab_size: int, bits: bool = False) -> torch.Tensor:
    """sampling.py's noise for N keys. keys: (N,) int64; returns (N, V) float32 (or int64 bits)."""
    salt = vocab_salt(vocab_size, keys.device)  # (V,)
    k = keys[:, None]  # (N, 1)
    h = mix32_tensor(((mix32_tensor(salt[None, :] ^ k)) + k) & 0xFFFFFFFF)  # (N, V)
    if bits:
        return h
    return -torch.log(-torch.log(uniform_from_hash(h)))


# ---------------------------------------------------------------------------------------------
# choice() at every node
# ---------------------------------------------------------------------------------------------

@triton.jit
def _choice_kernel(x_ptr, stride_x, keys_ptr, out_ptr, V, temperature,
                   MODE: tl.constexpr, BLOCK_V: tl.constexpr):
    # One program per node. MODE 0: argmax x. MODE 1: argmax log_softmax(x / T) + g, with the
    # log-softmax computed as torch does ((z - max) - log(sum exp(z - max)), z = x / T).
    # MODE 2: argmax x + g, x = log p' already processed (top-k / top-p) on the host side.
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    offs0 = tl.arange(0, BLOCK_V)
    if MODE != 0:
        key = tl.load(keys_ptr + row).to(tl.uint32)
    else:
        key = tl.zeros([], tl.uint32)
    if MODE == 1:
        m = tl.full([], float("-inf"), tl.float32)
        total = tl.zeros([], tl.float32)
        for v0 in range(0, V, BLOCK_V):
            offs = v0 + offs0
            z = tl.load(x_row + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
            z = tl.math.div_rn(z, temperature)  # IEEE division, as torch's z / T
            m_new = tl.maximum(m, tl.max(z, 0))
            total = total * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new), 0)
            m = m_new
        log_total = tl.log(total)
    best = tl.full([], float("-inf"), tl.float32)
    best_i = tl.zeros([], tl.int32)
    for v0 in range(0, V, BLOCK_V):
        offs = v0 + offs0
        ok = offs < V
        x = tl.load(x_row + offs, mask=ok, other=float("-inf")).to(tl.float32)
        if MODE == 0:
            score = x
        elif MODE == 1:
            _, g = _noise(key, offs)
            score = ((tl.math.div_rn(x, temperature) - m) - log_total) + g
        else:
            _, g = _noise(key, offs)
            score = x + g
        score = tl.where(ok, score, float("-inf"))
        block_best = tl.max(score, 0)
        block_i = tl.argmax(score, 0, tie_break_left=True)
        take = block_best > best  # strict: an earlier block keeps a tie (smallest id wins)
        best_i = tl.where(take, v0 + block_i, best_i)
        best = tl.where(take, block_best, best)
    tl.store(out_ptr + row, best_i.to(tl.int64))


def _params(temperature: float, top_k: int, top_p: float) -> SamplingParams:
    return SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)


def _needs_sort(params: SamplingParams, vocab: int) -> bool:
    """True when top-k or top-p removes anything (sampling.processed_logprobs's slow path)."""
    k = params.top_k if 0 < params.top_k < vocab else vocab
    return k != vocab or params.top_p < 1.0


def choice(logits: torch.Tensor, keys: torch.Tensor | None, temperature: float,
           top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """choice() of ALGORITHMS.md sec. 3 for N logit rows.

    logits: (N, V) contiguous, fp32 / fp16 / bf16.
    keys: (N,) int64 noise keys (``noise_key(seed, position of the chosen token)``); ignored
        and may be None at temperature 0.
    temperature, top_k, top_p: as in ``SamplingParams`` (validated there).
    Returns (N,) int64 token ids.
    """
    params = _params(temperature, top_k, top_p)
    _check_tensor("logits", logits, ndim=2, dtypes=_FLOATS)
    n, vocab = logits.shape
    if vocab < 1:
        raise ValueError("logits must have at least one column (V >= 1)")
    if params.greedy:
        keys_arg = logits  # unused by the greedy kernel
    else:
        if keys is None:
            raise ValueError("keys is required at temperature > 0 (one noise key per row)")
        _check_tensor("keys", keys, ndim=1, dtypes=(torch.int64,))
        _check_shape("keys", keys, (n,))
        keys_arg = keys
    _check_device(_choice_kernel, "logits", logits, keys=None if params.greedy else keys)
    out = torch.empty(n, dtype=torch.int64, device=logits.device)
    if n == 0:
        return out
    x, mode, temp = logits, _GREEDY, 1.0
    if not params.greedy:
        if _needs_sort(params, vocab):
            x, mode = processed_logprobs(logits, params).contiguous(), _LOGPROBS
        else:
            mode, temp = _TEMPERATURE, float(params.temperature)
    _choice_kernel[(n,)](x, x.stride(0), keys_arg, out, vocab, temp, MODE=mode, BLOCK_V=_BLOCK_V)
    return out


def choice_ref(logits: torch.Tensor, keys: torch.Tensor | None, temperature: float,
               top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """sampling.py's rule in torch. logits: (N, V); keys: (N,) int64 or None (greedy).
    Returns (N,) int64."""
    params = _params(temperature, top_k, top_p)
    if params.greedy:
        return logits.argmax(dim=-1)
    scores = processed_logprobs(logits, params) + gumbel_noise_ref(keys, logits.shape[-1])
    return scores.argmax(dim=-1)


# ---------------------------------------------------------------------------------------------
# the tree walk
# ---------------------------------------------------------------------------------------------

@triton.jit
def _verify_tree_kernel(choice_ptr, tokens_ptr, parents_ptr, out_ptr, N, BLOCK: tl.constexpr):
    # One program. out = [path_len, path[0] = 0, ..., path[path_len - 1], bonus, -1 ...].
    # A move goes to a child with a larger index, so N steps always end the walk, whatever the
    # parents hold (a malformed tree cannot hang the kernel or read out of bounds).
    offs = tl.arange(0, BLOCK)
    valid = offs < N
    tok = tl.load(tokens_ptr + offs, mask=valid, other=-1)
    par = tl.load(parents_ptr + offs, mask=valid, other=-2)
    chosen = tl.load(choice_ptr + offs, mask=valid, other=-1)
    packed = tl.where(offs == 1, 0, -1).to(tl.int64)  # path[0] = the root
    node = tl.zeros([], tl.int64)
    length = tl.full([], 1, tl.int64)
    bonus = tl.full([], -1, tl.int64)
    done = tl.zeros([], tl.int32)
    for _ in range(0, N):
        y = tl.sum(tl.where(offs == node, chosen, 0), 0)  # choice at the current node
        hit = (par == node) & (tok == y) & (offs > node) & valid
        found = tl.max(hit.to(tl.int32), 0)
        child = tl.min(tl.where(hit, offs, BLOCK), 0).to(tl.int64)
        move = (1 - done) * found  # 0/1 ints: the interpreter mishandles scalar bool '&'
        stop = (1 - done) * (1 - found)
        packed = tl.where(offs == tl.where(move != 0, length + 1, -1), child, packed)
        length = length + move
        node = tl.where(move != 0, child, node)
        bonus = tl.where(stop != 0, y, bonus)
        done = done + stop
    packed = tl.where(offs == 0, length, packed)
    packed = tl.where(offs == length + 1, bonus, packed)
    tl.store(out_ptr + offs, packed, mask=offs < N + 2)


def verify_tree(logits: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor,
                keys: torch.Tensor | None, temperature: float, top_k: int = 0,
                top_p: float = 1.0) -> torch.Tensor:
    """Verify one speculation tree (ALGORITHMS.md sec. 4) on the device.

    logits: (N, V) contiguous, the oracle's logits at every tree node (fp32 / fp16 / bf16).
    tokens: (N,) int64 node tokens (node 0 is the root; its token is ignored).
    parents: (N,) int64, parents[0] = -1, parents[i] < i; siblings carry distinct tokens.
    keys: (N,) int64, keys[i] = noise_key(seed, L + depth(i) + 1) (the position of the token
        chosen at node i); None (or anything) at temperature 0.
    temperature, top_k, top_p: the sampling parameters.
    Returns (N + 2,) int64 on the device: [path_len, path (node indices, root first), bonus
    token, -1 padding]; ``unpack_verify`` turns it into (path, bonus) with one transfer.
    """
    _check_tensor("tokens", tokens, ndim=1, dtypes=(torch.int64,))
    _check_tensor("parents", parents, ndim=1, dtypes=(torch.int64,))
    _check_tensor("logits", logits, ndim=2, dtypes=_FLOATS)
    n = logits.shape[0]
    if n < 1:
        raise ValueError("logits must have one row per tree node (N >= 1), got 0 rows")
    _check_shape("tokens", tokens, (n,))
    _check_shape("parents", parents, (n,))
    _check_device(_verify_tree_kernel, "logits", logits, tokens=tokens, parents=parents)
    chosen = choice(logits, keys, temperature, top_k, top_p)  # (N,)
    out = torch.empty(n + 2, dtype=torch.int64, device=logits.device)
    _verify_tree_kernel[(1,)](chosen, tokens, parents, out, n,
                              BLOCK=triton.next_power_of_2(n + 2), num_warps=1)
    return out


def verify_tree_ref(logits: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor,
                    keys: torch.Tensor | None, temperature: float, top_k: int = 0,
                    top_p: float = 1.0) -> torch.Tensor:
    """The walk of ALGORITHMS.md sec. 4 in Python over ``choice_ref``.

    logits: (N, V); tokens, parents, keys: (N,) int64 (keys may be None when greedy).
    Returns the packed (N + 2,) int64 tensor of ``verify_tree``.
    """
    chosen = choice_ref(logits, keys, temperature, top_k, top_p).tolist()
    toks, pars = tokens.tolist(), parents.tolist()
    n = len(toks)
    node, path = 0, [0]
    while True:
        y = chosen[node]
        child = next((c for c in range(node + 1, n) if pars[c] == node and toks[c] == y), None)
        if child is None:
            break
        path.append(child)
        node = child
    packed = [len(path)] + path + [y] + [-1] * (n - len(path))
    return torch.tensor(packed, dtype=torch.int64, device=logits.device)


def unpack_verify(packed: torch.Tensor) -> tuple[list[int], int]:
    """(path, bonus) from ``verify_tree``'s output, in one device-to-host transfer.

    path: accepted node indices, root (0) first; the accepted tokens are the tokens of
    path[1:] followed by bonus.
    """
    vals = packed.tolist()
    n = vals[0]
    return vals[1:1 + n], vals[1 + n]
