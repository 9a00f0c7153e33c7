"""Decoding strategies. Each is a small object with ``start(prompt)`` and ``round(remaining)``.

``round`` runs one or more oracle forward passes (plus whatever drafting they need: plain steps
and fixed chains run several back to back in one native call) and returns the new tokens they
accepted, at least one, at most ``remaining``. All of them choose tokens with
``sampling.choose`` on the oracle's logits at the emitted token's absolute position, so a
seed fixes one sequence for every strategy (ALGORITHMS.md sec. 3).
"""
from __future__ import annotations

import time

from staged_engine.model.backend import _cpu
from staged_engine.model.runner import ModelRunner
from staged_engine.sampling import SamplingConfig
from staged_engine.spec.drafters import ModelDrafter
from staged_engine.spec.planner import RoundPlanner
from staged_engine.spec.verify import choose_one, verify


# Plain steps a round of plain decoding runs back to back (one native call) in a stream, which
# arrives in pieces of up to this many tokens. Where nobody reads the tokens before the end
# (``Engine.generate``) a round runs as many steps as it can: each return to Python costs more
# than the interpreter's work, the passes after it running slower (demo oracle, T 0.8 top-p,
# Zen 4: calls of 96 steps 1.5% faster a step by the native clock, 3.7% by the wall clock, than
# calls of 8; whole 128-token generations 1.02-1.08x). A planner's block of plain steps (16) runs
# whole, in one call, and where nobody reads the tokens before the end, so does its whole run of
# plain blocks (``RoundPlanner.plain_run``).
PLAIN_BATCH = 8
# Such a call runs for about this long at most, judged from the previous call's seconds a step
# (the first runs PLAIN_BATCH steps), so that an interrupt is seen within it on a model whose
# step takes tens of milliseconds: the demo oracle runs ~1,000 steps in it.
CALL_SECONDS = 0.25
# Rounds a pinned draft chain runs back to back (one native call, ``_cpu.chain_rounds``): its
# streams arrive in pieces of up to this many rounds' tokens. Where nobody reads the tokens before
# the end (``Engine.generate``) a call runs as many rounds as fit in CALL_SECONDS (the first call
# this many): each return to Python cost ~150 us of interpreter work run cold after the oracle's
# pass, ~37 us a round of a chain of one at 4 rounds a call (demo pair, Zen 4). A planner's fixed
# chain runs the rest of its block (16 rounds) in one call.
CHAIN_BATCH = 4


def fit_call(first: int, seconds_each: float | None) -> int:
    """How many steps or rounds a native call may run where nobody reads the tokens before the
    end: ``first`` the first time, then what the last call's ``seconds_each`` runs in
    ``CALL_SECONDS`` (never fewer than ``first``)."""
    if seconds_each is None:
        return first
    return max(first, int(CALL_SECONDS / max(seconds_each, 1e-9)))


class RoundClock:
    """The wall time a planner charges a round. It runs from the end of the previous round: what
    the engine and the caller do between rounds is paid per round, so an arm with more rounds a
    token pays more of it. A gap longer than the round itself is the caller pausing a stream,
    not the arm's doing, and counts as the round's own length."""

    def __init__(self) -> None:
        self.end: float | None = None  # when the previous round of this generation ended
        self.entry = self.t0 = 0.0

    def reset(self) -> None:
        self.end = None

    def enter(self) -> None:
        self.entry = time.perf_counter()
        self.t0 = self.entry if self.end is None else self.end

    def exclude(self) -> float:
        """Keep the time since ``enter`` off this round's clock (a one-off cost of the round, to be
        charged some other way); returns it."""
        now = time.perf_counter()
        spent = now - self.entry
        self.t0, self.entry = self.t0 + spent, now
        return spent

    def seconds(self) -> float:
        """The round's seconds on the clock; marks its end."""
        end = self.end = time.perf_counter()
        return (end - self.entry) + min(self.entry - self.t0, end - self.entry)


class Decoder:
    """Base: an oracle runner, the sampling rule, and counters for stats."""

    name = "base"

    def __init__(self, oracle: ModelRunner, sampling: SamplingConfig, stop_token: int | None = None,
                 whole: bool = False) -> None:
        self.oracle = oracle
        self.sampling = sampling
        self.stop_token = stop_token  # plain steps run back to back up to this token (EOS)
        # Nobody reads the tokens before the generation ends (``Engine.generate``): plain steps
        # run in calls of ``call_steps``, not in a stream's pieces.
        self.whole = whole
        self.root = -1  # the last accepted token, not yet seen by the oracle
        self.accepted_lengths: list[int] = []  # tokens emitted per round
        self.step_seconds: float | None = None  # wall seconds a step of the last call of plain steps

    def start(self, prompt: list[int]) -> None:
        """Prefill every prompt token but the last, which becomes the first round's root."""
        self.oracle.reset()
        self.oracle.prefill(prompt[:-1])
        self.root = prompt[-1]
        self.accepted_lengths = []
        self.step_seconds = None

    def round(self, remaining: int) -> list[int]:
        raise NotImplementedError

    def call_steps(self, n: int) -> int:
        """Plain steps a call may run of ``n`` where nobody reads the tokens before the end:
        ``PLAIN_BATCH`` the first time, then what the last call's rate runs in ``CALL_SECONDS``."""
        return min(n, fit_call(PLAIN_BATCH, self.step_seconds))

    def plain_steps(self, n: int) -> list[int]:
        """Up to ``n`` oracle steps back to back (fewer at ``stop_token``): the tokens chosen.
        Plain decoding is made of them, and so is every round a planner spends undrafted."""
        oracle = self.oracle
        t0 = time.perf_counter()
        out = oracle.steps(self.root, n, self.sampling.rule, self.stop_token) if n > 0 else []
        if out is None:  # off the native path: one step at a time
            out = []
            while len(out) < n and (not out or out[-1] != self.stop_token):
                logits = oracle.step(out[-1] if out else self.root)
                out.append(choose_one(oracle.backend, logits, oracle.length, self.sampling))
        if out:
            self.root = out[-1]
            self.step_seconds = (time.perf_counter() - t0) / len(out)
        self.accepted_lengths.extend([1] * len(out))
        return out

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
    """One oracle pass per token: the reference every other strategy must reproduce. A round
    runs up to ``batch`` steps back to back (fewer at ``stop_token``), which spares the engine's
    per-round work between tokens; streams then arrive in pieces of up to ``batch`` tokens.
    ``whole``: as many as ``call_steps`` allows."""

    name = "plain"

    def __init__(self, oracle: ModelRunner, sampling: SamplingConfig, stop_token: int | None = None,
                 batch: int = PLAIN_BATCH, whole: bool = False) -> None:
        super().__init__(oracle, sampling, stop_token, whole)
        self.batch = batch

    def round(self, remaining: int) -> list[int]:
        return self.plain_steps(self.call_steps(remaining) if self.whole else min(remaining, self.batch))


class SpeculativeDecoder(Decoder):
    """chain / tree / staged: a drafter proposes a tree, the oracle verifies it in one pass.

    The strategies differ only in the drafter's tree shape and inner stages; verification is
    the one rule of ALGORITHMS.md sec. 4 (``tree.walk`` with ``choose`` at every node). With a
    ``planner`` (the default) each round drafts and verifies only what pays on this machine,
    within the shape's limits (``spec.planner``); without one every round plays the shape.
    """

    def __init__(self, oracle: ModelRunner, sampling: SamplingConfig, drafter: ModelDrafter, name: str,
                 planner_factory=None, stop_token: int | None = None, whole: bool = False) -> None:
        # ``whole``: a run of plain blocks plays in one call (``RoundPlanner.plain_run``), not a
        # block a call as a stream's pieces need.
        super().__init__(oracle, sampling, stop_token, whole)
        self.drafter = drafter
        self.name = name
        self.planner_factory = planner_factory
        self.planner: RoundPlanner | None = None
        self.clock = RoundClock()
        # The last catch-up's seconds not yet charged, and its share per token emitted (``round``).
        self.catch_up_left = self.catch_up_per_token = 0.0
        self.round_seconds: float | None = None  # wall seconds a round of the last native chain block

    def start(self, prompt: list[int]) -> None:
        super().start(prompt)
        self.planner = self.planner_factory() if self.planner_factory is not None else None
        self.drafter.start(prompt, lazy=self.planner is not None)
        self.clock.reset()
        self.catch_up_left = self.catch_up_per_token = 0.0
        self.round_seconds = None

    def call_rounds(self) -> int:
        """Rounds a pinned chain's native call may run: ``CHAIN_BATCH`` for a stream's pieces and
        for the first call; where nobody reads the tokens before the end, then, what the last
        call's rate runs in ``CALL_SECONDS``."""
        return fit_call(CHAIN_BATCH, self.round_seconds) if self.whole else CHAIN_BATCH

    def _drafted_seconds(self, emitted: int, remaining: int) -> float:
        """A drafted round's seconds on the clock plus its share of the last catch-up (``round``),
        never more than what is left of it. A call off the clock (``RoundPlanner.off_clock``: a
        generation's first) pays none: its tokens' share is spread over the ``remaining`` tokens
        after it, so the rounds on the clock still pay the whole catch-up."""
        if self.planner.off_clock():
            self.catch_up_per_token = self.catch_up_left / max(remaining - emitted, 1)
            return self.clock.seconds()
        share = min(self.catch_up_left, self.catch_up_per_token * emitted)
        self.catch_up_left -= share
        return self.clock.seconds() + share

    def draft_calls(self) -> int:
        return self.drafter.calls

    def draft_seconds(self) -> float:
        return self.drafter.forward_seconds

    def draft_weight_bytes(self) -> int:
        return self.drafter.weight_bytes_read()

    def round(self, remaining: int) -> list[int]:
        planner = self.planner
        if planner is None:
            shape = self.drafter.shape
            depth = min(shape.max_depth, shape.budget - 1)
            block = self._native_chain_block(remaining, depth, self.call_rounds())
            if block is not None:
                return block[0]
            emitted = self._native_chain(remaining, depth)
            return emitted if emitted is not None else self._round(remaining, shape.budget, shape.max_depth)[0]
        oracle, clock = self.oracle, self.clock
        clock.enter()
        if planner.playing_plain():  # the rest of a block of plain steps, in one native call
            # with no planning: interpreter work between passes runs from caches the oracle's
            # weights have just streamed through
            out = self.plain_steps(self.call_steps(min(remaining, planner.plain_run())) if self.whole
                                   else min(remaining, planner.block_rounds()))
            self.drafter.skip(out)
            planner.observe_steps(len(out), clock.seconds())
            return out
        steps = planner.steps_arm()
        if steps is not None:  # the rest of a block of prompt lookup's passes, in one native call:
            # its rounds are passes, each emitting its kept guesses and one token of its own
            rounds = planner.block_rounds()
            out, passes = self.lookup_steps(min(remaining, rounds * (steps.depth + 1)), steps.depth, steps.order or 1,
                                            rounds)
            self.drafter.skip(out)
            planner.observe_lookup_steps(len(out), passes, clock.seconds())
            return out
        drafting = planner.drafting()
        if drafting and len(self.drafter.unseen) > 4:
            # The draft's backlog (the prompt, or what plain steps left) is the price of drafting
            # in this generation from here on. It is spread over the tokens the generation has
            # left, each drafted round paying its tokens' share: a short generation pays it all,
            # as the caller does, while the one block of a check no longer pays a long plain
            # stint's whole backlog (charged there, a draft that pays looked 10-20% slower than
            # plain), and a drafting arm is not favoured for a speed it cannot deliver (kept off
            # the clock, the draft's prefill of every prompt went unpaid: 1-3% of a 128-token
            # generation, about the margin by which drafting arms lost while the clock rated them
            # level with plain steps).
            self.drafter.catch_up()
            self.catch_up_left = clock.exclude()
            self.catch_up_per_token = self.catch_up_left / max(remaining, 1)
        arm = planner.start_round(oracle.length)
        way = planner.arm(arm)
        self.drafter.use_inner = way.inner
        if way.depth is not None:  # a fixed chain the clock compares with the planned rounds
            if not way.lookup:  # the rest of its block, in one native call
                block = self._native_chain_block(remaining, way.depth, planner.block_rounds(), way.lookup_first)
                if block is not None:
                    out, rounds = block
                    n = min(len(out), remaining)
                    planner.observe_fixed(n, self._drafted_seconds(n, remaining) if drafting else clock.seconds(), rounds)
                    return out
            lookup = way.lookup or (way.lookup_first and self.drafter.lookup_matches())
            emitted = None if lookup else self._native_chain(remaining, way.depth)
            if emitted is None:
                emitted = self._round(remaining, way.depth + 1, way.depth, lookup=lookup)[0]
            n = min(len(emitted), remaining)
            planner.observe_fixed(n, self._drafted_seconds(n, remaining) if drafting else clock.seconds())
            return emitted
        shape = self.drafter.shape
        emitted = self._native_chain(remaining, shape.max_depth, planner, shape.budget)
        if emitted is not None:
            return emitted
        emitted, draft, path = self._round(remaining, shape.budget, shape.max_depth, planner)
        n = min(len(emitted), remaining)
        planner.observe(draft.tree, draft.logr, path, n, self._drafted_seconds(n, remaining))
        return emitted

    def extra_stats(self) -> dict:
        return {} if self.planner is None else {"planner": self.planner.summary()}

    def lookup_steps(self, n: int, depth: int, order: int, passes: int | None = None) -> tuple[list[int], int]:
        """Up to ``n`` tokens in at most ``passes`` oracle passes (None: n) of plain steps, each
        also verifying up to ``depth`` tokens prompt lookup finds after the context's last 3 (down
        to ``order``) tokens, in one native call (``ModelRunner.lookup_steps``; plain steps off the
        native path): the tokens, which are plain decoding's, and the passes they took."""
        got = self.oracle.lookup_steps(self.root, n, self.sampling.rule, self.drafter.history[:-1], depth, order,
                                       self.stop_token, passes) if n > 0 else None
        if got is None:
            out = self.plain_steps(n if passes is None else min(n, passes))
            return out, len(out)
        out, lengths, _, _ = got
        self.root = out[-1]
        self.accepted_lengths.extend(lengths)
        return out, len(lengths)

    def _native_rules(self) -> tuple:
        """(temperature, top_k, top_p, seed) of the oracle's rule and (temperature, top_k, seed,
        top_p) of the draft's, as the native chain rounds take them (greedy: the draft's argmax)."""
        t, top_k, top_p, seed = self.sampling.rule
        dt, dk, dp, dseed = (0.0, 0, 1.0, 0) if self.sampling.greedy else self.sampling.draft_rule
        return t, top_k, top_p, seed or 0, dt, dk, dseed or 0, dp

    def _native_chain(self, remaining: int, depth: int, planner: RoundPlanner | None = None,
                      budget: int | None = None) -> list[int] | None:
        """A round of a draft chain in one native call (``_cpu.chain_round``: the draft's passes,
        the oracle's and the acceptance walk): a fixed chain of ``depth`` tokens, the same tokens,
        passes and cache entries as ``_round`` computes in Python; or with a ``planner`` a planned
        chain of at most ``depth`` tokens (and ``budget`` nodes) that stops where the planner's
        rule says (``RoundPlanner.chain_rule``), observed by the planner. None where it does not
        apply (a model off the native path, an inner stage proposing, no room to draft)."""
        drafter, oracle = self.drafter, self.oracle
        if oracle.native is None or not drafter.native_chain():
            return None
        drafter.trim_backlog()  # the round's first draft pass evaluates the backlog
        root_position = oracle.length
        n_ctx = min(oracle.max_len, oracle.model.config.n_positions)
        depth = drafter.chain_depth(min(depth, remaining - 1, n_ctx - 2 - root_position),
                                    depth + 1 if budget is None else budget)
        if depth <= 0:
            return None
        draft, unseen = drafter.runner, drafter.unseen
        n_unseen = len(unseen)
        t, top_k, top_p, seed, dt, dk, dseed, dp = self._native_rules()
        calibration, go, keep = planner.chain_rule(depth) if planner is not None else ((), (), ())
        d_start = draft.reserve(n_unseen + depth - 1)
        o_start = oracle.reserve(depth + 1)
        chain, logr, path, emitted, passes, d_seconds, o_seconds = _cpu.chain_round(
            draft.native, draft.cache.k, draft.cache.v, d_start, unseen, d_start, oracle.native, oracle.cache.k,
            oracle.cache.v, o_start, root_position, depth, t, top_k, top_p, seed, dt, dk, dseed,
            calibration, go, keep, draft_top_p=dp)
        draft.count(passes, d_seconds, n_unseen + passes - 1)
        if not path:  # the draft had no token worth offering: a plain step
            oracle.discard()
            emitted = self.plain_steps(1)
            drafter.accept_chain(passes, 1, emitted)
        else:
            oracle.count(1, o_seconds, len(chain) + 1)
            oracle.commit(path)
            drafter.accept_chain(passes, len(path), emitted)
            self.root = emitted[-1]
            self.accepted_lengths.append(len(emitted))
        if planner is not None:
            n = min(len(emitted), remaining)
            planner.observe_chain(logr, max(len(path), 1), n_unseen, passes, n, self._drafted_seconds(n, remaining))
        return emitted

    def _native_chain_block(self, remaining: int, depth: int, rounds: int,
                            lookup_first: bool = False) -> tuple[list[int], int] | None:
        """Up to ``rounds`` rounds of a fixed draft chain of ``depth`` tokens in one native call
        (``_cpu.chain_rounds``: each round ``_native_chain``'s, the same tokens, passes and cache
        entries), at most ``remaining`` tokens, stopping after a round that emits ``stop_token``:
        (the tokens, the rounds run). With ``lookup_first``, the rounds where the context's last 3
        tokens were seen before verify prompt lookup's chain instead, with no draft pass
        (``_round`` with ``lookup``). None where a native round does not apply, or with room for
        less than two tokens (then a round of ``_native_chain`` or ``_round`` ends the text)."""
        drafter, oracle = self.drafter, self.oracle
        if oracle.native is None or not drafter.native_chain():
            return None
        drafter.trim_backlog()  # the block's first draft pass evaluates the backlog
        root_position = oracle.length
        n_ctx = min(oracle.max_len, oracle.model.config.n_positions)
        # Every token within the window, and every entry within both caches: each round's chain
        # is cut to the tokens left, so the oracle writes at most n entries and the draft at most
        # its unseen tokens and n - 1 more.
        n = min(remaining, n_ctx - 1 - root_position, drafter.chain_depth(remaining - 1, remaining) + 1)
        if n < 2:
            return None
        draft, unseen = drafter.runner, drafter.unseen
        t, top_k, top_p, seed, dt, dk, dseed, dp = self._native_rules()
        d_start = draft.reserve(len(unseen) + n - 1)
        o_start = oracle.reserve(n)
        t0 = time.perf_counter()
        try:
            out, lengths, unseen, kept, passes, d_rows, d_seconds, o_seconds, o_rows, _ = _cpu.chain_rounds(
                draft.native, draft.cache.k, draft.cache.v, d_start, unseen, oracle.native, oracle.cache.k,
                oracle.cache.v, o_start, root_position, depth, n, max(rounds, 1), t, top_k, top_p, seed, dt, dk, dseed,
                -1 if self.stop_token is None else self.stop_token, lookup_first,
                drafter.history[:-1] if lookup_first else [], draft_top_p=dp)
        except BaseException:
            draft.discard()
            oracle.discard()
            raise
        self.round_seconds = (time.perf_counter() - t0) / max(len(lengths), 1)
        draft.count(passes, d_seconds, d_rows)
        oracle.count(len(lengths), o_seconds, o_rows)
        oracle.commit(list(range(len(out))))
        drafter.accept_chains(kept, unseen, out)
        self.root = out[-1]
        self.accepted_lengths.extend(lengths)
        return out, len(lengths)

    def _round(self, remaining: int, budget: int, max_depth: int, planner: RoundPlanner | None = None,
               lookup: bool = False):
        """One round: (emitted tokens, the drafted round, the accepted path). With ``lookup`` the
        tree is prompt lookup's chain (``ModelDrafter.build_lookup``), with no draft pass."""
        oracle = self.oracle
        root_position = oracle.length
        n_ctx = min(oracle.max_len, oracle.model.config.n_positions)
        # A node at depth d emits a token at position root + d + 1, which must stay in the window.
        max_depth = min(max_depth, remaining - 1, n_ctx - 1 - root_position - 1)
        budget = min(budget, n_ctx - root_position)
        if lookup:
            draft = self.drafter.build_lookup(max_depth)
        else:
            draft = self.drafter.build(root_position, budget, max_depth, planner)
        tree = draft.tree
        if len(tree) == 1:  # nothing worth verifying: a plain step
            emitted = self.plain_steps(1)
            self.drafter.accept(draft, [0], emitted)
            return emitted, draft, [0]
        positions = [root_position + d for d in tree.depths]
        mask = None if tree.is_chain() else tree.ancestor_mask(oracle.device)
        logits = oracle.forward_nodes(tree.tokens, positions, mask)  # (N, V)
        path, emitted = verify(oracle.backend, tree, logits, positions, self.sampling)
        oracle.commit(path)
        self.drafter.accept(draft, path, emitted)
        self.root = emitted[-1]
        self.accepted_lengths.append(len(emitted))
        return emitted, draft, path
