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
once; the core still sees every slot. One round is one oracle pass, as for every strategy: the
decoder runs the core's own ``BeamSampling`` / ``DSBDRun`` one step per ``round`` (the
reference functions ``beam_sample`` and ``dsbd_generate`` loop over the same objects, so the
engine and the reference cannot drift apart), and emits the tokens every live beam shares as
soon as they are fixed: they are certain to begin the best final beam. The last round emits
the rest of the best beam. One ``torch.Generator`` seeded from ``params.seed`` (0 when greedy)
drives every draw. The core's sequences start at the prompt's last token (the cache already
holds the rest of the prompt).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from staged_engine.beam.core import (
    CATCH_UP_NODES,
    Beams,
    BeamSampling,
    DSBDConfig,
    DSBDRun,
    Prefix,
    TorchRandom,
    distinct,
)
from staged_engine.model.backend import Backend, device_memory
from staged_engine.model.gpt2 import GPT2
from staged_engine.model.kv_cache import KVCache
from staged_engine.model.runner import ModelRunner
from staged_engine.sampling import SamplingConfig, SamplingParams, processed_probs
from staged_engine.spec.decoders import Decoder, RoundClock
from staged_engine.spec.planner import PlannerMemory

if TYPE_CHECKING:  # the engine validates options into it (staged_engine.config)
    from staged_engine.config import BeamConfig

PREFILL_CHUNK = 512  # prompt tokens per prefill pass on the stock path


def make_beam_decoder(engine, strategy: str, sampling: SamplingConfig, num_beams: int,
                      config: BeamConfig, memory: PlannerMemory | None = None) -> Decoder:
    """The decoder for strategy ``"beam"`` or ``"dsbd"`` on ``engine``'s oracle (and draft);
    ``memory``: DSBD's planner memory (None: every round drafts ``gamma`` layers)."""
    layout = config.layout
    if strategy == "beam":
        rows, slack = (1, 4 * num_beams + 1) if layout == "tree" else (num_beams, 1)
        check_fits(num_beams, [(engine.oracle, rows, slack)])
        return BeamDecoder(_beam_runner(engine.oracle, engine.backend, rows, slack), sampling, num_beams,
                           layout, slack)
    if strategy != "dsbd" or config.dsbd is None:
        raise ValueError(f"make_beam_decoder handles strategies 'beam' and 'dsbd', got {strategy!r}")
    cfg = config.dsbd
    if engine.draft is None:
        raise ValueError("strategy 'dsbd' needs a draft model (Engine.from_pretrained(draft=...))")
    rows = 1 if cfg.memory_mode or layout == "tree" else num_beams
    # Slots past the committed length: a round's forest (root, drafts, the draft's bonus pass),
    # plus in the tree layout the beams' own suffixes (the cache grows if they outgrow it).
    slack = 1 + cfg.draft_width * cfg.gamma + num_beams + (4 * num_beams if layout == "tree" else 0)
    # The draft's catch-up on skipped beam-sampling steps puts up to max(CATCH_UP_NODES, W)
    # nodes on one row.
    draft_slack = slack + (max(CATCH_UP_NODES, num_beams) if memory is not None else 0)
    check_fits(num_beams, [(engine.oracle, rows, slack), (engine.draft, rows, draft_slack)])
    return DSBDDecoder(_beam_runner(engine.oracle, engine.backend, rows, slack),
                       _beam_runner(engine.draft, engine.backend, rows, draft_slack), sampling, cfg, layout,
                       slack, memory, config.draft_window)


def check_fits(num_beams: int, runners: list[tuple[GPT2, int, int]]) -> None:
    """Refuse a width whose K/V caches (each ``(model, rows, extra_slots)`` of ``_beam_runner``)
    and per-beam scores over the vocabulary (two copies) cannot fit the device's memory: a
    ValueError naming ``num_beams``, not the allocator's failure a step later (``num_beams``
    10**6 on the demo pair asked for 33-41 GB at once)."""
    model = runners[0][0]
    need = 2 * num_beams * model.config.vocab_size * 4
    for m, rows, slots in runners:
        c = m.config
        need += 2 * c.n_layer * rows * (c.n_positions + slots) * c.n_embd * m.wte.weight.element_size()  # K and V
    have = device_memory(model.wte.weight.device)
    if have and need > have:
        raise ValueError(f"num_beams={num_beams} needs at least {need / 1e9:.1f} GB for its K/V cache and "
                         f"scores, more than this device's {have / 1e9:.1f} GB")


def _beam_runner(model: GPT2, backend: Backend, rows: int, extra_slots: int) -> ModelRunner:
    """A runner with ``rows`` cache rows and ``extra_slots`` slots past the context window for
    uncommitted tree entries."""
    return ModelRunner(model, backend, batch=rows, max_len=model.config.n_positions + extra_slots)


def conditionals(backend: Backend, logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """p'(. | each row) of (N, V) logits, float64 on the CPU: the backend's native kernel where
    it has one (without a sort of the vocabulary for top-p), else ``processed_probs``."""
    probs = backend.processed_probs(logits, params.rule)
    return probs if probs is not None else processed_probs(logits, params).double().cpu()


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

    def start(self, prefix: list[int]) -> None:
        """Reset the counters and prefill ``prefix`` into row 0."""
        self.runner.reset()
        self.runner.cache.set_committed(1, 0)
        view = self.view(1)
        # One row, in the pieces ModelRunner.prefill takes (on the native path the stock GEMMs
        # over 512 rows took 1.24x as long over the demo oracle's held-out prompts).
        chunk = self.runner.prefill_chunk(PREFILL_CHUNK)
        for i in range(0, len(prefix), chunk):
            part = prefix[i:i + chunk]
            ids = torch.tensor([part], dtype=torch.int64, device=self.runner.device)
            pos = torch.arange(view.lengths[0], view.lengths[0] + len(part), device=self.runner.device)[None]
            self.runner.run(ids, pos, None, last_only=True, cache=view)
            view.advance()
        self.length = self.shared = len(prefix)
        self.filled = 1
        self.runner.cache.set_committed(1, self.length)

    def view(self, rows: int) -> KVCache:
        """The first ``rows`` rows as a cache of their own, nothing pending."""
        return self.runner.cache.view(rows, self.length)

    def forward(self, view: KVCache, tokens: torch.Tensor, positions: torch.Tensor,
                tree_mask: torch.Tensor | None, last_only: bool = False) -> torch.Tensor:
        """One counted model pass over ``view``: tokens, positions (R, N) -> logits (R, N, V)."""
        return self.runner.run(tokens, positions, tree_mask, last_only, cache=view)

    def roots(self, view: KVCache, tokens: list[int], params: SamplingParams) -> torch.Tensor:
        """One token on each row of ``view`` right after its committed slots, nothing pending
        (a beam-sampling step): (n, V) float64 processed distributions, no tree mask."""
        n, dev = len(tokens), self.runner.device
        ids = torch.tensor(tokens, dtype=torch.int64, device=dev)[:, None]
        positions = torch.full((n, 1), self.length, dtype=torch.int64, device=dev)
        logits = self.forward(view, ids, positions, None)[:, 0]  # (n, V)
        return conditionals(self.runner.backend, logits, params)

    def reselect(self, sources: list[int], paths: list[list[int]], pending: int,
                 agree: list[int] | None = None) -> None:
        """Row i <- row sources[i]: its committed slots, then its pending entries ``paths[i]``
        (slot offsets past the committed length, paths[i][0] == 0, all the same length m)
        committed in order. ``pending``: entries written past the committed length. The
        committed length grows by m. ``agree[i]``: slots past the shared prefix in which row i
        already holds what row sources[i] holds (the tokens their sequences share: a slot's K/V
        depends on its prefix alone, bit for bit), which stay; None: none."""
        lows = [0 if i >= self.filled else self.shared + (agree[i] if agree is not None and i < len(agree) else 0)
                for i in range(len(sources))]
        backend = self.runner.backend
        self.length = self.runner.cache.reselect(sources, paths, self.length, pending, lows, backend.commit,
                                                 backend.copy_rows)
        self.filled = max(self.filled, len(sources))


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
        # The round's roots' distributions, (rows, V), when a pass evaluated them alone
        # (``_evaluate_roots``): ``probs`` of roots alone then indexes it, with no stack.
        self.root_dist: torch.Tensor | None = None
        # Each input slot's row, when the round's only pass so far was its roots' (``probs``):
        # ``advance`` after a step of beam sampling then needs no sequence hashed.
        self.slot_rows: list[int] | None = None
        # Per cache row, the sequence whose committed slots (all its tokens but the last) the row
        # holds; rows past the round's inputs keep what they held when they last took part (a
        # pass writes only the rows in view), None: nothing of this generation. A row that comes
        # back then copies only the slots past what it shares with its source.
        self.held: list[Prefix | None] = []
        self.nodes = 0  # distinct nodes evaluated over the generation
        self.batch_tokens = 0  # rows x nodes per pass, padding included

    def start(self, prompt: list[int]) -> None:
        """Prefill all of ``prompt`` but its last token, which starts the first round's beam."""
        self.rows.start(prompt[:-1])
        self.held = [None] * self.rows.runner.cache.batch
        self.begin([tuple(prompt[-1:])])

    def keep(self, outputs: list[Prefix]) -> None:
        """The next round's distinct input beams are ``outputs``: commit, reselect, begin."""
        self.finish(outputs)
        self.begin(outputs)

    def advance(self, beams: Beams, parents: Sequence[int] | None) -> None:
        if parents is not None and self.slot_rows is not None:
            self._advance_step(beams, parents)
        else:
            self.keep(distinct(beams.seqs))

    def _advance_step(self, beams: Beams, parents: Sequence[int]) -> None:
        """``keep`` after a step of beam sampling whose only pass was the roots' (``probs``):
        each output is its parent slot's beam and one token, so it is told apart by (row, token)
        and its path is its root's entry, with no sequence hashed or sliced: 54 us an advance
        against 58 at 2 beams, 83 against 89 at 4 (medians over 6,000 steps, AMD EPYC Zen 4)."""
        rows, seen, outputs, sources = self.slot_rows, set(), [], []
        for seq, parent in zip(beams.seqs, parents):
            row = rows[parent]
            if (row, seq[-1]) not in seen:
                seen.add((row, seq[-1]))
                outputs.append(seq)
                sources.append(row)
        self._reselect(sources, [[0]] * len(sources))
        self.begin(outputs)

    def begin(self, inputs: list[Prefix]) -> None:
        """A new round whose distinct input beams sit on rows 0..len(inputs)-1."""
        self.n_in = len(inputs[0])
        self.row_of = {s: i for i, s in enumerate(inputs)}
        self.entries = [{} for _ in inputs]
        self.dist = [{} for _ in inputs]
        self.root_dist = None
        self.slot_rows = None
        self.held[:len(inputs)] = inputs
        self.view = self.rows.view(len(inputs))

    def probs(self, prefixes) -> torch.Tensor:
        """(n, V) float64 p'(. | prefix) for each prefix; unseen ones cost one forward pass."""
        n_in, row_of = self.n_in, self.row_of
        if self.root_dist is None and not self.view.pending and all(len(seq) == n_in for seq in prefixes):
            # The round's input beams and nothing else, before anything else in the round (a
            # step of beam sampling, or a forest's first draft layer): every row's root in one
            # pass, no keys to sort out.
            rows = [row_of[seq] for seq in prefixes]
            if len(set(rows)) == len(self.entries):
                self._evaluate_roots([seq[n_in - 1:] for seq in row_of])
                self.slot_rows = rows
                return self._roots(rows)
        self.slot_rows = None  # more than the roots: ``advance`` sorts the outputs out by sequence
        where = []
        new: list[list[Prefix]] = [[] for _ in self.entries]
        for seq in prefixes:
            row, key = row_of[seq[:n_in]], seq[n_in - 1:]
            if key not in self.entries[row] and key not in new[row]:
                new[row].append(key)
            where.append((row, key))
        if any(new):
            self._evaluate(new)
        if self.root_dist is not None and all(len(key) == 1 for _, key in where):
            return self._roots([row for row, _ in where])
        return torch.stack([self.root_dist[row] if len(key) == 1 and self.root_dist is not None
                            else self.dist[row][key] for row, key in where])

    def _roots(self, rows: list[int]) -> torch.Tensor:
        """(len(rows), V): the roots' distributions (``_evaluate_roots``) of ``rows``."""
        if rows == list(range(len(self.entries))):
            return self.root_dist
        # Slots that repeat a beam share its row (index_select: 8 us against 12 us for indexing
        # with the list at 2 beams over 8,192 tokens, 17 against 31 at 8).
        return self.root_dist.index_select(0, torch.tensor(rows))

    def _evaluate(self, new: list[list[Prefix]]) -> None:
        view = self.view
        # Every row's root alone, nothing pending (a step of beam sampling) never gets here:
        # ``probs`` evaluates them with ``_evaluate_roots``.
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
        dist = conditionals(self.rows.runner.backend, real, self.params)  # (M, V)
        for m, (r, key) in enumerate(zip(real_rows, real_keys)):
            self.dist[r][key] = dist[m]
        self.nodes += len(real_keys)
        self.batch_tokens += rows * width

    def _evaluate_roots(self, roots: list[Prefix]) -> None:
        """The round's roots, one a row, with nothing pending: no tree mask to build or apply."""
        dist = self.rows.roots(self.view, [key[-1] for key in roots], self.params)  # (R, V)
        for r, key in enumerate(roots):
            self.entries[r][key] = 0
        self.root_dist = dist  # row r's root: dist[r] (``probs`` reads it there, no view per row)
        self.nodes += len(roots)
        self.batch_tokens += len(roots)

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
        self._reselect(sources, paths)

    def _reselect(self, sources: list[int], paths: list[list[int]]) -> None:
        """Row i <- row sources[i] with the pending entries paths[i] committed."""
        # Row i holds the committed tokens of held[i], all but its last (for an input, its root,
        # pending with the rest); the source row those of input s.
        inputs, held = list(self.row_of), self.held
        agree = [0 if s == i or held[i] is None else min(shared_prefix(held[i], inputs[s]), len(held[i]) - 1)
                 for i, s in enumerate(sources)]
        self.rows.reselect(sources, paths, self.view.pending, agree)


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
        dist = conditionals(self.runner.backend, logits, self.params)  # (N, V)
        for i, key in enumerate(keys):
            self.dist[key] = dist[i]
        self.nodes += n
        self.batch_tokens += n

    def _ensure(self, slots: int) -> None:
        """Grow the cache (a copy) when the tree outgrows it; rare, amortised."""
        if slots > self.cache.max_len:
            self.cache.grow(slots + self.slack)

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
        self.cache.compact(order, common, self.runner.backend.commit)
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
        self.peak_pending = max(self.peak_pending, self.cache.pending)

    def advance(self, beams: Beams, parents: Sequence[int] | None) -> None:
        self.keep(distinct(beams.seqs))


class RowBeamLM:
    """Beam sampling in the ``rows`` layout as a ``BeamLM``: one cache row per beam slot,
    duplicates included; each step is one pass of one token per row, then every row takes its
    parent's row (``reselect``) with that token committed."""

    def __init__(self, rows: RowCache, params: SamplingParams) -> None:
        self.rows = rows
        self.params = params
        self.view: KVCache | None = None
        self.seqs: list[Prefix] = []  # the sequence each row holds, its last token pending

    def start(self, prompt: list[int]) -> None:
        """Prefill all of ``prompt`` but its last token, which starts the first beam."""
        self.rows.start(prompt[:-1])

    def probs(self, prefixes: Sequence[Prefix]) -> torch.Tensor:
        self.view = self.rows.view(len(prefixes))
        self.seqs = list(prefixes)
        return self.rows.roots(self.view, [s[-1] for s in prefixes], self.params)

    def advance(self, beams: Beams, parents: Sequence[int] | None) -> None:
        if parents is None:
            raise ValueError("the rows layout of beam sampling needs each beam's parent slot")
        seqs = self.seqs
        agree = [shared_prefix(seqs[i], seqs[p]) if p != i and i < len(seqs) else 0 for i, p in enumerate(parents)]
        self.rows.reselect(list(parents), [[0]] * len(parents), self.view.pending, agree)


def _generator(params: SamplingParams) -> TorchRandom:
    return TorchRandom(torch.Generator().manual_seed(params.seed if params.seed is not None else 0))


def shared_prefix(a: Prefix, b: Prefix) -> int:
    """Length of the longest common prefix of two sequences, by bisection over slice equality
    (each comparison one C-level pass): beams share most of their tokens."""
    lo, hi = 0, min(len(a), len(b))
    if a[:hi] == b[:hi]:
        return hi
    while hi - lo > 1:  # a[:lo] == b[:lo], a[:hi] != b[:hi]
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def _common_prefix(seqs: list[Prefix], known: int = 0) -> int:
    """Length of the longest common prefix of ``seqs``, known to be at least ``known``."""
    first, n = seqs[0], min(len(s) for s in seqs)
    i = known
    while i < n and all(s[i] == first[i] for s in seqs):
        i += 1
    return i


# --------------------------------------------------------------------------------------------
# Decoders
# --------------------------------------------------------------------------------------------
class _BeamBase(Decoder):
    """Shared by both: the oracle's beam LM, the core's run (one step per round), streaming of
    the tokens every live beam shares, and the stats."""

    def __init__(self, oracle: ModelRunner, sampling: SamplingConfig, width: int, layout: str,
                 slack: int) -> None:
        super().__init__(oracle, sampling)
        self.params = sampling.params
        self.width = width
        self.layout = layout
        self.oracle_lm = _beam_lm(oracle, self.params, layout, slack, beam_sampling=self.name == "beam")
        self.prompt: list[int] = []
        self.run: BeamSampling | DSBDRun | None = None
        self.emitted = 0  # tokens of the best final beam already returned
        self.common = 0  # the live beams' common prefix (it only grows: they descend from it)

    def start(self, prompt: list[int]) -> None:
        self.prompt = list(prompt)
        self.oracle_lm.start(self.prompt)
        self.accepted_lengths = []
        self.run = None
        self.emitted = self.common = 0

    def _make_run(self, steps: int) -> BeamSampling | DSBDRun:
        raise NotImplementedError

    def _step(self) -> int:
        return self.run.step()

    def round(self, remaining: int) -> list[int]:
        """One step of the run (one oracle pass). Returns the new tokens that every live beam
        shares (possibly none); once the run is over, the rest of the best beam. The first call
        fixes the generation's length at ``remaining`` tokens per beam."""
        if self.run is None:
            self.run = self._make_run(remaining)
        self.accepted_lengths.append(self._step())
        beams = self.run.beams
        if self.run.finished:
            seq = beams.seqs[beams.best()]
            end = len(seq)
        else:
            self.common = _common_prefix(beams.seqs, self.common)
            seq, end = beams.seqs[0], self.common
        # Sequences start at the prompt's last token: generated tokens are seq[1:end].
        new = list(seq[1 + self.emitted:end])
        self.emitted = max(self.emitted, end - 1)
        return new

    def extra_stats(self) -> dict:
        """Beam statistics for ``res.stats``: final beams (generated tokens) and their oracle
        log-scores, the best beam's index, widths per layer, cache footprint and counters."""
        out = {"num_beams": self.width, "layout": self.layout,
               "oracle_cache_rows": self.oracle.cache.batch,
               "oracle_cache_bytes": self.oracle.cache.nbytes}
        if self.run is not None:
            beams = self.run.beams
            out["beam_scores"] = [float(x) for x in beams.log_p]
            out["beam_token_ids"] = [list(s[1:]) for s in beams.seqs]
            out["best_beam"] = beams.best()
        if self.layout == "tree":
            out["oracle_tree_peak"] = self.oracle_lm.peak_pending  # entries kept between rounds
        return out


def _beam_lm(runner: ModelRunner, params: SamplingParams, layout: str, slack: int, beam_sampling: bool = False):
    if layout == "tree":
        return TreeLM(runner, params, slack)
    return RowBeamLM(RowCache(runner), params) if beam_sampling else RowForestLM(RowCache(runner), params)


class BeamDecoder(_BeamBase):
    """Beam sampling with the oracle alone (ALGORITHMS.md sec. 9, the reference law)."""

    name = "beam"

    def _make_run(self, steps: int) -> BeamSampling:
        return BeamSampling(self.oracle_lm, self.prompt[-1:], self.width, steps, _generator(self.params))

    def extra_stats(self) -> dict:
        out = super().extra_stats()
        if self.run is not None:
            out["beam_widths"] = list(self.run.widths)
        return out


class DSBDDecoder(_BeamBase):
    """Dynamic-width speculative beam decoding (ALGORITHMS.md sec. 9) on a draft and an oracle.

    With a planner ``memory`` (the default unless ``gamma`` is pinned) each round's number of
    drafted layers is an arm of its ``Stints`` (``spec.planner.dsbd_arms``): 0, beam sampling
    itself, is the reference the clock compares the drafted arms with, in adjacent blocks of
    rounds, and the fastest plays. Every arm has the same law, so the choice never changes what
    is drawn from, only how fast."""

    name = "dsbd"

    def __init__(self, oracle: ModelRunner, draft: ModelRunner, sampling: SamplingConfig,
                 cfg: DSBDConfig, layout: str, slack: int, memory: PlannerMemory | None = None,
                 draft_window: int | None = None) -> None:
        super().__init__(oracle, sampling, cfg.width, layout, slack)
        self.draft = draft
        self.draft_window = draft_window
        self.draft_lm = _beam_lm(draft, self.params, layout, slack)
        self.cfg = cfg
        self.memory = memory
        self.clock = RoundClock()

    def start(self, prompt: list[int]) -> None:
        super().start(prompt)
        # With the planner and a fixed width, rounds of gamma 0 (beam sampling itself) leave the
        # draft where it was, and the first drafted round catches it up. So its prefill waits
        # for that round too: a generation the planner keeps on gamma 0 never runs the draft.
        self.draft_started = False
        if self.memory is None or self.cfg.dynamic:
            self._start_draft()
        self.clock.reset()

    def _start_draft(self) -> None:
        """Prefill the draft with the prompt's last ``draft_window`` tokens before its last (all
        of them with None), at the draft's own positions 0..: what a draft pass costs grows
        with its context, and a draft guesses from the text's last few dozen tokens."""
        w = self.draft_window
        self.draft_lm.start(self.prompt if w is None else self.prompt[-(w + 1):])
        self.draft_started = True

    def _step(self) -> int:
        if self.memory is None:
            return self.run.step()
        stints = self.memory.stints
        depth = self.memory.arms[stints.arm].depth  # dsbd_arms stay <= gamma
        if depth and not self.draft_started:
            self._start_draft()  # once a generation: not charged to the arm's round
        self.clock.enter()
        advanced = self.run.step(depth)
        stints.record(advanced, self.clock.seconds())
        return advanced

    def draft_calls(self) -> int:
        return self.draft.calls

    def draft_seconds(self) -> float:
        return self.draft.forward_seconds

    def draft_weight_bytes(self) -> int:
        return self.draft.calls * self.draft.model.weight_bytes()

    def _make_run(self, steps: int) -> DSBDRun:
        return DSBDRun(self.oracle_lm, self.draft_lm, self.prompt[-1:], steps, _generator(self.params), self.cfg)

    def extra_stats(self) -> dict:
        out = super().extra_stats()
        if self.run is None:
            return out
        cfg, core = self.cfg, self.run.stats
        # Slots drafts could fill: a layer takes at most its width of them.
        fillable = sum(min(d, w) for d, w in zip(core["drafted"], core["widths"]))
        out.update({
            "dsbd_options": {"gamma": cfg.gamma, "draft_width": cfg.draft_width,
                             "threshold": cfg.threshold, "w_min": cfg.w_min,
                             "dynamic": cfg.dynamic, "memory_mode": cfg.memory_mode},
            "rounds": core["rounds"],
            "beam_widths": core["widths"],  # width chosen per output layer
            "beams_drafted": core["drafted"],  # drafts open to verification per layer
            "beams_accepted": core["accepted"],  # drafts accepted per layer
            "draft_acceptance": sum(core["accepted"]) / fillable if fillable else 0.0,
            "input_beams": core["input_beams"],  # beams fed to each round
            "oracle_forest_nodes": self.oracle_lm.nodes,  # nodes the oracle evaluated
            "oracle_batch_tokens": self.oracle_lm.batch_tokens,  # rows x nodes, padding included
            "draft_batch_tokens": self.draft_lm.batch_tokens,
            "draft_cache_rows": self.draft.cache.batch,
        })
        if self.memory is not None:
            out["planner"] = self.memory.stints.summary([a.name for a in self.memory.arms])
        return out
