"""Plain decoding's steps in one native call (``_cpu.plain_steps``, ``ModelRunner.steps``)
against an independent Python loop: a pass over each token on the torch path (no native code)
and the choice by ``sampling.choose``, the torch implementation of the rule. The same tokens,
the same stop at a stop token, and cache entries equal to the reference's; bad arguments are
refused with a message naming them."""
from __future__ import annotations

import pytest
import torch

from staged_engine.model.backend import TorchBackend, _cpu
from staged_engine.model.checkpoint import load_model
from staged_engine.model.runner import ModelRunner
from staged_engine.sampling import SamplingConfig, SamplingParams, choose
from staged_engine.spec.decoders import PlainDecoder

pytestmark = pytest.mark.skipif(_cpu is None, reason="needs the staged_engine._cpu extension")

RULES = [SamplingParams(), SamplingParams(temperature=0.9, top_k=20, seed=7),
         SamplingParams(temperature=1.0, top_p=0.9, seed=11), SamplingParams(temperature=0.7, seed=3)]


def _reference(model, sampling, prompt, n, stop_token=None):
    """Tokens and committed K/V of a Python loop on the torch path (native=False)."""
    runner = ModelRunner(model, TorchBackend(native=False))
    runner.reset()
    runner.prefill(prompt[:-1])
    out, last = [], prompt[-1]
    for _ in range(n):
        logits = runner.step(last)
        last = int(choose(logits[None].double(), [runner.length], sampling.params, sampling.noise)[0])
        out.append(last)
        if last == stop_token:
            break
    return out, runner


def _native(model, sampling, prompt, n, stop_token=None, batch=8):
    runner = ModelRunner(model, TorchBackend(native=True))
    decoder = PlainDecoder(runner, sampling, stop_token, batch=batch)
    decoder.start(prompt)
    assert runner.native is not None
    out = []
    while len(out) < n and (not out or out[-1] != stop_token):
        out += decoder.round(n - len(out))
    return out, runner, decoder


@pytest.mark.parametrize("params", RULES, ids=["greedy", "top_k", "top_p", "temperature"])
def test_native_steps_equal_a_python_loop_on_the_torch_path(pair, params):
    model = load_model(pair[0])
    sampling = SamplingConfig.make(params, model.config.vocab_size)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, model.config.vocab_size, (7,), generator=g).tolist()
    with torch.inference_mode():
        want, ref = _reference(model, sampling, prompt, 45)
        got, runner, decoder = _native(model, sampling, prompt, 45, batch=8)  # rounds of 8, then 5
    assert got == want
    assert decoder.accepted_lengths == [1] * 45
    assert runner.length == ref.length == len(prompt) - 1 + 45
    assert runner.calls == 45 + 1 and runner.nodes == 45 + len(prompt) - 1  # the prefill's pass, then one a step
    n = runner.length
    # The torch path's kernels differ from the native ones in rounding only.
    assert torch.allclose(runner.cache.k[..., :n, :], ref.cache.k[..., :n, :], atol=1e-4, rtol=1e-4)
    assert torch.allclose(runner.cache.v[..., :n, :], ref.cache.v[..., :n, :], atol=1e-4, rtol=1e-4)


def test_native_steps_stop_after_the_stop_token(pair):
    model = load_model(pair[0])
    sampling = SamplingConfig.make(SamplingParams(temperature=1.0, seed=5), model.config.vocab_size)
    prompt = [3, 1, 4, 1, 5]
    with torch.inference_mode():
        free, _ = _reference(model, sampling, prompt, 30)
        stop = free[11]
        cut = free.index(stop) + 1  # the first time it comes
        want, _ = _reference(model, sampling, prompt, 30, stop)
        got, runner, _ = _native(model, sampling, prompt, 30, stop, batch=30)
    assert want == free[:cut]
    assert got == want
    assert runner.length == len(prompt) - 1 + cut
    assert runner.cache.pending == 0


def test_native_steps_refuse_bad_arguments(pair):
    model = load_model(pair[0])
    runner = ModelRunner(model, TorchBackend(native=True))
    runner.reset()
    runner.prefill([1, 2, 3])
    args = dict(model=runner.native, k_cache=runner.cache.k, v_cache=runner.cache.v, start=3, root=4, n=2,
                temperature=0.0, top_k=0, top_p=1.0, seed=0, stop_token=-1)
    with pytest.raises(ValueError, match="n must be >= 1"):
        _cpu.plain_steps(**{**args, "n": 0})
    with pytest.raises(ValueError, match="root must be a token id"):
        _cpu.plain_steps(**{**args, "root": model.config.vocab_size})
    with pytest.raises(ValueError, match="exceed the cache"):
        _cpu.plain_steps(**{**args, "start": runner.max_len - 1})
    with pytest.raises(ValueError, match="top_p must be in"):
        _cpu.plain_steps(**{**args, "top_p": 0.0})
    with pytest.raises(ValueError, match="KV cache overflow"):  # the runner checks the room first
        runner.steps(4, runner.max_len, (0.0, 0, 1.0, 0))
    assert runner.cache.pending == 0 and runner.length == 3
