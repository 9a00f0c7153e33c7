"""What one generation asks for, validated in one place.

``GenerationConfig.make`` turns the keyword arguments of ``Engine.generate`` / ``stream`` (and of
the CLI and the server, which pass the same names) into typed configs: the sampling rule
(``SamplingParams``), and for the speculative strategies a ``SpecConfig`` (the tree shape, whether
its depth adapts, the n-gram stage), for beams a ``BeamConfig`` (the cache layout and, for DSBD,
a ``DSBDConfig``). ``OPTIONS`` (in ``staged_engine.options``, plain data the CLI's parser reads
too) is the one table of which strategy takes which option; a bad value or an option the
strategy does not take raises ValueError naming it. What depends on the engine's models (is
there a draft, an n-gram table) is checked by the engine.
"""
from __future__ import annotations

import random
import warnings
from dataclasses import dataclass

from staged_engine.beam.core import DSBDConfig
from staged_engine.checks import check_int, is_int
from staged_engine.options import (DEFAULT_LAYOUT, DSBD_DEFAULTS, LAYOUTS, OPTIONS,  # noqa: F401 (config's names)
                                   STRATEGIES, TREE_KNOBS)
from staged_engine.sampling import SamplingParams
from staged_engine.spec.drafters import TreeShape


# The largest tree each speculative strategy may build. These are limits, not tuned shapes: by
# default spec.planner.RoundPlanner decides every round, from this machine's measured forward
# costs and the acceptance it observes, how many draft passes to run and which nodes to verify
# (none: a plain step). Pinning any shape knob plays that shape every round instead (unless the
# call also passes adaptive=True, which plans within the pinned limits).
SHAPE_LIMITS = {
    "chain": TreeShape(budget=17, max_depth=16, children=1, expand=1),
    "tree": TreeShape(budget=32, max_depth=12, children=4, expand=4),
    "staged": TreeShape(budget=17, max_depth=16, children=1, expand=1),
}
# The n-gram stage's mini-tree below the draft's best path: a chain of its 6 likeliest tokens.
DEFAULT_NGRAM_WIDTHS = (1,) * 6
# The most context the draft model catches up on at once (``ModelDrafter.window``); None: all.
# A catch-up (the prompt, or what plain steps left before a drafted round) costs the draft a
# pass over every token of it; a draft guesses from the text's last few dozen tokens. Demo pair,
# 24 held-out prompts (32-386 tokens), a fixed chain of 2, 128 new tokens, in one process (AVX2
# Zen 1): tokens per oracle call with the whole text / the last 64 / 32 / 16 tokens 2.43 / 2.45 /
# 2.46 / 2.44 greedy, 1.98 / 1.98 / 1.96 / 1.95 at T 0.8 / top-p 0.95, 1.97 / 1.95 / 1.94 / 1.94
# at T 1 / top-k 50, and the whole generation against plain decoding 1.206 / 1.227 / 1.246 /
# 1.237x, 0.994 / 1.004 / 1.008 / 0.997x and 0.988 / 1.004 / 1.010 / 0.989x. 64 keeps what a
# draft reads from a longer context; the outputs never depend on it.
DEFAULT_DRAFT_WINDOW: int | None = 64



def _check_bool(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")
    return value


def _draft_window(options: dict) -> int | None:
    """The ``draft_window`` option (the default when absent; None: no window), an integer >= 1."""
    window = options.get("draft_window", DEFAULT_DRAFT_WINDOW)
    return window if window is None else check_int("draft_window", window)


def check_options(strategy: str, options: dict) -> None:
    """ValueError naming any option ``strategy`` does not take, and which strategies do take it."""
    known = OPTIONS[strategy]
    unknown = sorted(set(options) - set(known))
    if not unknown:
        return
    if not known:
        raise ValueError(f"strategy {strategy!r} takes no options, got {unknown}")
    owners = {name: [s for s, names in OPTIONS.items() if name in names] for name in unknown}
    hint = "; ".join(f"{name} is an option of {', '.join(map(repr, who))}" for name, who in owners.items() if who)
    raise ValueError(f"unknown option(s) {unknown} for strategy {strategy!r}; known: {list(known)}"
                     + (f" ({hint})" if hint else ""))


@dataclass(frozen=True)
class SpecConfig:
    """chain / tree / staged: the tree shape (the planner's limits when ``adaptive``, else the
    shape every round plays), and the n-gram stage's mini-tree widths (staged only)."""

    shape: TreeShape
    adaptive: bool
    ngram_widths: tuple[int, ...] = ()
    ngram_learn: bool = False
    draft_window: int | None = DEFAULT_DRAFT_WINDOW

    @classmethod
    def from_options(cls, strategy: str, options: dict) -> "SpecConfig":
        check_options(strategy, options)
        shape = SHAPE_LIMITS[strategy]
        if strategy == "chain":
            k = check_int("chain_length", options.get("chain_length", shape.max_depth))
            shape = TreeShape(budget=k + 1, max_depth=k, children=1, expand=1)
        else:
            shape = TreeShape(**{f: options.get(f, getattr(shape, f)) for f in TREE_KNOBS})
        pinned = any(k in options for k in (*TREE_KNOBS, "chain_length"))
        adaptive = _check_bool("adaptive", options.get("adaptive", not pinned))
        window = _draft_window(options)
        if strategy != "staged":
            return cls(shape, adaptive, draft_window=window)
        widths = options.get("ngram_widths", DEFAULT_NGRAM_WIDTHS)
        if isinstance(widths, (str, bytes)) or not hasattr(widths, "__iter__"):
            raise ValueError(f"ngram_widths must be a non-empty sequence of integers >= 1, got {widths!r}")
        widths = tuple(widths)
        if not widths or any(not is_int(w) or w < 1 for w in widths):
            raise ValueError(f"ngram_widths must be a non-empty sequence of integers >= 1, got {widths!r}")
        return cls(shape, adaptive, widths, _check_bool("ngram_learn", options.get("ngram_learn", False)), window)


@dataclass(frozen=True)
class BeamConfig:
    """beam / dsbd: the cache layout and, for dsbd, the DSBD knobs. ``adaptive`` (dsbd): each
    round's number of drafted layers, 0 to ``gamma``, is chosen by the clock
    (``spec.planner.dsbd_arms``). Every choice has the same law, but the rounds consume the
    random stream differently, so a seed fixes the draws only when the rounds are fixed, and
    memory mode's law depends on where rounds end: the default is adaptive unless ``gamma`` is
    pinned, the request samples with a seed of its own or asks for memory mode."""

    layout: str
    dsbd: DSBDConfig | None = None
    adaptive: bool = False
    # dsbd: the most of the prompt the draft prefills (its last N tokens before the last, at the
    # draft's own positions 0..; None: all of it), as ``SpecConfig.draft_window`` bounds a
    # catch-up: a draft pass then attends over at most N + the beams' tokens. With a fixed width
    # the draws' law is beam sampling's whatever the draft (the law tests enumerate drafts), so
    # the window changes the draws, never their law; with a dynamic width the widths follow the
    # draft's scores, and the window is part of the draft, as the choice of draft is. Demo pair,
    # AVX2 Zen 3, 12 held-out prompts x 64 tokens, 4 beams, T 0.8 / top-p 0.95, the paper's
    # dynamic DSBD (gamma 4) with and without the window alternating in one process, 3 repeats:
    # 1.14x and 1.15x faster in two runs, the oracle's mean log-prob per token -2.44 against
    # -2.62 (beam sampling's -1.42); with a fixed width (the planner drafting in under 2% of
    # rounds there) the window ran 0.970x and 1.005x at 2 beams and 1.003x at 4.
    draft_window: int | None = DEFAULT_DRAFT_WINDOW

    @classmethod
    def from_options(cls, strategy: str, num_beams: int, options: dict, seeded: bool = False) -> "BeamConfig":
        check_options(strategy, options)
        layout = options.get("layout", DEFAULT_LAYOUT)
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        if strategy == "beam":
            return cls(layout)
        pinned = "gamma" in options or seeded or options.get("memory_mode", False) is True
        adaptive = _check_bool("adaptive", options.get("adaptive", not pinned))
        window = _draft_window(options)
        knobs = {k: v for k, v in options.items() if k not in ("layout", "adaptive", "draft_window")}
        opts = {**DSBD_DEFAULTS, **knobs}
        for name in ("gamma", "draft_width", "w_min"):
            check_int(name, opts[name])
        t = opts["threshold"]
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0.0 <= t <= 1.0:
            raise ValueError(f"threshold must be a number in [0, 1], got {t!r}")
        for name in ("dynamic", "memory_mode"):
            _check_bool(name, opts[name])
        if opts["w_min"] > num_beams:
            raise ValueError(f"w_min must be <= num_beams ({num_beams}), got {opts['w_min']}")
        return cls(layout, DSBDConfig(width=num_beams, draft_width=opts["draft_width"], gamma=opts["gamma"],
                                      threshold=float(t), w_min=opts["w_min"], dynamic=opts["dynamic"],
                                      memory_mode=opts["memory_mode"]), adaptive, window)


@dataclass(frozen=True)
class GenerationConfig:
    """One generation's request, validated: build it with ``make``."""

    strategy: str
    max_new_tokens: int
    params: SamplingParams  # the seed is drawn here when sampling without one
    num_beams: int = 1
    stop_at_eos: bool = True
    token_healing: bool = False
    spec: SpecConfig | None = None  # chain / tree / staged
    beam: BeamConfig | None = None  # beam / dsbd

    @classmethod
    def make(cls, strategy: str = "staged", max_new_tokens: int = 128, temperature: float = 0.0,
             top_k: int = 0, top_p: float = 1.0, seed: int | None = None, num_beams: int = 1,
             stop_at_eos: bool = True, token_healing: bool = False, **options) -> "GenerationConfig":
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
        check_int("max_new_tokens", max_new_tokens)
        check_int("num_beams", num_beams)
        if num_beams > 1 and strategy not in ("beam", "dsbd"):
            raise ValueError(f"num_beams > 1 needs strategy 'beam' or 'dsbd', got {strategy!r}")
        sampling = isinstance(temperature, (int, float)) and not isinstance(temperature, bool) and temperature > 0
        seeded = sampling and seed is not None  # the caller's own seed, which must fix the draws
        if seed is None and sampling:
            seed = random.getrandbits(63)
        params = SamplingParams(temperature, top_k, top_p, seed)
        _check_bool("token_healing", token_healing)
        _check_bool("stop_at_eos", stop_at_eos)
        if num_beams > 1 and not sampling:
            # Beam sampling's law (ALGORITHMS.md sec. 9) at temperature 0: every beam takes the
            # argmax, so the W beams are W copies of the greedy path (HF's num_beams with
            # do_sample=False is beam search, a different law). Exact, so allowed, but said: on
            # the demo pair (AVX2 Zen 3, 6 prompts x 64 tokens) 4 such beams took 2.0x plain
            # decoding's time in the tree layout, 3.6x in rows, 3.7x with dsbd.
            warnings.warn(f"num_beams={num_beams} at temperature 0: beam sampling gives every beam the greedy "
                          f"choice, so all {num_beams} beams are plain greedy decoding's tokens, at the cost "
                          f"of {num_beams} beams; set a temperature > 0 for beams that differ",
                          UserWarning, stacklevel=3)
        spec = beam = None
        if strategy in ("chain", "tree", "staged"):
            spec = SpecConfig.from_options(strategy, options)
        elif strategy in ("beam", "dsbd"):
            beam = BeamConfig.from_options(strategy, num_beams, options, seeded)
        else:
            check_options(strategy, options)
        return cls(strategy, max_new_tokens, params, num_beams, stop_at_eos, token_healing, spec, beam)
