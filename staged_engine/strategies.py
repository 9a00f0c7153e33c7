"""Decoding strategies. Each is a small object with ``start(prompt)`` and ``round(remaining)``.

``round`` runs one oracle forward pass (plus whatever drafting it needs) and returns the new
tokens it accepted, at least one, at most ``remaining``. All of them choose tokens with
``sampling.choose`` on the oracle's logits at the emitted token's absolute position, so a
seed fixes one sequence for every strategy (ALGORITHMS.md sec. 3).
"""
from __future__ import annotations

from .drafters import ModelDrafter
from .runner import ModelRunner
from .sampling import NoiseTable, SamplingParams


class Decoder:
    """Base: an oracle runner, the sampling rule, and counters for stats."""

    name = "base"

    def __init__(self, oracle: ModelRunner, params: SamplingParams, noise: NoiseTable | None) -> None:
        self.oracle = oracle
        self.params = params
        self.noise = noise
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


class PlainDecoder(Decoder):
    """One oracle pass per token: the reference every other strategy must reproduce."""

    name = "plain"

    def round(self, remaining: int) -> list[int]:
        position = self.oracle.length + 1  # where the chosen token will sit
        logits = self.oracle.step(self.root)
        token = self.oracle.cache.backend.choose_one(logits, position, self.params, self.noise)
        self.root = token
        self.accepted_lengths.append(1)
        return [token]


class SpeculativeDecoder(Decoder):
    """chain / tree / staged: a drafter proposes a tree, the oracle verifies it in one pass.

    The strategies differ only in the drafter's tree shape and inner stages; verification is
    the one rule of ALGORITHMS.md sec. 4 (``tree.walk`` with ``choose`` at every node).
    """

    def __init__(self, oracle: ModelRunner, params: SamplingParams, noise: NoiseTable | None,
                 drafter: "ModelDrafter", name: str) -> None:
        super().__init__(oracle, params, noise)
        self.drafter = drafter
        self.name = name

    def start(self, prompt: list[int]) -> None:
        super().start(prompt)
        self.drafter.start(prompt)

    def draft_calls(self) -> int:
        return self.drafter.calls

    def draft_seconds(self) -> float:
        return self.drafter.forward_seconds

    def draft_weight_bytes(self) -> int:
        return self.drafter.weight_bytes_read()

    def round(self, remaining: int) -> list[int]:
        oracle = self.oracle
        root_position = oracle.length
        n_ctx = min(oracle.max_len, oracle.model.config.n_positions)
        # A node at depth d emits a token at position root + d + 1, which must stay in the window.
        max_depth = min(self.drafter.shape.max_depth, remaining - 1, n_ctx - 1 - root_position - 1)
        budget = min(self.drafter.shape.budget, n_ctx - root_position)
        tree, draft_nodes, state = self.drafter.build(root_position, budget, max_depth)
        positions = [root_position + d for d in tree.depths]
        mask = None if tree.is_chain() else tree.ancestor_mask(oracle.device)
        logits = oracle.forward_nodes(tree.tokens, positions, mask)  # (N, V)
        path, emitted = oracle.cache.backend.verify(tree, logits, positions, self.params, self.noise)
        oracle.commit(path)
        self.drafter.accept(state, [draft_nodes[n] for n in path], emitted)
        self.root = emitted[-1]
        self.accepted_lengths.append(len(emitted))
        return emitted
