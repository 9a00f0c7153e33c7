"""The draft's child scoring in the native CPU extension (csrc/cpu_kernels.cpp, top_children)
against a sorted float64 log-softmax, and its argument checks. The whole native forward pass is
tested in tests/kernels/test_native_forward.py."""
from __future__ import annotations

import pytest
import torch

from staged_engine.model.backend import _cpu

pytestmark = pytest.mark.skipif(_cpu is None, reason="staged_engine._cpu is not built")


_BAD_INPUTS = r"""
import torch
from staged_engine import _cpu
s = torch.full((2, 40), float("-inf"))
cases = [
    ("scores must have 2 dimensions", lambda: _cpu.top_children(torch.randn(40), 3)),
    ("k must be", lambda: _cpu.top_children(s, 0)),
    ("k must be", lambda: _cpu.top_children(s, 41)),
    ("scores must be float32", lambda: _cpu.top_children(s.double(), 3)),
]
for expected, call in cases:
    try:
        call()
    except ValueError as exc:
        assert expected in str(exc), (expected, str(exc))
    else:
        raise AssertionError("no error for " + expected)
print("ok", len(cases))
"""


def test_bad_inputs_raise_value_error_in_a_subprocess():
    """The extension's error path, run in a child process: a crash there (as one toolchain showed)
    fails this test instead of ending the whole suite."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _BAD_INPUTS], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, f"exit {out.returncode}: {out.stderr[-2000:]}"
    assert out.stdout.strip() == "ok 4"


@pytest.mark.parametrize("n,v,k", [(1, 8192, 4), (5, 997, 1), (3, 37, 8), (2, 16, 16), (4, 515, 64)])
def test_top_children_matches_sorted_log_softmax(n, v, k):
    g = torch.Generator().manual_seed(v + k)
    scores = torch.randn(n, v, generator=g)
    scores[0, ::7] = float("-inf")  # removed by top-k / top-p
    scores[-1, 3] = scores[-1, 5] = scores[-1, 9] = scores[-1].max() + 1.0  # a three-way tie at the top
    idx, logr = _cpu.top_children(scores, k)
    ref = torch.log_softmax(scores.double(), dim=-1)
    vals, order = torch.sort(ref, dim=-1, descending=True, stable=True)  # ties: smaller id first
    assert torch.equal(idx, order[:, :k])
    torch.testing.assert_close(logr.double(), vals[:, :k], rtol=1e-6, atol=1e-6)
    assert idx[-1, :min(k, 3)].tolist() == [3, 5, 9][:k]  # the tie, smaller ids first


def test_top_children_rows_with_few_finite_entries():
    scores = torch.full((2, 40), float("-inf"))
    scores[0, 17] = 2.0
    scores[1, 30], scores[1, 2] = 1.0, 1.0
    idx, logr = _cpu.top_children(scores, 3)
    assert idx[0, 0] == 17 and logr[0, 0] == 0.0 and torch.isinf(logr[0, 1:]).all()
    assert idx[1, :2].tolist() == [2, 30]
    torch.testing.assert_close(logr[1, :2], torch.full((2,), -0.6931472))
