"""Plain steps with prompt lookup riding along (``_cpu.lookup_steps``, ``ModelRunner.lookup_steps``,
the staged planner's ``lookup_steps`` arm) against independent references: a Python loop of
one-token passes on the torch path (no native code) choosing by ``sampling.choose``, and
``ContextLookup``, the Python prompt lookup, for what each pass proposes. The same tokens, the same
stop at a stop token, cache entries bit-equal to ``plain_steps``' (the kept entries of a pass are
a prefix of its chain, in place); guesses were proposed and kept; bad arguments are refused with
a message naming them."""
from __future__ import annotations

import pytest
import torch

from staged_engine.model.backend import TorchBackend, _cpu
from staged_engine.model.checkpoint import load_model
from staged_engine.model.runner import ModelRunner
from staged_engine.sampling import SamplingConfig, SamplingParams, choose
from staged_engine.spec.drafters import ContextLookup

pytestmark = pytest.mark.skipif(_cpu is None, reason="needs the staged_engine._cpu extension")

RULES = [SamplingParams(), SamplingParams(temperature=0.9, top_k=20, seed=7),
         SamplingParams(temperature=1.0, top_p=0.9, seed=11), SamplingParams(temperature=0.7, seed=3)]
# A prompt that repeats itself, so that prompt lookup has matches from the first pass on.
PROMPT = [5, 9, 2, 7, 5, 9, 2, 7, 5, 9, 2, 7, 5, 9]


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


def _lookup(model, sampling, prompt, n, depth, order, stop_token=None, chunk=9):
    """Calls of ``ModelRunner.lookup_steps`` of at most ``chunk`` tokens, as a decoder makes them."""
    runner = ModelRunner(model, TorchBackend(native=True))
    runner.reset()
    runner.prefill(prompt[:-1])
    history, root, out, lengths, proposed, kept = list(prompt[:-1]), prompt[-1], [], [], 0, 0
    while len(out) < n and (not out or out[-1] != stop_token):
        got = runner.lookup_steps(root, min(chunk, n - len(out)), sampling.rule, history, depth, order, stop_token)
        assert got is not None
        tokens, lens, p, k = got
        assert tokens, "a call returned no token"  # (the runner refuses more than it reserved)
        # A pass emits its kept guesses and one token of its own: 1 to depth + 1 tokens.
        assert all(1 <= length <= depth + 1 for length in lens), (lens, depth)
        assert sum(lens) == len(tokens)
        history += [root] + tokens[:-1]
        root = tokens[-1]
        out += tokens
        lengths += lens
        proposed, kept = proposed + p, kept + k
    return out, runner, lengths, proposed, kept


@pytest.mark.parametrize("depth,order", [(1, 3), (2, 3), (3, 2), (8, 1)])
@pytest.mark.parametrize("params", RULES, ids=["greedy", "top_k", "top_p", "temperature"])
def test_lookup_steps_equal_a_python_loop_and_plain_steps(pair, params, depth, order):
    model = load_model(pair[0])
    sampling = SamplingConfig.make(params, model.config.vocab_size)
    n = 40
    with torch.inference_mode():
        want, ref = _reference(model, sampling, PROMPT, n)
        got, runner, lengths, proposed, kept = _lookup(model, sampling, PROMPT, n, depth, order)
        plain = ModelRunner(model, TorchBackend(native=True))
        plain.reset()
        plain.prefill(PROMPT[:-1])
        steps = plain.steps(PROMPT[-1], n, sampling.rule)
    assert got == want == steps
    assert runner.length == ref.length == plain.length == len(PROMPT) - 1 + n
    assert runner.cache.pending == 0
    k = runner.length
    # Bit for bit the entries of one-token passes (a row's numbers do not depend on the pass's rows) ...
    assert torch.equal(runner.cache.k[..., :k, :], plain.cache.k[..., :k, :])
    assert torch.equal(runner.cache.v[..., :k, :], plain.cache.v[..., :k, :])
    # ... and within rounding of the torch path's.
    assert torch.allclose(runner.cache.k[..., :k, :], ref.cache.k[..., :k, :], atol=1e-4, rtol=1e-4)
    # Every pass emitted its kept guesses and one token of its own; passes are counted as calls.
    assert sum(lengths) == n and len(lengths) == runner.calls - 1 and kept == n - len(lengths)
    assert proposed > 0 and kept <= proposed <= depth * len(lengths)
    if params.greedy and order <= 2:  # this model's greedy text repeats tokens and pairs: guesses are kept
        assert kept > 0


def test_each_pass_proposes_what_context_lookup_proposes(pair):
    """Pass by pass, the guesses are ContextLookup's (the Python prompt lookup): the chain after
    the latest earlier occurrence of the context's last 3 tokens, else 2, down to ``order``."""
    model = load_model(pair[0])
    sampling = SamplingConfig.make(SamplingParams(), model.config.vocab_size)
    depth, order = 3, 2
    with torch.inference_mode():
        got, _, lengths, proposed, kept = _lookup(model, sampling, PROMPT, 40, depth, order, chunk=1000)
    context = list(PROMPT)
    expect_proposed = expect_kept = 0
    at = 0
    for length in lengths:
        room = min(depth, 40 - at - 1)
        guess = ContextLookup(list(context)).propose(room, order) if room > 0 else []
        emitted = got[at:at + length]
        kept_here = 0
        while kept_here < len(guess) and emitted[kept_here] == guess[kept_here]:
            kept_here += 1
        assert length == min(kept_here, len(guess)) + 1  # the kept guesses, then the oracle's own
        expect_proposed += len(guess)
        expect_kept += length - 1
        context += emitted
        at += length
    assert (proposed, kept) == (expect_proposed, expect_kept)
    assert expect_kept > 0 and expect_proposed > expect_kept  # guesses were kept, and refused


def test_lookup_steps_stop_after_the_stop_token(pair):
    model = load_model(pair[0])
    sampling = SamplingConfig.make(SamplingParams(), model.config.vocab_size)
    with torch.inference_mode():
        free, _ = _reference(model, sampling, PROMPT, 30)
        stop = free[17]
        cut = free.index(stop) + 1
        got, runner, _, _, _ = _lookup(model, sampling, PROMPT, 30, 3, 2, stop_token=stop, chunk=30)
    assert got == free[:cut]
    assert runner.length == len(PROMPT) - 1 + cut and runner.cache.pending == 0


def test_lookup_steps_stop_at_a_kept_guess_inside_a_pass(pair):
    """A stop token that is a kept guess with more kept after it in the same pass: the tokens end
    there, and the pass's later entries are not committed. The lookup reads only ``history``, not
    the cache, so a history whose last tokens occurred before, followed by the oracle's own next
    tokens, makes the first pass propose (and keep) them all."""
    model = load_model(pair[0])
    sampling = SamplingConfig.make(SamplingParams(), model.config.vocab_size)
    with torch.inference_mode():
        free, _ = _reference(model, sampling, PROMPT, 12)
        at = next((j for j in range(7) if free.index(free[j]) == j), None)
        assert at is not None, f"no token of {free[:7]} is the first of its kind"
        want, _ = _reference(model, sampling, PROMPT, 12, stop_token=free[at])
        history = PROMPT[-3:] + free[:8] + PROMPT[-3:-1]
        runner = ModelRunner(model, TorchBackend(native=True))
        runner.reset()
        runner.prefill(PROMPT[:-1])
        got = runner.lookup_steps(PROMPT[-1], 12, sampling.rule, history, 8, 3, stop_token=free[at])
    assert got is not None
    tokens, lengths, proposed, kept = got
    assert want == free[:at + 1]
    assert tokens == want
    assert lengths == [at + 1] and proposed == 8 and kept == at
    assert runner.calls == 1 + 1 and runner.nodes == len(PROMPT) - 1 + 9  # the prefill, then 9 rows
    assert runner.length == len(PROMPT) - 1 + at + 1 and runner.cache.pending == 0


def test_lookup_steps_return_at_most_n_tokens_when_more_guesses_would_be_kept(pair):
    """The raw native call (no runner to refuse an overlong commit) with room in the cache for
    more: a history that makes the first pass propose 8 of the oracle's own next tokens, and n
    = 3. Exactly the first 3 come back, from one pass over the root and 2 guesses."""
    model = load_model(pair[0])
    sampling = SamplingConfig.make(SamplingParams(), model.config.vocab_size)
    with torch.inference_mode():
        free, _ = _reference(model, sampling, PROMPT, 12)
        runner = ModelRunner(model, TorchBackend(native=True))
        runner.reset()
        runner.prefill(PROMPT[:-1])
        tokens, _, lengths, proposed, kept = _cpu.lookup_steps(
            runner.native, runner.cache.k, runner.cache.v, len(PROMPT) - 1, PROMPT[-3:] + free[:8] + PROMPT[-3:-1],
            PROMPT[-1], 3, 0.0, 0, 1.0, 0, -1, 8, 3)
    assert tokens == free[:3]
    assert lengths == [3] and proposed == 2 and kept == 2


def test_lookup_steps_stop_after_max_passes(pair):
    """The raw native call with a budget of passes: a history that makes the first pass propose
    8 of the oracle's own next tokens, n = 20. With max_passes = 1 exactly that pass's 9 tokens
    come back (its kept guesses and its own); with 2, the next pass's too; with no limit (-1,
    the default) passes run until the 20 tokens. Every token is plain decoding's."""
    model = load_model(pair[0])
    sampling = SamplingConfig.make(SamplingParams(), model.config.vocab_size)
    with torch.inference_mode():
        free, _ = _reference(model, sampling, PROMPT, 24)
        got = {}
        for limit in (1, 2, -1):
            runner = ModelRunner(model, TorchBackend(native=True))
            runner.reset()
            runner.prefill(PROMPT[:-1])
            got[limit] = _cpu.lookup_steps(
                runner.native, runner.cache.k, runner.cache.v, len(PROMPT) - 1, PROMPT[-3:] + free[:8] + PROMPT[-3:-1],
                PROMPT[-1], 20, 0.0, 0, 1.0, 0, -1, 8, 3, max_passes=limit)
    (one, _, lengths1, _, _), (two, _, lengths2, _, _), (all_, _, lengths, _, _) = got[1], got[2], got[-1]
    assert lengths1 == [9] and one == free[:9]
    assert len(lengths2) == 2 and lengths2[0] == 9 and two == free[:len(two)]
    assert len(lengths) > 2 and all_ == free[:20]


def test_lookup_steps_refuse_bad_arguments(pair):
    model = load_model(pair[0])
    runner = ModelRunner(model, TorchBackend(native=True))
    runner.reset()
    runner.prefill([1, 2, 3])
    args = dict(model=runner.native, k_cache=runner.cache.k, v_cache=runner.cache.v, start=3, history=[1, 2, 3],
                root=4, n=2, temperature=0.0, top_k=0, top_p=1.0, seed=0, stop_token=-1, depth=2, min_order=3)
    _cpu.lookup_steps(**args)  # valid
    for change, message in [({"n": 0}, "n must be >= 1"), ({"depth": -1}, "depth must be in"),
                            ({"depth": 9}, "depth must be in"), ({"min_order": 0}, "min_order must be in"),
                            ({"min_order": 4}, "min_order must be in"), ({"history": [1, -2, 3]}, "history must hold"),
                            ({"root": -1}, "root must be a token id"),
                            ({"root": model.config.vocab_size}, "root must be a token id"),
                            ({"history": [1, model.config.vocab_size]}, "history must hold"),
                            ({"start": runner.max_len - 1}, "exceed the cache"), ({"top_p": 0.0}, "top_p must be in"),
                            ({"max_passes": 0}, "max_passes must be"), ({"max_passes": -2}, "max_passes must be")]:
        with pytest.raises(ValueError, match=message):
            _cpu.lookup_steps(**{**args, **change})
    with pytest.raises(ValueError, match="KV cache overflow"):  # the runner checks the room first
        runner.lookup_steps(4, runner.max_len, (0.0, 0, 1.0, 0), [1, 2, 3], 2, 3)
    assert runner.cache.pending == 0 and runner.length == 3


@pytest.mark.parametrize("params", RULES, ids=["greedy", "top_k", "top_p", "temperature"])
def test_lookup_steps_in_one_region_give_the_bits_of_a_pass_a_call(pair, params):
    """Plain steps with prompt lookup in one OpenMP region (``NativeGPT2::step_region``, passes of
    1-9 rows, the default) against a ``forward_ids`` call and a ``verify_tree`` walk a pass
    (``set_step_region(False)``): the same tokens, passes, guesses proposed and kept, and
    bit-equal cache entries, over 1 and 2 threads, depths 1-8, through a stop token."""
    model = load_model(pair[0])
    sampling = SamplingConfig.make(params, model.config.vocab_size)
    saved, was = torch.get_num_threads(), _cpu.step_region()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for depth, order in ((1, 3), (2, 3), (8, 1)):
                runs = {}
                for region in (False, True):
                    _cpu.set_step_region(region)
                    with torch.inference_mode():
                        got, runner, lengths, proposed, kept = _lookup(model, sampling, PROMPT, 40, depth, order)
                    n = runner.length
                    runs[region] = (got, lengths, proposed, kept, runner.cache.k[..., :n, :].clone(),
                                    runner.cache.v[..., :n, :].clone())
                off, on = runs[False], runs[True]
                where = f"{threads} threads, depth {depth}"
                assert on[:4] == off[:4], where
                assert torch.equal(on[4], off[4]) and torch.equal(on[5], off[5]), where
                stop = off[0][23]
                _cpu.set_step_region(True)
                with torch.inference_mode():
                    stopped, *_ = _lookup(model, sampling, PROMPT, 40, depth, order, stop_token=stop)
                assert stopped == off[0][:off[0].index(stop) + 1], where
    finally:
        torch.set_num_threads(saved)
        _cpu.set_step_region(was)
