"""The tree-mask path of the forward pass against dense references."""
from __future__ import annotations

import torch

from staged_engine.model.checkpoint import load_model
from staged_engine.spec.tree import Tree


def _dense_logits(model, ids: list[int]) -> torch.Tensor:
    cache = model.new_cache()
    x = torch.tensor([ids])
    return model(x, torch.arange(len(ids))[None], cache)[0]


def test_chain_tree_equals_dense_causal(checkpoints):
    model = load_model(checkpoints["odd96"])
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 997, (30,), generator=g).tolist()
    ref = _dense_logits(model, ids)
    cache = model.new_cache()
    prefix = 17
    model(torch.tensor([ids[:prefix]]), torch.arange(prefix)[None], cache)
    cache.advance()
    chain = Tree.from_arrays(ids[prefix:], [-1] + list(range(len(ids) - prefix - 1)))
    mask = chain.ancestor_mask()
    pos = torch.tensor([[prefix + d for d in chain.depths]])
    out = model(torch.tensor([chain.tokens]), pos, cache, mask)[0]
    torch.testing.assert_close(out, ref[prefix:], rtol=1e-5, atol=1e-5)


def test_branching_tree_equals_separate_branches(checkpoints):
    model = load_model(checkpoints["eps64"])
    g = torch.Generator().manual_seed(2)
    prefix = torch.randint(0, 1001, (9,), generator=g).tolist()
    # root(0) -> 1 -> 3 -> 6 ; root -> 2 -> 4 ; 2 -> 5 ; 1 -> 7
    parents = [-1, 0, 0, 1, 2, 2, 3, 1]
    tokens = torch.randint(0, 1001, (len(parents),), generator=g).tolist()
    tree = Tree.from_arrays(tokens, parents)
    cache = model.new_cache()
    model(torch.tensor([prefix]), torch.arange(len(prefix))[None], cache)
    cache.advance()
    pos = torch.tensor([[len(prefix) + d for d in tree.depths]])
    out = model(torch.tensor([tokens]), pos, cache, tree.ancestor_mask())[0]
    for node in range(len(tokens)):
        branch, n = [], node
        while n >= 0:
            branch.append(tokens[n])
            n = parents[n]
        ref = _dense_logits(model, prefix + branch[::-1])[-1]
        torch.testing.assert_close(out[node], ref, rtol=1e-5, atol=1e-5)


def test_tree_over_earlier_pending_entries(checkpoints):
    """A second pass whose nodes hang below entries written (not committed) by a first pass."""
    model = load_model(checkpoints["odd96"])
    ids = [3, 1, 4, 1, 5, 9, 2, 6]
    cache = model.new_cache()
    model(torch.tensor([ids[:4]]), torch.arange(4)[None], cache)
    cache.advance()
    model(torch.tensor([[ids[4], 77]]), torch.tensor([[4, 5]]), cache,
          torch.tensor([[True, False], [True, True]]))
    # entries: 0 = ids[4] (pos 4), 1 = 77 (pos 5). New: ids[5] below entry 0, at position 5.
    mask = torch.tensor([[True, False, True]])
    out = model(torch.tensor([[ids[5]]]), torch.tensor([[5]]), cache, mask)[0, 0]
    ref = _dense_logits(model, ids[:6])[-1]
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
