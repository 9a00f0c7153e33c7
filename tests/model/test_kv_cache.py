"""KVCache on its own: every method against a plain copy of what it should hold."""
from __future__ import annotations

import pytest
import torch

from staged_engine.model.backend import TorchBackend, _cpu
from staged_engine.model.kv_cache import KVCache, move_entries


def _cache(batch: int = 2, max_len: int = 16, dtype: torch.dtype = torch.float64) -> KVCache:
    cache = KVCache(n_layer=2, batch=batch, n_head=3, max_len=max_len, head_dim=4, dtype=dtype, device="cpu")
    g = torch.Generator().manual_seed(0)
    cache.k.copy_(torch.randn(cache.k.shape, generator=g, dtype=torch.float64))
    cache.v.copy_(torch.randn(cache.v.shape, generator=g, dtype=torch.float64))
    return cache


def test_append_reserves_after_committed_and_pending_slots():
    cache = _cache()
    assert cache.append(5) == ([0, 0], [0, 0], 5)
    cache.advance()
    assert cache.lengths == [5, 5] and cache.pending == 0
    assert cache.append(2) == ([5, 5], [5, 5], 2)
    assert cache.append(3) == ([7, 7], [5, 5], 5)  # after the first pass's pending entries
    with pytest.raises(ValueError, match="overflow"):
        cache.append(7)


def test_commit_moves_the_path_into_place_in_every_layer():
    cache = _cache(batch=1)
    cache.append(4)
    cache.advance()
    cache.append(6)
    k0, v0 = cache.k.clone(), cache.v.clone()
    cache.commit([0, 2, 5])
    assert cache.lengths == [7] and cache.pending == 0
    for m, src in enumerate([0, 2, 5]):
        assert torch.equal(cache.k[:, 0, :, 4 + m], k0[:, 0, :, 4 + src])
        assert torch.equal(cache.v[:, 0, :, 4 + m], v0[:, 0, :, 4 + src])
    assert torch.equal(cache.k[:, 0, :, :4], k0[:, 0, :, :4])  # committed slots untouched


@pytest.mark.parametrize("path", [[], [1, 2], [0, 2, 2], [0, 6]])
def test_commit_rejects_a_bad_path(path):
    cache = _cache(batch=1)
    cache.append(6)
    with pytest.raises(ValueError, match="commit path"):
        cache.commit(path)


def test_commit_uses_the_given_mover():
    cache = _cache(batch=1)
    cache.append(3)
    calls = []
    cache.commit([0, 2], move=lambda *a: calls.append(a[2:]) or move_entries(*a))
    assert calls == [(0, 0, [0, 2])]


def test_view_shares_storage_and_starts_clean():
    cache = _cache(batch=3)
    view = cache.view(2, 5)
    assert view.batch == 2 and view.lengths == [5, 5] and view.pending == 0
    view.k[0, 1, 0, 5, 0] = 42.0
    assert cache.k[0, 1, 0, 5, 0] == 42.0
    with pytest.raises(ValueError, match="cache rows"):
        cache.view(4, 0)
    with pytest.raises(ValueError, match="view length"):
        cache.view(1, 17)


def test_views_after_grow_use_the_new_storage():
    # Views of a row count are kept (beams take one every step); a grow must not leave them on
    # the old storage, where writes would be lost and reads stale.
    cache = _cache(batch=2, max_len=8)
    cache.view(2, 3)
    cache.grow(20)
    view = cache.view(2, 3)
    assert view.max_len == 20
    view.v[1, 1, 2, 15, 3] = 7.0
    assert cache.v[1, 1, 2, 15, 3] == 7.0


def test_reselect_copies_rows_then_commits_each_path():
    cache = _cache(batch=3)
    cache.set_committed(3, 4)
    k0 = cache.k.clone()
    # 3 pending entries per row; row 0 <- row 2 keeping entry 1, row 1 <- row 0 keeping 0, row 2 <- 2 keeping 2
    new_length = cache.reselect([2, 0, 2], [[0, 1], [0, 2], [0, 2]], length=4, pending=3)
    assert new_length == 6 and cache.lengths == [6, 6, 6] and cache.pending == 0
    want = {0: (2, [0, 1]), 1: (0, [0, 2]), 2: (2, [0, 2])}
    for row, (src, path) in want.items():
        assert torch.equal(cache.k[:, row, :, :4], k0[:, src, :, :4])
        for m, p in enumerate(path):
            assert torch.equal(cache.k[:, row, :, 4 + m], k0[:, src, :, 4 + p])
    with pytest.raises(ValueError, match="sources"):
        cache.reselect([3], [[0]], length=4, pending=1)


@pytest.mark.parametrize("sources,lows", [([1, 0], [3, 1]), ([1, 2, 0], [0, 4, 2]), ([2, 2, 1], [6, 1, 3]),
                                          ([3, 0, 0, 2], [5, 2, 0, 6]), ([1, 0, 3, 2], [2, 6, 4, 0])])
@pytest.mark.parametrize("native,dtype", [(False, torch.float64), *(
    pytest.param(True, dt, marks=pytest.mark.skipif(_cpu is None, reason="no _cpu")) for dt in (torch.float32, torch.float16))])
def test_reselect_copies_each_row_from_its_own_low(sources, lows, native, dtype):
    # Each destination row takes its source's slots [lows[i], span) and keeps its own below (a
    # low of span copies nothing), swaps and cycles included, in Python and in the native
    # kernel (float32 and float16 caches); the reference gathers every row from an untouched copy.
    w = len(sources)
    cache = _cache(batch=4, dtype=dtype)
    cache.set_committed(4, 5)
    k0, v0 = cache.k.clone(), cache.v.clone()
    calls = []

    def copy_rows(*args):
        calls.append(TorchBackend(native=True).copy_rows(*args))
        return calls[-1]

    assert cache.reselect(sources, [[0]] * w, length=5, pending=1, low=lows,
                          copy_rows=copy_rows if native else None) == 6
    assert calls == ([True] if native else [])
    for row, (src, lo) in enumerate(zip(sources, lows)):
        assert torch.equal(cache.k[:, row, :, lo:6], k0[:, src, :, lo:6]), row
        assert torch.equal(cache.v[:, row, :, lo:6], v0[:, src, :, lo:6]), row
        assert torch.equal(cache.k[:, row, :, :lo], k0[:, row, :, :lo]), row  # below its low: untouched
        assert torch.equal(cache.v[:, row, :, :lo], v0[:, row, :, :lo]), row
    for bad in ([0] * (w - 1), [0] * (w - 1) + [7], [-1] + [0] * (w - 1)):  # too few, past span, negative
        with pytest.raises(ValueError, match="reselect low"):
            cache.reselect(sources, [[0]] * w, length=5, pending=1, low=bad)


@pytest.mark.parametrize("sources", [[1, 0], [1, 2, 0], [0, 0, 0], [2, 2, 1], [3, 0, 0, 2], [1, 1, 3, 3]])
def test_reselect_rows_that_are_sources_and_destinations(sources):
    # Swaps and cycles read a row after another destination wrote it unless it was saved first;
    # the reference gathers every row from an untouched copy.
    w = len(sources)
    cache = _cache(batch=4)
    cache.set_committed(4, 5)
    k0, v0 = cache.k.clone(), cache.v.clone()
    cache.reselect(sources, [[0]] * w, length=5, pending=1, low=2)
    for row, src in enumerate(sources):
        assert torch.equal(cache.k[:, row, :, 2:6], k0[:, src, :, 2:6])
        assert torch.equal(cache.v[:, row, :, 2:6], v0[:, src, :, 2:6])
        assert torch.equal(cache.k[:, row, :, :2], k0[:, row, :, :2])  # below ``low``: untouched


def test_compact_keeps_entries_and_commits_the_trunk():
    cache = _cache(batch=1)
    cache.append(3)
    cache.advance()
    cache.append(6)
    k0 = cache.k.clone()
    cache.compact([0, 1, 3, 5], common=2)
    assert cache.lengths == [5] and cache.pending == 2
    for m, src in enumerate([0, 1, 3, 5]):
        assert torch.equal(cache.k[:, 0, :, 3 + m], k0[:, 0, :, 3 + src])
    with pytest.raises(ValueError, match="increasing"):
        cache.compact([1, 0], common=0)


def test_grow_keeps_what_is_used():
    cache = _cache(batch=1, max_len=8)
    cache.append(5)
    k0 = cache.k[:, :, :, :5].clone()
    cache.grow(20)
    assert cache.max_len == 20 and cache.pending == 5
    assert torch.equal(cache.k[:, :, :, :5], k0)
    cache.append(10)  # room now


def test_select_rows_reorders():
    cache = _cache(batch=2)
    cache.set_committed(2, 3)
    k0 = cache.k.clone()
    cache.select_rows([1, 1])
    assert torch.equal(cache.k[:, 0, :, :3], k0[:, 1, :, :3]) and torch.equal(cache.k[:, 1, :, :3], k0[:, 1, :, :3])


@pytest.mark.skipif(_cpu is None, reason="needs the staged_engine._cpu extension")
def test_native_row_copies_refuse_bad_arguments():
    cache = _cache(batch=3, dtype=torch.float32)
    k, v = cache.k, cache.v
    _cpu.kv_copy_rows(k, v, [1, 0], [0, 2], 6)  # valid
    for args, message in [(([3, 0], [0, 0], 6), "sources\\[0\\] must be a row"),
                          (([1, 0], [0], 6), "lows must hold one slot per source"),
                          (([1, 0], [0, 7], 6), "lows\\[1\\] must be in"),
                          (([1, 0], [0, 0], 17), "span must be in"),
                          (([0, 1, 2, 0], [0] * 4, 6), "at most 3 rows")]:
        with pytest.raises(ValueError, match=message):
            _cpu.kv_copy_rows(k, v, *args)
    with pytest.raises(ValueError, match="contiguous float32"):
        _cpu.kv_copy_rows(k.double(), v.double(), [1, 0], [0, 0], 6)
