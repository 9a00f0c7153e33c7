"""Beam sampling and dynamic-width speculative beam decoding (DSBD) on the engine's models.

ALGORITHMS.md sec. 9. The math (joint beam distributions, layer verification, dynamic width, the
round) lives in ``dsbd_core`` and is exact-law tested there; this module puts real models and
KV caches behind its ``BeamLM`` interface (token sequences -> processed next-token
distributions, one forward pass per call):

- ``beam``: beam sampling with the oracle alone, the reference law: per step one oracle pass
  over the current beams, W candidates drawn i.i.d. from p_beam.
- ``dsbd``: per round the draft runs beam sampling of width W_S for gamma steps (one draft pass
  per layer), the oracle evaluates the whole forest in ONE pass, ``dsbd_core.dsbd_round``
  verifies layer by layer, and both caches keep what the output beams descend from.
  ``memory_mode`` feeds only the best output beam to the next round.

Two cache layouts (option ``layout``), same results draw for draw:

- ``"tree"`` (default, ``TreeLM``): ONE cache row. Committed slots hold the beams' common prefix;
  pending entries hold a tree of every beam's own suffix and the round's drafts; a pass feeds
  only the distinct new nodes with their ancestor mask. No padding, no per-beam cache copies:
  on a CPU, where a pass costs about its token count, this is what makes beams cheap.
- ``"rows"`` (``RowForestLM``, the paper's layout): one cache row per distinct beam, a round's
  drafted tree as that row's tree mask, rows padded with masked dummy nodes to the longest; after
  the round each output beam's path is committed and rows are reselected (copied). For beam
  sampling every beam slot, duplicates included, has its row. Memory mode needs one row.

A node whose sequence repeats another's (beam sampling draws with replacement) is evaluated
once; the core still sees every slot. Both decoders run the whole generation in one ``round``
call and return the best beam's tokens. One ``torch.Generator`` seeded from ``params.seed``
(0 when greedy) drives every draw. The core's sequences start at the prompt's last token (the
cache already holds the rest of the prompt).
"""
from __future__ import annotations

import copy
import time

import numpy as np
import torch

from .backend import Backend
from .dsbd_core import Beams, DSBDConfig, Prefix, TorchRandom, beam_joint, dsbd_round, extend
from .kv_cache import KVCache
from .model import GPT2
from .runner import ModelRunner
from .sampling import SamplingParams, processed_probs
from .strategies import Decoder

# Paper defaults (Qin et al., sec. 5): gamma 4, 8 draft beams, threshold 0.7, W_min 1.
DSBD_OPTIONS = {"gamma": 4, "draft_width": 8, "threshold": 0.7, "w_min": 1, "dynamic": True,
                "memory_mode": False}
# "tree": one cache row holding the beams' common prefix and a tree of their suffixes and drafts
# (no padding, no row copies); "rows": one cache row per beam, as in the DSBD paper.
LAYOUTS = ("tree", "rows")
DEFAULT_LAYOUT = "tree"
PREFILL_CHUNK = 512


def make_beam_decoder(engine, strategy: str, params: SamplingParams, num_beams: int,
                      options: dict) -> Decoder:
    """The decoder for strategy ``"beam"`` or ``"dsbd"`` on ``engine``'s oracle (and draft).

    ``options`` are the strategy's keyword options (``layout`` for both, ``DSBD_OPTIONS`` for
    dsbd); a bad one raises ValueError naming it.
    """
    options = dict(options)
    layout = options.pop("layout", DEFAULT_LAYOUT)
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if strategy == "beam":
        if options:
            raise ValueError(f"unknown option(s) {sorted(options)} for strategy 'beam'; known: ['layout']")
        rows, slack = (1, 4 * num_beams + 1) if layout == "tree" else (num_beams, 1)
        return BeamDecoder(_beam_runner(engine.oracle, engine.backend, rows, slack), params, num_beams,
                           layout, slack)
    if strategy != "dsbd":
        raise ValueError(f"make_beam_decoder handles strategies 'beam' and 'dsbd', got {strategy!r}")
    cfg = dsbd_config(num_beams, options)
    if engine.draft is None:
        raise ValueError("strategy 'dsbd' needs a draft model (Engine.from_pretrained(draft=...))")
    rows = 1 if cfg.memory_mode or layout == "tree" else num_beams
    # Slots past the committed length: a round's forest (root, drafts, the draft's bonus pass),
    # plus in the tree layout the beams' own suffixes (the cache grows if they outgrow it).
    slack = 1 + cfg.draft_width * cfg.gamma + num_beams + (4 * num_beams if layout == "tree" else 0)
    return DSBDDecoder(_beam_runner(engine.oracle, engine.backend, rows, slack),
                       _beam_runner(engine.draft, engine.backend, rows, slack), params, cfg, layout, slack)


def dsbd_config(num_beams: int, options: dict) -> DSBDConfig:
    """Validated ``DSBDConfig`` from the user's options (missing ones take the paper defaults)."""
    unknown = sorted(set(options) - set(DSBD_OPTIONS))
    if unknown:
        raise ValueError(f"unknown option(s) {unknown} for strategy 'dsbd'; "
                         f"known: {list(DSBD_OPTIONS) + ['layout']}")
    opts = {**DSBD_OPTIONS, **options}
    for name in ("gamma", "draft_width", "w_min"):
        v = opts[name]
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
    t = opts["threshold"]
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0.0 <= t <= 1.0:
        raise ValueError(f"threshold must be a number in [0, 1], got {t!r}")
    for name in ("dynamic", "memory_mode"):
        if not isinstance(opts[name], bool):
            raise ValueError(f"{name} must be True or False, got {opts[name]!r}")
    if opts["w_min"] > num_beams:
        raise ValueError(f"w_min must be <= num_beams ({num_beams}), got {opts['w_min']}")
    return DSBDConfig(width=num_beams, draft_width=opts["draft_width"], gamma=opts["gamma"],
                      threshold=float(t), w_min=opts["w_min"], dynamic=opts["dynamic"],
                      memory_mode=opts["memory_mode"])


def _beam_runner(model: GPT2, backend: Backend, rows: int, extra_slots: int) -> ModelRunner:
    """A runner with ``rows`` cache rows and ``extra_slots`` slots past the context window for
    uncommitted tree entries."""
    runner = ModelRunner(model, backend, batch=rows)
    runner.cache = model.new_cache(batch=rows, max_len=model.config.n_positions + extra_slots,
                                   backend=backend)
    return runner


# --------------------------------------------------------------------------------------------
# Multi-row KV cache bookkeeping
# --------------------------------------------------------------------------------------------
class RowCache:
    """A runner's cache as rows that all hold ``length`` committed slots.

    Forward passes go through a view of the first ``rows`` rows (the rest are not computed).
    Slots [0, shared) (the prompt) are the same in every row that was ever filled, so
    reselection copies only what differs.
    """

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.length = 0  # committed slots, in every row in use
        self.shared = 0  # leading slots identical in rows [0, filled)
        self.filled = 1  # rows that hold the shared prefix

    @property
    def cache(self) -> KVCache:
        return self.runner.cache

    def start(self, prefix: list[int]) -> None:
        """Reset the counters and prefill ``prefix`` into row 0."""
        self.runner.reset()
        self.length, self.shared, self.filled = 0, 0, 1
        dev = self.runner.device
        view = self.view(1)
        for i in range(0, len(prefix), PREFILL_CHUNK):
            part = prefix[i:i + PREFILL_CHUNK]
            ids = torch.tensor([part], dtype=torch.int64, device=dev)
            pos = torch.arange(view.lengths[0], view.lengths[0] + len(part), device=dev)[None]
            self.forward(view, ids, pos, None, last_only=True)
            view.advance()
        self.length = self.shared = len(prefix)
        self._sync(1)

    def view(self, rows: int) -> KVCache:
        """A KVCache over rows [0, rows) sharing this cache's storage, nothing pending."""
        if rows > self.cache.batch:
            raise ValueError(f"{rows} beams need {rows} cache rows, the cache has {self.cache.batch}")
        view = copy.copy(self.cache)
        view.k, view.v = self.cache.k[:, :rows], self.cache.v[:, :rows]  # (L, rows, H, S, D)
        view.lengths = [self.length] * rows
        view.pending = 0
        return view

    def forward(self, view: KVCache, tokens: torch.Tensor, positions: torch.Tensor,
                tree_mask: torch.Tensor | None, last_only: bool = False) -> torch.Tensor:
        """One counted model pass over ``view``: tokens, positions (R, N) -> logits (R, N, V)."""
        runner = self.runner
        t0 = time.perf_counter()
        logits = runner.model(tokens, positions, view, tree_mask, last_only)
        runner.forward_seconds += time.perf_counter() - t0
        runner.calls += 1
        runner.nodes += tokens.numel()
        return logits

    def reselect(self, sources: list[int], paths: list[list[int]], pending: int) -> None:
        """Row i <- row sources[i]: its committed slots, then its pending entries ``paths[i]``
        (slot offsets past the committed length, paths[i][0] == 0, all the same length m)
        committed in order. ``pending``: entries written past the committed length. The
        committed length grows by m."""
        k, v = self.cache.k, self.cache.v  # (L, B, H, S, D)
        span = self.length + pending
        changed = [i for i, s in enumerate(sources) if s != i]
        if changed:
            low = 0 if any(i >= self.filled for i in changed) else self.shared
            # Copy each source out first (a destination may be another row's source); per-row
            # copies beat one advanced-index gather/scatter here.
            saved = {s: (k[:, s, :, low:span].clone(), v[:, s, :, low:span].clone())
                     for s in {sources[i] for i in changed}}
            for i in changed:
                k_src, v_src = saved[sources[i]]
                k[:, i, :, low:span].copy_(k_src)
                v[:, i, :, low:span].copy_(v_src)
        backend = self.cache.backend
        for row, path in enumerate(paths):
            if path != list(range(len(path))):
                backend.commit(k, v, row, self.length, path)
        self.filled = max(self.filled, len(sources))
        self.length += len(paths[0])
        self._sync(len(sources))

    def _sync(self, rows: int) -> None:
        """Mirror the bookkeeping in the runner's cache (rows past ``rows`` are unused)."""
        self.cache.lengths = [self.length] * rows + [0] * (self.cache.batch - rows)
        self.cache.pending = 0


class RowForestLM:
    """One model's view of the current DSBD round as a ``dsbd_core.BeamLM``.

    ``probs(seqs)`` evaluates, in one forward pass, the sequences it has not seen in this round
    (each on the cache row of its input beam, as a tree below that row's root) and returns the
    processed next-token distributions at every sequence. Sequences are the core's: they start
    at the prompt's last token; a sequence's *key* is its part from the input beam's last token
    (the round's root, not yet in the cache) on.
    """

    def __init__(self, rows: RowCache, params: SamplingParams) -> None:
        self.rows = rows
        self.params = params
        self.n_in = 0  # length of the round's input sequences
        self.row_of: dict[Prefix, int] = {}
        self.entries: list[dict[Prefix, int]] = []  # per row: key -> pending slot offset
        self.dist: list[dict[Prefix, torch.Tensor]] = []  # per row: key -> (V,) float64
        self.view: KVCache | None = None
        self.nodes = 0  # distinct nodes evaluated over the generation
        self.batch_tokens = 0  # rows x nodes per pass, padding included

    def start(self, prompt: list[int]) -> None:
        """Prefill all of ``prompt`` but its last token, which starts the first round's beam."""
        self.rows.start(prompt[:-1])
        self.begin([tuple(prompt[-1:])])

    def keep(self, outputs: list[Prefix]) -> None:
        """The next round's distinct input beams are ``outputs``: commit, reselect, begin."""
        self.finish(outputs)
        self.begin(outputs)

    def begin(self, inputs: list[Prefix]) -> None:
        """A new round whose distinct input beams sit on rows 0..len(inputs)-1."""
        self.n_in = len(inputs[0])
        self.row_of = {s: i for i, s in enumerate(inputs)}
        self.entries = [{} for _ in inputs]
        self.dist = [{} for _ in inputs]
        self.view = self.rows.view(len(inputs))

    def probs(self, prefixes) -> torch.Tensor:
        """(n, V) float64 p'(. | prefix) for each prefix; unseen ones cost one forward pass."""
        where = []
        new: list[list[Prefix]] = [[] for _ in self.entries]
        for seq in prefixes:
            row, key = self.row_of[seq[:self.n_in]], seq[self.n_in - 1:]
            if key not in self.entries[row] and key not in new[row]:
                new[row].append(key)
            where.append((row, key))
        if any(new):
            self._evaluate(new)
        return torch.stack([self.dist[row][key] for row, key in where])

    def _evaluate(self, new: list[list[Prefix]]) -> None:
        view = self.view
        rows, width, pending = len(new), max(len(keys) for keys in new), view.pending
        tokens = np.zeros((rows, width), dtype=np.int64)
        positions = np.full((rows, width), self.rows.length, dtype=np.int64)
        mask = np.zeros((rows, width, pending + width), dtype=np.bool_)  # (R, N, P + N)
        real_rows, real_cols, real_keys = [], [], []
        for r, keys in enumerate(new):
            entries = self.entries[r]
            for i, key in enumerate(sorted(keys, key=len)):  # parents before children
                entries[key] = pending + i
                tokens[r, i] = key[-1]
                positions[r, i] = self.rows.length + len(key) - 1
                for j in range(1, len(key) + 1):  # ancestors, the node itself included
                    mask[r, i, entries[key[:j]]] = True
                real_rows.append(r)
                real_cols.append(i)
                real_keys.append(key)
            for i in range(len(keys), width):  # padding: a dummy that sees only itself
                mask[r, i, pending + i] = True
        dev = self.rows.runner.device
        logits = self.rows.forward(view, torch.from_numpy(tokens).to(dev),
                                   torch.from_numpy(positions).to(dev),
                                   torch.from_numpy(mask).to(dev))  # (R, N, V)
        real = logits[torch.tensor(real_rows), torch.tensor(real_cols)]  # (M, V)
        dist = processed_probs(real, self.params).double().cpu()  # (M, V)
        for m, (r, key) in enumerate(zip(real_rows, real_keys)):
            self.dist[r][key] = dist[m]
        self.nodes += len(real_keys)
        self.batch_tokens += rows * width

    def finish(self, outputs: list[Prefix]) -> None:
        """Commit each distinct output beam's path (its tokens but the last, which is the next
        round's root) and move it to row i for output i."""
        sources, paths = [], []
        for seq in outputs:
            row = self.row_of[seq[:self.n_in]]
            entries = self.entries[row]
            steps = len(seq) - self.n_in
            paths.append([entries[seq[self.n_in - 1:self.n_in + j]] for j in range(steps)])
            sources.append(row)
        self.rows.reselect(sources, paths, self.view.pending)


class TreeLM:
    """One model's single cache row as a ``dsbd_core.BeamLM`` over a prefix-shared beam tree.

    The committed slots hold what every current beam shares (the prompt and the beams' common
    ancestry); the pending entries after them form a tree that persists across rounds: every
    beam's own suffix, plus whatever was evaluated since (drafted nodes). ``probs(seqs)``
    evaluates the sequences not seen yet in one pass (tree mask: each node's ancestors) and
    returns p' at each; a sequence's *key* is its part past the committed tokens. ``keep(beams)``
    drops the entries no surviving beam descends from, commits the beams' new common part and
    compacts the rest. No padding and no per-beam copies of the cache: a pass costs the number
    of distinct new nodes.
    """

    def __init__(self, runner: ModelRunner, params: SamplingParams, slack: int) -> None:
        self.runner = runner
        self.params = params
        self.slack = slack  # slots past the context window the cache starts with (and grows by)
        self.base = 0  # tokens of the core's sequences that are committed
        self.entries: dict[Prefix, int] = {}  # key -> pending offset
        self.keys: list[Prefix] = []  # pending offset -> key
        self.ancestors: list[np.ndarray] = []  # pending offset -> offsets of its ancestors and itself
        self.dist: dict[Prefix, torch.Tensor] = {}  # key -> (V,) float64 p' after that sequence
        self.nodes = 0  # nodes evaluated over the generation (the oracle-pass tokens)
        self.batch_tokens = 0
        self.peak_pending = 0  # largest tree kept between rounds

    @property
    def cache(self) -> KVCache:
        return self.runner.cache

    def start(self, prompt: list[int]) -> None:
        """Prefill all of ``prompt`` but its last token, which starts the first beam."""
        self.runner.reset()
        self.runner.prefill(prompt[:-1])
        self.base = 0
        self.entries, self.keys, self.ancestors, self.dist = {}, [], [], {}

    def probs(self, prefixes) -> torch.Tensor:
        """(n, V) float64 p'(. | prefix) for each prefix; unseen ones cost one forward pass."""
        wanted, new = [], {}
        for seq in prefixes:
            key = seq[self.base:]
            if key not in self.dist:
                new[key] = None
            wanted.append(key)
        if new:
            self._evaluate(sorted(new, key=len))  # parents before children
        return torch.stack([self.dist[key] for key in wanted])

    def _evaluate(self, keys: list[Prefix]) -> None:
        cache, n = self.cache, len(keys)
        pending, length = cache.pending, cache.lengths[0]
        self._ensure(length + pending + n)
        mask = np.zeros((n, pending + n), dtype=np.bool_)  # (N, P + N)
        for i, key in enumerate(keys):
            offset = pending + i
            parent = self.entries.get(key[:-1])  # None: the parent is committed
            if parent is None and len(key) > 1:
                raise RuntimeError(f"tree node {key} has no evaluated parent")
            anc = np.array([offset]) if parent is None else np.append(self.ancestors[parent], offset)
            mask[i, anc] = True
            self.entries[key] = offset
            self.keys.append(key)
            self.ancestors.append(anc)
        positions = [length + len(key) - 1 for key in keys]
        logits = self.runner.forward_nodes([key[-1] for key in keys], positions,
                                           torch.from_numpy(mask).to(self.runner.device))  # (N, V)
        dist = processed_probs(logits, self.params).double().cpu()  # (N, V)
        for i, key in enumerate(keys):
            self.dist[key] = dist[i]
        self.nodes += n
        self.batch_tokens += n

    def _ensure(self, slots: int) -> None:
        """Grow the cache (a copy) when the tree outgrows it; rare, amortised."""
        old = self.cache
        if slots <= old.max_len:
            return
        model = self.runner.model
        new = model.new_cache(batch=1, max_len=slots + self.slack, backend=old.backend)
        used = old.lengths[0] + old.pending
        new.k[:, :, :, :used] = old.k[:, :, :, :used]
        new.v[:, :, :, :used] = old.v[:, :, :, :used]
        new.lengths, new.pending = list(old.lengths), old.pending
        self.runner.cache = new

    def keep(self, beams: list[Prefix]) -> None:
        """The surviving (distinct, equally long) beams: keep the entries they descend from."""
        keys = [seq[self.base:] for seq in beams]
        kept: set[int] = set()
        for key in keys:
            node = self.entries.get(key, self.entries.get(key[:-1]))  # deepest evaluated node
            if node is not None:
                kept.update(self.ancestors[node].tolist())
        # The common part of every beam (their last tokens excepted) becomes committed; it is
        # made of ancestors of every other kept node, so it comes first in slot order.
        common = 0
        shortest = min(len(key) for key in keys) - 1
        while common < shortest and all(key[common] == keys[0][common] for key in keys):
            common += 1
        order = sorted(kept)
        cache = self.cache
        length = cache.lengths[0]
        if order != list(range(len(order))):
            cache.backend.commit(cache.k, cache.v, 0, length, order)
        remap = np.full(len(self.keys), -1, dtype=np.int64)
        remap[order[common:]] = np.arange(len(order) - common)
        keys_new, anc_new, dist_new = [], [], {}
        for off in order[common:]:
            key = self.keys[off]
            anc = remap[self.ancestors[off]]
            keys_new.append(key[common:])
            anc_new.append(anc[anc >= 0])
            dist_new[key[common:]] = self.dist[key]
        self.keys, self.ancestors, self.dist = keys_new, anc_new, dist_new
        self.entries = {key: i for i, key in enumerate(keys_new)}
        self.base += common
        cache.lengths = [length + common]
        cache.pending = len(keys_new)
        self.peak_pending = max(self.peak_pending, cache.pending)


def _distinct(seqs: list[Prefix]) -> list[Prefix]:
    return list(dict.fromkeys(seqs))


def _generator(params: SamplingParams) -> TorchRandom:
    return TorchRandom(torch.Generator().manual_seed(params.seed if params.seed is not None else 0))


# --------------------------------------------------------------------------------------------
# Decoders
# --------------------------------------------------------------------------------------------
class _BeamBase(Decoder):
    """Shared by both: the oracle's beam LM, the final beams and their stats."""

    def __init__(self, oracle: ModelRunner, params: SamplingParams, width: int, layout: str,
                 slack: int) -> None:
        super().__init__(oracle, params, None)
        self.width = width
        self.layout = layout
        self.oracle_lm = _beam_lm(oracle, params, layout, slack)
        self.prompt: list[int] = []
        self.final: Beams | None = None
        self.stats: dict = {}
        self._view: KVCache | None = None  # rows layout: the rows of the current beam step

    def start(self, prompt: list[int]) -> None:
        self.prompt = list(prompt)
        self.oracle_lm.start(self.prompt)
        self.accepted_lengths = []
        self.final = None
        self.stats = {}

    def _best_tokens(self, beams: Beams) -> list[int]:
        self.final = beams
        return list(beams.seqs[beams.best()][1:])

    def extra_stats(self) -> dict:
        """Beam statistics for ``res.stats``: final beams (generated tokens) and their oracle
        log-scores, the best beam's index, widths per layer, cache footprint and counters."""
        out = {"num_beams": self.width, "layout": self.layout, **self.stats,
               "oracle_cache_rows": self.oracle.cache.batch,
               "oracle_cache_bytes": self.oracle.cache.nbytes}
        if self.final is not None:
            out["beam_scores"] = [float(x) for x in self.final.log_p]
            out["beam_token_ids"] = [list(s[1:]) for s in self.final.seqs]
            out["best_beam"] = self.final.best()
        return out


def _beam_lm(runner: ModelRunner, params: SamplingParams, layout: str, slack: int):
    return TreeLM(runner, params, slack) if layout == "tree" else RowForestLM(RowCache(runner), params)


class BeamDecoder(_BeamBase):
    """Beam sampling with the oracle alone (ALGORITHMS.md sec. 9, the reference law)."""

    name = "beam"

    def round(self, remaining: int) -> list[int]:
        """The whole generation: ``remaining`` steps; returns the best beam's tokens."""
        source = _generator(self.params)
        beams = Beams.start(self.prompt[-1:])
        step_fn = self._step_tree if self.layout == "tree" else self._step_rows
        for step in range(remaining):
            cond = step_fn(beams)  # (n, V) float64 at the n current beams
            draws = source.categorical(beam_joint(beams.log_p, cond), self.width)
            beams = extend(beams, cond, cond, draws)
            if step + 1 < remaining:
                self._advance(beams, [c // cond.shape[1] for c in draws])
        self.accepted_lengths = [1] * remaining
        self.stats = {"beam_widths": [self.width] * remaining}
        if self.layout == "tree":
            self.stats["oracle_tree_peak"] = self.oracle_lm.peak_pending  # entries kept between steps
        return self._best_tokens(beams)

    def _step_tree(self, beams: Beams) -> torch.Tensor:
        return self.oracle_lm.probs(beams.seqs)  # one pass over the distinct beams

    def _step_rows(self, beams: Beams) -> torch.Tensor:
        """One pass over one cache row per beam slot (duplicates included)."""
        rows = self.oracle_lm.rows
        n, dev = len(beams.seqs), self.oracle.device
        self._view = rows.view(n)
        tokens = torch.tensor([[s[-1]] for s in beams.seqs], dtype=torch.int64, device=dev)
        positions = torch.full((n, 1), rows.length, dtype=torch.int64, device=dev)
        logits = rows.forward(self._view, tokens, positions, None)[:, 0]  # (n, V)
        return processed_probs(logits, self.params).double().cpu()

    def _advance(self, beams: Beams, parents: list[int]) -> None:
        if self.layout == "tree":
            self.oracle_lm.keep(_distinct(beams.seqs))
        else:  # row i <- the row of beam i's parent, with the parent's token committed
            self.oracle_lm.rows.reselect(parents, [[0]] * len(parents), self._view.pending)


class DSBDDecoder(_BeamBase):
    """Dynamic-width speculative beam decoding (ALGORITHMS.md sec. 9) on a draft and an oracle."""

    name = "dsbd"

    def __init__(self, oracle: ModelRunner, draft: ModelRunner, params: SamplingParams,
                 cfg: DSBDConfig, layout: str, slack: int) -> None:
        super().__init__(oracle, params, cfg.width, layout, slack)
        self.draft = draft
        self.draft_lm = _beam_lm(draft, params, layout, slack)
        self.cfg = cfg

    def start(self, prompt: list[int]) -> None:
        super().start(prompt)
        self.draft_lm.start(self.prompt)

    def draft_calls(self) -> int:
        return self.draft.calls

    def draft_seconds(self) -> float:
        return self.draft.forward_seconds

    def draft_weight_bytes(self) -> int:
        model = self.draft.model
        return self.draft.calls * model.config.weight_bytes_fp32 * model.wte.weight.element_size() // 4

    def round(self, remaining: int) -> list[int]:
        """The whole generation: rounds until ``remaining`` layers; returns the best beam's tokens."""
        cfg, source = self.cfg, _generator(self.params)
        oracle_lm, draft_lm = self.oracle_lm, self.draft_lm
        core: dict = {"rounds": 0, "oracle_calls": 0, "oracle_rows": 0, "draft_calls": 0,
                      "widths": [], "drafted": [], "accepted": [], "input_beams": []}
        beams, done = Beams.start(self.prompt[-1:]), 0
        while done < remaining:
            core["rounds"] += 1
            core["input_beams"].append(len(beams.seqs))
            beams, advanced = dsbd_round(oracle_lm, draft_lm, beams, remaining - done, cfg, source, core)
            done += advanced
            self.accepted_lengths.append(advanced)
            if done < remaining:
                if cfg.memory_mode:
                    beams = beams.select([beams.best()])
                outputs = _distinct(beams.seqs)
                oracle_lm.keep(outputs)
                draft_lm.keep(outputs)
        # Slots drafts could fill: a layer takes at most its width of them.
        fillable = sum(min(d, w) for d, w in zip(core["drafted"], core["widths"]))
        self.stats = {
            "dsbd_options": {"gamma": cfg.gamma, "draft_width": cfg.draft_width,
                             "threshold": cfg.threshold, "w_min": cfg.w_min,
                             "dynamic": cfg.dynamic, "memory_mode": cfg.memory_mode},
            "rounds": core["rounds"],
            "beam_widths": core["widths"],  # width chosen per output layer
            "beams_drafted": core["drafted"],  # drafts open to verification per layer
            "beams_accepted": core["accepted"],  # drafts accepted per layer
            "draft_acceptance": sum(core["accepted"]) / fillable if fillable else 0.0,
            "input_beams": core["input_beams"],  # beams fed to each round
            "oracle_forest_nodes": oracle_lm.nodes,  # nodes the oracle evaluated
            "oracle_batch_tokens": oracle_lm.batch_tokens,  # rows x nodes, padding included
            "draft_batch_tokens": draft_lm.batch_tokens,
            "draft_cache_rows": self.draft.cache.batch,
        }
        if self.layout == "tree":
            self.stats["oracle_tree_peak"] = oracle_lm.peak_pending  # entries kept between rounds
        return self._best_tokens(beams)
