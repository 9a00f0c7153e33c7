"""A synthetic first-order Markov "language model" for exact-law tests (ALGORITHMS.md sec. 10).

p(v | prefix) = T[prefix[-1], v] with a (V, V) float64 transition matrix, so the probability of
any continuation is a closed-form product of matrix entries.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch


class MarkovLM:
    """BeamLM over a (V, V) row-stochastic float64 matrix; counts its calls."""

    def __init__(self, transition: torch.Tensor) -> None:
        if transition.dtype != torch.float64 or transition.dim() != 2:
            raise ValueError("transition must be a (V, V) float64 tensor")
        if not torch.allclose(transition.sum(1), torch.ones(transition.shape[0], dtype=torch.float64)):
            raise ValueError("transition rows must sum to 1")
        self.transition = transition
        self.calls = 0

    @property
    def vocab(self) -> int:
        return self.transition.shape[0]

    def probs(self, prefixes: Sequence[tuple[int, ...]]) -> torch.Tensor:
        """(n, V) float64: the next-token distribution after each prefix."""
        self.calls += 1
        return self.transition[[prefix[-1] for prefix in prefixes]]

    def log_prob(self, seq: Sequence[int], start: int) -> float:
        """Closed form: log of the probability of seq[start:] given seq[:start]."""
        total = 0.0
        for t in range(start, len(seq)):
            p = float(self.transition[seq[t - 1], seq[t]])
            total += math.log(p) if p > 0 else -math.inf
        return total


def random_markov(vocab: int, seed: int, zero_frac: float = 0.0, sharpness: float = 1.0) -> MarkovLM:
    """A random chain; each entry is zeroed with probability ``zero_frac`` (every row keeps at
    least one positive entry); ``sharpness`` > 1 makes rows peakier."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.rand(vocab, vocab, dtype=torch.float64, generator=g) ** sharpness
    zeros = torch.rand(vocab, vocab, dtype=torch.float64, generator=g) < zero_frac
    keep = torch.randint(vocab, (vocab,), generator=g)
    zeros[torch.arange(vocab), keep] = False
    rows = torch.where(zeros, torch.zeros_like(rows), rows + 1e-3)
    return MarkovLM(rows / rows.sum(1, keepdim=True))
