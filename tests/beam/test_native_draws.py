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


def test_extend_on_the_host_matches_its_torch_code(monkeypatch):
    """extend's numpy scores (CPU float64) against its torch code, taken with the host path
    switched off: the same sequences, scores within rounding of one log, and a draft's zero mass
    at a candidate giving log q = -inf on both."""
    g = torch.Generator().manual_seed(5)
    for width, vocab, n in ((1, 50, 3), (3, 8192, 3), (8, 1000, 8), (4, 97, 16)):
        p = torch.softmax(torch.randn(width, vocab, generator=g, dtype=torch.float64) * 3, -1)
        q = torch.softmax(torch.randn(width, vocab, generator=g, dtype=torch.float64) * 3, -1)
        cands = torch.randint(0, width * vocab, (n,), generator=g).tolist()
        q.view(-1)[cands[0]] = 0.0  # the draft gives the first candidate no mass
        beams = core.Beams([tuple(range(i, i + 5)) for i in range(width)],
                           torch.randn(width, generator=g, dtype=torch.float64),
                           torch.randn(width, generator=g, dtype=torch.float64))
        for q_cond in (p, q):
            host = core.extend(beams, p, q_cond, cands)
            monkeypatch.setattr(core, "_on_host", lambda *t: False)
            ref = core.extend(beams, p, q_cond, cands)
            monkeypatch.undo()
            assert host.seqs == ref.seqs == [beams.seqs[c // vocab] + (c % vocab,) for c in cands]
            assert host.log_p.dtype == host.log_q.dtype == torch.float64
            assert torch.allclose(host.log_p, ref.log_p, rtol=1e-14, atol=0)
            assert torch.equal(torch.isinf(host.log_q), torch.isinf(ref.log_q))
            finite = torch.isfinite(ref.log_q)
            assert torch.allclose(host.log_q[finite], ref.log_q[finite], rtol=1e-14, atol=0)
        assert bool(torch.isinf(core.extend(beams, p, q, cands).log_q[0]))
