"""config.py: one table of options, validated into typed configs with errors that name the option."""
from __future__ import annotations

import warnings

import pytest

from staged_engine.config import (
    OPTIONS,
    SHAPE_LIMITS,
    STRATEGIES,
    BeamConfig,
    GenerationConfig,
    SpecConfig,
)
from staged_engine.spec.drafters import TreeShape


def test_every_option_is_refused_by_the_strategies_that_do_not_take_it():
    names = {n for opts in OPTIONS.values() for n in opts}
    for strategy in STRATEGIES:
        for name in sorted(names - set(OPTIONS[strategy])):
            with pytest.raises(ValueError, match=name):
                GenerationConfig.make(strategy, num_beams=2 if strategy in ("beam", "dsbd") else 1, **{name: 1})


def test_pinning_a_knob_pins_the_shape():
    cfg = GenerationConfig.make("tree", budget=6, max_depth=3)
    limits = SHAPE_LIMITS["tree"]
    assert cfg.spec == SpecConfig(TreeShape(budget=6, max_depth=3, children=limits.children, expand=limits.expand),
                                  adaptive=False)
    assert GenerationConfig.make("chain", chain_length=4).spec.shape == TreeShape(5, 4, 1, 1)
    assert GenerationConfig.make("chain").spec.adaptive is True
    staged = GenerationConfig.make("staged", temperature=0.8, seed=1, ngram_widths=[3, 1])
    assert staged.spec.ngram_widths == (3, 1) and staged.spec.adaptive  # n-gram widths pin no shape
    assert staged.spec.shape == SHAPE_LIMITS["staged"]
    assert GenerationConfig.make("dsbd", num_beams=4, gamma=2).beam.dsbd.gamma == 2
    assert GenerationConfig.make("beam", num_beams=2, layout="rows").beam == BeamConfig("rows")


@pytest.mark.parametrize("kwargs,needle", [
    (dict(strategy="tree", adaptive="yes"), "adaptive"),
    (dict(strategy="chain", chain_length=0), "chain_length"),
    (dict(strategy="staged", ngram_widths=[]), "ngram_widths"),
    (dict(strategy="staged", ngram_widths="3,1"), "ngram_widths"),
    (dict(strategy="staged", ngram_learn=1), "ngram_learn"),
    (dict(strategy="dsbd", num_beams=2, w_min=3), "w_min"),
    (dict(strategy="beam", layout="grid"), "layout"),
    (dict(strategy="plain", stop_at_eos="no"), "stop_at_eos"),
    (dict(strategy="plain", temperature="hot"), "temperature"),
    (dict(strategy="greedy"), "strategy"),
])
def test_bad_values_name_the_option(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        GenerationConfig.make(**kwargs)


def test_a_seed_is_drawn_only_when_sampling():
    assert GenerationConfig.make("plain").params.seed is None
    assert GenerationConfig.make("plain", temperature=1.0).params.seed is not None


@pytest.mark.parametrize("strategy", ["beam", "dsbd"])
def test_beams_at_temperature_0_warn_that_every_beam_is_the_greedy_path(strategy):
    with pytest.warns(UserWarning, match=r"num_beams=3 at temperature 0: .* all 3 beams are plain greedy"):
        GenerationConfig.make(strategy, num_beams=3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # beams that can differ, or a single beam: nothing to say
        GenerationConfig.make(strategy, num_beams=3, temperature=0.7, seed=1)
        GenerationConfig.make(strategy, num_beams=1)
