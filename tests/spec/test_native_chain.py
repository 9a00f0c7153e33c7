"""A fixed chain's round in one native call (``_cpu.chain_round``) against the same round in
Python: the same tokens every round, and afterwards both caches hold, bit for bit, what the
Python rounds left there; the tokens are also plain decoding's (the independent reference)."""
from __future__ import annotations

import pytest
import torch

from staged_engine.model.backend import TorchBackend, _cpu
from staged_engine.model.checkpoint import load_model
from staged_engine.model.runner import ModelRunner
from staged_engine.sampling import SamplingConfig, SamplingParams
from staged_engine.spec.decoders import PlainDecoder, SpeculativeDecoder
from staged_engine.spec.drafters import ModelDrafter, TreeShape

pytestmark = pytest.mark.skipif(_cpu is None, reason="needs the staged_engine._cpu extension")

RULES = [SamplingParams(), SamplingParams(temperature=0.9, top_k=20, seed=7),
         SamplingParams(temperature=1.0, top_p=0.9, seed=11)]


class PythonRounds(SpeculativeDecoder):
    """The reference: every round on the Python path."""

    def _native_chain(self, remaining: int, depth: int):
        return None


def _make(cls, oracle, draft, params, depth):
    sampling = SamplingConfig.make(params, oracle.config.vocab_size)
    backend = TorchBackend(native=True)
    shape = TreeShape(budget=depth + 1, max_depth=depth, children=1, expand=1)
    drafter = ModelDrafter(ModelRunner(draft, backend), sampling, shape)
    return cls(ModelRunner(oracle, backend), sampling, drafter, "chain")


def _run(decoder, prompt, n):
    out, rounds = [], []
    decoder.start(prompt)
    while len(out) < n:
        new = decoder.round(n - len(out))
        rounds.append(new)
        out += new
    return out, rounds


def _committed(runner):
    length = runner.length
    return runner.cache.k[:, :, :, :length].clone(), runner.cache.v[:, :, :, :length].clone(), length


@pytest.mark.parametrize("depth", [1, 3, 6])
@pytest.mark.parametrize("params", RULES, ids=["greedy", "top_k", "top_p"])
def test_native_chain_rounds_equal_the_python_rounds_and_plain_decoding(pair, params, depth):
    oracle, draft = (load_model(d) for d in pair)
    g = torch.Generator().manual_seed(depth)
    prompt = torch.randint(0, oracle.config.vocab_size, (9,), generator=g).tolist()
    native, python = _make(SpeculativeDecoder, oracle, draft, params, depth), _make(PythonRounds, oracle, draft,
                                                                                     params, depth)
    with torch.inference_mode():
        got, got_rounds = _run(native, prompt, 40)
        want, want_rounds = _run(python, prompt, 40)
        sampling = SamplingConfig.make(params, oracle.config.vocab_size)
        plain = PlainDecoder(ModelRunner(oracle, TorchBackend(native=True)), sampling)
        ref, _ = _run(plain, prompt, 40)
    assert got_rounds == want_rounds  # the same chains accepted, round by round
    assert got[:40] == ref[:40]
    assert native.accepted_lengths == python.accepted_lengths
    # The caches: the oracle's and the draft's committed entries, bit for bit.
    for a, b in ((native.oracle, python.oracle), (native.drafter.runner, python.drafter.runner)):
        ka, va, la = _committed(a)
        kb, vb, lb = _committed(b)
        assert la == lb
        assert torch.equal(ka, kb) and torch.equal(va, vb)
        assert (a.calls, a.nodes) == (b.calls, b.nodes)
    assert native.drafter.unseen == python.drafter.unseen
    assert native.drafter.history == python.drafter.history


def test_chain_round_refuses_bad_arguments(pair):
    oracle, draft = (load_model(d) for d in pair)
    dec = _make(SpeculativeDecoder, oracle, draft, SamplingParams(), 2)
    dec.start([1, 2, 3])
    d, o = dec.drafter.runner, dec.oracle
    args = dict(draft=d.native, draft_k=d.cache.k, draft_v=d.cache.v, draft_start=0, unseen=[1, 2, 3],
                draft_position=0, oracle=o.native, oracle_k=o.cache.k, oracle_v=o.cache.v, oracle_start=2,
                root_position=2, depth=2, temperature=0.0, top_k=0, top_p=1.0, seed=0, draft_temperature=0.0,
                draft_top_k=0, draft_seed=0)
    with pytest.raises(ValueError, match="depth must be in"):
        _cpu.chain_round(**{**args, "depth": 0})
    with pytest.raises(ValueError, match="unseen must hold"):
        _cpu.chain_round(**{**args, "unseen": []})
    with pytest.raises(ValueError, match="outside the vocabulary"):
        _cpu.chain_round(**{**args, "unseen": [1, 2, oracle.config.vocab_size]})
    with pytest.raises(ValueError, match="exceed the cache"):
        _cpu.chain_round(**{**args, "oracle_start": o.max_len - 1})
