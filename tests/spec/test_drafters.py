"""ModelDrafter on its own: each tree is the best-first tree a brute-force search over the
draft's full-recompute distributions finds, and after the oracle accepts a path the draft cache
holds exactly what prefilling the accepted text would."""
from __future__ import annotations

import heapq

import pytest
import torch

from staged_engine.model.backend import TorchBackend, _cpu
from staged_engine.model.checkpoint import load_model
from staged_engine.model.runner import ModelRunner
from staged_engine.sampling import SamplingConfig, SamplingParams
from staged_engine.spec.drafters import ModelDrafter, TreeShape


def best_first_tree(model, context: list[int], shape: TreeShape) -> set[tuple[int, ...]]:
    """The ``budget - 1`` highest cumulative draft log-probability paths below the root, each node
    offering its ``children`` most likely tokens, depth <= max_depth: a priority-queue search
    over full causal passes (``forward_train``, no cache). Scores only fall along a path, so
    popping in order yields the global best set."""
    def top(path: tuple[int, ...]) -> list[tuple[float, int]]:
        with torch.no_grad():
            logp = torch.log_softmax(model.forward_train(torch.tensor([context + list(path)]))[0, -1], -1)
        vals, ids = logp.topk(shape.children)
        return list(zip(vals.tolist(), ids.tolist()))

    heap, chosen = [(0.0, ())], set()
    while heap and len(chosen) < shape.budget - 1:
        neg, path = heapq.heappop(heap)
        if path:
            chosen.add(path)
        if len(path) < shape.max_depth:
            for lp, tok in top(path):
                heapq.heappush(heap, (neg - lp, path + (tok,)))
    return chosen


def _paths(tree) -> set[tuple[int, ...]]:
    out = set()
    for node in range(1, len(tree)):
        path, n = [], node
        while n > 0:
            path.append(tree.tokens[n])
            n = tree.parents[n]
        out.add(tuple(reversed(path)))
    return out


def test_trees_are_best_first_and_the_cache_follows_acceptance(pair):
    _, draft_dir = pair
    model = load_model(draft_dir)
    backend = TorchBackend()
    sampling = SamplingConfig(SamplingParams())
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, model.config.vocab_size, (12,), generator=g).tolist()
    shape = TreeShape(budget=9, max_depth=4, children=3, expand=2)
    drafter = ModelDrafter(ModelRunner(model, backend), sampling, shape)
    history = list(prompt)
    with torch.inference_mode():
        drafter.start(prompt)
        for step in range(6):
            root_position = len(history) - 1
            draft = drafter.build(root_position, shape.budget, shape.max_depth)
            tree = draft.tree
            assert tree.tokens[0] == history[-1]
            assert all(p < i for i, p in enumerate(tree.parents) if i)  # topological
            assert len(tree) == shape.budget
            assert _paths(tree) == best_first_tree(model, history, shape)
            # The oracle accepts some path (the first child chain, cut at step % 3) and a bonus.
            path = [0]
            while len(path) <= step % 3 and tree.children[path[-1]]:
                path.append(next(iter(tree.children[path[-1]].values())))
            emitted = [tree.tokens[n] for n in path[1:]] + [int(torch.randint(0, 50, (1,), generator=g))]
            drafter.accept(draft, path, emitted)
            history += emitted
        drafter.catch_up()
        runner = drafter.runner
        ref = ModelRunner(model, backend)
        ref.prefill(history[:-1])
    assert runner.length == ref.length == len(history) - 1
    n = ref.length
    assert torch.allclose(runner.cache.k[:, 0, :, :n], ref.cache.k[:, 0, :, :n], atol=1e-5)
    assert torch.allclose(runner.cache.v[:, 0, :, :n], ref.cache.v[:, 0, :, :n], atol=1e-5)


def test_draft_children_at_t_above_0_are_the_best_perturbed_scores_over_what_the_rule_keeps():
    """At T > 0 a draft scores every token the request's rule keeps: the top-k (no cap: a rule of
    200 scores 200; the whole vocabulary without one), then the top-p cut over them (the tokens
    whose mass ranked ahead is below top_p). Its children are the best of log p' + g over those
    (float64 reference), the native and torch paths agree, log r is normalised over the tokens
    the top-k keeps (the cut picks children, it does not renormalise), and a child the cut
    leaves no room for has log r -inf (the peaked row)."""
    from types import SimpleNamespace

    from staged_engine.sampling import gumbel_noise, vocab_salt

    v = 1000
    logits = torch.randn(3, v, generator=torch.Generator().manual_seed(4)) * 2
    logits[2, 7] = 30.0  # a peaked row: its nucleus under a cut is one or two tokens
    positions = [10, 11, 12]
    for params in (SamplingParams(0.8, 0, 0.95, 5), SamplingParams(1.0, 0, 1.0, 6), SamplingParams(1.0, 200, 1.0, 7),
                   SamplingParams(1.0, 20, 1.0, 8), SamplingParams(1.0, 200, 0.9, 9), SamplingParams(1.2, 0, 0.5, 10)):
        cfg = SamplingConfig.make(params, v)
        got = [ModelDrafter(SimpleNamespace(backend=TorchBackend(native=native)), cfg, TreeShape(children=4))
               ._child_scores(logits, positions) for native in (True, False)]
        for r in range(3):
            cand = sorted(range(v), key=lambda i: (-float(logits[r, i]), i))[:params.top_k or v]
            z = torch.log_softmax(logits[r, cand].double() / params.temperature, 0)
            kept = int(((torch.cumsum(z.exp(), 0) - z.exp()) < params.top_p).sum()) if params.top_p < 1 else len(cand)
            s = z + gumbel_noise(params.seed, positions[r], vocab_salt(v)).double()[torch.tensor(cand)]
            order = sorted(range(max(kept, 1)), key=lambda j: (-float(s[j]), cand[j]))[:4]
            want_ids, want_lr = [cand[j] for j in order], (s[order] - torch.logsumexp(s, 0)).tolist()
            for ids, lr in got:
                n = len(want_ids)
                assert ids[r][:n] == want_ids, (params, r)
                assert torch.allclose(torch.tensor(lr[r][:n], dtype=torch.float64),
                                      torch.tensor(want_lr, dtype=torch.float64), atol=1e-4)
                assert all(x == float("-inf") for x in lr[r][n:])  # no room under the cut
            if r == 2 and params.top_p < 1:
                assert len(want_ids) < 4  # the peaked row's cut bites


def test_a_windowed_draft_sees_the_text_s_tail_at_its_own_positions_and_draws_the_text_s_noise(pair):
    """A catch-up longer than ``window`` restarts the draft's cache from the text's last
    ``window`` tokens before the root, at positions 0.. of its own, while every draft choice
    still draws the noise of the text's position (the oracle's): the root's 4 children (the tree
    builder) and a chain of 2 (the chain builder) equal what HF transformers finds run on that
    tail alone (float64 perturbed scores for T > 0), native and torch."""
    from transformers import GPT2LMHeadModel

    from staged_engine.sampling import gumbel_noise, vocab_salt

    _, draft_dir = pair
    model = load_model(draft_dir)
    hf = GPT2LMHeadModel.from_pretrained(draft_dir, dtype=torch.float32).eval()
    v = model.config.vocab_size
    g = torch.Generator().manual_seed(21)
    prompt = torch.randint(0, v, (14,), generator=g).tolist()
    window = 5

    def best(params: SamplingParams, path: list[int], k: int) -> list[int]:
        """The k best children after the tail (positions 0..) and ``path``, by the draft's rule."""
        with torch.no_grad():
            logits = hf(torch.tensor([prompt[-window - 1:] + path])).logits[0, -1].double()
        if params.temperature == 0:
            cand, scores = list(range(v)), logits
        else:
            cand = sorted(range(v), key=lambda i: (-float(logits[i]), i))[:params.top_k or v]
            noise = gumbel_noise(params.seed, len(prompt) + len(path), vocab_salt(v)).double()  # the text's position
            scores = torch.log_softmax(logits[cand] / params.temperature, 0) + noise[torch.tensor(cand)]
        order = sorted(range(len(cand)), key=lambda j: (-float(scores[j]), cand[j]))
        return [cand[j] for j in order[:k]]

    for params in (SamplingParams(), SamplingParams(0.9, 0, 1.0, 3), SamplingParams(1.0, 30, 1.0, 8)):
        sampling = SamplingConfig.make(params, v)
        first = best(params, [], 4)
        chain = [first[0], best(params, [first[0]], 1)[0]]
        for native in (True, False):
            for children, depth in ((4, 1), (1, 2)):
                shape = TreeShape(budget=max(children, depth) + 1, max_depth=depth, children=children, expand=1)
                drafter = ModelDrafter(ModelRunner(model, TorchBackend(native=native)), sampling, shape, window=window)
                with torch.inference_mode():
                    if native:  # the prompt left unseen
                        drafter.start(prompt, lazy=True)
                    else:  # a backlog plain steps left
                        drafter.start(prompt[:4])
                        drafter.skip(prompt[4:])
                    drafter.catch_up()
                    assert (drafter.runner.length, drafter.offset) == (window, len(prompt) - 1 - window)
                    assert drafter.calls == (1 if native else 2)  # the restart keeps the pass counts
                    tree = drafter.build(len(prompt) - 1, shape.budget, depth).tree
                if children > 1:
                    assert [tree.tokens[n] for n in sorted(tree.children[0].values())] == first, (params, native)
                else:
                    assert tree.tokens[1:] == chain, (params, native)
        # The tree builder's later passes too: the root's best child is evaluated at the draft's
        # own next position, window + 1 (its noise is checked above).
        drafter = ModelDrafter(ModelRunner(model, TorchBackend()), sampling,
                               TreeShape(budget=3, max_depth=2, children=2, expand=1), window=window)
        seen = []
        forward = drafter.runner.forward_nodes
        drafter.runner.forward_nodes = lambda t, p, m: seen.append(list(p)) or forward(t, p, m)
        with torch.inference_mode():
            drafter.start(prompt, lazy=True)
            drafter.catch_up()
            drafter.build(len(prompt) - 1, 3, 2)
        assert seen == [[window], [window + 1]]


@pytest.mark.skipif(_cpu is None, reason="needs the staged_engine._cpu extension (a lazy start defers the reset of a packed model)")
def test_a_lazy_start_resets_the_runner_at_its_first_use(pair):
    """A lazy start leaves the draft's runner alone until the generation first touches it: one
    that never drafts pays no reset and reports no draft passes (not the last generation's),
    and one that drafts gets a fresh cache."""
    _, draft_dir = pair
    model = load_model(draft_dir)
    runner = ModelRunner(model, TorchBackend(native=True))
    resets = []
    reset = runner.reset
    runner.reset = lambda: resets.append(1) or reset()
    sampling = SamplingConfig.make(SamplingParams(), model.config.vocab_size)
    shape = TreeShape(budget=3, max_depth=2, children=1, expand=1)
    prompt = [5, 6, 7, 8, 9, 10]
    with torch.inference_mode():
        first = ModelDrafter(runner, sampling, shape)
        first.start(prompt)  # eager: reset (the model packed) and prefilled
        assert resets == [1] and first.calls == 1 and runner.length == len(prompt) - 1
        second = ModelDrafter(runner, sampling, shape)
        second.start(prompt + [11], lazy=True)
        assert resets == [1]
        assert (second.calls, second.forward_seconds, second.weight_bytes_read()) == (0, 0.0, 0)
        second.catch_up()
        assert resets == [1, 1] and second.calls == 1 and runner.length == len(prompt)
