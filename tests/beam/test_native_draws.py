"""beam/core.py's native path (_cpu.beam_joint, _cpu.inverse_cdf) against its own torch code, and
the switch that turns it off."""
from __future__ import annotations

import pytest
import torch

import staged_engine.beam.core as core
from staged_engine.model.backend import _cpu

pytestmark = pytest.mark.skipif(_cpu is None, reason="staged_engine._cpu is not built")


def test_native_and_torch_paths_draw_the_same_candidates(monkeypatch):
    g = torch.Generator().manual_seed(11)
    for width, vocab in ((1, 50), (3, 8192), (8, 1000)):
        probs = torch.softmax(torch.randn(width, vocab, generator=g, dtype=torch.float64) * 2, -1)
        scores = torch.randn(width, generator=g, dtype=torch.float64) * 3
        native_joint = core.beam_joint(scores, probs)
        native_draws = core.TorchRandom(torch.Generator().manual_seed(3)).categorical(native_joint, 64)
        monkeypatch.setenv("STAGED_ENGINE_NATIVE", "0")
        torch_joint = core.beam_joint(scores, probs)
        torch_draws = core.TorchRandom(torch.Generator().manual_seed(3)).categorical(torch_joint, 64)
        monkeypatch.delenv("STAGED_ENGINE_NATIVE")
        assert torch.allclose(native_joint, torch_joint, rtol=1e-12, atol=0)
        assert native_draws == torch_draws


def test_staged_engine_native_0_keeps_the_beam_core_on_torch(monkeypatch):
    called = []

    class Spy:
        def __getattr__(self, name):
            called.append(name)
            return getattr(_cpu, name)

    monkeypatch.setattr(core, "_cpu", Spy())
    probs = torch.softmax(torch.randn(2, 9, dtype=torch.float64), -1)
    scores = torch.zeros(2, dtype=torch.float64)
    core.TorchRandom(torch.Generator().manual_seed(0)).categorical(core.beam_joint(scores, probs), 2)
    assert called == ["beam_joint", "inverse_cdf"]
    called.clear()
    monkeypatch.setenv("STAGED_ENGINE_NATIVE", "0")
    core.TorchRandom(torch.Generator().manual_seed(0)).categorical(core.beam_joint(scores, probs), 2)
    assert called == []
    core.beam_joint(torch.zeros(2, dtype=torch.float32), probs.float())  # not float64: torch, whatever the switch
    assert called == []
