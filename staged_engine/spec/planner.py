"""Each round, the tree worth verifying: expected tokens against measured seconds.

Two decisions, at two time scales:

- Whether to draft at all (``Stints``): drafting and plain steps take turns in blocks of rounds
  and are compared on the wall clock, always in adjacent blocks (a machine's speed drifts by tens
  of percent over seconds). The faster plays for stints that double while it stays faster; the
  other is checked one block per stint. A model of costs can be wrong; the clock cannot.
- Within a drafted round, how far to draft and what to verify (``RoundPlanner``): time is priced
  at the generation's running throughput, lambda tokens per second. A drafted node n is verified
  when its chance of acceptance A(n) (the product of calibrated chances along its path) exceeds
  lambda times what it adds to the oracle's pass; another draft pass runs when the acceptance it
  can add (frontier nodes' A times the rate at which the draft's best child is accepted) exceeds
  lambda times the pass's cost plus the nodes it adds.

Costs come from the measured ``CostProfile`` of each model (``spec.cost``: the shape of a pass's
time against node count and context) and from ``RoundCost``, a regression of every drafted
round's wall time on those profile figures, the number of draft passes and a constant: in place,
a pass costs what the profile says times what the other model's pass left in the caches, plus
Python. Chances of acceptance come from ``Acceptance``: the draft's own probability of a node
under the engine's sampling rule (with sampling, the softmax of the perturbed scores: with the
shared Gumbel noise, the draft's estimate that the oracle's noisy argmax is this token),
calibrated online per confidence bin by what the oracle accepted.

What is learned (``PlannerMemory``) outlives a generation: the engine keeps one per strategy and
sampling rule, so the second request starts where the first ended. Which nodes are verified never
changes the output: only the oracle decides what is emitted.
"""
from __future__ import annotations

import math

import numpy as np

from staged_engine.spec.cost import CostProfile
from staged_engine.spec.tree import Tree

_BINS = 10


class Acceptance:
    """P(oracle accepts a node | its parent was accepted), from the draft's probability r of the
    node, in ``_BINS`` bins of r. Each bin starts at a prior of r itself (weight ``prior``
    observations) and follows what the oracle did, with old observations decaying."""

    def __init__(self, prior: float = 4.0, decay: float = 0.998) -> None:
        self.decay = decay
        centers = [(i + 0.5) / _BINS for i in range(_BINS)]
        self.accepted = [prior * c for c in centers]
        self.offered = [prior] * _BINS
        self.top_accepted, self.top_offered = 2.0, 4.0  # the draft's best child of an accepted node

    @staticmethod
    def _bin(r: float) -> int:
        return min(_BINS - 1, max(0, int(r * _BINS)))

    def p(self, r: float) -> float:
        b = self._bin(r)
        return self.accepted[b] / self.offered[b]

    def top_rate(self) -> float:
        """How often the draft's best child of an accepted node is accepted."""
        return self.top_accepted / self.top_offered

    def observe(self, r: float, accepted: bool, top: bool) -> None:
        b = self._bin(r)
        self.accepted[b] = self.decay * self.accepted[b] + accepted
        self.offered[b] = self.decay * self.offered[b] + 1.0
        if top:
            d = 0.98
            self.top_accepted = d * self.top_accepted + accepted
            self.top_offered = d * self.top_offered + 1.0

    def table(self) -> list[dict]:
        return [{"r": f"{i / _BINS:.1f}-{(i + 1) / _BINS:.1f}", "p_accept": round(self.accepted[i] / self.offered[i], 3),
                 "weight": round(self.offered[i], 1)} for i in range(_BINS)]


class _Ratio:
    """A running ratio of two decayed sums (measured / predicted, tokens / seconds)."""

    def __init__(self, num: float, den: float, decay: float) -> None:
        self.num, self.den, self.decay = num, den, decay

    def add(self, num: float, den: float) -> None:
        self.num = self.decay * self.num + num
        self.den = self.decay * self.den + den

    @property
    def value(self) -> float:
        return self.num / self.den if self.den > 0 else 0.0


class RoundCost:
    """Seconds of a drafted round, in place: a ridge regression of the measured wall time on
    features the profiles predict,

        seconds = c . (t_oracle(1), 1, passes, sum of t_draft(rows) over passes,
                       t_oracle(nodes) - t_oracle(1)),

    refit every ``every`` rounds with old rounds decaying, and a prior of c = (1, 50 us, 50 us,
    1, 1) (the profiles are right and Python costs 50 us a round and a pass) worth ``prior``
    rounds. Rounds are buffered as plain floats: the per-round cost is an append."""

    PRIOR = np.array([1.0, 5e-5, 5e-5, 1.0, 1.0])
    SCALE = np.array([4e-4, 1.0, 2.0, 1e-4, 1e-4])  # typical feature sizes, for the ridge
    LOW = np.array([0.2, -1e-3, 0.0, 0.2, 0.1])
    HIGH = np.array([5.0, 1e-2, 1e-2, 10.0, 5.0])

    def __init__(self, decay: float = 0.98, prior: float = 3.0, every: int = 8) -> None:
        self.decay, self.every = decay, every
        self.ridge = np.diag(prior * self.SCALE ** 2)
        self.a = self.ridge.copy()
        self.b = self.ridge @ self.PRIOR
        self.coef = [float(c) for c in self.PRIOR]
        self.rows: list[tuple[list[float], float]] = []

    def predict(self, x: list[float]) -> float:
        c = self.coef
        return c[0] * x[0] + c[1] * x[1] + c[2] * x[2] + c[3] * x[3] + c[4] * x[4]

    def add(self, x: list[float], seconds: float) -> None:
        self.rows.append((x, seconds))
        if len(self.rows) < self.every:
            return
        xs = np.array([r[0] for r in self.rows])
        ys = np.array([r[1] for r in self.rows])
        w = self.decay ** np.arange(len(self.rows) - 1, -1, -1)  # the newest weighs 1
        keep = self.decay ** len(self.rows)
        self.rows = []
        # Old evidence decays, the prior's ridge stays: A = keep A + (1 - keep) R + X' W X.
        self.a = keep * self.a + (1.0 - keep) * self.ridge + (xs * w[:, None]).T @ xs
        self.b = keep * self.b + (1.0 - keep) * (self.ridge @ self.PRIOR) + (xs * w[:, None]).T @ ys
        try:
            coef = np.linalg.solve(self.a, self.b)
        except np.linalg.LinAlgError:
            return
        self.coef = [float(c) for c in np.clip(coef, self.LOW, self.HIGH)]


class PlannerMemory:
    """What the planner learns about this machine, these models, this sampling rule and this
    kind of text; shared by the generations of one engine with one strategy and rule."""

    def __init__(self) -> None:
        self.acceptance = Acceptance()
        self.cost = RoundCost()
        self.rate = _Ratio(0.0, 0.0, 0.95)  # tokens / seconds over recent rounds
        self.stints = Stints()


class Stints:
    """Drafting or plain steps, chosen by the tokens per second each delivered here.

    Rounds run in blocks of ``block`` rounds of one arm (0: plain steps, 1: drafting), each
    timed by the wall clock, everything included (a model of costs can be wrong, the clock
    cannot). A machine's speed drifts by tens of percent over seconds, so arms are compared only
    in adjacent blocks: every time a block follows a block of the other arm, log(drafting rate /
    plain rate) of the pair updates a running figure, ``advantage``. The arm it favours plays a
    stint of ``stint`` blocks; then the other arm plays one block and the favoured one another
    (two fresh pairs). If the advantage has changed sign the arms swap, else the stint doubles
    (up to ``max_stint``): when drafting does not pay here it costs about two blocks in every
    ``max_stint``, and when it does, plain steps cost as little.
    """

    def __init__(self, block: int = 16, first_stint: int = 2, max_stint: int = 32) -> None:
        self.block, self.first_stint, self.max_stint = block, first_stint, max_stint
        self.advantage = 0.0  # running log(drafting / plain tokens per second) over adjacent pairs
        self.pairs = 0
        self.last = [0.0, 0.0]  # the latest block rate of each arm
        self.prev_arm = -1  # the arm of the block before the current one
        self.plan = [1, 0, 1]  # arms of the next blocks: the first two comparisons
        self.arm = self.plan.pop(0)
        self.stint = first_stint
        self.favoured: int | None = None  # the arm the last plan favoured
        self.rounds_left = block
        self.tokens = self.seconds = 0.0  # of the current block

    def record(self, tokens: int, seconds: float, rounds: int = 1) -> None:
        self.tokens += tokens
        self.seconds += seconds
        self.rounds_left -= rounds
        if self.rounds_left > 0:
            return
        rate = self.tokens / max(self.seconds, 1e-9)
        self.tokens = self.seconds = 0.0
        self.rounds_left = self.block
        self.last[self.arm] = rate
        if self.prev_arm == 1 - self.arm and min(self.last) > 0:
            ratio = math.log(self.last[1] / self.last[0])
            self.advantage = ratio if self.pairs == 0 else 0.7 * self.advantage + 0.3 * ratio
            self.pairs += 1
        self.prev_arm = self.arm
        if not self.plan:
            self._schedule(1 if self.advantage >= 0 else 0)
        self.arm = self.plan.pop(0)

    def _schedule(self, favoured: int) -> None:
        """A plan ran out: a stint of the favoured arm, then a check of the other (one block of
        it and one of the favoured arm, two adjacent pairs)."""
        if self.favoured is not None:
            self.stint = self.first_stint if favoured != self.favoured else min(2 * self.stint, self.max_stint)
        self.favoured = favoured
        self.plan = [favoured] * self.stint + [1 - favoured, favoured]

def _clip(measured: float, predicted: float) -> float:
    """A measurement as evidence: within [1/4, 4] of its prediction (a page fault, a scheduler
    hiccup or a first call must not skew a running figure for dozens of rounds)."""
    return min(max(measured, 0.25 * predicted), 4.0 * predicted)


class RoundPlanner:
    """Plans the rounds of one generation of a speculative decoder (see the module docstring)."""

    def __init__(self, oracle: CostProfile, draft: CostProfile, memory: PlannerMemory | None = None) -> None:
        self.oracle_cost, self.draft_cost = oracle, draft
        self.m = memory if memory is not None else PlannerMemory()
        self.acceptance = self.m.acceptance
        self.context = -1
        self._set_context(0)
        self.drafted_rounds = self.plain_rounds = 0
        self.pass_rows: list[int] = []  # rows of each draft pass of the round being built

    # ------------------------------------------------------------- costs
    def _set_context(self, context: int) -> None:
        """Costs are read at the round's context, in steps of 32 tokens (memoised per step)."""
        context = context // 32 * 32
        if context != self.context:
            self.context = context
            self._oracle_at: dict[int, float] = {}
            self._draft_at: dict[int, float] = {}

    def _profile_oracle(self, n: int) -> float:
        t = self._oracle_at.get(n)
        if t is None:
            t = self._oracle_at[n] = self.oracle_cost.time(n, self.context)
        return t

    def _profile_draft(self, n: int) -> float:
        t = self._draft_at.get(n)
        if t is None:
            t = self._draft_at[n] = self.draft_cost.time(n, self.context)
        return t

    def node_cost(self, have: int, more: int) -> float:
        """Seconds ``more`` nodes add to an oracle pass over ``have`` nodes, in place."""
        c = self.m.cost.coef
        return c[4] * (self._profile_oracle(have + more) - self._profile_oracle(have))

    def pass_cost(self, rows: int) -> float:
        """Seconds of one more draft pass over ``rows`` rows, in place (Python included)."""
        c = self.m.cost.coef
        return max(c[2] + c[3] * self._profile_draft(rows), 0.0)

    def round_seconds(self, passes: list[int], nodes: int) -> float:
        """Predicted seconds of a drafted round with these draft passes and oracle nodes."""
        return self.m.cost.predict(self._features(passes, nodes))

    def _features(self, passes: list[int], nodes: int) -> list[float]:
        base = self._profile_oracle(1)
        return [base, 1.0, float(len(passes)), sum(self._profile_draft(r) for r in passes),
                self._profile_oracle(nodes) - base]

    def price(self) -> float:
        """lambda: tokens per second the generation is making (before any round: a plain step's)."""
        rate = self.m.rate
        return rate.value if rate.den > 0 else 1.0 / (self._profile_oracle(1) + 5e-5)

    # ------------------------------------------------------------- decisions
    def start_round(self, context: int) -> bool:
        """Whether this round drafts (else it is a plain oracle step): what ``Stints`` says."""
        self._set_context(context)
        self.pass_rows = []
        return self.m.stints.arm == 1

    def drafting(self) -> bool:
        """Whether the coming round will draft (what ``start_round`` will say)."""
        return self.m.stints.arm == 1

    def plain_steps(self) -> int:
        """How many plain steps may run back to back now (the rest of the current block)."""
        return self.m.stints.rounds_left

    def node_values(self, tree: Tree, logr: list[float]) -> list[float]:
        """A(n) for every node of ``tree`` (root 1.0), ``logr[n]`` the draft's log probability of
        node n given its parent."""
        value = [1.0] * len(tree)
        p = self.acceptance.p
        parents = tree.parents
        for n in range(1, len(tree)):
            value[n] = value[parents[n]] * p(math.exp(logr[n]))
        return value

    def another_pass(self, frontier_values: list[float], rows: int, verified: int) -> bool:
        """Whether a draft pass expanding nodes of these values (best first) over ``rows`` rows
        is worth its cost at the current price, when ``verified`` nodes besides the root would
        be verified without it: the pass must pay for itself and for the nodes it adds to the
        oracle's pass."""
        if not frontier_values:
            return False
        gain = self.acceptance.top_rate() * sum(frontier_values)
        cost = self.pass_cost(rows) + self.node_cost(1 + verified, len(frontier_values))
        return gain > self.price() * cost

    def select(self, tree: Tree, value: list[float], budget: int) -> list[int]:
        """Nodes to verify, root first in index order: the best-valued nodes (prefix-closed, as a
        child never outvalues its parent) while each pays for its share of the oracle's pass."""
        order = sorted(range(1, len(tree)), key=lambda n: (-value[n], n))
        lam = self.price()
        best_k, best_net, gain = 0, 0.0, 0.0
        for k, n in enumerate(order[:budget - 1], start=1):
            gain += value[n]
            net = gain - lam * self.node_cost(1, k)
            if net > best_net:
                best_k, best_net = k, net
        return [0] + sorted(order[:best_k])

    # ------------------------------------------------------------- after the round
    def note_pass(self, rows: int) -> None:
        """A draft pass over ``rows`` rows is about to run."""
        self.pass_rows.append(rows)

    @property
    def passes(self) -> int:
        return len(self.pass_rows)

    def observe_steps(self, steps: int, seconds: float) -> None:
        """``steps`` plain steps took ``seconds``."""
        m = self.m
        self.plain_rounds += steps
        m.rate.add(steps, seconds)
        m.stints.record(steps, seconds, steps)

    def observe(self, tree: Tree, logr: list[float] | None, path: list[int], emitted: int, seconds: float) -> None:
        """A drafted round: the verified tree (a lone root when nothing was worth verifying), the
        accepted path, the tokens emitted and its wall seconds."""
        m = self.m
        self.drafted_rounds += 1
        x = self._features(self.pass_rows, len(tree))
        seconds = _clip(seconds, m.cost.predict(x))
        m.cost.add(x, seconds)
        m.rate.add(emitted, seconds)
        m.stints.record(emitted, seconds)
        if len(tree) == 1:
            return
        on_path = set(path)
        children = tree.children
        for n in path:  # the oracle chose among the children of every node of the path
            kids = children[n]
            if not kids:
                continue
            top = max(kids.values(), key=lambda c: (logr[c], -c))
            for c in kids.values():
                self.acceptance.observe(math.exp(logr[c]), c in on_path, top=c == top)

    def summary(self) -> dict:
        m, st = self.m, self.m.stints
        c = m.cost.coef
        return {"drafted_rounds": self.drafted_rounds, "plain_rounds": self.plain_rounds,
                "drafting_advantage": round(math.exp(st.advantage), 3),  # drafting / plain tokens per s
                "stint_blocks": st.stint, "tokens_per_s": round(m.rate.value, 1),
                "top_child_acceptance": round(self.acceptance.top_rate(), 3),
                "round_cost": {"oracle_scale": round(float(c[0]), 3), "round_overhead_ms": round(1e3 * float(c[1]), 4),
                               "pass_overhead_ms": round(1e3 * float(c[2]), 4), "draft_scale": round(float(c[3]), 3),
                               "node_scale": round(float(c[4]), 3)},
                "acceptance": self.acceptance.table()}
