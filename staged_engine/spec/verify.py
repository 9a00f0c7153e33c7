"""The oracle's choice and tree verification (ALGORITHMS.md sec. 3, 4): native, Triton and torch.

Every strategy emits tokens through these two functions, so one seed fixes one sequence for all
of them: ``choose_one`` is the oracle's choice for one position (plain decoding, a round with
nothing drafted), ``verify`` walks a drafted tree over the oracle's logits and returns the
accepted path and the emitted tokens. The Triton variant (``staged_engine.kernels.verify``) runs
the same rule on the device in one launch when the runner's backend is Triton, the native one
(csrc/cpu_sampling.cpp) in one call on CPU; the torch code in ``sampling`` is the fallback, and
the tests hold all of them to a float64 reference.
"""
from __future__ import annotations

import torch

from staged_engine.model.backend import Backend
from staged_engine.sampling import SamplingConfig, choose, noise_key
from staged_engine.spec.tree import Tree, walk


def _uses_triton(backend: Backend) -> bool:
    return backend.name == "triton"


def _keys(positions: list[int], sampling: SamplingConfig, device) -> torch.Tensor | None:
    if sampling.greedy:
        return None
    return torch.tensor([noise_key(sampling.params.seed, p) for p in positions], dtype=torch.int64, device=device)


def choose_one(backend: Backend, logits: torch.Tensor, position: int, sampling: SamplingConfig) -> int:
    """The oracle's choice for the token at ``position`` from (V,) logits."""
    if _uses_triton(backend):
        from staged_engine.kernels import verify as kernels  # noqa: PLC0415 (needs triton)

        p = sampling.params
        return int(kernels.choice(logits[None].contiguous(), _keys([position], sampling, logits.device),
                                  p.temperature, p.top_k, p.top_p)[0])
    native = backend.choose_rows(logits[None], [position], sampling.rule)
    if native is not None:
        return native[0]
    return int(choose(logits[None], [position], sampling.params, sampling.noise)[0])


def verify(backend: Backend, tree: Tree, logits: torch.Tensor, positions: list[int],
           sampling: SamplingConfig) -> tuple[list[int], list[int]]:
    """ALGORITHMS.md sec. 4 over (N, V) oracle logits of ``tree`` (node i at positions[i]).

    Returns the accepted path (root first) and the emitted tokens (path tokens, then bonus).
    """
    if _uses_triton(backend):
        from staged_engine.kernels import verify as kernels  # noqa: PLC0415 (needs triton)

        dev, p = logits.device, sampling.params
        packed = kernels.verify_tree(
            logits.contiguous(), torch.tensor(tree.tokens, dtype=torch.int64, device=dev),
            torch.tensor(tree.parents, dtype=torch.int64, device=dev),
            _keys([q + 1 for q in positions], sampling, dev), p.temperature, p.top_k, p.top_p)
        path, bonus = kernels.unpack_verify(packed)
        return path, [tree.tokens[n] for n in path[1:]] + [bonus]
    native = backend.verify_tree(logits, tree.tokens, tree.parents, positions, sampling.rule)
    if native is not None:
        return native
    if sampling.greedy:
        return walk(tree, logits.argmax(dim=-1).tolist().__getitem__)

    def choice_at(node: int) -> int:  # lazily: only the nodes the walk reaches
        return int(choose(logits[node:node + 1], [positions[node] + 1], sampling.params, sampling.noise)[0])
    return walk(tree, choice_at)
