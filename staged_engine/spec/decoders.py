"""Decoding strategies. Each is a small object with ``start(prompt)`` and ``round(remaining)``.

``round`` runs one oracle forward pass (plus whatever drafting it needs) and returns the new
tokens it accepted, at least one, at most ``remaining``. All of them choose tokens with
``sampling.choose`` on the oracle's logits at the emitted token's absolute position, so a
seed fixes one sequence for every strategy (ALGORITHMS.md sec. 3).
"""
from __future__ import annotations

import math
import time

from staged_engine.checks import check_int
from staged_engine.model.runner import ModelRunner
from staged_engine.sampling import SamplingConfig
from staged_engine.spec.drafters import ModelDrafter, TreeShape
from staged_engine.spec.verify import choose_one, verify


class Decoder:
    """Base: an oracle runner, the sampling rule, and counters for stats."""

    name = "base"

    def __init__(self, oracle: ModelRunner, sampling: SamplingConfig) -> None:
        self.oracle = oracle
        self.sampling = sampling
        self.root = -1  # the last accepted token, not yet seen by the oracle
        self.accepted_lengths: list[int] = []  # tokens emitted per round

    def start(self, prompt: list[int]) -> None:
        """Prefill every prompt token but the last, which becomes the first round's root."""
        self.oracle.reset()
        self.oracle.prefill(prompt[:-1])
        self.root = prompt[-1]
        self.accepted_lengths = []

    def round(self, remaining: int) -> list[int]:
        raise NotImplementedError

    def draft_calls(self) -> int:
        return 0

    def draft_seconds(self) -> float:
        return 0.0

    def draft_weight_bytes(self) -> int:
        """Bytes of draft weights read over the generation (for relative memory traffic)."""
        return 0

    def extra_stats(self) -> dict:
        """Strategy-specific statistics merged into the generation's stats."""
        return {}


class PlainDecoder(Decoder):
    """One oracle pass per token: the reference every other strategy must reproduce."""

    name = "plain"

    def round(self, remaining: int) -> list[int]:
        position = self.oracle.length + 1  # where the chosen token will sit
        logits = self.oracle.step(self.root)
        token = choose_one(self.oracle.backend, logits, position, self.sampling)
        self.root = token
        self.accepted_lengths.append(1)
        return [token]


class SpeculativeDecoder(Decoder):
    """chain / tree / staged: a drafter proposes a tree, the oracle verifies it in one pass.

    The strategies differ only in the drafter's tree shape and inner stages; verification is
    the one rule of ALGORITHMS.md sec. 4 (``tree.walk`` with ``choose`` at every node).
    """

    def __init__(self, oracle: ModelRunner, sampling: SamplingConfig, drafter: ModelDrafter, name: str,
                 adaptive: bool = False) -> None:
        super().__init__(oracle, sampling)
        self.drafter = drafter
        self.name = name
        self.adaptive = adaptive
        self.controller: DepthController | None = None

    def start(self, prompt: list[int]) -> None:
        super().start(prompt)
        self.drafter.start(prompt)
        self.controller = DepthController(self.drafter.shape) if self.adaptive else None

    def draft_calls(self) -> int:
        return self.drafter.calls

    def draft_seconds(self) -> float:
        return self.drafter.forward_seconds

    def draft_weight_bytes(self) -> int:
        return self.drafter.weight_bytes_read()

    def round(self, remaining: int) -> list[int]:
        if self.controller is None:
            return self._round(remaining, self.drafter.shape.budget, self.drafter.shape.max_depth)
        arm = self.controller.choose()
        if arm > 0:  # after plain rounds the draft is behind: catch up off the clock, so the
            self.drafter.catch_up()  # arm is judged by its steady cost, not by the backlog
        t0 = time.perf_counter()
        emitted = self._round(remaining, *self.controller.limits(arm))
        self.controller.update(arm, len(emitted), time.perf_counter() - t0)
        return emitted

    def extra_stats(self) -> dict:
        return {} if self.controller is None else {"adaptive": self.controller.summary()}

    def _round(self, remaining: int, budget: int, max_depth: int) -> list[int]:
        oracle = self.oracle
        root_position = oracle.length
        n_ctx = min(oracle.max_len, oracle.model.config.n_positions)
        # A node at depth d emits a token at position root + d + 1, which must stay in the window.
        max_depth = min(max_depth, remaining - 1, n_ctx - 1 - root_position - 1)
        budget = min(budget, n_ctx - root_position)
        draft = self.drafter.build(root_position, budget, max_depth)
        tree = draft.tree
        if len(tree) == 1:  # nothing drafted (a plain step of the depth controller): the plain path
            logits = oracle.step(self.root)
            emitted = [choose_one(oracle.backend, logits, root_position + 1, self.sampling)]
            self.drafter.accept(draft, [0], emitted)
            self.root = emitted[-1]
            self.accepted_lengths.append(1)
            return emitted
        positions = [root_position + d for d in tree.depths]
        mask = None if tree.is_chain() else tree.ancestor_mask(oracle.device)
        logits = oracle.forward_nodes(tree.tokens, positions, mask)  # (N, V)
        path, emitted = verify(oracle.backend, tree, logits, positions, self.sampling)
        oracle.commit(path)
        self.drafter.accept(draft, path, emitted)
        self.root = emitted[-1]
        self.accepted_lengths.append(len(emitted))
        return emitted


class DepthController:
    """How deep to speculate this round, chosen from throughput measured while decoding.

    The arms are depth limits: 0 (a plain oracle step; the draft idles and catches up later) and
    a ladder of depths up to the shape's ``max_depth``, each with a node budget scaled from the
    shape's. Every arm keeps exponentially weighted sums of the tokens it emitted and the wall
    seconds its rounds took (draft passes, the oracle pass, verification and the Python between
    them), so its estimate is tokens per second on this machine, these models, this sampling
    rule and this text: nothing is tuned in advance.

    It starts by measuring depth 1 and a plain step, then plays the best arm and climbs the
    ladder: every ``interval`` rounds it measures a neighbour of the best arm (afresh, when its
    last figure is old). An exploration that does not move the best doubles the interval (up to
    ``max_interval``), one that does resets it, so speculation that does not pay costs a few
    rounds in a hundred, and a change of text (a loop starting, code turning into prose) is
    followed within tens of rounds. Which arm plays never changes the output: only the oracle
    decides what is emitted.
    """

    def __init__(self, shape: TreeShape, explore_every: int = 8, decay: float = 0.7,
                 max_interval: int = 64) -> None:
        check_int("explore_every", explore_every, 2)
        if not 0.0 < decay < 1.0:
            raise ValueError(f"decay must be in (0, 1), got {decay!r}")
        self.shape = shape
        depths, d = {0, shape.max_depth}, 1
        while d < shape.max_depth:
            depths.add(d)
            d *= 2
        self.depths = sorted(depths)
        self.explore_every = explore_every
        self.max_interval = max(max_interval, explore_every)
        self.decay = decay
        n = len(self.depths)
        self.tokens = [0.0] * n
        self.seconds = [0.0] * n
        self.plays = [0] * n
        self.last = [-1] * n  # round an arm was last measured
        self.rounds = 0
        self.interval = explore_every
        self.next_explore = explore_every
        self.exploring: tuple[int, int] | None = None  # (arm measured, best before it)
        self.probe = [min(1, n - 1), 0]

    def limits(self, arm: int) -> tuple[int, int]:
        """(node budget, max depth) of an arm."""
        d = self.depths[arm]
        if d == 0:
            return 1, 0
        s = self.shape
        return min(s.budget, max(d + 1, math.ceil(s.budget * d / s.max_depth))), d

    def rate(self, arm: int) -> float:
        return self.tokens[arm] / self.seconds[arm] if self.seconds[arm] > 0 else 0.0

    def best(self) -> int:
        played = [a for a in range(len(self.depths)) if self.plays[a]]
        return max(played, key=lambda a: (self.rate(a), -a)) if played else self.probe[0]

    def choose(self) -> int:
        for a in self.probe:
            if self.plays[a] == 0:
                return a
        best = self.best()
        if self.rounds >= self.next_explore:
            near = [a for a in (best - 1, best + 1) if 0 <= a < len(self.depths)]
            if near:
                arm = min(near, key=lambda a: (self.plays[a] > 0, self.last[a]))
                self.exploring = (arm, best)
                return arm
        return best

    def update(self, arm: int, tokens: int, seconds: float) -> None:
        if self.rounds - self.last[arm] > 2 * self.explore_every:  # an old figure: measure afresh
            self.tokens[arm] = self.seconds[arm] = 0.0
        self.tokens[arm] = self.decay * self.tokens[arm] + tokens
        self.seconds[arm] = self.decay * self.seconds[arm] + max(seconds, 1e-9)
        self.plays[arm] += 1
        self.last[arm] = self.rounds
        self.rounds += 1
        if self.exploring is not None:
            _, before = self.exploring
            self.exploring = None
            moved = self.best() != before
            self.interval = self.explore_every if moved else min(2 * self.interval, self.max_interval)
            self.next_explore = self.rounds + self.interval

    def summary(self) -> dict:
        """Per depth: rounds played and the latest tokens/s estimate."""
        return {str(d): {"rounds": self.plays[a], "tokens_per_s": round(self.rate(a), 1)}
                for a, d in enumerate(self.depths)}
