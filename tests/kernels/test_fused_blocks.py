"""All decoder blocks in one native call (``_cpu.forward_blocks``) give the very bits of the
model's own loop over the blocks (the same kernels and ops in the same order), on every
activation, for chains, trees, several rows and pending entries; bad arguments are refused."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from staged_engine.backend import TorchBackend, _cpu
from staged_engine.checkpoint import load_model

pytestmark = pytest.mark.skipif(_cpu is None or not hasattr(_cpu, "forward_blocks"),
                                reason="the _cpu extension is not built")


def _decode(model, backend, batch: int, steps) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """Run a fixed sequence of forward calls; return every call's logits and the final cache."""
    cache = model.new_cache(batch=batch, backend=backend)
    g = torch.Generator().manual_seed(0)
    outs = []
    vocab = model.config.vocab_size
    for n, tree, commit in steps:
        tokens = torch.randint(0, vocab, (batch, n), generator=g)
        base = cache.lengths[0] + cache.pending
        positions = torch.arange(base, base + n).expand(batch, n)
        mask = None
        if tree:  # every node sees the pending entries and itself, not its siblings
            m = cache.pending + n
            mask = torch.zeros(n, m, dtype=torch.bool)
            mask[:, :cache.pending] = True
            mask[:, cache.pending:] = torch.eye(n, dtype=torch.bool)
        with torch.inference_mode():
            outs.append(model.forward(tokens, positions, cache, mask))
        if commit:
            cache.advance()
    return outs, cache.k.clone(), cache.v.clone()


STEPS = [(7, False, True), (1, False, True), (1, False, False), (4, True, False), (3, False, True), (1, False, True)]


@pytest.mark.parametrize("name", ["odd96", "eps64", "relu80"])
@pytest.mark.parametrize("batch", [1, 3])
def test_fused_equals_the_loop_bit_for_bit(checkpoints, name, batch, monkeypatch):
    model = load_model(checkpoints[name])
    calls = []
    real = _cpu.forward_blocks
    monkeypatch.setattr(_cpu, "forward_blocks", lambda *a: calls.append(1) or real(*a))
    fused = TorchBackend(native=True, fused=True)
    loop = TorchBackend(native=True, fused=False)
    a, ka, va = _decode(model, fused, batch, STEPS)
    assert len(calls) == len(STEPS)  # the fused path ran every pass
    b, kb, vb = _decode(model, loop, batch, STEPS)
    assert len(calls) == len(STEPS)  # and the loop did not call it
    for x, y in zip(a, b):
        assert torch.equal(x, y)
    n = sum(s[0] for s in STEPS)
    assert torch.equal(ka[:, :, :, :n], kb[:, :, :, :n]) and torch.equal(va[:, :, :, :n], vb[:, :, :, :n])


def test_fused_matches_stock_torch(checkpoints):
    model = load_model(checkpoints["odd96"])
    a, _, _ = _decode(model, TorchBackend(native=True, fused=True), 1, STEPS)
    b, _, _ = _decode(model, TorchBackend(native=False), 1, STEPS)
    for x, y in zip(a, b):
        assert ((x - y).abs().max() / y.abs().max()).item() < 1e-5


def test_fused_is_off_without_the_native_kernels():
    assert TorchBackend(native=False, fused=True).fused is False


BAD = '''
import torch
from staged_engine import _cpu
x = torch.zeros(1, 2, 8)
w = [torch.ones(8), torch.zeros(8), torch.zeros(24, 8), torch.zeros(24), torch.zeros(8, 8), torch.zeros(8),
     torch.ones(8), torch.zeros(8), torch.zeros(32, 8), torch.zeros(32), torch.zeros(8, 32), torch.zeros(8)]
k = torch.zeros(1, 1, 2, 16, 4)
cases = {
    "weights": lambda: _cpu.forward_blocks(x, w[:11], k, k.clone(), [0], [0], 2, None, 2, 1e-5, 0.5, "gelu_tanh"),
    "writes exceed": lambda: _cpu.forward_blocks(x, w, k, k.clone(), [15], [0], 2, None, 2, 1e-5, 0.5, "gelu_tanh"),
    "activation": lambda: _cpu.forward_blocks(x, w, k, k.clone(), [0], [0], 2, None, 2, 1e-5, 0.5, "swish"),
    "cache must be": lambda: _cpu.forward_blocks(x, w, k[:, :, :1], k[:, :, :1].clone(), [0], [0], 2, None, 2, 1e-5, 0.5, "relu"),
    "writes needs": lambda: _cpu.forward_blocks(x, w, k, k.clone(), [0, 0], [0], 2, None, 2, 1e-5, 0.5, "relu"),
}
for name, call in cases.items():
    try:
        call()
    except ValueError as exc:
        assert name in str(exc), (name, str(exc))
        print("ok", name)
    else:
        raise SystemExit(f"{name}: no error")
'''


def test_bad_arguments_raise_value_error_in_a_subprocess():
    out = subprocess.run([sys.executable, "-c", BAD], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count("ok") == 5
