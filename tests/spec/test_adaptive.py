"""The per-round depth choice (strategies.DepthController): it plays the arm with the most
tokens per second, falls back to plain steps when speculation does not pay, follows a change of
text, and never changes the output (only the oracle decides what is emitted)."""
from __future__ import annotations

import pytest
import torch

from staged_engine import Engine
from staged_engine.spec.decoders import DepthController
from staged_engine.spec.drafters import TreeShape

VOCAB = 997


def _drive(ctl: DepthController, rounds: int, tokens_of, seconds_of) -> list[int]:
    """Simulate ``rounds`` rounds where depth d emits tokens_of(d) tokens in seconds_of(d) s."""
    played = []
    for _ in range(rounds):
        arm = ctl.choose()
        d = ctl.depths[arm]
        ctl.update(arm, tokens_of(d), seconds_of(d))
        played.append(d)
    return played


def test_arms_and_budgets_follow_the_shape():
    ctl = DepthController(TreeShape(budget=13, max_depth=6, children=2, expand=2))
    assert ctl.depths == [0, 1, 2, 4, 6]
    assert ctl.limits(0) == (1, 0)  # a plain step
    assert ctl.limits(len(ctl.depths) - 1) == (13, 6)  # the shape itself
    assert all(b >= d + 1 for b, d in map(ctl.limits, range(1, len(ctl.depths))))


def test_plays_the_fastest_arm():
    # Every draft token is accepted with probability 0.8 (expected tokens of a chain of depth d:
    # (1 - 0.8^(d+1)) / 0.2); a round costs 10 ms plus 2 ms per depth.
    ctl = DepthController(TreeShape(budget=9, max_depth=8, children=1, expand=1))
    tokens = lambda d: (1 - 0.8 ** (d + 1)) / 0.2  # noqa: E731
    seconds = lambda d: 0.010 + 0.002 * d  # noqa: E731
    best = max(ctl.depths, key=lambda d: tokens(d) / seconds(d))
    played = _drive(ctl, 200, tokens, seconds)
    assert played[-100:].count(best) >= 85  # exploration takes at most 1 round in 8


def test_falls_back_to_plain_when_speculation_loses():
    # A draft as slow as the oracle that is never right: every depth > 0 loses.
    ctl = DepthController(TreeShape(budget=5, max_depth=4, children=1, expand=1))
    played = _drive(ctl, 160, lambda d: 1, lambda d: 0.01 * (1 + d))
    assert played[-80:].count(0) >= 70


def test_follows_a_change_of_text():
    ctl = DepthController(TreeShape(budget=9, max_depth=8, children=1, expand=1))
    _drive(ctl, 100, lambda d: 1, lambda d: 0.01 * (1 + d))  # speculation useless
    played = _drive(ctl, 120, lambda d: d + 1, lambda d: 0.01 + 0.001 * d)  # everything accepted
    assert played[-40:].count(8) >= 34


@pytest.mark.parametrize("bad", [dict(explore_every=1), dict(decay=1.0), dict(decay=0.0)])
def test_bad_controller_settings_are_refused(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        DepthController(TreeShape(), **bad)


@pytest.fixture(scope="module")
def engine(pair):
    oracle, draft = pair
    return Engine.from_pretrained(oracle, draft=draft)


def _prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (int(torch.randint(2, 30, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


@pytest.mark.parametrize("strategy", ["chain", "tree"])
@pytest.mark.parametrize("kw", [dict(), dict(temperature=0.8, top_p=0.95, seed=4), dict(temperature=1.0, top_k=50, seed=9)])
def test_adaptive_and_fixed_both_equal_plain(engine, strategy, kw):
    for prompt in _prompts(3, 5):
        ref = engine.generate(prompt, max_new_tokens=40, strategy="plain", **kw).token_ids
        adaptive = engine.generate(prompt, max_new_tokens=40, strategy=strategy, **kw)
        fixed = engine.generate(prompt, max_new_tokens=40, strategy=strategy, adaptive=False, **kw)
        assert adaptive.token_ids == ref and fixed.token_ids == ref
        assert "adaptive" in adaptive.stats and "adaptive" not in fixed.stats
        rounds = sum(v["rounds"] for v in adaptive.stats["adaptive"].values())
        assert rounds == adaptive.stats["oracle_calls"]


def test_a_pinned_shape_is_not_adapted(engine):
    res = engine.generate([1, 2, 3], max_new_tokens=12, strategy="tree", budget=5, max_depth=2)
    assert "adaptive" not in res.stats
    res = engine.generate([1, 2, 3], max_new_tokens=12, strategy="tree", budget=5, max_depth=2, adaptive=True)
    assert "adaptive" in res.stats


@pytest.mark.parametrize("bad", ["yes", 1, None])
def test_bad_adaptive_is_refused(engine, bad):
    with pytest.raises(ValueError, match="adaptive"):
        engine.generate([1, 2, 3], max_new_tokens=4, strategy="chain", adaptive=bad)
    with pytest.raises(ValueError, match="plain"):
        engine.generate([1, 2, 3], max_new_tokens=4, strategy="plain", adaptive=True)
