"""Which strategy takes which option, and the defaults the command line shows: plain data that
``config`` validates against and the CLI builds its parser from. Nothing here imports torch, so
``staged-engine --help`` answers without loading it."""
from __future__ import annotations

STRATEGIES = ("plain", "chain", "tree", "staged", "beam", "dsbd")

TREE_KNOBS = ("budget", "max_depth", "children", "expand")

# Paper defaults (Qin et al., sec. 5): gamma 4, 8 draft beams, threshold 0.7, W_min 1.
DSBD_DEFAULTS = {"gamma": 4, "draft_width": 8, "threshold": 0.7, "w_min": 1, "dynamic": True,
                 "memory_mode": False}

# "tree": one cache row holding the beams' common prefix and a tree of their suffixes and drafts
# (no padding, no row copies); "rows": one cache row per beam, as in the DSBD paper.
LAYOUTS = ("tree", "rows")
DEFAULT_LAYOUT = "tree"

# Which strategy takes which keyword option: the one table the engine and the CLI read.
OPTIONS: dict[str, tuple[str, ...]] = {
    "plain": (),
    "chain": ("chain_length", "adaptive", "draft_window"),
    "tree": (*TREE_KNOBS, "adaptive", "draft_window"),
    "staged": (*TREE_KNOBS, "adaptive", "draft_window", "ngram_widths", "ngram_learn"),
    "beam": ("layout",),
    "dsbd": ("layout", *DSBD_DEFAULTS, "adaptive", "draft_window"),
}
