"""spec/verify.py against a brute-force tree walk and a float64 Gumbel-max written here."""
from __future__ import annotations

import pytest
import torch

from staged_engine.model.backend import TorchBackend
from staged_engine.sampling import (
    NoiseTable,
    SamplingConfig,
    SamplingParams,
    gumbel_noise,
    vocab_salt,
)
from staged_engine.spec.tree import Tree
from staged_engine.spec.verify import choose_one, verify

V = 40


def _tree(g: torch.Generator, logits: torch.Tensor) -> Tree:
    """A random tree whose children often carry their parent's likely tokens (so walks go deep)."""
    tree = Tree(int(torch.randint(V, (1,), generator=g)))
    for _ in range(int(torch.randint(4, 14, (1,), generator=g))):
        parent = int(torch.randint(len(tree), (1,), generator=g))
        for token in logits[parent].topk(3).indices.tolist() + torch.randint(V, (2,), generator=g).tolist():
            if token not in tree.children[parent]:
                tree.add(parent, token)
                break
    return tree


def _reference_choice(logit_row: torch.Tensor, position: int, params: SamplingParams) -> int:
    if params.greedy:
        return int(logit_row.argmax())
    z = torch.log_softmax(logit_row.double() / params.temperature, dim=-1)
    g = gumbel_noise(params.seed, position, vocab_salt(V)).double()
    return int((z + g).argmax())


def _reference_walk(tree: Tree, logits: torch.Tensor, root_position: int, params: SamplingParams):
    node, path, emitted = 0, [0], []
    while True:
        token = _reference_choice(logits[node], root_position + tree.depths[node] + 1, params)
        emitted.append(token)
        child = tree.children[node].get(token)
        if child is None:
            return path, emitted
        node = child
        path.append(node)


@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.3])
def test_verify_equals_the_brute_force_walk(temperature):
    g = torch.Generator().manual_seed(int(temperature * 10))
    backend = TorchBackend()
    deep = 0
    for trial in range(30):
        params = SamplingParams(temperature=temperature, seed=None if temperature == 0 else 1000 + trial)
        sampling = SamplingConfig(params, None if params.greedy else NoiseTable(params.seed, V))
        logits = torch.randn(16, V, generator=g) * 3
        tree = _tree(g, logits)
        logits = logits[:len(tree)]
        root = int(torch.randint(0, 50, (1,), generator=g))
        positions = [root + d for d in tree.depths]
        got = verify(backend, tree, logits, positions, sampling)
        assert got == _reference_walk(tree, logits, root, params)
        deep += len(got[0]) > 1
        assert choose_one(backend, logits[0], root + 1, sampling) == got[1][0]
    assert deep >= 5  # the walks do go into the tree


def test_sampling_config_pairs_noise_with_sampling():
    with pytest.raises(ValueError, match="noise"):
        SamplingConfig(SamplingParams(temperature=1.0, seed=1))
    with pytest.raises(ValueError, match="seed"):
        SamplingConfig.make(SamplingParams(temperature=1.0), V)
    assert SamplingConfig.make(SamplingParams(), V).noise is None
