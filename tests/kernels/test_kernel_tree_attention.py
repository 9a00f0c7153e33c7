"""tree_attention against its torch reference.

Mask kinds: "causal" (None: a chain over the N new tokens), "tree" (a random tree over the N
new tokens, M = N), "pending" (M = N + 5 uncommitted entries, the new tokens the last N nodes
of a random tree over all M, as after an earlier draft pass) and "chain" (None with
n_uncommitted = N + 3).

fp32: within a tight tolerance of the fp32 reference. fp16 / bf16 (STYLE.md 6): the kernel's
max error against the fp32 reference is at most twice that of PyTorch's own low-precision path
(``tree_attention_ref(..., upcast=False)``) plus a tiny epsilon. Slots outside each row's
[0, prefix + N) hold NaN, so any read outside the visible region shows up as NaN.
"""
from __future__ import annotations

import random
import zlib

import pytest
import torch

pytest.importorskip("triton")

from staged_engine.kernels.tree_attention import tree_attention, tree_attention_ref  # noqa: E402

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
HEAD_DIMS = [40, 64]
NEW_TOKENS = [1, 7, 33]
PREFIXES = [(0,), (97,), (97, 0, 1, 33)]  # per case, each row's prefix length (0, 1, 97 and more rows)
MASKS = ["causal", "tree", "pending"]  # "chain" has its own, smaller sweep
EXTRA = {"causal": 0, "tree": 0, "pending": 5, "chain": 3}  # M - N
N_HEAD = 2
EPS = 1e-5  # absolute slack for cases where both errors are ~0 (e.g. one visible key)


def _seed(*parts) -> int:
    return zlib.crc32(repr(parts).encode())


def _random_tree_mask(n: int, m: int, rng: random.Random) -> torch.Tensor:
    """(N, M) ancestor-or-self mask of the last N nodes of a random M-node tree (topological)."""
    parents = [-1] + [rng.randrange(i) for i in range(1, m)]
    mask = torch.zeros(n, m, dtype=torch.bool)
    for i in range(n):
        j = m - n + i
        while j >= 0:
            mask[i, j] = True
            j = parents[j]
    return mask


def _inputs(prefixes, n, d, dtype, mask_kind, device, seed):
    """q, k, v, prefix_len, tree_mask and the keyword arguments (n_uncommitted) of one case."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    b = len(prefixes)
    m = n + EXTRA[mask_kind]
    slots = max(prefixes) + m + 5
    q = torch.randn(b, N_HEAD, n, d, generator=gen)
    k = torch.randn(b, N_HEAD, slots, d, generator=gen)
    v = torch.randn(b, N_HEAD, slots, d, generator=gen)
    for row, p in enumerate(prefixes):  # garbage past each row's visible region
        k[row, :, p + m:] = float("nan")
        v[row, :, p + m:] = float("nan")
    mask = None
    if mask_kind in ("tree", "pending"):  # a different tree per row
        mask = torch.stack([_random_tree_mask(n, m, rng) for _ in range(b)]).to(device)
    kwargs = {"n_uncommitted": m} if mask_kind == "chain" else {}
    prefix_len = torch.tensor(prefixes, dtype=torch.int64, device=device)
    return (q.to(dtype).to(device), k.to(dtype).to(device), v.to(dtype).to(device), prefix_len, mask,
            kwargs)


def _check(q, k, v, prefix_len, mask, kwargs, out):
    scale = q.shape[-1] ** -0.5
    assert out.shape == q.shape and out.dtype == q.dtype
    ref32 = tree_attention_ref(q.float(), k.float(), v.float(), prefix_len, mask, scale, **kwargs)
    assert not torch.isnan(out).any()
    if q.dtype == torch.float32:
        torch.testing.assert_close(out, ref32, atol=1e-5, rtol=1e-5)
        return
    lowp = tree_attention_ref(q, k, v, prefix_len, mask, scale, upcast=False, **kwargs)
    err = (out.float() - ref32).abs().max().item()
    err_torch = (lowp.float() - ref32).abs().max().item()
    assert err <= 2 * err_torch + EPS, f"kernel error {err:.3g} vs torch low-precision {err_torch:.3g}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mask_kind", MASKS)
@pytest.mark.parametrize("prefixes", PREFIXES)
@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("n", NEW_TOKENS)
def test_tree_attention_matches_reference(device, n, d, prefixes, mask_kind, dtype):
    q, k, v, prefix_len, mask, kw = _inputs(prefixes, n, d, dtype, mask_kind, device,
                                            _seed(n, d, prefixes, mask_kind, dtype))
    out = tree_attention(q, k, v, prefix_len, mask, d ** -0.5, **kw)
    _check(q, k, v, prefix_len, mask, kw, out)


SPLIT_PREFIXES = [(97,), (200, 0, 5, 130)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_splits", [5])
@pytest.mark.parametrize("prefixes", SPLIT_PREFIXES)
@pytest.mark.parametrize("n", NEW_TOKENS)
def test_tree_attention_split_prefix(device, n, prefixes, num_splits, dtype):
    """The flash-decoding path: the prefix split across programs, then the combine kernel
    (splits past a row's prefix, and rows with no prefix at all, included)."""
    mask_kind = "pending" if n > 1 else "causal"
    q, k, v, prefix_len, mask, kw = _inputs(prefixes, n, 64, dtype, mask_kind, device,
                                            _seed(n, prefixes, num_splits, dtype))
    out = tree_attention(q, k, v, prefix_len, mask, 64 ** -0.5, num_splits=num_splits, **kw)
    _check(q, k, v, prefix_len, mask, kw, out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", [32, 80, 128])
def test_tree_attention_other_head_dims(device, d, dtype):
    q, k, v, prefix_len, mask, kw = _inputs((97, 3), 7, d, dtype, "tree", device, _seed(d, dtype))
    _check(q, k, v, prefix_len, mask, kw, tree_attention(q, k, v, prefix_len, mask, d ** -0.5))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", NEW_TOKENS)
def test_tree_attention_chain_after_pending(device, n, dtype):
    """tree_mask None with n_uncommitted = M > N: a chain through earlier pending entries."""
    q, k, v, prefix_len, mask, kw = _inputs((97, 0, 1, 33), n, 40, dtype, "chain", device,
                                            _seed(n, dtype, "chain"))
    out = tree_attention(q, k, v, prefix_len, None, 40 ** -0.5, **kw)
    _check(q, k, v, prefix_len, None, kw, out)


def test_tree_attention_chain_mask_equals_none(device):
    q, k, v, prefix_len, _, kw = _inputs((5, 40), 7, 40, torch.float32, "chain", device, 11)
    m = kw["n_uncommitted"]
    chain = torch.ones(7, m, dtype=torch.bool).tril_(m - 7).expand(2, 7, m).contiguous().to(device)
    a = tree_attention(q, k, v, prefix_len, None, 0.2, n_uncommitted=m)
    b = tree_attention(q, k, v, prefix_len, chain, 0.2)
    assert torch.equal(a, b)


def test_tree_attention_max_prefix_hint(device):
    q, k, v, prefix_len, mask, kw = _inputs((60, 2), 7, 64, torch.float16, "tree", device, 5)
    out = tree_attention(q, k, v, prefix_len, mask, 0.125, max_prefix=60, num_splits=3)
    _check(q, k, v, prefix_len, mask, kw, out)


# --- input validation ------------------------------------------------------------------------

def _args(device):
    q, k, v, prefix_len, mask, kw = _inputs((3, 0), 4, 16, torch.float32, "tree", device, 0)
    return dict(q=q, k_cache=k, v_cache=v, prefix_len=prefix_len, tree_mask=mask, scale=0.25)


BAD = [
    ("q", lambda a: a["q"][0]),
    ("q", lambda a: a["q"].transpose(2, 3)),  # not contiguous
    ("q", lambda a: a["q"].to(torch.int64)),
    ("k_cache", lambda a: a["k_cache"].half()),
    ("k_cache", lambda a: a["k_cache"][:, :1].contiguous()),  # wrong head count
    ("v_cache", lambda a: a["v_cache"][..., :8].contiguous()),
    ("prefix_len", lambda a: a["prefix_len"].to(torch.int32)),
    ("prefix_len", lambda a: a["prefix_len"][:1]),
    ("prefix_len", lambda a: a["prefix_len"].to("meta")),
    ("tree_mask", lambda a: a["tree_mask"].to(torch.uint8)),
    ("tree_mask", lambda a: a["tree_mask"][:, :3].contiguous()),
    ("tree_mask", lambda a: a["tree_mask"][:, :, :3].contiguous()),  # M < N
    ("scale", lambda a: float("nan")),
    ("scale", lambda a: "0.25"),
]


@pytest.mark.parametrize("arg,mutate", BAD)
def test_tree_attention_rejects_bad_input(device, arg, mutate):
    a = _args(device)
    a[arg] = mutate(a)
    with pytest.raises(ValueError, match=arg):
        tree_attention(**a)


def test_tree_attention_rejects_bad_options(device):
    a = _args(device)
    with pytest.raises(ValueError, match="max_prefix"):
        tree_attention(**a, max_prefix=100)
    with pytest.raises(ValueError, match="n_uncommitted"):
        tree_attention(**a, n_uncommitted=2)  # fewer than N = 4
    with pytest.raises(ValueError, match="tree_mask"):
        tree_attention(**a, n_uncommitted=5)  # disagrees with the mask's M = 4
    with pytest.raises(ValueError, match="num_splits"):
        tree_attention(**a, num_splits=0)


# --- CUDA only: sizes the interpreter is too slow for ------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n,prefixes", [(1, (4095, 17)), (128, (3000, 0)), (36, (1023, 500))])
def test_tree_attention_large_cuda(cuda_device, n, prefixes, dtype):
    q, k, v, prefix_len, mask, kw = _inputs(prefixes, n, 128, dtype, "pending", cuda_device,
                                            _seed(n, prefixes, dtype))
    _check(q, k, v, prefix_len, mask, kw, tree_attention(q, k, v, prefix_len, mask, 128 ** -0.5))
