"""Exact-law tests of the DSBD core (ALGORITHMS.md sec. 9-10; issue 8 acceptance 1-3).

Exact laws are computed by enumerating every branch of the code under test: ``_Replay`` is a
RandomSource that replays a forced prefix of choices, takes the first option at each new choice
and queues the alternatives, so each leaf of the choice tree runs once with its probability.
"""
from __future__ import annotations

import itertools
import math
from collections import Counter, defaultdict
from typing import Any, Callable, Iterator

import pytest
import torch
from markov_lm import MarkovLM, random_markov

import staged_engine.beam.core as core
from staged_engine.beam.core import (
    DSBDConfig,
    DSBDRun,
    acceptance_alphas,
    beam_joint,
    beam_sample,
    draft_log_scores,
    dsbd_generate,
    dsbd_width_rule,
    dynamic_width,
    prob_at_least,
    residual,
    verify_drafts,
    verify_layer,
)

F64 = torch.float64


# --------------------------------------------------------------------------------------------
# Exhaustive enumeration of a randomised function
# --------------------------------------------------------------------------------------------
class _Replay:
    """RandomSource that follows ``prefix`` and then always takes the first option."""

    def __init__(self, prefix: tuple[int, ...]) -> None:
        self.prefix, self.taken, self.prob = prefix, [], 1.0
        self.pending: list[tuple[int, ...]] = []

    def _choose(self, options: list[tuple[int, float]]) -> int:
        depth = len(self.taken)
        if depth < len(self.prefix):
            choice = self.prefix[depth]
        else:
            choice = options[0][0]
            self.pending += [tuple(self.taken) + (alt,) for alt, _ in options[1:]]
        self.prob *= dict(options)[choice]
        self.taken.append(choice)
        return choice

    def bernoulli(self, prob: float) -> bool:
        return bool(self._choose([(v, w) for v, w in ((1, prob), (0, 1.0 - prob)) if w > 0]))

    def categorical(self, probs: torch.Tensor, num: int) -> list[int]:
        options = [(c, w) for c, w in enumerate(probs.tolist()) if w > 0]
        return [self._choose(options) for _ in range(num)]


def enumerate_branches(fn: Callable[[_Replay], Any]) -> Iterator[tuple[Any, float]]:
    """Yield (fn's result, probability) for every leaf of fn's choice tree."""
    stack: list[tuple[int, ...]] = [()]
    while stack:
        source = _Replay(stack.pop())
        result = fn(source)
        stack += source.pending
        yield result, source.prob


def exact_law(fn: Callable[[_Replay], Any]) -> dict:
    law: dict = defaultdict(float)
    for key, prob in enumerate_branches(fn):
        law[key] += prob
    return dict(law)


def max_gap(a: dict, b: dict) -> float:
    return max(abs(a.get(k, 0.0) - b.get(k, 0.0)) for k in set(a) | set(b))


def tv(a: dict, b: dict) -> float:
    return 0.5 * sum(abs(a.get(k, 0.0) - b.get(k, 0.0)) for k in set(a) | set(b))


def iid_law(p: torch.Tensor, width: int) -> torch.Tensor:
    """(n,)*width: the law of ``width`` ordered i.i.d. draws from p."""
    law = p
    for _ in range(width - 1):
        law = torch.outer(law.reshape(-1), p)
    return law.reshape((p.numel(),) * width)


# --------------------------------------------------------------------------------------------
# Random layers (p_beam, q_beam) with zeros on both sides
# --------------------------------------------------------------------------------------------
def _cond(g: torch.Generator, n_beams: int, vocab: int, zero_frac: float) -> torch.Tensor:
    x = torch.rand(n_beams, vocab, dtype=F64, generator=g) ** 2 + 1e-2
    zero = torch.rand(n_beams, vocab, dtype=F64, generator=g) < zero_frac
    zero[torch.arange(n_beams), torch.randint(vocab, (n_beams,), generator=g)] = False
    x = torch.where(zero, torch.zeros_like(x), x)
    return x / x.sum(1, keepdim=True)


def random_layer(n_beams: int, vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """p_beam, q_beam over n_beams x vocab; seeds = 2 mod 3 give the draft a beam of score 0."""
    g = torch.Generator().manual_seed(seed)
    log_p = torch.randn(n_beams, dtype=F64, generator=g)
    log_q = torch.randn(n_beams, dtype=F64, generator=g)
    if seed % 3 == 2 and n_beams > 1:
        log_q[0] = -math.inf
    p_cond, q_cond = _cond(g, n_beams, vocab, 0.3), _cond(g, n_beams, vocab, 0.3)
    return beam_joint(log_p, p_cond), beam_joint(log_q, q_cond)


# (n_beams, vocab, draft_width W_S, width W), each with three seeds.
LAYER_SHAPES = [(1, 6, 3, 3), (2, 3, 3, 3), (3, 2, 2, 3), (2, 3, 3, 1), (3, 2, 3, 2), (1, 5, 1, 2),
                (2, 2, 2, 2), (1, 4, 0, 2)]
LAYER_CASES = [(*shape, seed) for shape in LAYER_SHAPES for seed in range(3)]


def special_layers() -> list[tuple[torch.Tensor, torch.Tensor]]:
    p = torch.tensor([0.5, 0.3, 0.2, 0.0], dtype=F64)
    return [
        (p, p.clone()),  # q = p: every draft accepted
        (p, torch.tensor([0.0, 0.0, 0.0, 1.0], dtype=F64)),  # disjoint supports: all rejected
        (torch.tensor([0.0, 1.0, 0.0, 0.0], dtype=F64), torch.full((4,), 0.25, dtype=F64)),
    ]


def test_layer_cases_cover_zeros_on_both_sides() -> None:
    layers = [random_layer(n, v, s) for n, v, _, _, s in LAYER_CASES]
    assert any(bool(((q == 0) & (p > 0)).any()) for p, q in layers)
    assert any(bool(((p == 0) & (q > 0)).any()) for p, q in layers)


# --------------------------------------------------------------------------------------------
# Acceptance 1: exact layer law
# --------------------------------------------------------------------------------------------
def layer_law(p: torch.Tensor, q: torch.Tensor, draft_width: int, width: int) -> torch.Tensor:
    """Exact law of the ordered output of one layer: drafts ~ q_beam and every accept/reject
    branch of ``verify_drafts`` enumerated; the extra draws (one from p_cur, the rest from
    p_beam) enter as exact product laws."""
    n = p.numel()
    law = torch.zeros((n,) * width, dtype=F64)

    def run(source: _Replay):
        drafted = source.categorical(q, draft_width)
        return drafted, verify_drafts(p, q, drafted, width, source)

    for (drafted, verdict), prob in enumerate_branches(run):
        chosen = tuple(drafted[pos] for pos in verdict.accepted)
        missing = width - len(chosen)
        if missing == 0:
            law[chosen] += prob
        else:
            tail = verdict.p_cur
            for _ in range(missing - 1):
                tail = torch.outer(tail, p).reshape(-1)
            law[chosen] += prob * tail.reshape((n,) * missing)
    return law


@pytest.mark.parametrize("n_beams,vocab,draft_width,width,seed", LAYER_CASES)
def test_layer_law_is_iid_p_beam(
    n_beams: int, vocab: int, draft_width: int, width: int, seed: int
) -> None:
    p, q = random_layer(n_beams, vocab, seed)
    law = layer_law(p, q, draft_width, width)
    assert abs(float(law.sum()) - 1.0) < 1e-12
    assert float((law - iid_law(p, width)).abs().max()) < 1e-9


@pytest.mark.parametrize("case", range(3))
@pytest.mark.parametrize("draft_width,width", [(3, 3), (2, 3), (3, 1)])
def test_layer_law_special_pairs(case: int, draft_width: int, width: int) -> None:
    p, q = special_layers()[case]
    assert float((layer_law(p, q, draft_width, width) - iid_law(p, width)).abs().max()) < 1e-9


@pytest.mark.parametrize("n_beams,vocab,draft_width,width,seed",
                         [(1, 4, 2, 2, 0), (2, 2, 3, 2, 1), (2, 2, 2, 3, 2), (1, 3, 3, 3, 5)])
def test_verify_layer_full_enumeration(
    n_beams: int, vocab: int, draft_width: int, width: int, seed: int
) -> None:
    """verify_layer end to end, its own extra draws enumerated too."""
    p, q = random_layer(n_beams, vocab, seed)
    law = exact_law(
        lambda s: tuple(verify_layer(p, q, s.categorical(q, draft_width), width, s).candidates))
    target = iid_law(p, width)
    keys = itertools.product(range(p.numel()), repeat=width)
    assert max(abs(law.get(k, 0.0) - float(target[k])) for k in keys) < 1e-9


def test_verify_layer_reports_acceptances_in_draw_order() -> None:
    """Duplicated drafts are separate entries; accepted positions index the drafted list."""
    p = torch.tensor([0.5, 0.5], dtype=F64)
    out = verify_layer(p, p.clone(), [1, 1, 0], 2, torch.Generator().manual_seed(0))
    assert out.accepted == [0, 1] and out.candidates == [1, 1] and out.completed
    with pytest.raises(ValueError, match="q_beam 0"):
        verify_layer(p, torch.tensor([1.0, 0.0], dtype=F64), [1], 1, torch.Generator())


# --------------------------------------------------------------------------------------------
# Beam sampling laws on the Markov LM (closed form), and DSBD's law by exact enumeration
# --------------------------------------------------------------------------------------------
def closed_form_beam_law(lm: MarkovLM, prompt: tuple[int, ...], steps: int,
                         width_of: Callable[[tuple], int]) -> dict:
    """Law of the final beams of beam sampling as sorted tuples, from closed-form sequence
    probabilities: each step draws width_of(beams) candidates i.i.d. (multinomial over the
    distinct candidate sequences)."""
    states = {(prompt,): 1.0}
    for _ in range(steps):
        nxt: dict = defaultdict(float)
        for beams, prob in states.items():
            weight: dict = defaultdict(float)
            for b in beams:
                for v in range(lm.vocab):
                    score = math.exp(lm.log_prob(b, len(prompt)))
                    weight[b + (v,)] += score * float(lm.transition[b[-1], v])
            total = sum(weight.values())
            cands = sorted(s for s, w in weight.items() if w > 0)
            width = width_of(beams)
            for combo in itertools.combinations_with_replacement(cands, width):
                counts = Counter(combo)
                coef = math.factorial(width) / math.prod(math.factorial(c) for c in counts.values())
                nxt[combo] += prob * coef * math.prod((weight[s] / total) ** c for s, c in counts.items())
        states = dict(nxt)
    return states


def as_multisets(law: dict) -> dict:
    out: dict = defaultdict(float)
    for beams, prob in law.items():
        out[tuple(sorted(beams))] += prob
    return dict(out)


PROMPT = (0,)


def _markov_pair(vocab: int, seed: int) -> tuple[MarkovLM, MarkovLM]:
    return random_markov(vocab, seed, zero_frac=0.25), random_markov(vocab, seed + 100, zero_frac=0.25)


def test_beam_sample_reference_matches_closed_form() -> None:
    oracle, _ = _markov_pair(3, 0)
    law = exact_law(lambda s: tuple(beam_sample(oracle, PROMPT, 2, 3, s).seqs))
    assert max_gap(as_multisets(law), closed_form_beam_law(oracle, PROMPT, 3, lambda b: 2)) < 1e-12


EXACT_RUNS = [  # vocab, seed, width, draft_width, gamma, steps, dynamic, threshold
    (2, 1, 2, 2, 2, 2, False, 0.7),  # two drafted layers: the forest, no bonus
    (2, 1, 1, 2, 2, 2, False, 0.7),  # W < W_S: children of rejected drafts are skipped
    (3, 1, 1, 2, 2, 2, False, 0.7),  # the same with V = 3
    (2, 2, 2, 3, 1, 2, False, 0.7),  # one drafted layer + bonus layer, W_S > W
    (2, 5, 2, 2, 1, 2, True, 0.5),  # dynamic width, bonus layer
    (2, 5, 2, 2, 2, 2, True, 0.65),  # dynamic width 1 inside the forest: skipped children
    (2, 4, 2, 2, 2, 2, True, 0.35),  # dynamic width over the forest
    (2, 4, 2, 2, 1, 3, True, 0.35),  # dynamic width, several rounds
]


@pytest.mark.parametrize("vocab,seed,width,draft_width,gamma,steps,dynamic,threshold", EXACT_RUNS)
def test_dsbd_law_exact(vocab: int, seed: int, width: int, draft_width: int, gamma: int, steps: int,
                        dynamic: bool, threshold: float) -> None:
    """Exact law of DSBD's ordered final beams (every draft draw, accept/reject branch and
    extra draw of the whole run enumerated) equals beam sampling's, to 1e-9."""
    oracle, draft = _markov_pair(vocab, seed)
    cfg = DSBDConfig(width=width, draft_width=draft_width, gamma=gamma, threshold=threshold,
                     w_min=1, dynamic=dynamic)
    widths_seen: set = set()

    def run(source: _Replay) -> tuple:
        res = dsbd_generate(oracle, draft, PROMPT, steps, source, cfg)
        widths_seen.update(res.stats["widths"])
        return tuple(res.seqs)

    law = exact_law(run)
    rule = dsbd_width_rule(draft, len(PROMPT), width, draft_width, threshold, 1) if dynamic else None
    reference = exact_law(lambda s: tuple(beam_sample(oracle, PROMPT, width, steps, s, rule).seqs))
    assert abs(sum(law.values()) - 1.0) < 1e-12
    assert max_gap(law, reference) < 1e-9
    if dynamic:
        assert widths_seen == {1, 2}, widths_seen  # the rule really varies the width here
        closed = closed_form_beam_law(oracle, PROMPT, steps, lambda b: rule(b, _p_beam(oracle, b)))
        assert max_gap(as_multisets(reference), closed) < 1e-9


SCHEDULED_RUNS = [  # vocab, seed, width, gamma, dynamic, memory_mode, per-round gammas, catch-up nodes
    (2, 1, 2, 2, False, False, (0, 2, 0), 64),  # the draft lags one step, then drafts
    (2, 2, 2, 2, False, False, (0, 0, 1), 2),  # a lag of two steps caught up one per pass
    (2, 4, 2, 1, True, False, (0, 1, 0), 64),  # dynamic width: a gamma-0 round still scores
    (2, 1, 2, 2, False, True, (0, 0, 1, 0), 4),  # memory mode: one beam per round, lagging
]


@pytest.mark.parametrize("vocab,seed,width,gamma,dynamic,memory_mode,schedule,nodes", SCHEDULED_RUNS)
def test_dsbd_rounds_of_any_gamma_keep_the_law(monkeypatch, vocab, seed, width, gamma, dynamic, memory_mode,
                                               schedule, nodes) -> None:
    """Rounds that draft any number of layers, 0 (beam sampling itself, the draft left behind
    with a fixed width) included, chain into beam sampling's exact law (not checked in memory
    mode, whose law depends on where rounds end), and the draft's catch-up gives the beams their
    true draft scores."""
    monkeypatch.setattr(core, "CATCH_UP_NODES", nodes)
    oracle, draft = _markov_pair(vocab, seed)
    cfg = DSBDConfig(width=width, draft_width=2, gamma=gamma, threshold=0.5, w_min=1, dynamic=dynamic,
                     memory_mode=memory_mode)
    steps = len(schedule)  # the last round is cut to the layers left
    start = len(PROMPT)

    def run(source: _Replay, gammas=schedule) -> tuple:
        r = DSBDRun(oracle, draft, PROMPT, steps, source, cfg)
        for g in gammas:
            if r.finished:
                break
            r.step(g)
            if r.synced is None:  # the draft is level with the beams: their scores are its own
                want = draft_log_scores(draft, r.beams.seqs, start)
                assert torch.allclose(r.beams.log_q, want, atol=1e-12), (r.beams.log_q, want)
        while not r.finished:
            r.step(0)
        return tuple(r.beams.seqs)

    law = exact_law(run)
    assert abs(sum(law.values()) - 1.0) < 1e-12
    if memory_mode:  # the paper's approximation: its law depends on where rounds end
        return
    rule = dsbd_width_rule(draft, start, width, cfg.draft_width, cfg.threshold, 1) if dynamic else None
    reference = exact_law(lambda s: tuple(beam_sample(oracle, PROMPT, width, steps, s, rule).seqs))
    assert max_gap(law, reference) < 1e-9


def test_dsbd_step_refuses_a_gamma_out_of_range() -> None:
    oracle, draft = _markov_pair(2, 1)
    r = DSBDRun(oracle, draft, PROMPT, 4, torch.Generator().manual_seed(0), DSBDConfig(width=2, gamma=2))
    for bad in (-1, 3, 1.0, True):
        with pytest.raises(ValueError, match="gamma must be an integer in"):
            r.step(bad)


def _p_beam(lm: MarkovLM, beams: tuple) -> torch.Tensor:
    log_p = torch.tensor([lm.log_prob(b, len(PROMPT)) for b in beams], dtype=F64)
    return beam_joint(log_p, lm.probs(list(beams)))


# --------------------------------------------------------------------------------------------
# Acceptance 2: Monte Carlo, DSBD with dynamic width against beam sampling's exact law
# --------------------------------------------------------------------------------------------
def _null_tv_quantile(law: dict, n: int, reps: int, quantile: float, seed: int) -> float:
    """The ``quantile`` of the TV distance between the empirical law of n exact draws and law."""
    probs = torch.tensor(list(law.values()), dtype=F64)
    g = torch.Generator().manual_seed(seed)
    draws = torch.multinomial(probs.expand(reps, -1), n, replacement=True, generator=g)  # (reps, n)
    ones = torch.ones_like(draws, dtype=F64)
    counts = torch.zeros(reps, probs.numel(), dtype=F64).scatter_add_(1, draws, ones)
    tvs = 0.5 * (counts / n - probs).abs().sum(1)
    return float(torch.quantile(tvs, quantile))


def test_dsbd_monte_carlo_matches_beam_sampling() -> None:
    vocab, width, steps, n = 3, 2, 3, 2500
    oracle, draft = _markov_pair(vocab, 8)
    cfg = DSBDConfig(width=width, draft_width=3, gamma=2, threshold=0.8, w_min=1, dynamic=True)
    rule = dsbd_width_rule(draft, len(PROMPT), width, cfg.draft_width, cfg.threshold, cfg.w_min)
    exact = closed_form_beam_law(oracle, PROMPT, steps, lambda b: rule(b, _p_beam(oracle, b)))
    g = torch.Generator().manual_seed(1234)
    samples, widths = [], Counter()
    for _ in range(4 * n):
        res = dsbd_generate(oracle, draft, PROMPT, steps, g, cfg)
        samples.append(tuple(sorted(res.seqs)))
        widths.update(res.stats["widths"])
    assert widths[1] > 0 and widths[2] > 0
    for size in (n, 4 * n):
        empirical = {k: c / size for k, c in Counter(samples[:size]).items()}
        dist, bound = tv(empirical, exact), _null_tv_quantile(exact, size, 1000, 0.999, size)
        print(f"N={size}: TV(DSBD, exact beam sampling)={dist:.4f}, null 99.9% quantile={bound:.4f}")
        assert dist <= bound


# --------------------------------------------------------------------------------------------
# Acceptance 3: dynamic width against brute force
# --------------------------------------------------------------------------------------------
def brute_force_counts(p: list[float], q: list[float], m: int) -> list[float]:
    """P(exactly k of m accepted) by walking every draft value and accept/reject branch of the
    sequential rule (no early stop), in plain Python."""
    out = [0.0] * (m + 1)

    def walk(p_cur: list[float], left: int, accepted: int, prob: float) -> None:
        if left == 0:
            out[accepted] += prob
            return
        rest = [max(a - b, 0.0) for a, b in zip(p_cur, q)]
        total = sum(rest)
        rejected = [r / total for r in rest] if total > 0 else p_cur
        for c, q_c in enumerate(q):
            if q_c > 0:
                a = min(1.0, p_cur[c] / q_c)
                if a > 0:
                    walk(p, left - 1, accepted + 1, prob * q_c * a)
                if a < 1:
                    walk(rejected, left - 1, accepted, prob * q_c * (1 - a))

    walk(p, m, 0, 1.0)
    return out


WIDTH_CASES = [(n_beams, vocab, m, seed) for (n_beams, vocab) in [(1, 4), (2, 2), (2, 3)]
               for m in (1, 2, 3, 4) for seed in range(2)]


@pytest.mark.parametrize("n_beams,vocab,m,seed", WIDTH_CASES)
def test_prob_at_least_matches_brute_force(n_beams: int, vocab: int, m: int, seed: int) -> None:
    p, q = random_layer(n_beams, vocab, seed + 10)
    counts = brute_force_counts(p.tolist(), q.tolist(), m)
    at_least = [sum(counts[k:]) for k in range(m + 1)]
    fast = prob_at_least(acceptance_alphas(p, q, m), m).tolist()
    assert max(abs(a - b) for a, b in zip(fast, at_least)) < 1e-12
    for t in (0.1, 0.3, 0.5, 0.7, 0.9):
        brute = max([k for k in range(1, m + 1) if at_least[k] >= t], default=0)
        for w_min, cap in ((1, m), (2, 8), (1, 2)):
            assert dynamic_width(p, q, m, t, w_min, cap) == min(cap, max(w_min, brute))


@pytest.mark.parametrize("seed", range(3))
def test_prob_at_least_is_the_stop_probability_of_verify_drafts(seed: int) -> None:
    """P(>= K of m) is the probability that the real verifier reaches K acceptances."""
    p, q = random_layer(2, 3, seed + 20)
    m = 3
    at_least = prob_at_least(acceptance_alphas(p, q, m), m)
    for k in range(1, m + 1):
        done = exact_law(lambda s: len(verify_drafts(p, q, s.categorical(q, m), k, s).accepted) == k)
        assert abs(done.get(True, 0.0) - float(at_least[k])) < 1e-12


def test_residual_and_alphas_edge_cases() -> None:
    p = torch.tensor([0.25, 0.75], dtype=F64)
    assert torch.equal(residual(p, p), p)  # no mass left: rejection impossible, p returned
    assert acceptance_alphas(p, p, 3)[0] == 1.0
    assert prob_at_least(acceptance_alphas(p, p, 3), 3).tolist() == [1.0, 1.0, 1.0, 1.0]
    disjoint = torch.tensor([0.0, 1.0], dtype=F64), torch.tensor([1.0, 0.0], dtype=F64)
    assert dynamic_width(*disjoint, 3, 0.7, 2, 4) == 2  # nothing accepted: w_min


# --------------------------------------------------------------------------------------------
# Generation loop: modes, stats, errors
# --------------------------------------------------------------------------------------------
def test_memory_mode_feeds_one_beam_per_round() -> None:
    oracle, draft = _markov_pair(4, 3)
    cfg = DSBDConfig(width=3, draft_width=3, gamma=2, dynamic=False, memory_mode=True)
    res = dsbd_generate(oracle, draft, (1, 2), 7, torch.Generator().manual_seed(0), cfg)
    stats = res.stats
    assert stats["input_beams"] == [1] * stats["rounds"]
    assert stats["oracle_calls"] == stats["rounds"] == oracle.calls
    assert len(stats["widths"]) == 7 and all(len(s) == 9 for s in res.seqs)
    assert res.best in res.seqs and len(res.seqs) == 3


def test_same_generator_seed_same_output() -> None:
    oracle, draft = _markov_pair(4, 4)
    runs = [dsbd_generate(oracle, draft, PROMPT, 6, torch.Generator().manual_seed(9)) for _ in range(2)]
    assert runs[0].seqs == runs[1].seqs and runs[0].stats == runs[1].stats


@pytest.mark.parametrize("kwargs,match", [
    ({"width": 0}, "width"), ({"gamma": 0}, "gamma"), ({"threshold": 1.5}, "threshold"),
    ({"width": 2, "w_min": 3}, "w_min"), ({"draft_width": 0}, "draft_width"),
])
def test_bad_config_raises(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        DSBDConfig(**kwargs)


def test_bad_run_arguments_raise() -> None:
    oracle, draft = _markov_pair(3, 5)
    with pytest.raises(ValueError, match="prompt"):
        dsbd_generate(oracle, draft, (), 2, torch.Generator())
    with pytest.raises(ValueError, match="steps"):
        dsbd_generate(oracle, draft, PROMPT, 0, torch.Generator())
