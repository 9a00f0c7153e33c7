"""Drafters: who proposes the speculative tree (ALGORITHMS.md sec. 5, 6).

A drafter is either an n-gram model (``NGramDrafter``) or a model with an optional inner
drafter (``ModelDrafter``). The model drafter builds the oracle's tree best-first by cumulative
draft probability, evaluating nodes in batched forward passes over its own KV cache; its inner
drafter hangs a mini-tree below the tip of the current most likely path in every pass, and the
nodes of that mini-tree the draft itself would have chosen come for free. Any depth of cascade
(oracle <- model <- model <- n-gram) is the same code. Inner stages are heuristics: only the
oracle decides what is emitted, so nothing here can change the output.
"""
from __future__ import annotations

import math
import threading
from dataclasses import dataclass

import numpy as np
import torch

from staged_engine.checks import check_int, is_int
from staged_engine.model.runner import ModelRunner
from staged_engine.sampling import SamplingConfig, draft_children
from staged_engine.spec.tree import Tree


@dataclass(frozen=True)
class TreeShape:
    """How big a tree to build (the knobs of ALGORITHMS.md sec. 5)."""

    budget: int = 16  # oracle batch size: tree nodes including the root
    max_depth: int = 8  # deepest node (root = 0)
    children: int = 4  # children offered by each evaluated node
    expand: int = 4  # nodes the draft evaluates per forward pass (besides n-gram nodes)

    def __post_init__(self) -> None:
        for name in ("budget", "max_depth", "children", "expand"):
            check_int(name, getattr(self, name))


@dataclass(frozen=True)
class DraftRound:
    """What drafting hands to verification (as vLLM's spec-decode metadata does): the oracle's
    tree, the draft-tree node behind each of its nodes, and the draft cache entry of every
    draft-tree node (-1: not evaluated), which ``ModelDrafter.accept`` keeps or drops."""

    tree: Tree
    draft_nodes: list[int]
    slots: list[int]
    logr: list[float] | None = None  # per node of ``tree``: the draft's log r given its parent


# An n-gram table is shared by every generation of an Engine, and ngram_learn writes to it:
# reads and writes of the native table are serialised (each call takes microseconds).
_NGRAM_LOCK = threading.Lock()


class NGramDrafter:
    """The lowest stage: mini-trees from an n-gram model; costs microseconds, has no cache."""

    def __init__(self, ngram, widths: tuple[int, ...] = (12, 7, 4, 1, 1, 1), learn: bool = False) -> None:
        if not widths or any(not is_int(w) or w < 1 for w in widths):
            raise ValueError(f"ngram_widths must be a non-empty sequence of integers >= 1, got {widths!r}")
        self.ngram = ngram
        self.widths = list(widths)
        self.learn = learn  # add the prompt and accepted text to the counts (prompt lookup)
        self.calls = 0

    def start(self, prompt: list[int]) -> None:
        self.calls = 0
        if self.learn:
            with _NGRAM_LOCK:
                self.ngram.update(prompt)

    def propose(self, context: list[int]) -> tuple[list[int], list[int]]:
        """Mini-tree below the last token of ``context``: tokens, parents (-1 = the tip)."""
        self.calls += 1
        with _NGRAM_LOCK:
            return self.ngram.propose(context[-(self.ngram.order - 1):] if self.ngram.order > 1 else [],
                                      self.widths)

    def observe(self, tokens: list[int], context: list[int]) -> None:
        if self.learn:
            keep = self.ngram.order - 1
            with _NGRAM_LOCK:
                self.ngram.update(tokens, context=context[-keep:] if keep else ())

    @property
    def forward_seconds(self) -> float:
        return 0.0


class ContextLookup:
    """Prompt lookup, the stage below every model: the tokens that followed the most recent
    earlier occurrence of the context's last 3 tokens (else 2, else 1). Code repeats itself
    (names, call patterns, a loop's body), and a small model's greedy text repeats more, so a
    continuation seen before is a free guess. It reads a token list that only grows (a drafter's
    accepted history) and indexes what is new at each proposal: a proposal is a few dict lookups
    however long the context, and a generation that never asks indexes nothing."""

    ORDER = 3

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens
        self.indexed = 0  # tokens[:indexed] are in the index
        # after[n - 1][n-gram] -> the index that followed its latest occurrence
        self.after: list[dict[tuple[int, ...], int]] = [{} for _ in range(self.ORDER)]

    def propose(self, depth: int, order: int = 1) -> list[int]:
        """Up to ``depth`` tokens to follow the context, or none when no suffix of at least
        ``order`` tokens was seen before."""
        toks, after = self.tokens, self.after
        for i in range(self.indexed, len(toks)):  # every n-gram ending at i - 1 is followed by i
            for n in range(1, min(self.ORDER, i) + 1):
                after[n - 1][tuple(toks[i - n:i])] = i
        self.indexed = len(toks)
        for n in range(min(self.ORDER, len(toks)), order - 1, -1):
            j = after[n - 1].get(tuple(toks[-n:]))
            if j is not None:
                return toks[j:j + depth]
        return []


class _Slots:
    """Visibility bookkeeping of a drafter's pending cache entries within one round."""

    def __init__(self, capacity: int = 64) -> None:
        self.vis = np.zeros((capacity, capacity), dtype=np.bool_)
        self.count = 0

    def add(self, parent_slot: int) -> int:
        s = self.count
        if s >= self.vis.shape[0]:
            grown = np.zeros((2 * s, 2 * s), dtype=np.bool_)
            grown[:s, :s] = self.vis[:s, :s]
            self.vis = grown
        self.vis[s, :] = False
        if parent_slot >= 0:
            self.vis[s, :s] = self.vis[parent_slot, :s]
        self.vis[s, s] = True
        self.count += 1
        return s

    def mask(self, first: int, device) -> torch.Tensor:
        """(N, count) visibility of slots first..count-1 over all slots so far."""
        return torch.from_numpy(self.vis[first:self.count, :self.count].copy()).to(device)


class ModelDrafter:
    """A draft model that builds trees best-first; optionally sped up by an inner drafter."""

    def __init__(self, runner: ModelRunner, sampling: SamplingConfig,
                 shape: TreeShape, inner: "NGramDrafter | ModelDrafter | None" = None,
                 window: int | None = None) -> None:
        if window is not None:
            check_int("draft_window", window)
        self._runner = runner
        # A lazy start leaves the runner as the last generation left it until this one first
        # touches it (``runner``): a generation the planner keeps on plain steps never resets it.
        self._reset_due = False
        self.sampling = sampling
        self.shape = shape
        self.inner = inner
        # A catch-up over more than ``window`` tokens restarts the draft's cache from the last
        # ``window`` of them (``catch_up``): the draft's position 0 is then the text's position
        # ``offset``. None: the draft always sees the whole text.
        self.window = window
        self.offset = 0
        self.use_inner = True  # whether the inner stage proposes this round (it always learns)
        self.unseen: list[int] = []  # accepted tokens the draft has not processed; last = root
        self.history: list[int] = []  # every accepted token, root included
        self.lookup: ContextLookup | None = None  # prompt lookup over history, made when first used

    @property
    def runner(self) -> ModelRunner:
        """The draft's runner, reset for this generation."""
        if self._reset_due:
            self._reset_due = False
            self._runner.reset()
        return self._runner

    # ----------------------------------------------------------------- lifecycle
    def start(self, prompt: list[int], lazy: bool = False) -> None:
        """A new generation. ``lazy``: do not prefill the prompt now; it stays unseen until the
        first drafted round needs it (``catch_up``), so a generation that never drafts (the
        planner found plain steps faster) never pays for the draft's prefill, nor for the reset
        of its runner (~120 us in a generation, its objects cold after the oracle's passes; AMD
        EPYC Zen 4), which waits for the first use. A model not yet packed for its backend is
        reset (packed) now, not inside a timed round."""
        runner = self._runner
        if lazy and runner.backend.packed_bytes(runner.model):
            self._reset_due = True
        else:
            self._reset_due = False
            runner.reset()
        self.offset = 0
        self.unseen = list(prompt)
        self.history = list(prompt)
        if not lazy:
            self.catch_up()
        self.lookup = None
        if self.inner is not None:
            self.inner.start(prompt)

    def catch_up(self) -> None:
        """Process the accepted tokens this draft has not seen (the prompt, what plain rounds
        left), all but the root, so the next tree starts from a current cache.

        With a ``window``, a backlog longer than it is not processed whole: the draft's cache
        starts afresh from the backlog's last ``window`` tokens, at positions 0.. of its own (the
        text as a draft trained on crops of code sees it), and ``offset`` maps them to the
        text's. The cost of a catch-up is then bounded whatever the prompt or the plain steps
        left; what the draft proposes is all it changes, never what is emitted."""
        if len(self.unseen) <= 1:
            return
        self.trim_backlog()
        self.runner.prefill(self.unseen[:-1])
        self.unseen = self.unseen[-1:]

    def trim_backlog(self) -> None:
        """Hold the backlog (what the draft's next pass evaluates before the root) to ``window``
        tokens: a longer one restarts the draft's cache from its last ``window``, at positions
        0.. of the draft's own (``offset`` maps them to the text's), as ``catch_up`` does. Every
        way a draft pass meets a backlog trims it first: a catch-up, a Python round (``build``)
        and a native chain round or block (the decoder's), whose first pass evaluates the
        backlog itself. (A lookup-or-draft arm never catches up: its draft falls behind by each
        lookup round and its next pass takes the rest. Untrimmed, that first pass evaluated the
        whole prompt: on the demo pair, 263 prompt tokens took the draft 3.2 ms, on the arm's
        clock, where 64 take ~0.45 ms.)"""
        if self.window is not None and len(self.unseen) - 1 > self.window:
            self.runner.rollback(0)
            self.offset = len(self.history) - 1 - self.window  # the root's text position minus its own
            self.unseen = self.unseen[-self.window - 1:]

    @property
    def calls(self) -> int:
        return 0 if self._reset_due else self._runner.calls

    @property
    def forward_seconds(self) -> float:
        inner = self.inner.forward_seconds if self.inner is not None else 0.0
        return (0.0 if self._reset_due else self._runner.forward_seconds) + inner

    def weight_bytes_read(self) -> int:
        """Weight bytes this drafter and its inner stages read so far."""
        own = self.calls * self._runner.model.weight_bytes()
        if isinstance(self.inner, ModelDrafter):
            own += self.inner.weight_bytes_read()
        return own

    # ----------------------------------------------------------------- scoring
    def _child_scores(self, logits: torch.Tensor, positions: list[int]) -> tuple[list, list]:
        """Top children of evaluated nodes: (tokens, log r) lists per row, best first.

        r is the draft's distribution used for tree scores: softmax(z) at T = 0, else the
        softmax of the Gumbel-perturbed processed draft log-probs (the noise the oracle uses)
        over the tokens the request's top-k keeps, all of them without one; the children are
        the best of them that its top-p keeps too (``SamplingConfig.draft_params``,
        ``sampling.draft_children``).
        """
        k = min(self.shape.children, logits.shape[-1])
        sampling = self.sampling
        if self.offset:  # the noise is keyed by the text's positions, the oracle's
            positions = [p + self.offset for p in positions]
        if not sampling.greedy:
            native = self.runner.backend.perturbed_children(logits, positions, sampling.draft_rule, k)
            if native is None:
                native = draft_children(logits, positions, sampling.draft_params, sampling.noise, k)
            return native[0].tolist(), native[1].tolist()
        idx, vals = self.runner.backend.top_children(logits.float(), k)
        return idx.tolist(), vals.tolist()

    # ----------------------------------------------------------------- tree building
    def build(self, root_position: int, budget: int, max_depth: int, planner=None) -> DraftRound:
        """Build the oracle's tree for this round: at most ``budget`` nodes in topological
        order, depth <= max_depth (a lone root when nothing is worth drafting).

        With a ``planner`` (``spec.planner.RoundPlanner``) a pass runs only while it is worth its
        cost, and the nodes kept are those worth verifying; else every pass the shape allows
        runs and the ``budget`` best-scored nodes are kept."""
        self.trim_backlog()
        if self._chain_only():
            return self._build_chain(root_position, budget, max_depth, planner)
        root_position -= self.offset  # the draft's own positions (``catch_up``)
        runner = self.runner
        tree = Tree(self.unseen[-1])
        logscore = [0.0]  # log of the cumulative draft probability
        slot = [-1]  # pending cache entry of an evaluated node, -1 if not evaluated
        slots = _Slots()
        base = runner.length  # committed draft tokens; the unseen tokens go right after
        room = min(runner.max_len, runner.model.config.n_positions) - base  # pending entries allowed
        max_depth = min(max_depth, room - len(self.unseen))
        if max_depth <= 0 or budget <= 1:
            return DraftRound(Tree(tree.tokens[0]), [0], slot)
        frontier = {0}
        for _ in range(budget + max_depth):  # a hard cap; the threshold test ends it sooner
            cand = self._pick(frontier, tree, logscore, budget, max_depth)
            cand = cand[:max(0, room - slots.count - (len(self.unseen) if slot[0] < 0 else 0))]
            if not cand:
                break
            if planner is not None and slot[0] >= 0:
                value = planner.node_values(tree, self._logr(tree, logscore))
                verified = sum(1 for n in range(1, len(tree)) if value[n] > 0.05)
                if not planner.another_pass([value[c] for c in cand], len(cand) + self._inner_rows(), verified):
                    break
            first_slot = slots.count
            tokens: list[int] = []
            positions: list[int] = []
            expand_rows: list[tuple[int, int]] = []  # (batch row, tree node)
            if slot[0] < 0:  # first pass: the unseen tokens, ending in the root
                parent = -1
                for i, tok in enumerate(self.unseen):
                    parent = slots.add(parent)
                    tokens.append(tok)
                    positions.append(base + i)
                slot[0] = parent
                expand_rows.append((len(tokens) - 1, 0))
                cand = [c for c in cand if c != 0]
            for node in cand:
                slot[node] = slots.add(slot[tree.parents[node]])
                tokens.append(tree.tokens[node])
                positions.append(root_position + tree.depths[node])
                expand_rows.append((len(tokens) - 1, node))
            mini = self._hang_mini_tree(tree, expand_rows, tokens, positions,
                                        slots, first_slot, root_position, max_depth, room)
            if planner is not None:
                planner.note_pass(len(tokens))
            logits = runner.forward_nodes(tokens, positions, slots.mask(first_slot, runner.device))
            # Children of every evaluated row; n-gram rows only count where the draft agrees.
            rows = [r for r, _ in expand_rows] + [r for r, _, _ in mini]
            child_tok, child_logr = self._child_scores(logits[rows], [positions[r] + 1 for r in rows])
            per_row = {r: (child_tok[i], child_logr[i]) for i, r in enumerate(rows)}
            row_node = dict(expand_rows)
            for r, node in expand_rows:
                frontier.discard(node)
                self._add_children(tree, logscore, slot, frontier, node, *per_row[r])
            for r, prow, tok in mini:
                pnode = row_node.get(prow)
                node = None if pnode is None else tree.children[pnode].get(tok)
                if node is None or slot[node] >= 0:
                    continue
                slot[node] = first_slot + r
                row_node[r] = node
                frontier.discard(node)
                if tree.depths[node] < max_depth:
                    self._add_children(tree, logscore, slot, frontier, node, *per_row[r])
        logr = self._logr(tree, logscore)
        if planner is not None:
            keep = planner.select(tree, planner.node_values(tree, logr), budget)
        else:
            keep = sorted(range(1, len(tree)), key=lambda n: (-logscore[n], n))[:budget - 1]
            keep = [0] + sorted(keep)  # best-scored nodes are prefix-closed; index order is topological
        new_index = {old: i for i, old in enumerate(keep)}
        out = Tree(tree.tokens[0])
        for old in keep[1:]:
            out.add(new_index[tree.parents[old]], tree.tokens[old])
        return DraftRound(out, keep, slot, [logr[old] for old in keep])

    def _chain_only(self) -> bool:
        """One child per node and at most an n-gram chain below: the chain builder applies."""
        if self.shape.children != 1:
            return False
        return self.inner is None or (isinstance(self.inner, NGramDrafter) and all(w == 1 for w in self.inner.widths))

    def _build_chain(self, root_position: int, budget: int, max_depth: int, planner) -> DraftRound:
        """``build`` for a draft offering one child per node: a chain, with no ranking.

        Each pass evaluates the chain's tip (the first pass also the unseen tokens) and, with an
        n-gram stage, the n-gram's chain below the tip: every n-gram node the draft agrees with
        is evaluated for free, so one pass can extend the chain by several nodes. The n-gram
        rows after a disagreement stay in the draft's cache as dead entries, masked from later
        passes and dropped at acceptance."""
        runner = self.runner
        unseen = self.unseen
        root = unseen[-1]
        base = runner.length
        root_position -= self.offset  # the draft's own positions (``catch_up``)
        max_depth = self.chain_depth(max_depth, budget)
        if max_depth <= 0:
            return DraftRound(Tree(root), [0], [-1])
        ngram = self.inner if self.use_inner else None
        tokens, positions = list(unseen), list(range(base, base + len(unseen)))
        chain, logr = [root], [0.0]
        slots = [len(unseen) - 1]  # pending entry of each evaluated chain node
        live = list(range(len(unseen)))  # pending entries on the chain (the unseen ones included)
        written = 0  # pending entries so far
        dead = False  # whether some pending entry is off the chain
        value = 1.0
        while len(chain) - 1 < max_depth:
            tip_depth = len(chain) - 1
            proposal: list[int] = []
            if ngram is not None:
                proposal = ngram.propose(self.history + chain[1:])[0][:max_depth - tip_depth - 1]
                tokens += proposal
                positions += [root_position + tip_depth + 1 + i for i in range(len(proposal))]
            if planner is not None:
                if len(chain) > 1 and not planner.another_pass([value], len(tokens), len(chain) - 1):
                    break
                planner.note_pass(len(tokens))
            mask = None
            if dead:  # the new rows see the chain's entries and each other, not the dead ones
                n = len(tokens)
                mask = torch.zeros((n, written + n), dtype=torch.bool)
                mask[:, live] = True
                mask[:, written:] = torch.ones((n, n), dtype=torch.bool).tril_()
                mask = mask.to(runner.device)
            logits = runner.forward_nodes(tokens, positions, mask)
            first = written + len(tokens) - len(proposal) - 1  # the tip's entry
            rows = len(proposal) + 1
            tok, lr = self._child_scores(logits[-rows:], [positions[-rows + i] + 1 for i in range(rows)])
            if len(chain) > 1:
                slots.append(first)
                live.append(first)
            written += len(tokens)
            stop = False
            for i in range(rows):  # walk down the n-gram's rows while the draft agrees
                if not tok[i] or lr[i][0] == float("-inf"):
                    stop = True
                    break
                chain.append(tok[i][0])
                logr.append(lr[i][0])
                if planner is not None:
                    value *= planner.acceptance.p(math.exp(lr[i][0]))
                if i < len(proposal) and proposal[i] == tok[i][0] and len(chain) - 1 < max_depth:
                    slots.append(first + 1 + i)  # evaluated in this pass already
                    live.append(first + 1 + i)
                    continue
                dead = dead or i < len(proposal)  # its rows from here on are off the chain
                break
            if stop:
                break
            tokens, positions = [chain[-1]], [root_position + len(chain) - 1]
        slots.append(-1)  # the tip was not evaluated
        slots = slots[:len(chain)]
        tree = Tree(root)
        for parent, token in enumerate(chain[1:]):
            tree.add(parent, token)
        keep = list(range(len(chain)))
        if planner is not None and len(chain) > 1:
            keep = planner.select(tree, planner.node_values(tree, logr), budget)
            if len(keep) < len(chain):
                tree = Tree(root)
                for parent, token in enumerate(chain[1:len(keep)]):
                    tree.add(parent, token)
        return DraftRound(tree, keep, slots, logr[:len(keep)])

    @staticmethod
    def _logr(tree: Tree, logscore: list[float]) -> list[float]:
        """Each node's draft log probability given its parent (root 0)."""
        return [0.0] + [logscore[n] - logscore[tree.parents[n]] for n in range(1, len(tree))]

    def _inner_rows(self) -> int:
        """Rows the inner stage adds to a pass (an estimate: its widths, or its budget)."""
        if not self.use_inner:
            return 0
        if isinstance(self.inner, NGramDrafter):
            return len(self.inner.widths)
        if isinstance(self.inner, ModelDrafter):
            return self.inner.shape.budget - 1
        return 0

    def _hang_mini_tree(self, tree: Tree, expand_rows: list[tuple[int, int]], tokens: list[int],
                        positions: list[int],
                        slots: _Slots, first_slot: int, root_position: int, max_depth: int,
                        room: int) -> list[tuple[int, int, int]]:
        """Append the inner drafter's mini-tree below the tip of the most likely path to this
        pass's batch. Returns (batch row, parent batch row, token) per appended node."""
        if self.inner is None or not self.use_inner:
            return []
        tip = self._tip(tree)
        tip_row = next((r for r, n in expand_rows if n == tip), None)
        if tip_row is None or tree.depths[tip] >= max_depth:  # the tip is not in this pass
            return []
        m_tokens, m_parents = self.inner.propose(self.history + self._path_tokens(tree, tip))
        mini: list[tuple[int, int, int]] = []
        depth_of: list[int] = []
        for tok, par in zip(m_tokens, m_parents):
            if par >= len(depth_of):  # its parent was cut off below
                continue
            prow = tip_row if par < 0 else mini[par][0]
            d = (tree.depths[tip] if par < 0 else depth_of[par]) + 1
            if d > max_depth or slots.count >= room:
                break
            slots.add(first_slot + prow)
            tokens.append(tok)
            positions.append(root_position + d)
            depth_of.append(d)
            mini.append((len(tokens) - 1, prow, tok))
        return mini

    def _pick(self, frontier: set[int], tree: Tree, logscore: list[float], budget: int,
              max_depth: int) -> list[int]:
        """Unexpanded nodes worth expanding: their children could still enter the budget."""
        if 0 in frontier:
            return [0]
        others = sorted(logscore[1:], reverse=True)
        threshold = others[budget - 2] if len(others) >= budget - 1 else float("-inf")
        cand = [n for n in frontier if tree.depths[n] < max_depth and logscore[n] > threshold]
        cand.sort(key=lambda n: (-logscore[n], n))
        return cand[:self.shape.expand]

    def _add_children(self, tree: Tree, logscore: list[float], slot: list[int], frontier: set[int],
                      node: int, tokens: list[int], logr: list[float]) -> None:
        for tok, lr in zip(tokens, logr):
            if lr == float("-inf") or tok in tree.children[node]:
                continue
            child = tree.add(node, tok)
            logscore.append(logscore[node] + lr)
            slot.append(-1)
            frontier.add(child)

    @staticmethod
    def _tip(tree: Tree) -> int:
        """First unexpanded node on the most likely path (best child at every step).

        Children are added right after a node's pass, so walking down best children stops at a
        node whose children are not known yet: the root in the first pass, else a node that is
        either in the current pass or still waiting in the frontier.
        """
        node = 0
        while tree.children[node]:
            node = min(tree.children[node].values())  # children are added best first
        return node

    @staticmethod
    def _path_tokens(tree: Tree, node: int) -> list[int]:
        """Tokens from the root's child down to ``node`` (root excluded)."""
        out = []
        while node > 0:
            out.append(tree.tokens[node])
            node = tree.parents[node]
        return out[::-1]

    # ----------------------------------------------------------------- after verification
    def accept(self, draft: DraftRound, path: list[int], emitted: list[int]) -> None:
        """Sync with the oracle: ``path`` is the accepted path of ``draft.tree`` (root first),
        ``emitted`` the new tokens (path tokens after the root, then the bonus)."""
        slot = draft.slots
        draft_nodes = [draft.draft_nodes[n] for n in path]
        evaluated = 0
        while evaluated < len(draft_nodes) and slot[draft_nodes[evaluated]] >= 0:
            evaluated += 1
        if evaluated == 0:  # the draft ran no pass this round
            self.runner.discard()
            self.unseen.extend(emitted)
        else:
            # slots 0..slot[root]-1 hold the unseen tokens before the root
            keep = list(range(slot[0])) + [slot[n] for n in draft_nodes[:evaluated]]
            self.runner.commit(keep)
            self.unseen = emitted[evaluated - 1:]
        if self.inner is not None:
            self.inner.observe(emitted, self.history)
        self.history.extend(emitted)

    def native_chain(self) -> bool:
        """Whether a round of this drafter is a plain draft chain (one child per node, no inner
        stage proposing), which ``_cpu.chain_round`` can run in one call."""
        return self.shape.children == 1 and (self.inner is None or not self.use_inner) \
            and self.runner.native is not None

    def chain_depth(self, max_depth: int, budget: int) -> int:
        """The depth ``_build_chain`` would draft to: within the draft's cache and window too."""
        room = min(self.runner.max_len, self.runner.model.config.n_positions) - self.runner.length
        return min(max_depth, room - len(self.unseen), budget - 1)

    def accept_chain(self, passes: int, accepted: int, emitted: list[int]) -> None:
        """``accept`` after a native chain round of ``passes`` draft passes (the first over the
        unseen tokens, each later one over a chain token), of which ``accepted`` nodes (the root
        included) were accepted: the evaluated ones among them are the prefix kept."""
        evaluated = min(accepted, passes)
        self.accept_chains(len(self.unseen) - 1 + evaluated, emitted[evaluated - 1:], emitted)

    def accept_chains(self, kept: int, unseen: list[int], emitted: list[int]) -> None:
        """Sync after native chain rounds (one: ``accept_chain``; a block: ``_cpu.chain_rounds``)
        that emitted ``emitted``, kept the first ``kept`` of this draft's pending entries and left
        it ``unseen`` (the emitted tokens it has not evaluated, ending in the new root)."""
        if kept:
            self.runner.commit(list(range(kept)))
        else:
            self.runner.discard()
        self.unseen = list(unseen)
        if self.inner is not None:
            self.inner.observe(emitted, self.history)
        self.history.extend(emitted)

    def _context_lookup(self) -> ContextLookup:
        """Prompt lookup over this drafter's history, made at first use."""
        if self.lookup is None:
            self.lookup = ContextLookup(self.history)
        return self.lookup

    def lookup_matches(self) -> bool:
        """Whether the context's last ``ContextLookup.ORDER`` tokens were seen before (prompt
        lookup then has a chain with a long match behind it)."""
        return bool(self._context_lookup().propose(1, ContextLookup.ORDER))

    def build_lookup(self, max_depth: int) -> DraftRound:
        """The oracle's tree for a round drafted by prompt lookup alone (``ContextLookup``): the
        chain of at most ``max_depth`` tokens that followed the context's suffix before, with no
        draft pass (a lone root when nothing matches: a plain step)."""
        tree = Tree(self.unseen[-1])
        for parent, token in enumerate(self._context_lookup().propose(max_depth) if max_depth > 0 else []):
            tree.add(parent, token)
        return DraftRound(tree, list(range(len(tree))), [-1] * len(tree))

    def skip(self, tokens: list[int]) -> None:
        """The oracle took plain steps to ``tokens`` without a draft: the draft falls behind by
        them (its next pass catches up)."""
        self.unseen.extend(tokens)
        if self.inner is not None:
            self.inner.observe(tokens, self.history)
        self.history.extend(tokens)

    # ----------------------------------------------------------------- as an inner stage
    def propose(self, context: list[int]) -> tuple[list[int], list[int]]:
        """Mini-tree below the last token of ``context`` (which extends the accepted history):
        this drafter's own best-first tree, as tokens and parents (-1 = the tip)."""
        n = len(self.history)
        if context[:n] != self.history:
            raise ValueError("inner drafter out of sync with the accepted history")
        saved = self.unseen
        self.unseen = saved + context[n:]
        try:
            tree = self.build(len(context) - 1, self.shape.budget, self.shape.max_depth).tree
        finally:
            self.runner.discard()
            self.unseen = saved
        return tree.tokens[1:], [p - 1 for p in tree.parents[1:]]

    def observe(self, emitted: list[int], context: list[int]) -> None:
        """The outer stage accepted ``emitted``: commit it to this drafter's cache."""
        self.unseen = self.unseen + emitted
        self.runner.prefill(self.unseen[:-1])
        self.unseen = self.unseen[-1:]
        if self.inner is not None:
            self.inner.observe(emitted, self.history)
        self.history.extend(emitted)
