"""ModelDrafter on its own: each tree is the best-first tree a brute-force search over the
draft's full-recompute distributions finds, and after the oracle accepts a path the draft cache
holds exactly what prefilling the accepted text would."""
from __future__ import annotations

import heapq

import torch

from staged_engine.model.backend import TorchBackend
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


def test_draft_children_at_t_above_0_are_the_best_perturbed_scores_among_its_64_likeliest_tokens():
    """At T > 0 a draft scores only its DRAFT_CANDIDATES likeliest tokens (fewer under top-k, and
    no top-p cut): its children are the best of log p' + g over them (float64 reference), the
    native and torch paths agree, and log r is normalised over the same candidates."""
    from types import SimpleNamespace

    from staged_engine.sampling import DRAFT_CANDIDATES, gumbel_noise, vocab_salt

    v = 1000
    logits = torch.randn(3, v, generator=torch.Generator().manual_seed(4)) * 2
    positions = [10, 11, 12]
    for params in (SamplingParams(0.8, 0, 0.95, 5), SamplingParams(1.0, 0, 1.0, 6), SamplingParams(1.0, 200, 1.0, 7),
                   SamplingParams(1.0, 20, 1.0, 8)):
        cfg = SamplingConfig.make(params, v)
        got = [ModelDrafter(SimpleNamespace(backend=TorchBackend(native=native)), cfg, TreeShape(children=4))
               ._child_scores(logits, positions) for native in (True, False)]
        keep = min(DRAFT_CANDIDATES, params.top_k or v)
        for r in range(3):
            cand = sorted(range(v), key=lambda i: (-float(logits[r, i]), i))[:keep]
            z = torch.log_softmax(logits[r, cand].double() / params.temperature, 0)
            s = z + gumbel_noise(params.seed, positions[r], vocab_salt(v)).double()[torch.tensor(cand)]
            order = sorted(range(keep), key=lambda j: (-float(s[j]), cand[j]))[:4]
            want_ids, want_lr = [cand[j] for j in order], (s[order] - torch.logsumexp(s, 0)).tolist()
            for ids, lr in got:
                assert ids[r] == want_ids
                assert torch.allclose(torch.tensor(lr[r], dtype=torch.float64), torch.tensor(want_lr, dtype=torch.float64), atol=1e-4)
