"""Speculative trees and the one verification rule (ALGORITHMS.md sec. 1, 4).

Node 0 is the root (the last accepted token, not yet processed by the oracle); every other
node has a parent with a smaller index and a token distinct from its siblings'. Node i sits at
absolute position L + depth(i).
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch


class Tree:
    def __init__(self, root_token: int) -> None:
        self.tokens: list[int] = [root_token]
        self.parents: list[int] = [-1]
        self.depths: list[int] = [0]
        self.children: list[dict[int, int]] = [{}]  # token -> child node

    def __len__(self) -> int:
        return len(self.tokens)

    def add(self, parent: int, token: int) -> int:
        """Append a child of ``parent`` carrying ``token``; returns its index."""
        if not 0 <= parent < len(self.tokens):
            raise ValueError(f"parent {parent} is not a node of this tree")
        if token in self.children[parent]:
            raise ValueError(f"node {parent} already has a child with token {token}")
        node = len(self.tokens)
        self.tokens.append(token)
        self.parents.append(parent)
        self.depths.append(self.depths[parent] + 1)
        self.children.append({})
        self.children[parent][token] = node
        return node

    @classmethod
    def from_arrays(cls, tokens: list[int], parents: list[int]) -> "Tree":
        tree = cls(tokens[0])
        for tok, par in zip(tokens[1:], parents[1:]):
            tree.add(par, tok)
        return tree

    def ancestor_mask(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """(N, N) bool: mask[i, j] = node j is an ancestor of node i or i itself."""
        n = len(self.tokens)
        m = np.zeros((n, n), dtype=np.bool_)
        for i, p in enumerate(self.parents):
            if p >= 0:
                m[i] = m[p]
            m[i, i] = True
        return torch.from_numpy(m).to(device)

    def is_chain(self) -> bool:
        return all(p == i - 1 for i, p in enumerate(self.parents))


def walk(tree: Tree, choice_at: Callable[[int], int]) -> tuple[list[int], list[int]]:
    """The acceptance walk of ALGORITHMS.md sec. 4.

    ``choice_at(node)`` is the oracle's choice of the token after ``node``. Returns the accepted
    path (node indices, root first) and the emitted tokens (the path's tokens after the root,
    then the bonus token): len(tokens) == len(path) >= 1.
    """
    node = 0
    path = [0]
    out: list[int] = []
    while True:
        y = choice_at(node)
        out.append(y)
        child = tree.children[node].get(y)
        if child is None:
            return path, out
        path.append(child)
        node = child
