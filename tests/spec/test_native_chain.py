"""A fixed chain's round in one native call (``_cpu.chain_round``), and a block of them
(``_cpu.chain_rounds``), against the same rounds in Python: the same tokens every round, and
afterwards both caches hold, bit for bit, what the Python rounds left there; the tokens are also
plain decoding's (the independent reference)."""
from __future__ import annotations

import math

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

    def _native_chain_block(self, remaining: int, depth: int, rounds: int):
        return None


class NativeRounds(SpeculativeDecoder):
    """One native round a call (``_cpu.chain_round``), no blocks."""

    def _native_chain_block(self, remaining: int, depth: int, rounds: int):
        return None


def _make(cls, oracle, draft, params, depth, window=None, stop_token=None, whole=False):
    sampling = SamplingConfig.make(params, oracle.config.vocab_size)
    backend = TorchBackend(native=True)
    shape = TreeShape(budget=depth + 1, max_depth=depth, children=1, expand=1)
    drafter = ModelDrafter(ModelRunner(draft, backend), sampling, shape, window=window)
    return cls(ModelRunner(oracle, backend), sampling, drafter, "chain", stop_token=stop_token, whole=whole)


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


def _assert_same_state(native, python):
    """The caches (the oracle's and the draft's committed entries, bit for bit), the counters and
    the draft's view of the text."""
    for a, b in ((native.oracle, python.oracle), (native.drafter.runner, python.drafter.runner)):
        ka, va, la = _committed(a)
        kb, vb, lb = _committed(b)
        assert la == lb
        assert torch.equal(ka, kb) and torch.equal(va, vb)
        assert (a.calls, a.nodes) == (b.calls, b.nodes)
        assert a.cache.pending == b.cache.pending == 0
    assert native.drafter.unseen == python.drafter.unseen
    assert native.drafter.history == python.drafter.history


@pytest.mark.parametrize("window", [None, 4], ids=["whole", "window"])
@pytest.mark.parametrize("depth", [1, 3, 6])
@pytest.mark.parametrize("params", RULES, ids=["greedy", "top_k", "top_p"])
def test_native_chain_rounds_equal_the_python_rounds_and_plain_decoding(pair, params, depth, window):
    """One native round a call, and blocks of ``CHAIN_BATCH`` rounds a call (a pinned chain's
    default), against the Python rounds. With a ``window`` the draft starts from the prompt's
    last 4 tokens before the root, at positions of its own (``ModelDrafter.catch_up``): the
    native round must draw the text's noise there, as the Python round does."""
    oracle, draft = (load_model(d) for d in pair)
    g = torch.Generator().manual_seed(depth)
    prompt = torch.randint(0, oracle.config.vocab_size, (9,), generator=g).tolist()
    blocks, native, python = (_make(cls, oracle, draft, params, depth, window)
                              for cls in (SpeculativeDecoder, NativeRounds, PythonRounds))
    with torch.inference_mode():
        got_blocks, block_calls = _run(blocks, prompt, 40)
        got, got_rounds = _run(native, prompt, 40)
        want, want_rounds = _run(python, prompt, 40)
        sampling = SamplingConfig.make(params, oracle.config.vocab_size)
        plain = PlainDecoder(ModelRunner(oracle, TorchBackend(native=True)), sampling)
        ref, _ = _run(plain, prompt, 40)
    assert native.drafter.offset == python.drafter.offset == (0 if window is None else len(prompt) - 1 - window)
    assert got_rounds == want_rounds  # the same chains accepted, round by round
    assert got[:40] == ref[:40]
    assert got_blocks == got
    assert native.accepted_lengths == python.accepted_lengths == blocks.accepted_lengths
    assert len(block_calls) < len(got_rounds)  # rounds did run in blocks
    _assert_same_state(native, python)
    _assert_same_state(blocks, python)


@pytest.mark.parametrize("params", RULES[:2], ids=["greedy", "top_k"])
def test_a_whole_generation_runs_its_chain_in_calls_as_long_as_plain_steps(pair, params, monkeypatch):
    """Where nobody reads the tokens before the end (``whole``), a pinned chain's first native
    call runs ``CHAIN_BATCH`` rounds and the next as many as fit in ``CALL_SECONDS`` (the rest
    of these 40 tokens, unless a loaded machine's first rounds ran over 10 ms each); a stream's
    calls stay at ``CHAIN_BATCH`` rounds. The tokens are plain decoding's."""
    from staged_engine.spec import decoders

    oracle, draft = (load_model(d) for d in pair)
    prompt = torch.randint(0, oracle.config.vocab_size, (9,), generator=torch.Generator().manual_seed(5)).tolist()
    rounds = []
    real = _cpu.chain_rounds

    def counting(*args, **kwargs):
        got = real(*args, **kwargs)
        rounds.append(len(got[1]))  # the rounds this call ran
        return got

    monkeypatch.setattr(_cpu, "chain_rounds", counting)
    got = {}
    with torch.inference_mode():
        for whole in (True, False):
            rounds.clear()
            got[whole], _ = _run(_make(SpeculativeDecoder, oracle, draft, params, 1, whole=whole), prompt, 40)
            calls = list(rounds)
            if whole:
                assert calls[0] == decoders.CHAIN_BATCH and max(calls) > decoders.CHAIN_BATCH
            else:
                assert len(calls) > 2 and max(calls) == decoders.CHAIN_BATCH
        sampling = SamplingConfig.make(params, oracle.config.vocab_size)
        ref, _ = _run(PlainDecoder(ModelRunner(oracle, TorchBackend(native=True)), sampling), prompt, 40)
    assert got[True][:40] == got[False][:40] == ref[:40]


@pytest.mark.parametrize("params", RULES[:2], ids=["greedy", "top_k"])
def test_a_block_of_chain_rounds_stops_after_the_round_that_emits_the_stop_token(pair, params):
    """A block ends with the round that emitted ``stop_token``, whole (as that round alone
    returns it): the caller cuts the text there, and every cache and counter is where the
    Python rounds left them."""
    oracle, draft = (load_model(d) for d in pair)
    prompt = torch.randint(0, oracle.config.vocab_size, (9,), generator=torch.Generator().manual_seed(3)).tolist()
    with torch.inference_mode():
        free, _ = _run(_make(PythonRounds, oracle, draft, params, 3), prompt, 40)
        stop = free[17]  # a token the text emits, not at its start
        blocks, python = (_make(cls, oracle, draft, params, 3, stop_token=stop) for cls in (SpeculativeDecoder, PythonRounds))
        blocks.start(prompt)
        python.start(prompt)
        got, want, calls = [], [], 0
        while stop not in got:
            got += blocks.round(40 - len(got))
            calls += 1
        while stop not in want:
            want += python.round(40 - len(want))
    assert got == want
    assert calls < len(blocks.accepted_lengths)  # rounds did run in blocks
    assert got[:free.index(stop) + 1] == free[:free.index(stop) + 1]
    assert blocks.accepted_lengths == python.accepted_lengths
    _assert_same_state(blocks, python)


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


def test_chain_rounds_refuses_bad_arguments(pair):
    oracle, draft = (load_model(d) for d in pair)
    dec = _make(SpeculativeDecoder, oracle, draft, SamplingParams(), 2)
    dec.start([1, 2, 3])
    d, o = dec.drafter.runner, dec.oracle
    args = dict(draft=d.native, draft_k=d.cache.k, draft_v=d.cache.v, draft_start=0, unseen=[1, 2, 3],
                oracle=o.native, oracle_k=o.cache.k, oracle_v=o.cache.v, oracle_start=2, root_position=2, depth=2,
                n=8, max_rounds=4, temperature=0.0, top_k=0, top_p=1.0, seed=0, draft_temperature=0.0,
                draft_top_k=0, draft_seed=0, stop_token=-1)
    for name, value, message in (("depth", 0, "depth must be in"), ("n", 0, "n must be"),
                                 ("max_rounds", 0, "max_rounds must be"), ("unseen", [], "unseen must hold"),
                                 ("unseen", [1, oracle.config.vocab_size, 3], "outside the vocabulary"),
                                 ("unseen", [1, 2, oracle.config.vocab_size], "the root must be a token id"),
                                 ("history", [oracle.config.vocab_size], "history must hold token ids"),
                                 ("oracle_start", o.max_len - 1, "exceed the cache"),
                                 ("draft_start", d.max_len - 2, "must not be past the oracle"),
                                 ("root_position", -1, "must be >= 0")):
        with pytest.raises(ValueError, match=message):
            _cpu.chain_rounds(**{**args, name: value})


class LookupFirstPython(SpeculativeDecoder):
    """The reference of a lookup-or-draft round in Python: prompt lookup's chain where the
    context's last 3 tokens were seen before (``_round`` with ``lookup``), else the draft's."""

    def round(self, remaining: int) -> list[int]:
        depth = self.drafter.shape.max_depth
        lookup = self.drafter.lookup_matches()
        return self._round(remaining, depth + 1, depth, lookup=lookup)[0]


class LookupFirstBlocks(SpeculativeDecoder):
    def round(self, remaining: int) -> list[int]:
        block = self._native_chain_block(remaining, self.drafter.shape.max_depth, 4, lookup_first=True)
        return block[0] if block is not None else LookupFirstPython.round(self, remaining)


@pytest.mark.parametrize("depth", [2, 3])
@pytest.mark.parametrize("params", RULES, ids=["greedy", "top_k", "top_p"])
def test_lookup_first_blocks_equal_the_python_rounds_and_plain_decoding(pair, params, depth, monkeypatch):
    """``chain_rounds`` with ``lookup_first`` (the planner's lookup-or-draft arms): rounds of
    prompt lookup's chain where the context's last 3 tokens were seen before, of the draft's
    chain elsewhere, the draft catching up on the lookup rounds' tokens in its next pass. The
    prompt repeats itself, so both kinds of rounds run."""
    oracle, draft = (load_model(d) for d in pair)
    g = torch.Generator().manual_seed(depth)
    head = torch.randint(0, oracle.config.vocab_size, (6,), generator=g).tolist()
    prompt = head + head[:4] + head + head[:3]
    lookups = []
    real = _cpu.chain_rounds

    def counting(*args, **kwargs):
        got = real(*args, **kwargs)
        lookups.append((got[9], got[4]))  # lookup rounds, draft passes
        return got

    monkeypatch.setattr(_cpu, "chain_rounds", counting)
    blocks, python = (_make(cls, oracle, draft, params, depth) for cls in (LookupFirstBlocks, LookupFirstPython))
    with torch.inference_mode():
        got, calls = _run(blocks, prompt, 48)
        want, _ = _run(python, prompt, 48)
        sampling = SamplingConfig.make(params, oracle.config.vocab_size)
        ref, _ = _run(PlainDecoder(ModelRunner(oracle, TorchBackend(native=True)), sampling), prompt, 48)
    assert got[:48] == want[:48] == ref[:48]
    assert blocks.accepted_lengths == python.accepted_lengths
    assert len(calls) < len(blocks.accepted_lengths)  # rounds did run in blocks
    assert sum(n for n, _ in lookups) > 0 and sum(p for _, p in lookups) > 0  # both kinds of rounds ran
    _assert_same_state(blocks, python)


class LookupFirstRounds(SpeculativeDecoder):
    """A lookup-or-draft round a call: prompt lookup's chain in Python, the draft's in one native
    call (``_native_chain``)."""

    def round(self, remaining: int) -> list[int]:
        if self.drafter.lookup_matches():
            return LookupFirstPython.round(self, remaining)
        emitted = self._native_chain(remaining, self.drafter.shape.max_depth)
        return emitted if emitted is not None else LookupFirstPython.round(self, remaining)


@pytest.mark.parametrize("native", ["chain_rounds", "chain_round"])
@pytest.mark.parametrize("params", RULES, ids=["greedy", "top_k", "top_p"])
def test_a_lookup_first_arm_holds_a_long_backlog_to_the_window(pair, params, native, monkeypatch):
    """A lookup-or-draft arm never catches up (its draft falls behind by each lookup round and
    its next pass evaluates the rest), so under a planner's lazy start its first native call, a
    block or a round, meets the whole prompt as the draft's backlog. That call's first pass
    evaluates only the window's tokens, from the draft's position 0
    (``ModelDrafter.trim_backlog``), as a Python round's does; the tokens are plain decoding's."""
    oracle, draft = (load_model(d) for d in pair)
    prompt = torch.randint(0, oracle.config.vocab_size, (40,), generator=torch.Generator().manual_seed(2)).tolist()
    window = 8
    calls = []
    real = getattr(_cpu, native)

    def recording(*args, **kwargs):
        calls.append((args[3], len(args[4])))  # the draft's start slot, its unseen tokens
        return real(*args, **kwargs)

    monkeypatch.setattr(_cpu, native, recording)
    cls = LookupFirstBlocks if native == "chain_rounds" else LookupFirstRounds
    blocks, python = (_make(c, oracle, draft, params, 2, window) for c in (cls, LookupFirstPython))
    for dec in (blocks, python):
        dec.planner_factory = object  # a planner's start: the drafter starts lazily, the prompt unseen
    with torch.inference_mode():
        got, _ = _run(blocks, prompt, 24)
        want, _ = _run(python, prompt, 24)
        sampling = SamplingConfig.make(params, oracle.config.vocab_size)
        ref, _ = _run(PlainDecoder(ModelRunner(oracle, TorchBackend(native=True)), sampling), prompt, 24)
    assert calls[0] == (0, window + 1)
    assert blocks.drafter.offset == python.drafter.offset == len(prompt) - 1 - window
    assert got[:24] == want[:24] == ref[:24]
    _assert_same_state(blocks, python)


def _draft_chain_reference(draft, prompt, depth):
    """The draft's greedy chain after ``prompt`` on the torch path, with each token's softmax
    probability: the independent reference of what a planned chain offers."""
    runner = ModelRunner(draft, TorchBackend(native=False))
    runner.reset()
    runner.prefill(prompt[:-1])
    tokens, probs, last = [], [], prompt[-1]
    for _ in range(depth):
        p = torch.softmax(runner.step(last).double(), -1)
        last = int(p.argmax())
        tokens.append(last)
        probs.append(float(p[last]))
    return tokens, probs


@pytest.mark.parametrize("params", RULES, ids=["greedy", "top_k", "top_p"])
def test_chain_passes_in_one_step_region_over_two_threads_equal_the_python_rounds(pair, params):
    """Over 2 threads, a native chain round's draft passes after its first run in one OpenMP
    region (``NativeGPT2::step_region``, the default; the draft's best child by ``best_child``):
    round by round the tokens of the Python rounds (2 threads too; their child choice is
    ``top_children`` / ``perturbed_children`` on tensors), both caches bit for bit, and the same
    as a ``forward_ids`` call a pass (``set_step_region(False)``); whole context and a window."""
    oracle, draft = (load_model(d) for d in pair)
    prompt = torch.randint(0, oracle.config.vocab_size, (9,), generator=torch.Generator().manual_seed(4)).tolist()
    saved, was = torch.get_num_threads(), _cpu.step_region()
    try:
        torch.set_num_threads(2)
        for window in (None, 4):
            with torch.inference_mode():
                want, want_rounds = _run(_make(PythonRounds, oracle, draft, params, 4, window), prompt, 40)
                for region in (True, False):
                    _cpu.set_step_region(region)
                    for cls in (NativeRounds, SpeculativeDecoder):
                        dec = _make(cls, oracle, draft, params, 4, window)
                        python = _make(PythonRounds, oracle, draft, params, 4, window)
                        got, got_rounds = _run(dec, prompt, 40)
                        _run(python, prompt, 40)
                        assert got == want, (window, region, cls.__name__)
                        if cls is NativeRounds:
                            assert got_rounds == want_rounds
                        _assert_same_state(dec, python)
    finally:
        torch.set_num_threads(saved)
        _cpu.set_step_region(was)


@pytest.mark.parametrize("go,keep,expect", [
    ([0.7, 0.6, 0.3, 0.5, 0.0, 0.0], [0.0] * 6, 4),  # A = c, c^2, ..: the 4th pass is not worth it
    ([0.7, 0.6, 0.3, 0.5, 0.0, 0.0], [0.1, 0.1, 0.45, 0.45, 0, 0], 3),  # the 4th token is not worth its node
    ([0.0] * 6, [0.0] * 6, 6),  # every pass pays: the whole depth
    ([0.9] * 6, [0.9] * 6, 0),  # not even the first token: a plain step, the oracle does not run
])
def test_a_planned_chain_stops_where_its_rule_says(pair, go, keep, expect):
    """``chain_round`` with a planner's rule: chain token i has the value A(i), the product of
    calibration[bin of its draft probability] along the chain; another pass runs while
    A(i) > go[i - 1], then the chain keeps its tokens while A(i) > keep[i - 1]. The chain is the
    draft's greedy chain on the torch path, cut where that rule cuts it, and the tokens emitted
    are plain greedy decoding's."""
    oracle, draft = (load_model(d) for d in pair)
    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(0, oracle.config.vocab_size, (9,), generator=g).tolist()
    with torch.inference_mode():
        ref_tokens, ref_probs = _draft_chain_reference(draft, prompt, 6)
        calibration = [0.8 - 0.05 * b for b in range(10)]  # any bin: the rule reads the draft's r
        values, a = [], 1.0
        for r in ref_probs:
            a *= calibration[min(9, int(r * 10))]
            values.append(a)
        n = 0
        while n < 6:
            n += 1
            if not values[n - 1] > go[n - 1]:
                break
        drafted = n  # one draft pass a token
        while n > 0 and not values[n - 1] > keep[n - 1]:
            n -= 1
        assert n == expect
        dec = _make(SpeculativeDecoder, oracle, draft, SamplingParams(), 6)
        dec.start(prompt)
        d, o, unseen = dec.drafter.runner, dec.oracle, dec.drafter.unseen
        root_position = o.length
        d_start, o_start = d.reserve(len(unseen) + 5), o.reserve(7)
        chain, logr, path, emitted, passes, _, _ = _cpu.chain_round(
            d.native, d.cache.k, d.cache.v, d_start, unseen, d_start, o.native, o.cache.k, o.cache.v, o_start,
            root_position, 6, 0.0, 0, 1.0, 0, 0.0, 0, 0, calibration, go, keep)
        plain = PlainDecoder(ModelRunner(oracle, TorchBackend(native=True)), SamplingConfig.make(SamplingParams(),
                                                                                                 oracle.config.vocab_size))
        want, _ = _run(plain, prompt, 8)
    assert chain == ref_tokens[:n]
    assert len(logr) == n and all(abs(math.exp(x) - p) < 1e-5 for x, p in zip(logr, ref_probs))
    assert passes == drafted
    if n == 0:
        assert path == [] and emitted == []
    else:
        assert emitted == want[:len(emitted)] and len(emitted) == len(path)


def test_a_planned_chain_needs_its_whole_rule(pair):
    oracle, draft = (load_model(d) for d in pair)
    dec = _make(SpeculativeDecoder, oracle, draft, SamplingParams(), 2)
    dec.start([1, 2, 3])
    d, o = dec.drafter.runner, dec.oracle
    args = dict(draft=d.native, draft_k=d.cache.k, draft_v=d.cache.v, draft_start=0, unseen=[1, 2, 3],
                draft_position=0, oracle=o.native, oracle_k=o.cache.k, oracle_v=o.cache.v, oracle_start=2,
                root_position=2, depth=2, temperature=0.0, top_k=0, top_p=1.0, seed=0, draft_temperature=0.0,
                draft_top_k=0, draft_seed=0, calibration=[0.5] * 10, go=[0.1, 0.1], keep=[0.0, 0.0])
    with pytest.raises(ValueError, match="10 calibration bins"):
        _cpu.chain_round(**{**args, "calibration": [0.5] * 9})
    with pytest.raises(ValueError, match="go and keep thresholds"):
        _cpu.chain_round(**{**args, "go": [0.1]})
    with pytest.raises(ValueError, match="go and keep thresholds"):
        _cpu.chain_round(**{**args, "keep": [0.1]})


@pytest.mark.parametrize("params", RULES, ids=["greedy", "top_k", "top_p"])
def test_a_fixed_chain_without_log_r_drafts_the_same_chain(pair, params):
    """``chain_round(with_logr=False)`` (chain_rounds' fixed blocks) chooses each draft token
    without its log r (``best_child_token``): over 12 prompts the same chain, path, emitted tokens
    and draft passes as with it, and an empty log r list; a planned chain reads log r, so it
    computes and returns it either way."""
    oracle, draft = (load_model(d) for d in pair)
    g = torch.Generator().manual_seed(9)
    d_t, d_k, d_seed = (0.0, 0, 0) if params.temperature == 0 else (params.temperature, params.top_k or 0, params.seed)
    rule = (params.temperature, params.top_k or 0, params.top_p, params.seed or 0, d_t, d_k, d_seed)
    with torch.inference_mode():
        for i in range(12):
            prompt = torch.randint(0, oracle.config.vocab_size, (5 + i,), generator=g).tolist()
            got = {}
            for with_logr, planned in ((True, False), (False, False), (False, True)):
                dec = _make(SpeculativeDecoder, oracle, draft, params, 4)
                dec.start(prompt)
                d, o, unseen = dec.drafter.runner, dec.oracle, dec.drafter.unseen
                d_start, o_start = d.reserve(len(unseen) + 3), o.reserve(5)
                plan = ([0.9] * 10, [0.0] * 4, [0.0] * 4) if planned else ((), (), ())
                got[(with_logr, planned)] = _cpu.chain_round(
                    d.native, d.cache.k, d.cache.v, d_start, unseen, d_start, o.native, o.cache.k, o.cache.v, o_start,
                    o.length, 4, *rule[:4], *rule[4:], *plan, with_logr=with_logr)
            full, lean, planned = got[(True, False)], got[(False, False)], got[(False, True)]
            assert lean[0] == full[0] and lean[2:5] == full[2:5], i  # chain, path, emitted, passes
            assert lean[1] == [] and len(full[1]) == len(full[0])
            assert len(planned[1]) == len(planned[0]) and planned[1] == full[1][:len(planned[1])]
