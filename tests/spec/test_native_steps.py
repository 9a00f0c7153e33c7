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


def _steps_bits(model, sampling, prompt, n, stop_token, region):
    """Plain steps in calls of 8 with the step region on or off: tokens and committed K/V."""
    was = _cpu.step_region()
    _cpu.set_step_region(region)
    try:
        out, runner, _ = _native(model, sampling, prompt, n, stop_token, batch=8)
    finally:
        _cpu.set_step_region(was)
    n = runner.length
    return out, runner.cache.k[..., :n, :].clone(), runner.cache.v[..., :n, :].clone()


@pytest.fixture(scope="module")
def head64(tmp_path_factory) -> str:
    """Two heads of 64 dimensions: over 2 threads each computes its own head's q/k/v and attends."""
    from ckpt_util import make_hf_checkpoint

    return make_hf_checkpoint(str(tmp_path_factory.mktemp("head64") / "m"), seed=5, vocab_size=301,
                              n_positions=96, n_embd=128, n_layer=2, n_head=2)


@pytest.mark.parametrize("params", RULES, ids=["greedy", "top_k", "top_p", "temperature"])
def test_one_region_gives_the_bits_of_a_pass_a_call(checkpoints, head64, params):
    """Plain steps in one OpenMP region (``NativeGPT2::step_region``, the default) against a
    ``forward_ids`` call and a ``verify_tree`` choice a pass (``set_step_region(False)``, the path
    prompt lookup's passes take): the same tokens and bit-equal cache entries, with 1 and 2
    threads (over 2, odd96's 3 heads take the shared attention path and its barrier, head64's
    2 heads one a thread), on float32 and float16 K/V caches, over an LM head cut to 50 rows (the
    rest -inf), and through a stop token."""
    saved = torch.get_num_threads()
    try:
        for path in (checkpoints["odd96"], head64):
            model = load_model(path)
            sampling = SamplingConfig.make(params, model.config.vocab_size)
            prompt = torch.randint(0, model.config.vocab_size, (9,), generator=torch.Generator().manual_seed(2)).tolist()
            for threads in (1, 2):
                torch.set_num_threads(threads)
                for kv_dtype, head_rows in ((None, None), (torch.float16, None), (None, 50)):
                    model.kv_dtype, model.head_rows = kv_dtype, head_rows
                    with torch.inference_mode():
                        ref = _steps_bits(model, sampling, prompt, 40, None, region=False)
                        got = _steps_bits(model, sampling, prompt, 40, None, region=True)
                        stop = ref[0][17]
                        cut = ref[0].index(stop) + 1
                        stopped = _steps_bits(model, sampling, prompt, 40, stop, region=True)
                    where = f"{model.config.n_embd} wide, {threads} threads, kv {kv_dtype}, head_rows {head_rows}"
                    assert got[0] == ref[0], where
                    assert torch.equal(got[1], ref[1]) and torch.equal(got[2], ref[2]), where
                    assert stopped[0] == ref[0][:cut], where
                    m = stopped[1].shape[-2]
                    assert torch.equal(stopped[1], ref[1][..., :m, :]) and torch.equal(stopped[2], ref[2][..., :m, :])
                    if head_rows is not None:
                        assert max(ref[0]) < head_rows, where
            model.kv_dtype = model.head_rows = None
    finally:
        torch.set_num_threads(saved)


def test_one_region_refuses_steps_past_the_models_positions(pair):
    """Steps whose positions would pass n_positions are refused before any pass, also where the
    cache has room for them (a cache with slack past the context window, as beam trees grow)."""
    model = load_model(pair[0])
    native = TorchBackend(native=True).native_model(model)
    cfg = model.config
    n_pos = cfg.n_positions
    shape = (cfg.n_layer, 1, cfg.n_head, n_pos + 8, cfg.n_embd // cfg.n_head)
    k, v = torch.zeros(shape), torch.zeros(shape)
    args = dict(model=native, k_cache=k, v_cache=v, start=n_pos - 2, root=4, n=3,
                temperature=0.0, top_k=0, top_p=1.0, seed=0, stop_token=-1)
    with pytest.raises(ValueError, match=f"positions \\[{n_pos - 2}, {n_pos + 1}\\) exceed the model's {n_pos}"):
        _cpu.plain_steps(**args)
    with pytest.raises(ValueError, match=f"slots \\[{n_pos + 6}, {n_pos + 9}\\) exceed the cache's {n_pos + 8}"):
        _cpu.plain_steps(**{**args, "start": n_pos + 6})
    assert not k.any() and not v.any()  # nothing written
    tokens, _ = _cpu.plain_steps(**{**args, "n": 2})  # the last position there is
    assert len(tokens) == 2 and k[:, :, :, n_pos - 2:n_pos].any() and not k[:, :, :, n_pos:].any()
