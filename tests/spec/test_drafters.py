"""ModelDrafter on its own: trees within their limits, and a draft cache that, after the oracle
accepts a path, holds exactly what prefilling the accepted text would."""
from __future__ import annotations

import torch

from staged_engine.model.backend import TorchBackend
from staged_engine.model.checkpoint import load_model
from staged_engine.model.runner import ModelRunner
from staged_engine.sampling import SamplingConfig, SamplingParams
from staged_engine.spec.drafters import ModelDrafter, TreeShape


def test_trees_respect_the_shape_and_the_cache_follows_acceptance(pair):
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
            assert 1 < len(tree) <= shape.budget and max(tree.depths) <= shape.max_depth
            assert all(p < i for i, p in enumerate(tree.parents) if i)  # topological
            assert tree.tokens[0] == history[-1]
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
