"""kv_append and kv_commit against their torch references: bit-exact (torch.equal)."""
from __future__ import annotations

import random
import zlib

import pytest
import torch

pytest.importorskip("triton")

from staged_engine.kernels.kv_cache import (  # noqa: E402
    kv_append,
    kv_append_ref,
    kv_commit,
    kv_commit_ref,
)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
HEAD_DIMS = [40, 64]
NEW_TOKENS = [1, 7, 33]
STARTS = [(0,), (97,), (97, 0, 1, 33)]  # per case, each row's first slot (0, 1, 97 and more rows)
N_LAYER, N_HEAD = 3, 3


def _seed(*parts) -> int:
    """A seed that is stable across runs (Python's str hash is salted per process)."""
    return zlib.crc32(repr(parts).encode())


def _cache(batch: int, slots: int, d: int, dtype: torch.dtype, device, gen) -> tuple:
    shape = (N_LAYER, batch, N_HEAD, slots, d)  # (L, B, H, S, D)
    k = torch.randn(shape, generator=gen).to(dtype).to(device)
    v = torch.randn(shape, generator=gen).to(dtype).to(device)
    return k, v


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("n", NEW_TOKENS)
@pytest.mark.parametrize("starts", STARTS)
def test_kv_append_matches_reference(device, dtype, d, n, starts):
    gen = torch.Generator().manual_seed(_seed(dtype, d, n, starts))
    b = len(starts)
    slots = max(starts) + n + 3
    k, v = _cache(b, slots, d, dtype, device, gen)
    k_ref, v_ref = k.clone(), v.clone()
    qkv = torch.randn(b, n, 3 * N_HEAD * d, generator=gen).to(dtype).to(device)
    st = torch.tensor(starts, dtype=torch.int64, device=device)
    layer = 1  # a (B, H, S, D) view inside the (L, B, H, S, D) cache, as the model passes it
    q = kv_append(qkv, k[layer], v[layer], st)
    q_ref = kv_append_ref(qkv, k_ref[layer], v_ref[layer], st)
    assert q.shape == (b, N_HEAD, n, d) and q.dtype == dtype and q.is_contiguous()
    assert torch.equal(q, q_ref)
    assert torch.equal(k, k_ref)  # written slots equal, every other slot and layer untouched
    assert torch.equal(v, v_ref)


def test_kv_append_fills_last_slot(device):
    k, v = _cache(2, 10, 40, torch.float32, device, torch.Generator().manual_seed(1))
    qkv = torch.randn(2, 4, 3 * N_HEAD * 40, device=device)
    st = torch.tensor([6, 0], device=device)
    k_ref, v_ref = k.clone(), v.clone()
    kv_append(qkv, k[0], v[0], st, max_start=6)
    kv_append_ref(qkv, k_ref[0], v_ref[0], st)
    assert torch.equal(k, k_ref) and torch.equal(v, v_ref)


def _paths(m_cols: int, lengths: list[int], rng: random.Random) -> list[list[int]]:
    """Strictly increasing paths starting at 0, padded with zeros to m_cols."""
    out = []
    for length in lengths:
        p = [0] + sorted(rng.sample(range(1, m_cols + 8), length - 1)) if length else []
        out.append(p + [0] * (m_cols - len(p)))
    return out


# (starts per row, path per row); every path strictly increasing from 0
COMMIT_CASES = [
    ([5], [[0]]),  # the root only: nothing moves
    ([0], [[0, 1, 2]]),  # a chain already in place
    ([3], [[0, 2, 3, 6]]),
    ([97, 1], [[0, 1, 5, 6, 20, 32], [0, 3, 4, 0, 0, 0]]),  # second row shorter (path_len 3)
    ([0, 4, 9], "random"),  # long random paths, more than one BLOCK_M chunk
    ([2], "shift"),  # path[m] = m + 1: every slot is read by one program chunk and written by it
]


def _commit_inputs(case, rng):
    starts, paths = case
    if paths == "random":
        lengths = [70, 0, 33]
        paths = _paths(70, lengths, rng)
    elif paths == "shift":
        lengths = [90]
        paths = [[0] + list(range(2, 91))]
    else:
        lengths = [len(p) if i == 0 or len(starts) == 1 else 3 for i, p in enumerate(paths)]
    return starts, paths, lengths


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("case", COMMIT_CASES, ids=range(len(COMMIT_CASES)))
def test_kv_commit_matches_reference(device, dtype, d, case):
    rng = random.Random(_seed(dtype, d, case))
    starts, paths, lengths = _commit_inputs(case, rng)
    r = len(starts)
    batch = r + 1  # one row that is never listed must stay untouched
    rows = rng.sample(range(batch), r)
    slots = max(s + max(p) for s, p in zip(starts, paths)) + 2
    k, v = _cache(batch, slots, d, dtype, device, torch.Generator().manual_seed(rng.randrange(2**31)))
    k_ref, v_ref = k.clone(), v.clone()
    args = [torch.tensor(x, dtype=torch.int64, device=device) for x in (rows, starts, paths, lengths)]
    kv_commit(k, v, *args)
    kv_commit_ref(k_ref, v_ref, *args)
    assert torch.equal(k, k_ref)
    assert torch.equal(v, v_ref)


def test_kv_commit_equals_sequential_decoding(device):
    """After commit, slots [L, L + m) hold what sequential decoding of the path would have written."""
    k, v = _cache(1, 40, 64, torch.float16, device, torch.Generator().manual_seed(3))
    start, path = 7, [0, 2, 5, 9, 10]
    expect_k = k[:, 0, :, [start + p for p in path]].clone()  # (L, H, M, D)
    expect_v = v[:, 0, :, [start + p for p in path]].clone()
    before_k = k[:, 0, :, :start].clone()
    t = lambda x: torch.tensor(x, dtype=torch.int64, device=device)  # noqa: E731
    kv_commit(k, v, t([0]), t([start]), t([path]), t([len(path)]))
    assert torch.equal(k[:, 0, :, start:start + len(path)], expect_k)
    assert torch.equal(v[:, 0, :, start:start + len(path)], expect_v)
    assert torch.equal(k[:, 0, :, :start], before_k)


# --- input validation: ValueError naming the argument --------------------------------------

def _append_args(device):
    k = torch.zeros(2, 3, 16, 8, device=device)
    return dict(qkv=torch.zeros(2, 4, 3 * 3 * 8, device=device), k_cache=k, v_cache=k.clone(),
                starts=torch.tensor([0, 3], device=device))


APPEND_BAD = [
    ("qkv", lambda a: a["qkv"][..., :-3]),  # last dim not 3 * H * D
    ("qkv", lambda a: a["qkv"].transpose(0, 1).contiguous().transpose(0, 1)),  # not contiguous
    ("qkv", lambda a: a["qkv"].to(torch.int32)),
    ("k_cache", lambda a: a["k_cache"].half()),
    ("k_cache", lambda a: a["k_cache"][0]),
    ("v_cache", lambda a: a["v_cache"][:, :, :8]),
    ("starts", lambda a: a["starts"].to(torch.int32)),
    ("starts", lambda a: a["starts"][:1]),
    ("starts", lambda a: torch.tensor([0, 13], device=a["starts"].device)),  # 13 + 4 > 16
    ("starts", lambda a: torch.tensor([-1, 0], device=a["starts"].device)),
    ("starts", lambda a: a["starts"].to("meta")),  # another device
]


@pytest.mark.parametrize("arg,mutate", APPEND_BAD)
def test_kv_append_rejects_bad_input(device, arg, mutate):
    a = _append_args(device)
    a[arg] = mutate(a)
    with pytest.raises(ValueError, match=arg):
        kv_append(**a)


def _commit_args(device):
    k = torch.zeros(2, 3, 2, 16, 8, device=device)
    t = lambda x: torch.tensor(x, dtype=torch.int64, device=device)  # noqa: E731
    return dict(k=k, v=k.clone(), rows=t([1]), starts=t([2]), path=t([[0, 2, 3]]), path_len=t([3]))


COMMIT_BAD = [
    ("k", lambda a: a["k"][0]),
    ("v", lambda a: a["v"].half()),
    ("rows", lambda a: a["rows"] + 5),
    ("rows", lambda a: a["rows"].to(torch.int32)),
    ("path", lambda a: torch.tensor([[0, 3, 2]], device=a["path"].device)),  # not increasing
    ("path", lambda a: torch.tensor([[1, 2, 3]], device=a["path"].device)),  # not from the root
    ("path", lambda a: torch.tensor([[0, 2, 14]], device=a["path"].device)),  # past S
    ("path", lambda a: a["path"][0]),
    ("path_len", lambda a: a["path_len"] + 1),
    ("starts", lambda a: a["starts"][:0]),
    ("path_len", lambda a: a["path_len"].to("meta")),
]


@pytest.mark.parametrize("arg,mutate", COMMIT_BAD)
def test_kv_commit_rejects_bad_input(device, arg, mutate):
    a = _commit_args(device)
    a[arg] = mutate(a)
    with pytest.raises(ValueError, match=arg):
        kv_commit(**a)


def test_kv_commit_rejects_duplicate_rows(device):
    a = _commit_args(device)
    t = lambda x: torch.tensor(x, dtype=torch.int64, device=device)  # noqa: E731
    a.update(rows=t([1, 1]), starts=t([2, 2]), path=t([[0, 1], [0, 1]]), path_len=t([2, 2]))
    with pytest.raises(ValueError, match="rows"):
        kv_commit(**a)


def test_wrappers_reject_cpu_tensors_without_interpreter(device):
    if device.type == "cpu":
        pytest.skip("on CPU the interpreter is on; this checks the CUDA build's refusal of CPU tensors")
    a = {key: val.cpu() for key, val in _append_args(device).items()}
    with pytest.raises(ValueError, match="qkv"):
        kv_append(**a)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_kv_large_cuda(cuda_device, dtype):
    """A GPT-2-L-sized layer (H = 20, D = 64) with a long cache."""
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(4, 2, 20, 2048, 64, generator=gen).to(dtype).to(cuda_device)
    v = torch.randn_like(k)
    k_ref, v_ref = k.clone(), v.clone()
    qkv = torch.randn(2, 128, 3 * 1280, generator=gen).to(dtype).to(cuda_device)
    st = torch.tensor([1500, 17], device=cuda_device)
    assert torch.equal(kv_append(qkv, k[2], v[2], st), kv_append_ref(qkv, k_ref[2], v_ref[2], st))
    rows, starts = torch.tensor([0, 1], device=cuda_device), torch.tensor([1500, 17], device=cuda_device)
    path = torch.tensor([[0] + list(range(3, 130, 2)), [0, 1, 2] + [0] * 62], device=cuda_device)
    plen = torch.tensor([64, 3], device=cuda_device)
    kv_commit(k, v, rows, starts, path, plen)
    kv_commit_ref(k_ref, v_ref, rows, starts, path, plen)
    assert torch.equal(k, k_ref) and torch.equal(v, v_ref)
