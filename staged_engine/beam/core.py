"""Dynamic-width speculative beam decoding (DSBD): the model-agnostic core.

ALGORITHMS.md sec. 9 (Qin et al., AAAI 2025, arXiv 2409.16560). Everything here works on float64
probability tensors and on an abstract ``BeamLM`` (token prefixes -> processed next-token
distributions); the engine's models and KV caches plug in behind that interface.

Terms. A *layer* holds W beams b_0..b_{W-1} (token tuples, duplicates allowed: a beam is a
*slot*, not a set element). Its candidate space is the W x V pairs (slot i, token v), flattened as
``c = i * V + v``. ``p_beam(c) ∝ S_p(b_i) p(v | b_i)`` where S_p is the product of the oracle's
processed probabilities along the generated part of b_i (carried as a log-score); ``q_beam`` is the
same with the draft's S_q and q. One beam-sampling step draws W candidates i.i.d. from p_beam.

Verification of one layer (``verify_layer``). The drafted candidates arrive in draw order; two
draws of the same (slot, token) are two entries, each tested on its own, and an accepted entry is
its own slot in the next layer (with its own drafted children). Starting from p_cur = p_beam,
entry c is accepted with probability min(1, p_cur(c) / q_beam(c)); a rejection sets
p_cur <- norm(max(p_cur - q_beam, 0)), an acceptance resets p_cur <- p_beam. After W accepted
entries the rest are ignored. With k < W accepted, one more candidate comes from p_cur and the
other W - k - 1 from p_beam. The output is ordered: accepted entries in acceptance order, then
the extra draws.

Why the output is exactly W i.i.d. draws from p_beam. Given i.i.d. drafts x_1, x_2, ... ~ q_beam,
the run of tests between two acceptances is the multi-draft rejection rule (Leviathan's rule with
target p_j and proposal q, whose residual is p_{j+1}); with any number of drafts left, including
none (then the draw from p_cur finishes it), it returns one sample of p_beam. The drafts it has not
touched are still i.i.d. q_beam and independent of everything so far, so the next output is a fresh
sample of p_beam, independent of the earlier ones. Hence output_1, ..., output_W are i.i.d. p_beam.

Forest. The draft's beam sampling (width W_S, gamma steps) gives layer l+1's drafts i.i.d. from
q over *all* W_S drafted slots of layer l. Verification keeps only the drafts whose parent slot was
accepted ("descendants of rejected candidates are rejected": skipped, they neither count as a
rejection nor change p_cur). Given layer l's drafts and its accepted slots A, the kept drafts are
i.i.d. from q restricted to A and renormalised, which is exactly ``q_beam`` over the layer A (with
the draft's scores S_q), and their number does not depend on their values. So every layer of a
round is an exact beam-sampling step from the previous layer's output, and the rounds chain.

Dynamic width. The width of the beams layer L outputs is ``dynamic_width(p_beam, q_beam, ...)``
of that layer's inputs: a deterministic function of the beams (S_q is the draft's score of the
whole generated part, never reset at round boundaries). DSBD with dynamic width therefore has the
law of beam sampling that applies the same width rule at every step (``dsbd_width_rule``); with
``dynamic=False`` it is plain beam sampling of width W. Memory mode (only the best beam of a
round feeds the next round) is the paper's approximation and changes the law.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence, Union

import numpy as np
import torch

from staged_engine.model.backend import _cpu, native_enabled

Prefix = tuple[int, ...]
Tensor = torch.Tensor


# --------------------------------------------------------------------------------------------
# Randomness
# --------------------------------------------------------------------------------------------
class RandomSource(Protocol):
    """Every random choice DSBD makes; tests substitute an exhaustive enumerator."""

    def bernoulli(self, prob: float) -> bool:
        """True with probability ``prob`` in [0, 1]."""
        ...

    def categorical(self, probs: Tensor, num: int) -> list[int]:
        """``num`` i.i.d. indices drawn from ``probs`` ((n,) float64, non-negative, sum 1)."""
        ...


class TorchRandom:
    """A RandomSource over an explicit ``torch.Generator`` (CPU)."""

    def __init__(self, generator: torch.Generator) -> None:
        self.generator = generator

    def bernoulli(self, prob: float) -> bool:
        u = torch.rand((), dtype=torch.float64, generator=self.generator).item()
        return u < prob  # u in [0, 1): prob 1 always accepts, prob 0 never does

    def categorical(self, probs: Tensor, num: int) -> list[int]:
        """Inverse CDF: the first index whose cumulative mass exceeds u * total, u ~ U[0, 1).
        (torch.multinomial draws a single sample by an exponential race over every entry,
        ~20x slower on a joint of 8 x 8192 candidates.)"""
        if num == 0:
            return []
        if _native(probs):  # the same draws in one call (the torch code below is the reference)
            return _cpu.inverse_cdf(probs, torch.rand(num, dtype=probs.dtype, generator=self.generator))
        cdf = torch.cumsum(probs, 0)  # (n,)
        u = torch.rand(num, dtype=cdf.dtype, generator=self.generator)
        index = torch.searchsorted(cdf, u * cdf[-1], right=True)  # zero-mass entries never hit
        if bool((index >= cdf.numel()).any()):  # u * total rounded up to total
            index = index.clamp(max=int(torch.nonzero(probs > 0).max()))
        return index.tolist()


Rng = Union[torch.Generator, RandomSource]


def _native(*tensors: Tensor) -> bool:
    """Whether the extension's float64 beam kernels take these tensors: native paths on
    (``native_enabled``, the backend's switch), CPU, float64. After a forward pass has streamed
    the weights through the caches, each torch operator over a few beams' rows costs 30-50 us of
    dispatch, more than its arithmetic."""
    return native_enabled() and _on_host(*tensors)


def _on_host(*tensors: Tensor) -> bool:
    """CPU float64 tensors: numpy reads them in place, the extension's beam kernels take them."""
    return all(t.device.type == "cpu" and t.dtype == torch.float64 for t in tensors)


def as_random(rng: Rng) -> RandomSource:
    """Wrap a torch.Generator; pass a RandomSource through."""
    return TorchRandom(rng) if isinstance(rng, torch.Generator) else rng


# --------------------------------------------------------------------------------------------
# Distributions over the joint (beam, token) space
# --------------------------------------------------------------------------------------------
def beam_joint(log_scores: Tensor, probs: Tensor) -> Tensor:
    """Joint candidate distribution of a layer.

    log_scores: (W,) float64 log S(b_i) (may hold -inf). probs: (W, V) float64 next-token
    distributions at each beam. Returns (W * V,) float64 ``∝ S(b_i) probs[i, v]`` at index
    ``i * V + v``, normalised; all zeros when no candidate has positive mass.
    On the CPU one native call (``_cpu.beam_joint``) computes it; the torch code below is its
    reference (and the path elsewhere).
    """
    if _native(log_scores, probs):
        return _cpu.beam_joint(log_scores, probs)
    finite = torch.isfinite(log_scores)
    if not bool(finite.any()):
        return torch.zeros(probs.numel(), dtype=torch.float64)
    weights = torch.exp(log_scores - log_scores[finite].max())  # (W,), -inf -> 0
    joint = (weights[:, None] * probs).reshape(-1)  # (W * V,)
    total = joint.sum()
    return joint / total if total > 0 else joint


def residual(p: Tensor, q: Tensor) -> Tensor:
    """norm(max(p - q, 0)) over (n,) float64. When p <= q everywhere a rejection has
    probability zero; ``p`` is returned so callers stay well defined."""
    r = torch.clamp(p - q, min=0.0)
    total = r.sum()
    return r / total if total > 0 else p


class ResidualChain:
    """The residual chain p_1 = p, p_{j+1} = residual(p_j, q) of one layer, without
    materialising it: what a draft is tested against after j - 1 rejections since the last
    acceptance (index ``j - 1`` below), shared by the dynamic width and the verifier.

    Each p_j = max(p - t_j q, 0) / S(t_j) with S(t) = sum_c max(p(c) - t q(c), 0), t_1 = 0 and
    t_{j+1} = t_j + S(t_j): one reduction per level. When S(t_{j+1}) = 0 the chain stays at p_j,
    as ``residual`` returns its input. p, q: (n,) float64 joint distributions.
    """

    def __init__(self, p: Tensor, q: Tensor) -> None:
        self.p, self.q = p, q
        self.t: list[float] = [0.0]  # thresholds t_j
        self.s: list[float] = [float(p.sum())]  # S(t_j); 1 for a normalised p

    def _extend(self, levels: int) -> None:
        while len(self.t) < levels:
            if self.s[-1] <= 0.0:  # p has no mass at all
                self.t.append(self.t[-1])
                self.s.append(self.s[-1])
                continue
            t = self.t[-1] + self.s[-1]
            s = float(torch.clamp(self.p - t * self.q, min=0.0).sum())
            if s > 0.0:
                self.t.append(t)
                self.s.append(s)
            else:  # no mass left: a rejection is impossible, the chain stays put
                self.t.append(self.t[-1])
                self.s.append(self.s[-1])

    def prob(self, level: int, c: int) -> float:
        """p_{level + 1}(c)."""
        self._extend(level + 1)
        if self.s[level] <= 0.0:  # p has no mass at all
            return 0.0
        return max(float(self.p[c]) - self.t[level] * float(self.q[c]), 0.0) / self.s[level]

    def dist(self, level: int) -> Tensor:
        """p_{level + 1} as an (n,) tensor (p itself at level 0)."""
        self._extend(level + 1)
        if level == 0 or self.s[level] <= 0.0:  # p itself (also when p has no mass at all)
            return self.p
        return torch.clamp(self.p - self.t[level] * self.q, min=0.0) / self.s[level]

    def alphas(self, m: int) -> Tensor:
        """(m,) float64: alpha_j = sum_c min(p_j(c), q(c)) = 1 - S(t_j + S(t_j)) / S(t_j)."""
        if self.s[0] <= 0.0:  # p has no mass at all: nothing is ever accepted
            return torch.zeros(m, dtype=torch.float64)
        self._extend(m + 1)
        out = torch.empty(m, dtype=torch.float64)
        for j in range(m):
            moved = self.t[j + 1] != self.t[j]  # t grows by S(t_j) > 0 whenever the chain moves
            out[j] = 1.0 - self.s[j + 1] / self.s[j] if moved else 1.0
        return out


def acceptance_alphas(
    p_beam: Tensor, q_beam: Tensor, m: int, chain: ResidualChain | None = None
) -> Tensor:
    """(m,) float64: alpha_j = sum_c min(p_j(c), q_beam(c)), the probability that a fresh draft
    is accepted after j - 1 rejections since the last acceptance; p_1 = p_beam,
    p_{j+1} = residual(p_j, q_beam). ``chain``: that layer's ResidualChain, if already made."""
    return (chain or ResidualChain(p_beam, q_beam)).alphas(m)


def accepted_count_law(alphas: Tensor, m: int) -> Tensor:
    """(m + 1,) float64: P(m, k), the probability that exactly k of m drafts are accepted
    (testing all m, no early stop).

    Recursion over the index i of the first acceptance (acceptance resets the state):
    P(n, 0) = R_n and P(n, k) = sum_{i=1..n} R_{i-1} alpha_i P(n - i, k - 1), where
    R_j = prod_{l <= j} (1 - alpha_l). ``alphas`` needs at least m entries.
    """
    a = alphas[:m].tolist()
    run = [1.0]  # run[j] = R_j
    for alpha in a:
        run.append(run[-1] * (1.0 - alpha))
    table = [[0.0] * (m + 1) for _ in range(m + 1)]  # table[n][k] = P(n, k)
    for n in range(m + 1):
        table[n][0] = run[n]
        for k in range(1, n + 1):
            table[n][k] = sum(run[i - 1] * a[i - 1] * table[n - i][k - 1] for i in range(1, n + 1))
    return torch.tensor(table[m], dtype=torch.float64)


def prob_at_least(alphas: Tensor, m: int) -> Tensor:
    """(m + 1,) float64: entry K is P(at least K of m drafts accepted), K = 0..m."""
    exact = accepted_count_law(alphas, m)
    return torch.flip(torch.cumsum(torch.flip(exact, [0]), 0), [0])


def dynamic_width(
    p_beam: Tensor, q_beam: Tensor, draft_width: int, threshold: float, w_min: int, max_width: int,
    chain: ResidualChain | None = None,
) -> int:
    """W_L = min(max_width, max(w_min, max{K : P(>= K accepted of draft_width) >= threshold}))
    for the layer whose joint distributions are p_beam, q_beam ((n,) float64)."""
    at_least = prob_at_least(acceptance_alphas(p_beam, q_beam, draft_width, chain), draft_width)
    best = max((k for k in range(1, draft_width + 1) if at_least[k] >= threshold), default=0)
    return min(max_width, max(w_min, best))


# --------------------------------------------------------------------------------------------
# Verification of one layer
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DraftVerdict:
    """accepted: positions into the drafted list, in acceptance order (at most ``width``).
    p_cur: (n,) the distribution the next candidate would come from (p_beam after an
    acceptance or when nothing was drafted, else the residual after the latest rejections)."""

    accepted: list[int]
    p_cur: Tensor


@dataclass(frozen=True)
class LayerVerdict:
    """candidates: the ``width`` output candidates (flat indices): the accepted drafts in
    acceptance order, then the extra draws. accepted: positions into the drafted list.
    completed: whether ``width`` drafts were accepted (no extra draws)."""

    candidates: list[int]
    accepted: list[int]
    completed: bool


def verify_drafts(
    p_beam: Tensor, q_beam: Tensor, drafted: Sequence[int], width: int, rng: Rng,
    chain: ResidualChain | None = None,
) -> DraftVerdict:
    """Test the drafted candidates (flat indices, i.i.d. from q_beam, in draw order) one by one
    with the reset rule until ``width`` are accepted. p_beam, q_beam: (n,) float64; ``chain``:
    their ResidualChain, if already made (p_cur after k rejections in a row is its level k)."""
    source = as_random(rng)
    chain = chain or ResidualChain(p_beam, q_beam)
    accepted: list[int] = []
    level = 0
    for pos, c in enumerate(drafted):
        if len(accepted) == width:
            break
        q_c = float(q_beam[c])
        if q_c <= 0.0:
            raise ValueError(f"drafted candidate {c} has q_beam 0: drafts must come from q_beam")
        if source.bernoulli(min(1.0, chain.prob(level, c) / q_c)):
            accepted.append(pos)
            level = 0
        else:
            level += 1
    return DraftVerdict(accepted, chain.dist(level))


def fill_layer(p_beam: Tensor, p_cur: Tensor, missing: int, rng: Rng) -> list[int]:
    """The extra draws of an incomplete layer: one from p_cur, ``missing - 1`` from p_beam."""
    if missing <= 0:
        return []
    source = as_random(rng)
    return source.categorical(p_cur, 1) + source.categorical(p_beam, missing - 1)


def verify_layer(
    p_beam: Tensor, q_beam: Tensor, drafted: Sequence[int], width: int, rng: Rng,
    chain: ResidualChain | None = None,
) -> LayerVerdict:
    """One verified layer: ``width`` candidates distributed as i.i.d. draws from p_beam.

    p_beam, q_beam: (n,) float64 joint distributions; drafted: flat candidate indices drawn
    i.i.d. from q_beam, in draw order (duplicates are separate entries).
    """
    if width < 1:
        raise ValueError(f"width must be >= 1, got {width}")
    verdict = verify_drafts(p_beam, q_beam, drafted, width, rng, chain)
    chosen = [drafted[pos] for pos in verdict.accepted]
    extra = fill_layer(p_beam, verdict.p_cur, width - len(chosen), rng)
    return LayerVerdict(chosen + extra, verdict.accepted, not extra)


# --------------------------------------------------------------------------------------------
# Beams over an abstract language model
# --------------------------------------------------------------------------------------------
class BeamLM(Protocol):
    """A language model seen through its processed distributions (ALGORITHMS.md sec. 2)."""

    def probs(self, prefixes: Sequence[Prefix]) -> Tensor:
        """(len(prefixes), V) float64: p'(. | prefix) for each prefix (one forward pass)."""
        ...

    def advance(self, beams: "Beams", parents: Sequence[int] | None) -> None:
        """The next step's (or round's) input beams, and for a beam-sampling step the slot each
        came from (None for a DSBD round): a model with a KV cache keeps what they descend from."""
        ...


class CachelessLM:
    """Base of a BeamLM without a cache: nothing to keep between steps."""

    def advance(self, beams: "Beams", parents: Sequence[int] | None) -> None:
        return None


@dataclass(frozen=True)
class Beams:
    """seqs: W full token sequences (prompt included). log_p, log_q: (W,) float64 log-scores of
    the generated tokens under the oracle and the draft (log_q unused by plain beam sampling)."""

    seqs: list[Prefix]
    log_p: Tensor
    log_q: Tensor

    @staticmethod
    def start(prompt: Sequence[int]) -> "Beams":
        zero = torch.zeros(1, dtype=torch.float64)
        return Beams([tuple(prompt)], zero, zero.clone())

    def select(self, slots: Sequence[int]) -> "Beams":
        index = torch.tensor(list(slots), dtype=torch.long)
        return Beams([self.seqs[i] for i in slots], self.log_p[index], self.log_q[index])

    def best(self) -> int:
        """Slot of the highest oracle score; ties go to the smallest token sequence."""
        top = float(self.log_p.max())
        return min((s for s in range(len(self.seqs)) if float(self.log_p[s]) == top),
                   key=lambda s: self.seqs[s])


def extend(beams: Beams, p_cond: Tensor, q_cond: Tensor, candidates: Sequence[int]) -> Beams:
    """The next layer: one beam per candidate (flat index over ``beams``).
    p_cond, q_cond: (W, V) oracle and draft distributions at ``beams``."""
    vocab = p_cond.shape[1]
    pairs = [divmod(c, vocab) for c in candidates]  # (parent slot, token) per candidate
    seqs = [beams.seqs[i] + (v,) for i, v in pairs]
    if _on_host(beams.log_p, beams.log_q, p_cond, q_cond):
        return Beams(seqs, *_extend_scores_host(beams, p_cond, q_cond, candidates))
    parent, token = torch.tensor(pairs, dtype=torch.long).reshape(-1, 2).T  # (W',), (W',)
    log_pc = torch.log(p_cond[parent, token])
    log_qc = log_pc if q_cond is p_cond else torch.log(q_cond[parent, token])  # beam sampling: q is p
    return Beams(seqs, beams.log_p[parent] + log_pc, beams.log_q[parent] + log_qc)


def _extend_scores_host(beams: Beams, p_cond: Tensor, q_cond: Tensor,
                        candidates: Sequence[int]) -> tuple[Tensor, Tensor]:
    """``extend``'s scores of CPU float64 tensors in numpy, on their storage: the same sums as
    its torch code of logs that differ from torch's by a unit in the last place at most (and
    rarely), in a third to a half of its time (a handful of torch operators over a few beams
    costs more in dispatch than in arithmetic: 54 -> 30 us a call at 2 beams over the demo's
    8,192 tokens, 116 -> 39 us at 4). The reference functions run the same code, so engine and
    reference still agree draw for draw."""
    cand = np.asarray(candidates, dtype=np.int64)
    parent = cand // p_cond.shape[1]
    with np.errstate(divide="ignore"):  # a draft's zero mass at a candidate: log q = -inf, as torch
        log_pc = np.log(p_cond.numpy().reshape(-1)[cand])
        log_qc = log_pc if q_cond is p_cond else np.log(q_cond.numpy().reshape(-1)[cand])
    return (torch.from_numpy(beams.log_p.numpy()[parent] + log_pc),
            torch.from_numpy(beams.log_q.numpy()[parent] + log_qc))


WidthRule = Callable[[Sequence[Prefix], Tensor], int]


@dataclass(frozen=True)
class BeamResult:
    """seqs: final beams (prompt included); log_scores: (W,) float64 oracle log-scores of the
    generated tokens; best: the highest-scored beam (the output); stats: counters."""

    seqs: list[Prefix]
    log_scores: Tensor
    best: Prefix
    stats: dict = field(default_factory=dict)


class BeamSampling:
    """Beam sampling, one step (one oracle pass) per ``step()``: W candidates i.i.d. from
    p_beam. ``beam_sample`` runs it to the end; the engine's ``beam`` strategy runs the very
    same object one step per round. ``width_rule(seqs, p_beam)``, if given, picks each step's width."""

    def __init__(self, lm: BeamLM, prompt: Sequence[int], width: int, steps: int, rng: Rng,
                 width_rule: WidthRule | None = None) -> None:
        _check_run(prompt, width, steps)
        self.lm, self.width, self.steps, self.width_rule = lm, width, steps, width_rule
        self.source = as_random(rng)
        self.beams = Beams.start(prompt)
        self.done = 0
        self.widths: list[int] = []

    @property
    def finished(self) -> bool:
        return self.done >= self.steps

    def step(self) -> int:
        """One step; returns the layers it advanced (1)."""
        if self.finished:
            raise ValueError("beam sampling has run all its steps")
        cond = self.lm.probs(self.beams.seqs)  # (W, V)
        p_beam = beam_joint(self.beams.log_p, cond)
        w = self.width if self.width_rule is None else self.width_rule(self.beams.seqs, p_beam)
        self.widths.append(w)
        draws = self.source.categorical(p_beam, w)
        self.beams = extend(self.beams, cond, cond, draws)
        self.done += 1
        if not self.finished:
            self.lm.advance(self.beams, [c // cond.shape[1] for c in draws])
        return 1

    def result(self) -> BeamResult:
        return BeamResult(self.beams.seqs, self.beams.log_p, self.beams.seqs[self.beams.best()],
                          {"oracle_calls": self.done, "widths": self.widths})


def beam_sample(
    lm: BeamLM,
    prompt: Sequence[int],
    width: int,
    steps: int,
    rng: Rng,
    width_rule: WidthRule | None = None,
) -> BeamResult:
    """Reference beam sampling: ``steps`` times draw ``width`` candidates i.i.d. from p_beam."""
    run = BeamSampling(lm, prompt, width, steps, rng, width_rule)
    while not run.finished:
        run.step()
    return run.result()


def draft_log_scores(draft_lm: BeamLM, seqs: Sequence[Prefix], start: int) -> Tensor:
    """(W,) float64: log S_q of the tokens of each sequence from index ``start`` on."""
    out = torch.zeros(len(seqs), dtype=torch.float64)
    for i, seq in enumerate(seqs):
        if len(seq) > start:
            cond = draft_lm.probs([seq[:t] for t in range(start, len(seq))])  # (T, V)
            out[i] = torch.log(cond[torch.arange(cond.shape[0]), list(seq[start:])]).sum()
    return out


def dsbd_width_rule(
    draft_lm: BeamLM, prompt_len: int, width: int, draft_width: int, threshold: float, w_min: int
) -> WidthRule:
    """DSBD's dynamic width as a function of a layer's beams, for ``beam_sample``: the law of
    ``dsbd_generate(dynamic=True)`` equals beam sampling with this rule."""

    def rule(seqs: Sequence[Prefix], p_beam: Tensor) -> int:
        q_beam = beam_joint(draft_log_scores(draft_lm, seqs, prompt_len), draft_lm.probs(seqs))
        return dynamic_width(p_beam, q_beam, draft_width, threshold, w_min, width)

    return rule


# --------------------------------------------------------------------------------------------
# Drafting: the forest
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DraftLayer:
    """One drafted layer, in draw order. parents: (W_S,) slot of each node's parent in the
    previous layer (layer 0 = the round's input beams); tokens: (W_S,); nodes: the nodes as
    Beams (sequences and draft log-scores; log_p is not known yet and holds zeros)."""

    parents: list[int]
    tokens: list[int]
    nodes: Beams


@dataclass(frozen=True)
class Forest:
    """q_cond[l]: (n_l, V) draft distributions at every node of layer l (layer 0 = inputs).
    layers[l - 1]: drafted layer l. Fewer than gamma layers when q_beam lost all mass."""

    q_cond: list[Tensor]
    layers: list[DraftLayer]

    def node_prefixes(self, inputs: Beams) -> list[Prefix]:
        """Every node the oracle evaluates in the round's single pass: inputs, then each layer."""
        return list(inputs.seqs) + [s for layer in self.layers for s in layer.nodes.seqs]


def draft_forest(draft_lm: BeamLM, inputs: Beams, draft_width: int, gamma: int, rng: Rng) -> Forest:
    """The draft's beam sampling (width ``draft_width``, ``gamma`` steps) from the input beams,
    with the draft's own scores; one draft call per layer."""
    source = as_random(rng)
    current, q_conds, layers = inputs, [], []
    for _ in range(gamma):
        q_cond = draft_lm.probs(current.seqs)  # (n_l, V)
        q_conds.append(q_cond)
        q_beam = beam_joint(current.log_q, q_cond)
        if not bool(q_beam.sum() > 0):
            break
        draws = source.categorical(q_beam, draft_width)
        vocab = q_cond.shape[1]
        nodes = extend(current, q_cond, q_cond, draws)
        nodes = Beams(nodes.seqs, torch.zeros_like(nodes.log_q), nodes.log_q)
        layers.append(DraftLayer([c // vocab for c in draws], [c % vocab for c in draws], nodes))
        current = nodes
    return Forest(q_conds, layers)


# --------------------------------------------------------------------------------------------
# One round and the generation loop
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DSBDConfig:
    width: int = 8  # W: beams per layer (the cap when dynamic)
    draft_width: int = 8  # W_S: beams of the draft's beam sampling per layer
    gamma: int = 4  # drafted layers per round
    threshold: float = 0.7  # t: P(>= W_L accepted of W_S) >= t picks W_L
    w_min: int = 1  # smallest dynamic width
    dynamic: bool = True  # False: every layer has exactly ``width`` beams
    memory_mode: bool = False  # only the best beam of a round feeds the next round

    def __post_init__(self) -> None:
        for name in ("width", "draft_width", "gamma", "w_min"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.w_min > self.width:
            raise ValueError(f"w_min must be <= width ({self.width}), got {self.w_min}")
        if not 0.0 <= self.threshold <= 1.0:
            raise ValueError(f"threshold must be in [0, 1], got {self.threshold}")

    def layer_width(self, p_beam: Tensor, q_beam: Tensor, chain: ResidualChain | None = None) -> int:
        if not self.dynamic:
            return self.width
        return dynamic_width(p_beam, q_beam, self.draft_width, self.threshold, self.w_min, self.width,
                             chain)


def _kept_children(layer: DraftLayer, slots: Sequence[int], vocab: int) -> tuple[list[int], list[int]]:
    """Drafts of ``layer`` whose parent slot survived, in draw order: (node ids in the layer,
    flat candidates over the surviving slots). The others descend from rejected candidates."""
    position = {slot: j for j, slot in enumerate(slots)}
    kept, flat = [], []
    for node, (parent, token) in enumerate(zip(layer.parents, layer.tokens)):
        if parent in position:
            kept.append(node)
            flat.append(position[parent] * vocab + token)
    return kept, flat


def _record(stats: dict, width: int, drafted: int, accepted: int) -> None:
    stats["widths"].append(width)
    stats["drafted"].append(drafted)
    stats["accepted"].append(accepted)


def dsbd_round(
    oracle: BeamLM, draft: BeamLM, inputs: Beams, layers_left: int, cfg: DSBDConfig,
    source: RandomSource, stats: dict, gamma: int | None = None,
) -> tuple[Beams, int]:
    """One round: draft a forest of ``gamma`` layers (default ``cfg.gamma``), one oracle pass over
    it, verify layer by layer. Returns the output beams and the number of layers (tokens per
    beam) they advanced. With gamma 0 the round is one beam-sampling step whose draft pass only
    scores the inputs (the width rule's q_beam).

    Engine mapping: ``oracle.probs`` is the single forward pass over every forest node
    (``Forest.node_prefixes``: inputs, then each drafted layer in draw order; a node that repeats
    another's sequence may share its KV row). The last layer's nodes are evaluated too, for the
    bonus layer drawn when every drafted layer passes."""
    gamma = cfg.gamma if gamma is None else gamma
    forest = draft_forest(draft, inputs, cfg.draft_width, min(gamma, layers_left), source)
    stats["draft_calls"] += len(forest.q_cond)
    p_all = oracle.probs(forest.node_prefixes(inputs))  # (n_nodes, V)
    stats["oracle_calls"] += 1
    stats["oracle_rows"] += p_all.shape[0]
    sizes = [len(inputs.seqs)] + [len(layer.parents) for layer in forest.layers]
    p_nodes = list(torch.split(p_all, sizes))  # p_nodes[l]: (n_l, V)
    vocab = p_all.shape[1]

    beams, slots = inputs, list(range(len(inputs.seqs)))
    for depth in range(min(len(forest.layers) + 1, layers_left)):
        index = torch.tensor(slots, dtype=torch.long)
        p_cond = p_nodes[depth][index]  # (W, V)
        if depth < len(forest.q_cond):
            q_cond = forest.q_cond[depth][index]
        else:  # the bonus layer: the draft catches up on the last drafted layer's survivors
            q_cond = draft.probs(beams.seqs)
            stats["draft_calls"] += 1
        p_beam, q_beam = beam_joint(beams.log_p, p_cond), beam_joint(beams.log_q, q_cond)
        chain = ResidualChain(p_beam, q_beam)  # shared by the width rule and the verifier
        width = cfg.layer_width(p_beam, q_beam, chain)
        kept: list[int] = []
        drafted: list[int] = []
        if depth < len(forest.layers):
            kept, drafted = _kept_children(forest.layers[depth], slots, vocab)
        verdict = verify_layer(p_beam, q_beam, drafted, width, source, chain)
        _record(stats, width, len(drafted), len(verdict.accepted))
        beams = extend(beams, p_cond, q_cond, verdict.candidates)
        if not verdict.completed:
            return beams, depth + 1
        slots = [kept[pos] for pos in verdict.accepted]
    return beams, min(len(forest.layers) + 1, layers_left)


# Nodes the draft evaluates per pass when it catches up on beam-sampling steps it skipped.
CATCH_UP_NODES = 64


class DSBDRun:
    """DSBD, one round (one oracle pass) per ``step()``. ``dsbd_generate`` runs it to the end;
    the engine's ``dsbd`` strategy runs the very same object one round per call. stats: rounds,
    oracle_calls (one per round), oracle_rows (forest nodes the oracle evaluated), draft_calls;
    per output layer ``widths``, ``drafted`` (drafts whose parent survived, i.e. the candidates
    open to verification) and ``accepted``; ``input_beams`` per round.

    Each round may draft its own number of layers (``step(gamma)``, at most ``cfg.gamma``): every
    round is an exact beam-sampling step per layer, whatever its gamma, so the rounds chain. A
    round of gamma 0 is beam sampling itself. With a fixed width its draft does not run at all:
    the draft's cache stays where it was, the beams' draft scores are placeholders, and the first
    drafted round after such steps catches the draft up (``_catch_up``: a pass per
    ``CATCH_UP_NODES`` nodes of the beams' new tokens, which also restores their draft scores).
    With a dynamic width the width rule needs the draft's scores, so a gamma-0 round still scores
    its inputs with one draft pass."""

    def __init__(self, oracle: BeamLM, draft: BeamLM, prompt: Sequence[int], steps: int, rng: Rng,
                 cfg: DSBDConfig = DSBDConfig()) -> None:
        _check_run(prompt, cfg.width, steps)
        self.oracle, self.draft, self.steps, self.cfg = oracle, draft, steps, cfg
        self.source = as_random(rng)
        self.beams = Beams.start(prompt)
        self.done = 0
        self.stats: dict = {"rounds": 0, "oracle_calls": 0, "oracle_rows": 0, "draft_calls": 0,
                            "widths": [], "drafted": [], "accepted": [], "input_beams": []}
        self.synced: Beams | None = None  # the draft's beams while it lags (None: it does not)
        self.lag: list[Beams] = []  # every stride-th round input since, for the catch-up
        self.stride = max(1, CATCH_UP_NODES // cfg.width)

    @property
    def finished(self) -> bool:
        return self.done >= self.steps

    def step(self, gamma: int | None = None) -> int:
        """One round of ``gamma`` drafted layers (default and limit ``cfg.gamma``; 0: a step of
        beam sampling); returns the layers (tokens per beam) it advanced."""
        if self.finished:
            raise ValueError("DSBD has run all its steps")
        gamma = self.cfg.gamma if gamma is None else gamma
        if isinstance(gamma, bool) or not isinstance(gamma, int) or not 0 <= gamma <= self.cfg.gamma:
            raise ValueError(f"gamma must be an integer in [0, {self.cfg.gamma}], got {gamma!r}")
        self.stats["rounds"] += 1
        self.stats["input_beams"].append(len(self.beams.seqs))
        parents = None  # each output's input slot, for a step of beam sampling
        if gamma == 0 and not self.cfg.dynamic:
            if self.synced is None:
                self.synced, self.lag = self.beams, []
            beams, parents = self._beam_step()
            advanced = 1
        else:
            if self.synced is not None:
                self._catch_up()
            beams, advanced = dsbd_round(self.oracle, self.draft, self.beams, self.steps - self.done, self.cfg,
                                         self.source, self.stats, gamma)
        self.done += advanced
        if not self.finished:
            if self.cfg.memory_mode:  # the paper's approximation: only the best beam goes on
                beams, parents = beams.select([beams.best()]), None
            self.oracle.advance(beams, parents)
            if self.synced is None:
                self.draft.advance(beams, None)
            elif (len(beams.seqs[0]) - len(self.synced.seqs[0])) % self.stride == 0:
                self.lag.append(beams)
        self.beams = beams
        return advanced

    def _beam_step(self) -> tuple[Beams, list[int]]:
        """A step of beam sampling with the oracle alone (width ``cfg.width``): the new beams and
        the input slot each came from."""
        cond = self.oracle.probs(self.beams.seqs)  # (W, V)
        self.stats["oracle_calls"] += 1
        self.stats["oracle_rows"] += cond.shape[0]
        draws = self.source.categorical(beam_joint(self.beams.log_p, cond), self.cfg.width)
        _record(self.stats, self.cfg.width, 0, 0)
        vocab = cond.shape[1]
        # log_q: a placeholder until the catch-up
        return extend(self.beams, cond, cond, draws), [c // vocab for c in draws]

    def _catch_up(self) -> None:
        """Feed the draft what the beam-sampling steps since ``synced`` added, ``stride`` layers
        per pass, advancing it to each kept round input and then to the current beams, and give
        the beams their draft scores."""
        prev = self.synced
        targets = self.lag if self.lag and self.lag[-1] is self.beams else [*self.lag, self.beams]
        for target in targets:
            start = len(prev.seqs[0])
            score = {s: lq for s, lq in zip(prev.seqs, prev.log_q.tolist())}
            prefixes = list(dict.fromkeys(s[:t] for s in distinct(target.seqs) for t in range(start, len(s))))
            q = self.draft.probs(prefixes)  # (n, V)
            self.stats["draft_calls"] += 1
            row = {p: i for i, p in enumerate(prefixes)}
            log_q = []
            for s in target.seqs:
                at = torch.tensor([row[s[:t]] for t in range(start, len(s))])
                log_q.append(score[s[:start]] + float(torch.log(q[at, list(s[start:])]).sum()))
            target = Beams(target.seqs, target.log_p, torch.tensor(log_q, dtype=torch.float64))
            self.draft.advance(target, None)
            prev = target
        self.beams, self.synced, self.lag = prev, None, []

    def result(self) -> BeamResult:
        return BeamResult(self.beams.seqs, self.beams.log_p, self.beams.seqs[self.beams.best()], self.stats)


def distinct(seqs: Sequence[Prefix]) -> list[Prefix]:
    """The distinct sequences, in first-seen order."""
    return list(dict.fromkeys(seqs))


def dsbd_generate(
    oracle: BeamLM,
    draft: BeamLM,
    prompt: Sequence[int],
    steps: int,
    rng: Rng,
    cfg: DSBDConfig = DSBDConfig(),
) -> BeamResult:
    """DSBD for ``steps`` tokens per beam. Returns the final beams, their oracle log-scores, the
    best beam and ``DSBDRun``'s stats."""
    run = DSBDRun(oracle, draft, prompt, steps, rng, cfg)
    while not run.finished:
        run.step()
    return run.result()


def _check_run(prompt: Sequence[int], width: int, steps: int) -> None:
    if len(prompt) == 0:
        raise ValueError("prompt must hold at least one token")
    if width < 1:
        raise ValueError(f"width must be >= 1, got {width}")
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
