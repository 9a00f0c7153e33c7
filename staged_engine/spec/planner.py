"""Each round, the tree worth verifying: expected tokens against measured seconds.

Two decisions, at two time scales:

- How to run the coming rounds (``Stints``): plain steps, rounds this planner plans, or a fixed
  chain of 1-3 drafted tokens. The ways take turns in blocks of rounds and are compared on the
  wall clock, always in adjacent blocks (a machine's speed drifts by tens of percent over
  seconds). The fastest plays for stints that double while it stays fastest; a challenger is
  checked one block per stint. A model of costs can be wrong; the clock cannot.
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
sampling rule, so the second request starts where the first ended, and the arms' scores outlive
the process (``save_memory``, ``load_memory``), so the next engine on this machine starts from
them (as a prior: ``Stints.restore``). Which nodes are verified never
changes the output: only the oracle decides what is emitted.
"""
from __future__ import annotations

import json
import math
import os
import warnings
from typing import NamedTuple

import numpy as np

from staged_engine.checks import atomic_path
from staged_engine.spec.cost import CostProfile
from staged_engine.spec.tree import Tree

_BINS = 10
_BIN_NAMES = tuple(f"{i / _BINS:.1f}-{(i + 1) / _BINS:.1f}" for i in range(_BINS))


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
        return [{"r": name, "p_accept": round(a / o, 3), "weight": round(o, 1)}
                for name, a, o in zip(_BIN_NAMES, self.accepted, self.offered)]


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


# The ways of running rounds that ``Stints`` compares on the clock: plain steps, the rounds
# ``RoundPlanner`` plans, and the draft's fixed chains of 1-3 tokens; for staged also chains of
# up to 3 tokens from prompt lookup alone (no draft pass: ``ContextLookup``), chains of 2-3
# tokens that come from prompt lookup in the rounds where the context's last 3 tokens were seen
# before and from the draft in the others, and, greedy, plain steps with prompt lookup riding
# along (``LOOKUP_STEPS``, ``Arm.steps``). A planned round of a chain without an inner stage
# (the chain strategy's) runs in one native call (``chain_rule``), and so does the rest of a
# block of a fixed arm's rounds (``_cpu.chain_rounds``, ``_cpu.lookup_steps``). A cost model can
# under- or over-draft, and an n-gram stage can cost more than it saves on some machine: a fixed
# way the clock finds faster here is played instead, and plain steps when nothing drafted pays.
PLAIN, PLANNED = 0, 1
FIXED_DEPTHS = (1, 2, 3)
LOOKUP_DEPTH = 3
# Plain steps with prompt lookup riding along (``Arm.steps``): (depth, least suffix order), up to
# two guesses after a 3-token match. Demo pair, held-out prompts, plain decoding's own text: a
# 3-token suffix had been seen before at 76% of the positions greedy and the token that followed
# it came next 94% of the time, at T 0.8 / top-p 0.95 16% and 66%, at T 1 / top-k 50 4% and 27%.
# A pass over 2-3 rows cost 1.07-1.14x one row (AVX2 Zen 3). Blocks of 16 tokens, alternating in
# one process with plain steps' (24 prompts x 2): greedy 1.27x, top-p 0.985x, top-k 0.94x; of the
# other forms tried, depth 3 after a 2-token match ran 1.34x, 0.92x and 0.87x and one guess after
# a 2-token match 1.19x, 0.97x and 0.92x. Like every arm it plays only where the clock finds it
# faster than plain steps.
LOOKUP_STEPS = ((2, 3),)


class Arm(NamedTuple):
    name: str
    depth: int | None = None  # a fixed chain's or a lookup's depth; None: plain steps or planned rounds
    inner: bool = True  # whether the inner stage (n-gram) proposes
    lookup: bool = False  # the chain comes from prompt lookup, with no draft pass
    # Round by round: prompt lookup's chain when the context's last ContextLookup.ORDER tokens
    # were seen before, else the draft's fixed chain.
    lookup_first: bool = False
    # Plain steps with prompt lookup riding along, a block in one native call (``_cpu.lookup_steps``):
    # each pass also verifies up to ``depth`` tokens that followed the latest earlier occurrence of
    # the context's last 3 (down to ``order``) tokens. No draft pass, no Python between passes.
    steps: bool = False
    order: int = 0


def arms_for(staged: bool, greedy: bool = True) -> tuple[Arm, ...]:
    """The arms of a strategy: plain steps, planned rounds (staged's with the n-gram stage) and
    the draft's fixed chains (the chain strategy's); for staged also prompt lookup's chains and
    the lookup-or-draft chains, and when decoding greedily plain steps with prompt lookup. (Fixed
    chains with the n-gram stage's proposals were arms too: they run on the Python path, and
    every memory kept on the project's machines scored them below the native fixed chain of the
    same depth, so they only cost exploration.)

    Plain steps with prompt lookup are no arm when sampling: there its guesses are rarely kept
    (see LOOKUP_STEPS) and its blocks run within a few percent of plain steps' (0.985x and 0.94x
    where they were timed), closer than the clock tells apart, so it played about as often as
    plain steps and cost a few percent each time: in the e2e bench at a235d93 (AVX2 Zen 3), the
    prompts where it was favoured ran at 0.92x (top-p) and 0.95x (top-k) plain, the others at
    0.99x and 0.97x; greedy, 1.08x against 1.03x for lookup-or-draft's."""
    arms = [Arm("plain"), Arm("planned"), *(Arm(f"fixed_{d}", d, False) for d in FIXED_DEPTHS)]
    if staged:
        arms += [Arm(f"lookup_{LOOKUP_DEPTH}", LOOKUP_DEPTH, False, True)]
        arms += [Arm(f"lookup_or_fixed_{d}", d, False, False, True) for d in (2, 3)]
        if greedy:
            arms += [Arm(f"lookup_steps_{d}", d, False, True, steps=True, order=o) for d, o in LOOKUP_STEPS]
    return tuple(arms)


def dsbd_arms(gamma: int) -> tuple[Arm, ...]:
    """DSBD's arms: rounds of 0 (beam sampling itself, the arm the others are timed against),
    1, 2 and 4 drafted layers, up to the request's ``gamma``, and ``gamma`` itself."""
    depths = sorted({0, *(g for g in (1, 2, 4) if g <= gamma), gamma})
    return tuple(Arm(f"gamma_{g}", g, False) for g in depths)


class PlannerMemory:
    """What the planner learns about this machine, these models, this sampling rule and this
    kind of text; shared by the generations of one engine with one strategy and rule."""

    def __init__(self, arms: tuple[Arm, ...] = arms_for(False)) -> None:
        self.arms = arms
        self.source = "new"  # or "cached": restored from what an earlier process learned here
        self.saved_at = 0.0  # time.monotonic() of the last save_memory
        self.unsaved = False  # learned more since (the engine saves at most every 5 s)
        self.path = ""  # where the engine keeps it
        self.acceptance = Acceptance()
        self.cost = RoundCost()
        self.rate = _Ratio(0.0, 0.0, 0.95)  # tokens / seconds over recent rounds
        # Arms that never run the draft (``Arm.lookup``: prompt lookup's chains and plain steps with
        # lookup) have no draft to go cold, so their blocks are on the clock from their first round.
        self.stints = Stints(len(arms), draftless=tuple(i for i, a in enumerate(arms) if a.lookup))


def load_memory(path: str, arms: tuple[Arm, ...]) -> "PlannerMemory":
    """The memory kept at ``path`` by ``save_memory`` (its ``source`` "cached"), or a new one
    ("new" when there is none, "ignored" with a warning when the file is unreadable or wrong)."""
    memory = PlannerMemory(arms)
    if not os.path.exists(path):
        return memory
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
        if not isinstance(raw, dict) or raw.get("arms") != [a.name for a in arms]:
            raise ValueError("it was kept for other arms")
        memory.stints.restore(raw.get("stints"))
        memory.source = "cached"
    except (OSError, ValueError, TypeError, json.JSONDecodeError) as exc:
        warnings.warn(f"ignoring the planner memory {path} ({exc}); starting afresh", stacklevel=3)
        memory = PlannerMemory(arms)
        memory.source = "ignored"
    return memory


def save_memory(path: str, memory: "PlannerMemory") -> None:
    """Keep what ``memory``'s ``Stints`` learned, so the next process on this machine starts
    from it instead of comparing every arm again (a warning if it cannot be written)."""
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
            json.dump({"arms": [a.name for a in memory.arms], "stints": memory.stints.state()}, f, indent=1)
    except OSError as exc:
        warnings.warn(f"could not keep the planner memory at {path}: {exc}", stacklevel=3)


# Rounds a generation's first call may run, off the clock (``Stints.start_generation``).
GENERATION_WARM = 4
# The weight of each pair in the running estimate of how far pairs stray (``Stints.noise_var``),
# and the most pairs of a restored memory that count as evidence for an arm (``Stints._sure``).
NOISE_WEIGHT = 0.1
KEPT_EVIDENCE = 4


class Stints:
    """Which way to run the coming rounds, chosen by the tokens per second each way delivered.

    Rounds run in blocks of ``block`` rounds of one arm (0 plain steps, 1 planned drafting, then
    fixed ways: ``arms_for``), each block timed by the wall clock, everything included. A
    machine's speed drifts by tens of percent over seconds, so arms are compared only in adjacent
    blocks, and only with plain steps: each time a drafting arm's block and a plain block are
    adjacent, the log ratio of their rates updates that arm's ``score``, its running
    log(rate / plain's rate) (plain's is 0 by definition). The best arm (plain steps unless a
    drafting arm's score clears theirs by 1.5 standard errors: ``_sure``) plays a stint of
    ``stint`` blocks, then a check (``_schedule``): a challenger, chosen by the highest optimistic
    score (score plus a bonus that shrinks as its pairs grow), so an arm far behind is seldom
    checked again; one that beats plain steps but not surely yet is checked again after a first
    stint. If the best arm changed the stint restarts, else it doubles, up to
    ``max_stint`` blocks, while the challenger's optimistic score is within 10% of the best's
    rate; further behind it grows (fourfold when plain steps are favoured) up to twice that within
    20%, four times beyond: a losing arm costs about one block in every
    ``max_stint``, and one that trails far one in every 4 ``max_stint`` (a check also pays the
    draft's catch-up on what plain steps left: the decoder charges each drafted round its
    tokens' share of it, spread over the tokens the generation has left).
    When the best changes between two drafting arms scored within ``tie`` of each other (two
    chain depths of about equal speed trading places on the clock's noise) the stint grows on.
    An arm with no pair yet (a memory kept before its first comparisons were done) is the next
    challenger, after a first stint's worth of the best arm, whatever the stint has grown to.
    After a restore every arm is one, until the first check says whether the memory still holds
    (``_confirm``): if it does, the arms it kept more than ``defer`` behind wait for the usual checks.
    A favoured drafting arm's blocks are also read for their tokens per round (``_watch``): a
    yield that says it has fallen behind plain steps cuts its stint short. A drafting arm's first
    look and a check of a challenger scored more than ``far`` behind run a quarter block
    (``_block_rounds``). The first round of a drafting block after plain steps plays off the
    block's clock: it pays for the switch (a cold draft), not for the arm's rate; the arms that
    run no draft (``draftless``) are on the clock from their first round. A generation's first
    call, of at most ``GENERATION_WARM`` rounds, plays off the clock too, whatever the arm: the
    passes after a prefill or an idle spell run slow for a while (``start_generation``).
    """

    def __init__(self, arms: int = 2 + len(FIXED_DEPTHS), block: int = 16, first_stint: int = 2,
                 max_stint: int = 32, bonus: float = 0.1, tie: float = 0.05, drop: float = 0.1,
                 far: float = 0.2, agree: float = 0.2, defer: float = 0.1,
                 draftless: tuple[int, ...] = (), sure: float = 1.5, noise: float = 0.15) -> None:
        if arms < 2:
            raise ValueError(f"arms must be at least 2 (plain and one drafting arm), got {arms}")
        self.draftless = frozenset(draftless)  # arms that never run the draft: none goes cold
        self.n_arms, self.block, self.first_stint, self.max_stint, self.bonus = arms, block, first_stint, max_stint, bonus
        self.far = far  # a challenger scored this far behind the favoured arm is checked in a short block
        self.tie = tie
        # After a restore: the scores kept, until the first check of an arm compared there says
        # whether they still hold (within ``agree`` in log rate: ``_confirm``); and which arms were.
        # One block's rate is noisy: in the demo's runs on the Zen 1 the first check landed 0.01-0.30
        # from the kept score with nothing changed, while the swings a restore must catch (a chain
        # at 0.7x plain in one hour, 1.3x in the next) are 0.6.
        # Confirmed, the arms kept more than ``defer`` behind the kept best wait for the usual
        # checks: a challenger within 10% may win on the next drift (``_schedule``), one further
        # behind seldom does.
        self.agree, self.defer = agree, defer
        self.kept: list[float] | None = None
        self.kept_compared = [False] * arms
        self.kept_stint = first_stint
        self.deferred = 0  # arms a confirmed memory left to the usual checks
        self.score = [0.0] * arms  # running log(rate / plain rate), from adjacent pairs
        self.pairs = [0] * arms  # adjacent pairs each arm took part in
        # How far one pair's log ratio strays from the arm's score (a running mean square, from
        # the prior ``noise``), and how many standard errors (``sure``) a drafting arm's score
        # must clear to be favoured over plain steps (``_sure``). The arms kept by a restored
        # memory count their kept pairs as evidence too, at most ``KEPT_EVIDENCE`` each.
        self.sure = sure
        self.noise_var = noise * noise
        self.kept_pairs = [0] * arms
        self.last = [0.0] * arms  # the latest block rate of each arm
        self.rounds = [0] * arms
        self.checks = 0
        self.prev_arm = -1  # the arm of the block before the current one
        # The first comparisons: every drafting arm next to a plain block.
        self.plan = [1, 0] + [a for arm in range(2, arms) for a in (arm, 0)][:-1] if arms > 2 else [1, 0, 1]
        self.stint = first_stint
        self.favoured: int | None = None  # the arm the last plan favoured
        self._next_block()  # the first: a drafting arm's first look
        self.tokens = self.seconds = 0.0  # of the current block
        # Tokens per round each arm's blocks yield (a running mean), against which a favoured
        # drafting arm's block is read: what its tokens per round say of its rate, free of the
        # clock's noise (``_watch``).
        self.yields = [0.0] * arms
        self.yield_blocks = [0] * arms
        self.drop = drop
        self.cuts = 0  # stints cut short by a drop in yield

    @property
    def advantage(self) -> float:
        """log(best drafting arm's rate / plain's rate)."""
        return max(self.score[1:])

    def start_generation(self) -> None:
        """A generation starts: its first call, of at most ``GENERATION_WARM`` rounds of whatever
        arm is playing, runs off the clock (``warm_limit``). After a prompt's prefill, or after
        the threads sat idle between requests, the first decode passes run slow and speed up over
        a millisecond or so: the demo oracle's one-row passes after a 133-token prefill took
        0.57, 0.44, 0.37, 0.29, 0.27, 0.24 ms, then 0.22 (after single-step passes, 0.20 from
        the first; after 10 ms idle, 0.91, 0.46, 0.33, ..; AMD EPYC Zen 4). Blocks run across
        generations, so the block a generation starts in was charged its ramp, and the arm next
        to it scored against that: in staged top-p runs a plain block's first call of a
        generation ran 0.339 ms a token against 0.265 for its other calls (medians, 48 and 383
        calls), and in simulation with this ramp an arm at 0.8x plain was scored 0.1 too high in
        log rate, one at 1.25x 0.08 too low. The first four passes hold ~90% of the ramp."""
        self.warming = True
        self.warm_limit = GENERATION_WARM

    def plain_run(self) -> int:
        """Rounds from here to the end of the run of plain blocks the plan holds: the rest of the
        current block (plain steps) and every plain block queued right after it. ``record`` takes
        them in one call and gives each block its share."""
        if self.arm != PLAIN:
            return 0
        n = self.rounds_left
        for arm in self.plan:
            if arm != PLAIN:
                break
            n += self._block_rounds(PLAIN)
        return n

    def record(self, tokens: int, seconds: float, rounds: int = 1) -> None:
        if rounds > self.rounds_left and self.arm == PLAIN and not self.warming:
            # A run of plain blocks in one call (``plain_run``): each block records its share of
            # the run's tokens and seconds, so each is read at the run's mean rate.
            while rounds > 0:
                part = min(rounds, self.rounds_left)
                t, s = tokens * part / rounds, seconds * part / rounds
                tokens, seconds, rounds = tokens - t, seconds - s, rounds - part
                self.record(t, s, part)
            return
        self.rounds_left -= rounds
        self.rounds[self.arm] += rounds
        if self.warming:  # a call off the clock: a cold draft's round (``_next_block``) or a
            # generation's first (``start_generation``). Its rounds count toward the block, so a
            # block a generation starts in is read from fewer rounds (a traced first look of 4
            # rounds from one). Played on top of the block instead, every block read from all of
            # its rounds, cold starts measured level: the first 12 held-out prompts from no
            # memory, staged against plain alternating, 32 runs a mode with both forms alternating
            # in one process, staged/plain 0.943 against 0.942 (T 0.8 / top-p 0.95), 0.920 against
            # 0.916 (T 1 / top-k 50), 0.983 against 0.995 greedy (means; AVX2 Zen 3).
            self.warming = False
            self.warm_rounds += rounds
        else:
            self.tokens += tokens
            self.seconds += seconds
        if self.rounds_left > 0:
            return
        timed = self.block_rounds - self.rounds_left - self.warm_rounds
        rate = self.tokens / max(self.seconds, 1e-9)
        if timed > 0:
            self._watch(self.arm, self.tokens / timed)
        self.tokens = self.seconds = 0.0
        a, b = self.arm, self.prev_arm
        if rate > 0:  # a block with timed rounds (each emits a token)
            self.last[a] = rate
            if b >= 0 and b != a and self.last[b] > 0:
                self._pair(a, b, math.log(rate / self.last[b]))
        self.prev_arm = a
        if not self.plan:
            self._schedule()
        self._next_block()

    def _next_block(self) -> None:
        """Start the plan's next block: its arm, and its rounds (``rounds_left`` of
        ``block_rounds``)."""
        self.arm = self.plan.pop(0)
        self.rounds_left = self.block_rounds = self._block_rounds(self.arm)
        # A drafting block after plain steps (or first of all) starts cold: its first round ran
        # 1.7x the block's later ones per token (greedy and T 1 / top-k 50 alike, demo pair, AVX2
        # Zen 3; after another drafting arm's block, no more than they), the draft's weights
        # having left the caches while only the oracle ran. That is a cost of switching, paid
        # once a stint, not of the arm's rate; in a first look of 4 rounds it took 15% off the
        # arm's rate (4 / 4.7). So the round plays but stays off the block's clock.
        self.warming = self.arm != PLAIN and self.arm not in self.draftless and self.prev_arm in (PLAIN, -1)
        self.warm_limit = 1  # rounds the call off the clock may run
        self.warm_rounds = 0

    def _block_rounds(self, arm: int) -> int:
        """Rounds of the block ``arm`` starts: a whole block for plain steps and for the favoured
        arm, whose blocks set the scores the rest is read against; a quarter block (at least 2
        rounds) for a drafting arm's first look and for a challenger scored more than ``far``
        behind the favoured arm (plain steps before any is favoured); a whole block for the
        other challengers, which might win on the next drift. A first look and a check of an arm
        far behind look for news (the text changed, so did the machine) and a short block finds
        it at a quarter of the cost: an arm at half plain's rate loses a quarter of the rounds a
        whole block of it did, and one that has become the faster still shows it (its score moves
        as far as a whole block's rate would move it). A DSBD arm drafting four layers at width 2
        ran at 0.3x beam sampling: its whole first block cost a first generation 2.5x its time."""
        fav = self.favoured if self.favoured is not None else PLAIN
        if arm in (fav, PLAIN):
            return self.block
        if self.pairs[arm] and math.exp(self.score[arm] - self.score[fav]) >= 1.0 - self.far:
            return self.block
        return max(2, self.block // 4)

    def _watch(self, arm: int, tokens_per_round: float) -> None:
        """A block of ``arm`` yielded ``tokens_per_round``. When it is the favoured drafting arm
        in the middle of its stint, its score times this yield over its usual one estimates its
        rate against plain steps now (a round costs what it did; what changed is the text: a
        loop the draft or prompt lookup followed has ended). Below 1 - ``drop`` the stint is
        cut short: plain steps are checked at once, then the arm plays on from a first stint.
        The clock alone would see the change only at the stint's next check, dozens of blocks
        on, several generations later. (A block's yield is itself noisy, ~10% for 16 rounds of
        1-4 tokens: with ``drop`` 0.1, in simulation, an arm 1.25x plain was cut 3 times in 500 blocks.)"""
        usual, seen = self.yields[arm], self.yield_blocks[arm]
        self.yields[arm] = tokens_per_round if seen == 0 else 0.8 * usual + 0.2 * tokens_per_round
        self.yield_blocks[arm] = seen + 1
        if arm == PLAIN or arm != self.favoured or seen < 2 or not self.plan or self.plan[0] != arm:
            return
        if math.exp(self.score[arm]) * tokens_per_round / usual < 1.0 - self.drop:
            self.plan = [PLAIN, arm]
            self.stint = self.first_stint
            self.cuts += 1

    def _pair(self, a: int, b: int, ratio: float) -> None:
        """Adjacent blocks of arms a then b said log(rate a / rate b) = ``ratio``. Only pairs
        with plain steps count: a drafting arm is scored against plain alone, so one arm's error
        never spreads to another through their comparison. The score is a running mean that
        starts from 0 (no advantage) as one observation, then a 0.3 EMA."""
        if PLAIN not in (a, b):
            return
        if a == PLAIN:
            a, ratio = b, -ratio
        first = self.pairs[a] == 0
        if not first:  # how far this pair strays from what the arm's earlier pairs said
            self.noise_var += NOISE_WEIGHT * ((ratio - self.score[a]) ** 2 - self.noise_var)
        self.pairs[a] += 1
        self.pairs[PLAIN] += 1
        w = max(0.3, 1.0 / (self.pairs[a] + 1))
        self.score[a] += w * (ratio - self.score[a])
        if first and self.kept is not None and self.kept_compared[a]:
            self._confirm(a, ratio)

    def _confirm(self, a: int, ratio: float) -> None:
        """The first check after a restore of an arm the kept memory had compared: its pair said
        log(rate / plain's) = ``ratio``. Within ``agree`` of the kept score (for a memory that
        favoured plain steps, no more than ``agree`` above it), the memory still holds (the same
        machine in the same state, the same kind of text): the arms kept more than ``defer`` behind
        the kept best are left to the usual checks, which come seldom for them, instead of each
        costing a block, the draft's catch-up and a cold round now, and the favourite resumes the
        stint the memory had reached (in the demo's sampled half on the Zen 1, where every drafting
        arm trails plain steps, re-checking every arm held the restored runs at 0.94x plain, a mean
        of 14). Further off, something changed and every arm is checked again once, as a restore
        does by default, its stint ramping up from a first one."""
        kept, self.kept = self.kept, None
        # A memory that favoured plain steps (no drafting arm kept above them) says that drafting
        # loses here: an arm found slower than kept says so too, so only one found faster than
        # kept by more than ``agree`` has every arm checked again (read both ways, one found
        # slower by as much had them all re-checked, each check a catch-up, a cold round and a
        # block at a loss, to learn that drafting still loses).
        plain_kept = max(kept[1:]) <= 0.0
        off = ratio - kept[a]
        if off > self.agree or (off < -self.agree and not plain_kept):
            self.kept_pairs = [0] * self.n_arms
            return
        best = max(kept)
        for b in range(1, self.n_arms):
            if self.pairs[b] == 0 and self.kept_compared[b] and math.exp(kept[b] - best) < 1.0 - self.defer:
                self.pairs[b] = 1  # its kept score stands, as one comparison's worth
                self.deferred += 1
        # The stint the memory had grown to resumes once the arms still unchecked are done: a
        # short process no longer restarts the checks' ramp from a first stint (every check of
        # it a block, a catch-up and a cold round: the demo's halves are 576 tokens).
        self.stint = max(self.stint, self.kept_stint)

    def _sure(self, a: int) -> float:
        """What the plan favours by: plain steps' score (0), a drafting arm's score less
        ``sure`` standard errors of it (the pairs' noise over the square root of its evidence:
        its pairs here and those a restored memory kept), -inf for an arm with no evidence.

        Plain steps are the safe way; a drafting arm replaces them only on evidence. A pair of
        adjacent blocks is a noisy witness: on the AVX2 Zen 3, one pair's log ratio strayed from
        its arm's mean by 0.3 (standard deviation; chain 2 against plain steps at T 1 / top-k
        50 read 0.45x to 1.87x over 16 pairs where its mean was 0.8x). With the favourite taken
        on the score alone, lucky pairs made a chain at 0.86x plain the favourite for 995 of a
        cold start's ~2,000 rounds (scored 1.30x), and cold starts from no memory played
        0.82-0.93x plain over the sweep's 16 prompts at T 1 / top-k 50. The
        margin shrinks as the pairs grow and with the noise the pairs show (its estimate:
        ``noise_var``), so on a quiet machine a faster chain is favoured after a pair or two.
        Cold starts on the Zen 3 (the sweep's 16 prompts x 128 tokens from no memory, 6 processes
        each way, alternating; ``sure`` 1.5 against 0): T 1 / top-k 50 0.924x plain against
        0.896x, T 0.8 / top-p 0.95 0.921x against 0.927x, greedy 1.21x against 1.15x (means)."""
        if a == PLAIN:
            return 0.0
        evidence = self.pairs[a] + min(self.kept_pairs[a], KEPT_EVIDENCE)
        if evidence == 0:
            return -math.inf
        return self.score[a] - self.sure * math.sqrt(self.noise_var / evidence)

    def _schedule(self) -> None:
        """A plan ran out: a stint of the best arm, then a check, which ends with a block of
        the best arm so that the next plan is made with both of its pairs counted. With plain
        favoured, the check is one block of the drafting arm with the highest optimistic score;
        with a drafting arm favoured, every other check is one block of plain steps (which keeps
        the favoured arm's score current), the others a challenger's block then a plain one."""
        best = max(range(self.n_arms), key=lambda a: (self._sure(a), -a))
        total = sum(self.pairs) / 2 + 1
        bonus = lambda a: self.bonus * math.sqrt(math.log(total + 1) / (self.pairs[a] + 1))  # noqa: E731
        others = [a for a in range(1, self.n_arms) if a != best]
        # An arm never compared yet (its first comparison cut short when a memory was kept and
        # restored mid-plan, or any arm after a restore) has no pair to be optimistic about: it
        # is checked first, those with the best kept scores before the rest.
        unseen = sorted((a for a in others if self.pairs[a] == 0), key=lambda a: (-self.score[a], a))
        challenger = unseen[0] if unseen else \
            max(others, key=lambda a: (self.score[a] + bonus(a), -a)) if others else PLAIN
        if self.favoured is not None:
            gap = self.score[best] - (self.score[challenger] + bonus(challenger))
            level = min(2, max(0, int(gap / 0.1)))
            cap = self.max_stint * 2 ** level
            # A challenger within 10% may win on the next drift: the stint doubles. With plain
            # steps favoured, a challenger further behind is a check's cost for little chance:
            # the stint grows fourfold, so a cold start reaches the cap after 3 checks instead of
            # 6 (each a block of the losing arm and its catch-up: about 1% of a 3,000-token run
            # where drafting loses by 30%). A drafting arm's lead moves with the text (a loop, a
            # docstring), so its stints keep doubling.
            grow = 4 if level > 0 and best == PLAIN else 2
            # A flip between two drafting arms within ``tie`` of each other is the noise of the
            # clock, not news: the stint grows on (restarting it would check plain and the
            # challengers every other block while two near-equal chains trade places).
            tie = best != PLAIN and self.favoured != PLAIN and self.score[self.favoured] > self.score[best] - self.tie
            # A challenger whose score beats plain steps' but not yet surely (``_sure``) is checked
            # again after a first stint: the evidence that would make it the favourite comes sooner.
            doubt = best == PLAIN and self.score[challenger] > 0
            self.stint = min(grow * self.stint, cap) if (best == self.favoured or tie) and not doubt \
                else self.first_stint
        self.favoured = best
        self.checks += 1
        if best == PLAIN:
            check = [challenger, PLAIN]
        elif (self.checks % 2 == 1 and not unseen) or challenger == PLAIN:
            check = [PLAIN, best]
        else:
            check = [challenger, PLAIN, best]
        self.plan = [best] * (self.first_stint if unseen else self.stint) + check

    def state(self) -> dict:
        """What outlives the process (``save_memory``): the scores and how sure they are. A
        memory saved in the middle of the checks after a restore (the demo's processes end there)
        is saved as it was kept where this process has not learned otherwise: an arm the kept
        memory had compared and this process has not checked yet counts as compared once (its
        score is the kept one), and until the first check the stint is the kept one (``restore``
        starts each process from a first stint). Saved as never compared and at a first stint,
        the next restore could not take the memory at its word (``_confirm``); such an arm keeps
        the pairs the memory had counted for it, the evidence ``_sure`` weighs."""
        pairs = [p if p else max(k, 1) if c else 0 for p, c, k in zip(self.pairs, self.kept_compared, self.kept_pairs)]
        stint = self.stint if self.kept is None else max(self.stint, self.kept_stint)
        return {"arms": self.n_arms, "score": list(self.score), "pairs": pairs,
                "rounds": list(self.rounds), "favoured": self.favoured, "stint": stint,
                "noise": math.sqrt(self.noise_var)}

    def restore(self, state: dict) -> None:
        """Start from a ``state()`` (ValueError if it is malformed or for other arms): the kept
        best arm plays first, and the arms are checked again once, a first stint apart, best kept
        first; if the first check agrees with the memory, those kept far behind are not
        (``_confirm``)."""
        if not isinstance(state, dict) or state.get("arms") != self.n_arms:
            raise ValueError(f"planner state must be for {self.n_arms} arms")
        score, pairs, rounds = state.get("score"), state.get("pairs"), state.get("rounds")
        lists = (score, pairs, rounds)
        if any(not isinstance(x, list) or len(x) != self.n_arms for x in lists):
            raise ValueError("planner state needs score, pairs and rounds per arm")
        if any(isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) for v in score) \
                or score[PLAIN] != 0 or any(abs(v) > 10 for v in score):
            raise ValueError("planner scores must be finite log ratios, plain's 0")
        if any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in pairs + rounds):
            raise ValueError("planner pairs and rounds must be integers >= 0")
        stint = state.get("stint")
        if isinstance(stint, bool) or not isinstance(stint, int) or not 1 <= stint <= 4 * self.max_stint:
            raise ValueError(f"planner stint must be an integer in [1, {4 * self.max_stint}]")
        # How far pairs strayed on this machine (a memory kept before it was kept has none: the
        # prior stands). It is the machine's, not the text's, so it carries over as it was.
        noise = state.get("noise", math.sqrt(self.noise_var))
        if isinstance(noise, bool) or not isinstance(noise, (int, float)) or not 0 < noise <= 2:
            raise ValueError(f"planner noise must be a standard deviation in (0, 2], got {noise!r}")
        self.noise_var = float(noise) ** 2
        # A kept memory is a prior, not a verdict: it was learned in another process, under
        # another load and often on other text (this project's VMs ran one chain at 0.7x plain
        # in one hour and 1.3x in the next). Its scores set the first favourite and the order
        # of the checks; its pairs and its stint do not carry over. So every arm is compared
        # again here, once, a first stint of the favourite apart (a quarter block each for those
        # kept far behind), and the first pair weighs what the kept score weighs (``_pair``).
        # Resumed as they were, a memory kept in a slow hour held plain steps 128 blocks before
        # the first check of a chain that had become the faster, then moved its score 0.3 of
        # the way at each check of ever longer stints: over 4,000 rounds it never played it.
        # When the first check finds the kept score again, the memory is taken at its word for
        # the arms it kept far behind (``_confirm``).
        self.score, self.rounds = [float(v) for v in score], list(rounds)
        self.pairs = [0] * self.n_arms
        self.kept, self.kept_compared = list(self.score), [p > 0 for p in pairs]
        self.kept_pairs = list(pairs)
        self.kept_stint = stint
        self.favoured, self.stint = None, self.first_stint  # _schedule keeps it while nothing is favoured
        self.prev_arm, self.tokens, self.seconds = -1, 0.0, 0.0
        self._schedule()
        self._next_block()

    def summary(self, names: list[str] | None = None) -> dict:
        names = names or [str(a) for a in range(self.n_arms)]
        # sure_vs_plain: the rate the plan favours an arm by (``_sure``), None for an arm with no
        # evidence yet; pair_noise: how far one pair's log ratio strays here (its estimate).
        sure = [self._sure(a) for a in range(self.n_arms)]
        return {"favoured": names[self.favoured if self.favoured is not None else self.arm],
                "stint_blocks": self.stint, "stint_cuts": self.cuts, "restore_deferred": self.deferred,
                "pair_noise": round(math.sqrt(self.noise_var), 3),
                "arms": {names[a]: {"rounds": self.rounds[a], "rate_vs_plain": round(math.exp(self.score[a]), 3),
                                    "sure_vs_plain": round(math.exp(sure[a]), 3) if math.isfinite(sure[a]) else None,
                                    "pairs": self.pairs[a]} for a in range(self.n_arms)}}


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
        self.drafted_rounds = self.plain_rounds = self.fixed_rounds = self.lookup_step_rounds = 0
        self.pass_rows: list[int] = []  # rows of each draft pass of the round being built
        self.m.stints.start_generation()  # one planner a generation

    # ------------------------------------------------------------- costs
    def _set_context(self, context: int) -> None:
        """Costs are read at the round's context, in steps of 32 tokens (memoised per step)."""
        context = context // 32 * 32
        if context != self.context:
            self.context = context
            self._oracle_at: dict[int, float] = {}
            self._draft_at: dict[int, float] = {}
            self._chain_costs: tuple[list[float], list[float]] = ([], [])

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
    def start_round(self, context: int) -> int:
        """Which arm this round plays (``Stints``): ``PLAIN`` (plain steps), ``PLANNED`` (this
        planner chooses the tree) or a fixed chain (``arm(index)`` tells which)."""
        self._set_context(context)
        self.pass_rows = []
        return self.m.stints.arm

    def playing_plain(self) -> bool:
        """Whether the coming round is plain steps (``block_rounds`` says how many)."""
        return self.m.stints.arm == PLAIN

    def steps_arm(self) -> Arm | None:
        """The arm of the coming round when it runs prompt lookup alone, a pass at a time: plain
        steps with prompt lookup (``Arm.steps``) or prompt lookup's chains (``Arm.lookup``, whose
        rounds are those passes with matches down to one token: ``order`` 0), else None;
        ``block_rounds`` says how many passes the coming call may run."""
        arm = self.m.arms[self.m.stints.arm]
        return arm if arm.lookup else None

    def drafting(self) -> bool:
        """Whether the coming round will run the draft model (what ``start_round`` will say)."""
        arm = self.m.stints.arm
        # A lookup-first arm's draft falls behind by every lookup round: its backlog is part of
        # the arm's cost, caught up in its next draft pass, on the clock.
        return arm != PLAIN and not self.m.arms[arm].lookup and not self.m.arms[arm].lookup_first

    def arm(self, index: int) -> Arm:
        """What arm ``index`` (from ``start_round``) plays."""
        return self.m.arms[index]

    def block_rounds(self) -> int:
        """Rounds the coming call may run of the current block: the rest of it, or while a call
        plays off the clock (``Stints.record``: a cold draft's round, a generation's first
        rounds) at most ``warm_limit`` of them."""
        stints = self.m.stints
        return min(stints.warm_limit, stints.rounds_left) if stints.warming else stints.rounds_left

    def plain_run(self) -> int:
        """Rounds of plain steps the coming call may run when nothing reads its tokens before the
        generation ends: the rest of the current block and of every plain block the plan holds
        right after it, in one native call (``Stints.plain_run``); ``block_rounds`` while a call
        plays off the clock."""
        stints = self.m.stints
        return self.block_rounds() if stints.warming else stints.plain_run()

    def off_clock(self) -> bool:
        """Whether the coming call's seconds stay off its arm's clock (``block_rounds``)."""
        return self.m.stints.warming

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

    def chain_rule(self, depth: int) -> tuple[list[float], list[float], list[float]]:
        """The rule of a planned chain of at most ``depth`` tokens, for ``_cpu.chain_round``:
        the acceptance calibration (per bin of the draft's probability), and per depth i the
        value A(i) a chain of i tokens needs for another pass to pay (``another_pass`` with one
        row) and for its i-th token to pay its node in the oracle's pass (``select``'s margin)."""
        costs, node = self._chain_costs
        if len(costs) < depth:  # seconds a pass and a node add at each depth, per context step
            pass_cost = self.pass_cost(1)
            node = [self.node_cost(i, 1) for i in range(1, depth + 2)]
            costs = [pass_cost + node[i] for i in range(1, depth + 1)]
            self._chain_costs = (costs, node)
        acc, lam = self.acceptance, self.price()
        go = lam / max(acc.top_rate(), 1e-6)  # a pass's gain is A(i) times the top child's rate
        return ([a / o for a, o in zip(acc.accepted, acc.offered)], [go * c for c in costs[:depth]],
                [lam * c for c in node[:depth]])

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

    def observe_lookup_steps(self, emitted: int, passes: int, seconds: float) -> None:
        """``passes`` oracle passes of plain steps with prompt lookup emitted ``emitted`` tokens
        in ``seconds``."""
        self.lookup_step_rounds += passes
        self.m.rate.add(emitted, seconds)
        self.m.stints.record(emitted, seconds, passes)

    def observe_fixed(self, emitted: int, seconds: float, rounds: int = 1) -> None:
        """``rounds`` rounds of a fixed chain emitted ``emitted`` tokens in ``seconds``."""
        self.fixed_rounds += rounds
        self.m.rate.add(emitted, seconds)
        self.m.stints.record(emitted, seconds, rounds)

    def _observe_drafted(self, pass_rows: list[int], nodes: int, emitted: int, seconds: float) -> None:
        """A drafted round's time against the cost model's prediction, its rate and its arm's clock."""
        m = self.m
        self.drafted_rounds += 1
        x = self._features(pass_rows, nodes)
        seconds = _clip(seconds, m.cost.predict(x))
        m.cost.add(x, seconds)
        m.rate.add(emitted, seconds)
        m.stints.record(emitted, seconds)

    def observe_chain(self, logr: list[float], accepted: int, unseen: int, passes: int, emitted: int,
                      seconds: float) -> None:
        """A planned chain's native round (``chain_rule``): the draft's log r of each chain token,
        ``accepted`` nodes accepted (the root included), the first of ``passes`` draft passes
        over ``unseen`` rows, the tokens emitted and its wall seconds. As ``observe``."""
        self._observe_drafted([unseen] + [1] * (passes - 1), len(logr) + 1, emitted, seconds)
        for i in range(min(accepted, len(logr))):  # token i + 1 was offered: node i was accepted
            self.acceptance.observe(math.exp(logr[i]), i + 1 < accepted, top=True)

    def observe(self, tree: Tree, logr: list[float] | None, path: list[int], emitted: int, seconds: float) -> None:
        """A drafted round: the verified tree (a lone root when nothing was worth verifying), the
        accepted path, the tokens emitted and its wall seconds."""
        self._observe_drafted(self.pass_rows, len(tree), emitted, seconds)
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
        m = self.m
        c = m.cost.coef
        return {"drafted_rounds": self.drafted_rounds, "fixed_rounds": self.fixed_rounds,
                "plain_rounds": self.plain_rounds, "lookup_step_rounds": self.lookup_step_rounds,
                "drafting_advantage": round(math.exp(m.stints.advantage), 3),  # best drafting arm / plain
                **m.stints.summary([a.name for a in m.arms]), "memory": m.source, "tokens_per_s": round(m.rate.value, 1),
                "top_child_acceptance": round(self.acceptance.top_rate(), 3),
                "round_cost": {"oracle_scale": round(float(c[0]), 3), "round_overhead_ms": round(1e3 * float(c[1]), 4),
                               "pass_overhead_ms": round(1e3 * float(c[2]), 4), "draft_scale": round(float(c[3]), 3),
                               "node_scale": round(float(c[4]), 3)},
                "acceptance": self.acceptance.table()}
