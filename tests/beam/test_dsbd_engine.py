"""Beam sampling and DSBD through the Engine (ALGORITHMS.md sec. 9; issue 8).

The laws themselves are proven in test_dsbd_law.py on a Markov LM. Here the engine's cached
implementation, in both cache layouts (one tree row; one row per beam), forest in one oracle
pass, is checked against full-recompute references on HF transformers' model driven by the same
generator draws: the per-step distributions must agree to 1e-4 and every draw must follow, so
the beams come out identical. Then acceptance with an identical draft, memory mode's one cache
row, the dynamic width, and errors.
"""
from __future__ import annotations

import math

import pytest
import torch
from transformers import GPT2LMHeadModel
from transformers.generation.logits_process import (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

import staged_engine.beam.core as core
from staged_engine import Engine, SamplingParams
from staged_engine.beam.core import CachelessLM, DSBDConfig, dsbd_generate
from staged_engine.beam.decoders import TreeLM
from staged_engine.model.runner import ModelRunner

VOCAB = 997
F64 = torch.float64


def _prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (n,), generator=g).tolist()


@pytest.fixture(scope="module")
def engine(pair):
    oracle, draft = pair
    return Engine.from_pretrained(oracle, draft=draft)


@pytest.fixture(scope="module")
def hf(pair):
    return GPT2LMHeadModel.from_pretrained(pair[0]).eval(), GPT2LMHeadModel.from_pretrained(pair[1]).eval()


def _hf_probs(model, batch: list[list[int]], temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """(n, V) float64 processed next-token distributions by HF's own model and logits warpers,
    full recompute (no cache). All sequences in ``batch`` have the same length."""
    with torch.no_grad():
        logits = model(torch.tensor(batch)).logits[:, -1].float()  # (n, V)
    if temperature == 0:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).to(F64)
    warpers = [TemperatureLogitsWarper(temperature)]
    if top_k:
        warpers.append(TopKLogitsWarper(top_k))
    if top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p))
    for w in warpers:
        logits = w(None, logits)
    return torch.softmax(logits, dim=-1).to(F64)


def inverse_cdf(probs: torch.Tensor, num: int, g: torch.Generator) -> list[int]:
    """``num`` i.i.d. draws from ``probs``: the first index whose cumulative mass exceeds
    u * total, u ~ U[0, 1) from ``g`` (the engine's categorical draw)."""
    cdf = torch.cumsum(probs, 0)
    u = torch.rand(num, dtype=F64, generator=g)
    return torch.searchsorted(cdf, u * cdf[-1], right=True).tolist()


def reference_beam_sample(model, prompt, width, steps, seed, temperature, top_k, top_p):
    """Beam sampling written out (ALGORITHMS.md sec. 9): W draws i.i.d. from the joint
    S(b_i) p'(v | b_i), by inverse CDF on a generator seeded with ``seed``.
    Returns the final beams (generated tokens), their log-scores and each step's joint."""
    g = torch.Generator().manual_seed(seed)
    beams, log_p, joints = [list(prompt)], torch.zeros(1, dtype=F64), []
    for _ in range(steps):
        cond = _hf_probs(model, beams, temperature, top_k, top_p)  # (n, V)
        joint = (torch.exp(log_p - log_p.max())[:, None] * cond).reshape(-1)
        joint = joint / joint.sum()
        joints.append(joint)
        draws = inverse_cdf(joint, width, g)
        parents, tokens = [c // VOCAB for c in draws], [c % VOCAB for c in draws]
        log_p = log_p[parents] + torch.log(cond[parents, tokens])
        beams = [beams[i] + [v] for i, v in zip(parents, tokens)]
    return [b[len(prompt):] for b in beams], log_p, joints


# --------------------------------------------------------------------------------------------
# (a) beam sampling through the engine = the reference on HF's model, draw for draw
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("layout,width,temperature,top_k,top_p,seed", [
    ("tree", 4, 1.0, 0, 1.0, 1), ("rows", 4, 1.0, 0, 1.0, 1), ("tree", 3, 0.7, 50, 1.0, 2),
    ("rows", 4, 1.0, 0, 0.9, 3), ("tree", 1, 1.0, 20, 0.95, 4),
])
def test_beam_matches_hf_reference(engine, hf, monkeypatch, layout, width, temperature, top_k, top_p, seed):
    seen = []
    real_joint = core.beam_joint

    def recording_joint(log_scores, probs):
        out = real_joint(log_scores, probs)
        seen.append(out)
        return out

    monkeypatch.setattr(core, "beam_joint", recording_joint)  # BeamSampling.step draws from it
    prompt, steps = _prompt(7 + seed, seed), 20
    res = engine.generate(prompt, max_new_tokens=steps, strategy="beam", num_beams=width,
                          temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, layout=layout)
    beams, log_p, joints = reference_beam_sample(hf[0], prompt, width, steps, seed, temperature, top_k, top_p)
    assert len(seen) == steps == len(joints)
    for ours, ref in zip(seen, joints):  # the per-step distributions over (beam, token)
        assert float((ours - ref).abs().max()) < 1e-4
    s = res.stats
    assert s["beam_token_ids"] == beams  # every draw followed
    assert max(abs(a - b) for a, b in zip(s["beam_scores"], log_p.tolist())) < 1e-3
    best = max(range(width), key=lambda i: (log_p[i].item(), [-t for t in beams[i]]))
    assert res.token_ids == beams[best] == s["beam_token_ids"][s["best_beam"]]
    assert s["oracle_calls"] == steps and s["new_tokens"] == steps


def test_beam_and_dsbd_greedy_equal_plain_greedy(engine):
    prompt = _prompt(9, 5)
    ref = engine.generate(prompt, max_new_tokens=24, strategy="plain").token_ids
    assert engine.generate(prompt, max_new_tokens=24, strategy="beam", num_beams=3).token_ids == ref
    assert engine.generate(prompt, max_new_tokens=24, strategy="dsbd", num_beams=3).token_ids == ref


def test_tree_lm_keeps_diverging_beams_and_grows(engine, hf):
    """The tree layout with beams that never coalesce: their suffixes pile up as pending tree
    entries; near the end of the context window they outgrow the cache's initial room (the
    window + 1 slot here), the cache is regrown, and every distribution still equals HF's full
    recompute."""
    params = SamplingParams(temperature=1.0, seed=0)
    runner = ModelRunner(engine.oracle, engine.backend, max_len=engine.config.n_positions + 1)
    lm = TreeLM(runner, params, slack=1)
    prompt = _prompt(engine.config.n_positions - 20, 70)
    lm.start(prompt)
    g = torch.Generator().manual_seed(70)
    beams = [tuple(prompt[-1:])]
    for step in range(7):
        probs = lm.probs(beams)  # (n, V)
        ref = torch.cat([_hf_probs(hf[0], [prompt[:-1] + list(b)], 1.0, 0, 1.0) for b in beams])
        assert float((probs - ref).abs().max()) < 1e-4
        if step == 0:  # branch into 4 beams, then extend each on its own
            beams = [beams[0] + (int(v),) for v in torch.randperm(VOCAB, generator=g)[:4]]
        else:
            beams = [b + (int(torch.randint(VOCAB, (1,), generator=g)),) for b in beams]
        lm.keep(beams)
    assert runner.cache.pending == lm.peak_pending == 4 * 6  # each beam's 6 evaluated own tokens
    assert runner.cache.max_len > engine.config.n_positions + 1  # regrown
    assert runner.cache.lengths == [len(prompt)]  # the prompt; the beams share nothing after it


# --------------------------------------------------------------------------------------------
# DSBD through the engine = the core's dsbd_generate on HF full-recompute models, draw for draw
# --------------------------------------------------------------------------------------------
class HFBeamLM(CachelessLM):
    """dsbd_core.BeamLM on an HF model without a cache. The core's sequences start at the
    prompt's last token; ``head`` is the rest of the prompt."""

    def __init__(self, model, head: list[int], temperature: float, top_k: int, top_p: float) -> None:
        self.model, self.head, self.args = model, head, (temperature, top_k, top_p)
        self.memo: dict[tuple, torch.Tensor] = {}

    def probs(self, prefixes) -> torch.Tensor:
        for p in prefixes:
            if p not in self.memo:
                self.memo[p] = _hf_probs(self.model, [self.head + list(p)], *self.args)[0]
        return torch.stack([self.memo[p] for p in prefixes])


@pytest.mark.parametrize("layout", ["tree", "rows"])
@pytest.mark.parametrize("memory_mode,dynamic,width,temperature,top_k,seed", [
    (False, True, 3, 1.0, 0, 7), (True, True, 3, 1.0, 40, 8), (False, False, 2, 0.8, 0, 9),
])
def test_dsbd_matches_core_on_hf(engine, hf, layout, memory_mode, dynamic, width, temperature, top_k, seed):
    prompt, steps = _prompt(11, seed), 18
    opts = dict(gamma=3, draft_width=4, threshold=0.7, w_min=1, dynamic=dynamic, memory_mode=memory_mode)
    res = engine.generate(prompt, max_new_tokens=steps, strategy="dsbd", num_beams=width,
                          temperature=temperature, top_k=top_k, seed=seed, layout=layout, **opts)
    oracle = HFBeamLM(hf[0], prompt[:-1], temperature, top_k, 1.0)
    draft = HFBeamLM(hf[1], prompt[:-1], temperature, top_k, 1.0)
    ref = dsbd_generate(oracle, draft, prompt[-1:], steps, torch.Generator().manual_seed(seed),
                        DSBDConfig(width=width, **opts))
    s = res.stats
    assert s["beam_token_ids"] == [list(b[1:]) for b in ref.seqs]
    assert res.token_ids == list(ref.best[1:])
    assert max(abs(a - b) for a, b in zip(s["beam_scores"], ref.log_scores.tolist())) < 1e-3
    assert s["beam_widths"] == ref.stats["widths"] and s["beams_accepted"] == ref.stats["accepted"]
    assert s["oracle_calls"] == s["rounds"] == ref.stats["rounds"]  # one oracle pass per round
    assert s["new_tokens"] == steps and sum(s["accepted_lengths"]) == steps


@pytest.mark.parametrize("layout", ["tree", "rows"])
@pytest.mark.parametrize("window", [4, None])
def test_a_windowed_dsbd_draft_prefills_the_prompt_s_tail_at_its_own_positions(engine, hf, layout, window):
    """``draft_window``: the draft prefills only the prompt's last N tokens before its last, at
    positions 0.. of its own, and DSBD then draws exactly what the core draws with an HF draft
    that sees that tail alone (None: the whole prompt, the reference of the test above)."""
    prompt, steps, seed, width, temperature = _prompt(11, 13), 16, 13, 2, 1.0
    opts = dict(gamma=3, draft_width=4, threshold=0.7, w_min=1, dynamic=True, memory_mode=False)
    res = engine.generate(prompt, max_new_tokens=steps, strategy="dsbd", num_beams=width, temperature=temperature,
                          seed=seed, layout=layout, draft_window=window, **opts)
    oracle = HFBeamLM(hf[0], prompt[:-1], temperature, 0, 1.0)
    draft = HFBeamLM(hf[1], prompt[:-1] if window is None else prompt[-window - 1:-1], temperature, 0, 1.0)
    ref = dsbd_generate(oracle, draft, prompt[-1:], steps, torch.Generator().manual_seed(seed),
                        DSBDConfig(width=width, **opts))
    s = res.stats
    assert s["beam_token_ids"] == [list(b[1:]) for b in ref.seqs]
    assert max(abs(a - b) for a, b in zip(s["beam_scores"], ref.log_scores.tolist())) < 1e-3
    assert s["beam_widths"] == ref.stats["widths"] and s["beams_accepted"] == ref.stats["accepted"]


class _Schedule:
    """Stand-in for a planner memory's ``Stints``: the arm of every round, in order."""

    def __init__(self, arms: list[int]) -> None:
        self.arms, self.arm, self.recorded = list(arms), arms[0], []

    def record(self, tokens: int, seconds: float, rounds: int = 1) -> None:
        self.recorded.append(tokens)
        self.arm = self.arms[len(self.recorded) % len(self.arms)]

    def summary(self, names=None) -> dict:
        return {}


@pytest.mark.parametrize("layout,dynamic,width", [("tree", False, 2), ("rows", False, 3), ("rows", True, 2)])
def test_adaptive_dsbd_rounds_match_core_on_hf(engine, hf, monkeypatch, layout, dynamic, width):
    """The planner's rounds of 0-3 drafted layers, the draft left behind on beam-sampling steps
    and caught up a stride at a time (2 nodes a pass), give draw for draw what the core's run
    with the same gammas gives on HF full-recompute models."""
    monkeypatch.setattr(core, "CATCH_UP_NODES", 2 * width)
    arms = [0, 0, 0, 3, 0, 1, 0, 0, 0, 0, 2, 2]  # dsbd_arms(3): gammas 0, 1, 2, 3
    memories = []
    real = Engine._dsbd_memory

    def scheduled(self, config):
        memory = real(self, config)
        memory.stints = _Schedule(arms)
        memories.append(memory)
        return memory

    monkeypatch.setattr(Engine, "_dsbd_memory", scheduled)
    monkeypatch.setattr(Engine, "_keep_memory", lambda self, memory: None)
    prompt, steps, seed, temperature = _prompt(9, 41), 20, 12, 1.0
    opts = dict(gamma=3, draft_width=3, threshold=0.7, w_min=1, dynamic=dynamic)
    res = engine.generate(prompt, max_new_tokens=steps, strategy="dsbd", num_beams=width, adaptive=True,
                          temperature=temperature, seed=seed, layout=layout, **opts)
    assert [a.depth for a in memories[0].arms] == [0, 1, 2, 3]
    rounds = res.stats["rounds"]
    assert rounds > len(arms)  # the schedule came round again
    oracle = HFBeamLM(hf[0], prompt[:-1], temperature, 0, 1.0)
    draft = HFBeamLM(hf[1], prompt[:-1], temperature, 0, 1.0)
    run = core.DSBDRun(oracle, draft, prompt[-1:], steps, torch.Generator().manual_seed(seed),
                       DSBDConfig(width=width, **opts))
    for r in range(rounds):
        run.step(arms[r % len(arms)])
    assert run.finished
    s = res.stats
    assert s["beam_token_ids"] == [list(b[1:]) for b in run.beams.seqs]
    assert max(abs(a - b) for a, b in zip(s["beam_scores"], run.beams.log_p.tolist())) < 1e-3
    assert s["beam_widths"] == run.stats["widths"] and s["beams_accepted"] == run.stats["accepted"]


@pytest.mark.parametrize("arms,draft_passes", [([0], 0), ([0, 0, 0, 2], None)])
def test_the_draft_starts_at_the_first_drafted_round(engine, hf, monkeypatch, arms, draft_passes):
    """With a fixed width the draft's prefill waits for the planner's first drafted round: a
    generation kept on gamma 0 (beam sampling itself) runs no draft pass at all, and one that
    drafts later prefills then and catches up, with the core's draws on HF models either way."""
    memories = []
    real = Engine._dsbd_memory

    def scheduled(self, config):
        memory = real(self, config)
        memory.stints = _Schedule(arms)
        memories.append(memory)
        return memory

    monkeypatch.setattr(Engine, "_dsbd_memory", scheduled)
    monkeypatch.setattr(Engine, "_keep_memory", lambda self, memory: None)
    prompt, steps, seed, width = _prompt(9, 43), 12, 5, 2
    opts = dict(gamma=2, draft_width=3, threshold=0.7, w_min=1, dynamic=False)
    res = engine.generate(prompt, max_new_tokens=steps, strategy="dsbd", num_beams=width, adaptive=True,
                          temperature=1.0, seed=seed, layout="rows", **opts)
    if draft_passes is not None:
        assert res.stats["draft_calls"] == draft_passes
    else:
        assert res.stats["draft_calls"] > 0
    oracle = HFBeamLM(hf[0], prompt[:-1], 1.0, 0, 1.0)
    draft = HFBeamLM(hf[1], prompt[:-1], 1.0, 0, 1.0)
    run = core.DSBDRun(oracle, draft, prompt[-1:], steps, torch.Generator().manual_seed(seed),
                       DSBDConfig(width=width, **opts))
    for r in range(res.stats["rounds"]):
        run.step(arms[r % len(arms)])
    assert run.finished
    assert res.stats["beam_token_ids"] == [list(b[1:]) for b in run.beams.seqs]


def test_seeded_or_pinned_dsbd_is_not_adaptive(engine):
    """A seed of the caller's, a pinned gamma or memory mode fix the rounds (and so the draws);
    otherwise the clock picks each round's gamma."""
    kw = dict(max_new_tokens=6, strategy="dsbd", num_beams=2, temperature=1.0)
    assert "planner" in engine.generate([1, 2, 3], **kw).stats
    assert "planner" not in engine.generate([1, 2, 3], seed=3, **kw).stats
    assert "planner" not in engine.generate([1, 2, 3], gamma=2, **kw).stats
    assert "planner" not in engine.generate([1, 2, 3], memory_mode=True, **kw).stats
    assert "planner" in engine.generate([1, 2, 3], seed=3, adaptive=True, **kw).stats


# --------------------------------------------------------------------------------------------
# (b) a draft identical to the oracle has every drafted candidate accepted
# --------------------------------------------------------------------------------------------
def test_identical_draft_accepts_every_layer(pair):
    eng = Engine.from_pretrained(pair[0], draft=pair[0])
    gamma, width = 4, 4
    for seed, layout in enumerate(("tree", "rows")):
        res = eng.generate(_prompt(8, 20 + seed), max_new_tokens=40, strategy="dsbd", num_beams=width,
                           temperature=1.0, seed=seed, gamma=gamma, draft_width=width, layout=layout)
        s = res.stats
        assert s["draft_acceptance"] == 1.0
        assert all(w == width for w in s["beam_widths"])  # P(>= K of W_S accepted) = 1 for every K
        for drafted, accepted in zip(s["beams_drafted"], s["beams_accepted"]):
            assert accepted == min(drafted, width)
        # W_S = W: every drafted layer survives whole, so each round gives gamma + 1 layers.
        assert s["accepted_lengths"] == [gamma + 1] * 8 and s["oracle_calls"] == 8


# --------------------------------------------------------------------------------------------
# (c) memory mode: one cache row per model
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", ["tree", "rows"])
def test_memory_mode_uses_one_cache_row(engine, layout):
    cfg = engine.config
    kw = dict(max_new_tokens=30, strategy="dsbd", num_beams=4, temperature=1.0, seed=1, layout=layout)
    one = engine.generate(_prompt(10, 30), memory_mode=True, **kw).stats
    full = engine.generate(_prompt(10, 30), memory_mode=False, **kw).stats
    # Context window + a round's forest (defaults gamma 4, W_S 8; W = 4) + the tree's room for
    # the beams' own suffixes.
    slots = cfg.n_positions + 1 + 8 * 4 + 4 + (4 * 4 if layout == "tree" else 0)
    row_bytes = 2 * cfg.n_layer * cfg.n_head * slots * cfg.head_dim * 4  # K and V, fp32
    assert one["oracle_cache_rows"] == one["draft_cache_rows"] == 1
    assert one["oracle_cache_bytes"] == row_bytes
    assert set(one["input_beams"]) == {1} and max(full["input_beams"]) > 1
    if layout == "rows":  # one row per beam
        assert full["oracle_cache_rows"] == 4 and full["oracle_cache_bytes"] == 4 * row_bytes
    else:  # the beams share one row; their suffixes are tree entries
        assert full["oracle_cache_rows"] == full["draft_cache_rows"] == 1
        assert full["oracle_cache_bytes"] >= row_bytes
    assert one["new_tokens"] == full["new_tokens"] == 30


# --------------------------------------------------------------------------------------------
# (d) the dynamic width changes the number of beams layer by layer
# --------------------------------------------------------------------------------------------
def test_dynamic_width_varies(engine):
    kw = dict(max_new_tokens=40, strategy="dsbd", num_beams=4, temperature=1.0, seed=2, draft_width=6)
    dyn = engine.generate(_prompt(12, 40), threshold=0.7, **kw).stats
    assert len(set(dyn["beam_widths"])) > 1 and min(dyn["beam_widths"]) >= 1
    assert max(dyn["beam_widths"]) <= 4 and len(dyn["beam_widths"]) == 40
    fixed = engine.generate(_prompt(12, 40), dynamic=False, **kw).stats
    assert set(fixed["beam_widths"]) == {4}
    floor = engine.generate(_prompt(12, 40), threshold=1.0, w_min=2, **kw).stats
    assert min(floor["beam_widths"]) >= 2


# --------------------------------------------------------------------------------------------
# (e) bad options name themselves
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("strategy,opts,needle", [
    ("dsbd", dict(gamma=0), "gamma"), ("dsbd", dict(gamma=2.5), "gamma"),
    ("dsbd", dict(draft_width=0), "draft_width"), ("dsbd", dict(threshold=1.5), "threshold"),
    ("dsbd", dict(threshold=True), "threshold"), ("dsbd", dict(w_min=5), "w_min"),
    ("dsbd", dict(w_min=0), "w_min"), ("dsbd", dict(dynamic="yes"), "dynamic"),
    ("dsbd", dict(memory_mode=1), "memory_mode"), ("dsbd", dict(budget=4), "budget"),
    ("dsbd", dict(layout="grid"), "layout"), ("beam", dict(gamma=4), "gamma"),
    ("beam", dict(layout=None), "layout"), ("dsbd", dict(draft_window=0), "draft_window"),
    ("dsbd", dict(draft_window=2.5), "draft_window"), ("beam", dict(draft_window=8), "draft_window"),
])
def test_bad_options_raise(engine, strategy, opts, needle):
    with pytest.raises(ValueError, match=needle):
        engine.generate([1, 2, 3], max_new_tokens=4, strategy=strategy, num_beams=4, **opts)


@pytest.mark.parametrize("strategy", ["beam", "dsbd"])
@pytest.mark.parametrize("layout", ["tree", "rows"])
def test_a_width_whose_cache_cannot_fit_is_refused(engine, monkeypatch, strategy, layout):
    """The width's K/V cache and scores are sized against the device's memory before anything is
    allocated: a clear error naming num_beams (here a 64 KB device), not the allocator's."""
    import staged_engine.beam.decoders as dec

    assert dec.device_memory(torch.device("cpu")) > 1 << 30
    monkeypatch.setattr(dec, "device_memory", lambda device: 1 << 16)
    with pytest.raises(ValueError, match="num_beams=4 needs at least .* GB for its K/V cache"):
        engine.generate([1, 2, 3], max_new_tokens=2, strategy=strategy, num_beams=4, layout=layout)
    monkeypatch.setattr(dec, "device_memory", lambda device: 0)  # unknown: not refused
    assert len(engine.generate([1, 2, 3], max_new_tokens=2, strategy=strategy, num_beams=4,
                               layout=layout).token_ids) == 2


def test_dsbd_needs_a_draft(checkpoints):
    with pytest.raises(ValueError, match="draft"):
        Engine.from_pretrained(checkpoints["odd96"]).generate([1, 2], strategy="dsbd", num_beams=2)


@pytest.mark.parametrize("layout", ["tree", "rows"])
def test_stats_and_context_limit(engine, layout):
    """Generation up to the end of the context window stays inside it; stats are consistent."""
    n_ctx = engine.config.n_positions
    prompt = _prompt(n_ctx - 9, 50)  # room for 9 new tokens; the last one sits at n_ctx - 1
    res = engine.generate(prompt, max_new_tokens=50, strategy="dsbd", num_beams=3, temperature=1.0, seed=0,
                          layout=layout)
    s = res.stats
    assert len(res.token_ids) == 9 and s["finish_reason"] == "context"
    assert len(s["beam_scores"]) == len(s["beam_token_ids"]) == s["beam_widths"][-1]
    assert all(math.isfinite(x) for x in s["beam_scores"])
    assert s["tokens_per_oracle_call"] == 9 / s["oracle_calls"]
    res = engine.generate(prompt, max_new_tokens=50, strategy="beam", num_beams=3, temperature=1.0, seed=0,
                          layout=layout)
    assert len(res.token_ids) == 9 and res.stats["finish_reason"] == "context"
