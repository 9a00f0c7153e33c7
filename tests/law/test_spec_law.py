"""Exact law of tree and staged sampling on a tiny second-order Markov LM (ALGORITHMS.md sec. 3-7,
10; issue acceptance "Exact law").

The real ``Engine`` drives ``Markov2Model`` (tests/markov_lm.py), a model adapter with GPT-2's
forward contract over a real KVCache: it stores each token and its position in the cache and
finds a node's previous token through the tree mask and the committed slots, so the oracle's
logits are right only if the engine's masks, positions and cache commits are. Speculation runs
unchanged (draft trees, n-gram mini-trees, ``Backend.verify``); the histogram of the 3-token
continuations over many seeds is compared with the closed form
T[a, b, x1] T[b, x1, x2] T[x1, x2, x3] by total variation, against the 99.9% quantile of the
TV of exact samples of the same size (simulated from the closed form itself).
"""
from __future__ import annotations

from collections import Counter

import pytest
import torch
from markov_lm import Markov2Model, random_markov2, sample_markov2

from staged_engine import Engine, NGramModel
from staged_engine.model.kv_cache import KVCache
from staged_engine.spec.tree import Tree

F64 = torch.float64
V = 6
STEPS = 3
TREE = dict(budget=6, max_depth=3, children=2)
STAGED = dict(TREE, ngram_widths=(3, 2, 1))
OPTIONS = {"plain": {}, "tree": TREE, "staged": STAGED}
SEED_OFFSET = {"plain": 0, "tree": 1_000_000, "staged": 2_000_000}  # independent samples
N = 2000  # always-on sample size; the shrink check uses 4 N
QUANTILE, REPS = 0.999, 2000

# name -> (oracle T, draft T): dense random pair; sparse oracle with a peaky, zero-heavy draft
CASES = {
    "dense": (lambda: random_markov2(V, 1), lambda: random_markov2(V, 2)),
    "sparse": (lambda: random_markov2(V, 3, zero_frac=0.3),
               lambda: random_markov2(V, 4, zero_frac=0.5, sharpness=4.0)),
}
# The dense pair's top-3 sets overlap at (4, 2), so top-k drafts can match there too.
PROMPTS = {"dense": [2, 5, 4, 2], "sparse": [2, 4, 1, 3]}


# --------------------------------------------------------------------------------------------
# Closed form and the noise bound
# --------------------------------------------------------------------------------------------
def processed(transition: torch.Tensor, temperature: float = 1.0, top_k: int = 0) -> torch.Tensor:
    """(V, V, V) float64 p'(v | a, b): softmax(log T / temperature), top-k kept, renormalised."""
    p = transition ** (1.0 / temperature)
    if 0 < top_k < p.shape[-1]:
        drop = torch.sort(p, dim=-1, descending=True, stable=True).indices[..., top_k:]
        p = p.scatter(-1, drop, 0.0)
    return p / p.sum(-1, keepdim=True)


def closed_form(transition: torch.Tensor, context: list[int], temperature: float = 1.0,
                top_k: int = 0) -> torch.Tensor:
    """(V, V, V): P(x1, x2, x3 | context) = p'[a, b, x1] p'[b, x1, x2] p'[x1, x2, x3]."""
    p = processed(transition, temperature, top_k)
    a, b = context[-2], context[-1]
    return torch.einsum("i,ij,ijk->ijk", p[a, b], p[b], p)


def tv(counts: Counter, n: int, law: torch.Tensor) -> float:
    emp = torch.zeros_like(law)
    for key, c in counts.items():
        emp[key] = c / n
    return 0.5 * float((emp - law).abs().sum())


_BOUNDS: dict = {}


def null_tv_quantile(law: torch.Tensor, n: int, reps: int = REPS, quantile: float = QUANTILE,
                     seed: int = 0) -> float:
    """The ``quantile`` of TV(empirical law of n exact draws, law) over ``reps`` simulations."""
    key = (law.numpy().tobytes(), n, reps, quantile, seed)
    if key not in _BOUNDS:
        probs = law.reshape(-1)
        g = torch.Generator().manual_seed(seed + n)
        tvs = []
        for chunk in range(0, reps, 250):
            r = min(250, reps - chunk)
            draws = torch.multinomial(probs.expand(r, -1), n, replacement=True, generator=g)
            ones = torch.ones_like(draws, dtype=F64)
            counts = torch.zeros(r, probs.numel(), dtype=F64).scatter_add_(1, draws, ones)
            tvs.append(0.5 * (counts / n - probs).abs().sum(1))
        _BOUNDS[key] = float(torch.quantile(torch.cat(tvs), quantile))
    return _BOUNDS[key]


# --------------------------------------------------------------------------------------------
# Engines and samples
# --------------------------------------------------------------------------------------------
_ENGINES: dict = {}
_SAMPLES: dict = {}
_DRAFT_NODES: Counter = Counter()  # samples' key -> nodes the draft model evaluated


def engine(case: str) -> Engine:
    if case not in _ENGINES:
        oracle_t, draft_t = (make() for make in CASES[case])
        oracle, draft = Markov2Model(oracle_t), Markov2Model(draft_t)
        # the n-gram stage counts a stream sampled from the draft (the paper samples its draft)
        ngram = NGramModel.build(sample_markov2(draft_t, 4000, seed=7), order=3, vocab_size=V)
        _ENGINES[case] = Engine(oracle=oracle, draft=draft, ngram=ngram)
    return _ENGINES[case]


def samples(case: str, strategy: str, n: int, temperature: float = 1.0,
            top_k: int = 0) -> tuple[list[tuple[int, ...]], list[int]]:
    """The continuations of seeds SEED_OFFSET[strategy] + 0..n-1 and all accepted lengths;
    extended on demand, so N and 4 N share their first N seeds."""
    key = (case, strategy, temperature, top_k)
    outs, lengths = _SAMPLES.setdefault(key, ([], []))
    eng = engine(case)
    nodes_before = eng.draft.nodes
    for i in range(len(outs), n):
        res = eng.generate(PROMPTS[case], max_new_tokens=STEPS, strategy=strategy, temperature=temperature,
                           top_k=top_k, seed=SEED_OFFSET[strategy] + i, stop_at_eos=False,
                           **OPTIONS[strategy])
        assert len(res.token_ids) == STEPS
        outs.append(tuple(res.token_ids))
        lengths.extend(res.stats["accepted_lengths"])
    _DRAFT_NODES[key] += eng.draft.nodes - nodes_before
    return outs[:n], lengths


def check_law(case: str, strategy: str, sizes: tuple[int, ...], temperature: float = 1.0,
              top_k: int = 0) -> list[float]:
    law = closed_form(engine(case).oracle.transition, PROMPTS[case], temperature, top_k)
    assert abs(float(law.sum()) - 1.0) < 1e-12
    outs, _ = samples(case, strategy, max(sizes), temperature, top_k)
    dists, bounds = [], []
    for n in sizes:
        dists.append(tv(Counter(outs[:n]), n, law))
        bounds.append(null_tv_quantile(law, n))
        print(f"{case} {strategy} T={temperature} top_k={top_k} N={n}: TV={dists[-1]:.4f} "
              f"bound(99.9%)={bounds[-1]:.4f}")
    impossible = sorted(o for o in set(outs) if law[o] == 0)
    assert not impossible, f"{strategy} emitted continuations of probability 0: {impossible}"
    for n, dist, bound in zip(sizes, dists, bounds):
        assert dist <= bound, f"{strategy} N={n}: TV {dist:.4f} above the null bound {bound:.4f}"
    return dists


# --------------------------------------------------------------------------------------------
# The adapter against its closed form
# --------------------------------------------------------------------------------------------
def _forward(model: Markov2Model, cache: KVCache, tokens: list[int], positions: list[int], mask=None):
    return model(torch.tensor([tokens]), torch.tensor([positions]), cache, mask, False)[0]


def test_adapter_forward_is_the_markov_chain() -> None:
    t = random_markov2(V, 11, zero_frac=0.2)
    model = Markov2Model(t)
    log_t = t.log()
    cache = model.new_cache()
    assert isinstance(cache, KVCache) and cache.k.dtype == F64
    prefix = [5, 0, 3, 3, 1]
    out = _forward(model, cache, prefix, list(range(5)))  # prefill, chain (mask None)
    assert cache.pending == 5
    for i in range(1, 5):
        assert torch.equal(out[i], log_t[prefix[i - 1], prefix[i]])
    assert torch.equal(out[0], log_t[model.bos, prefix[0]])
    cache.advance()
    # root(0)=2 -> 1:4 -> 3:0 -> 5:2 ; root -> 2:1 -> 4:5 ; 1 -> 6:3
    tree = Tree.from_arrays([2, 4, 1, 0, 5, 2, 3], [-1, 0, 0, 1, 2, 3, 1])
    pos = [5 + d for d in tree.depths]
    out = _forward(model, cache, tree.tokens, pos, tree.ancestor_mask())
    assert cache.pending == len(tree) and cache.lengths == [5]
    for i in range(len(tree)):
        prev = prefix[-1] if i == 0 else tree.tokens[tree.parents[i]]
        assert torch.equal(out[i], log_t[prev, tree.tokens[i]]), i
    # a second pass over pending entries: children of nodes 5 and 4, mask (2, 7 + 2)
    mask = torch.zeros(2, 9, dtype=torch.bool)
    mask[0, :7] = tree.ancestor_mask()[5]
    mask[1, :7] = tree.ancestor_mask()[4]
    mask[0, 7] = mask[1, 8] = True
    out2 = _forward(model, cache, [1, 0], [9, 8], mask)
    assert torch.equal(out2[0], log_t[2, 1]) and torch.equal(out2[1], log_t[5, 0])
    assert cache.pending == 9
    # commit the path 0 -> 2 -> 4 -> (pending 8): the entries move to slots 5..8
    cache.commit([0, 2, 4, 8])
    assert cache.lengths == [9] and cache.pending == 0
    assert cache.k[0, 0, 0, 5:9, 0].tolist() == [2, 1, 5, 0]
    assert cache.k[0, 0, 0, :9, 1].tolist() == list(range(9))
    out3 = _forward(model, cache, [4], [9])  # sees the committed, moved entries only
    assert torch.equal(out3[0], log_t[0, 4])
    with pytest.raises(ValueError, match="tree_mask"):
        _forward(model, cache, [4, 1], [10, 11], torch.ones(2, 2, dtype=torch.bool))


def test_adapter_rejects_a_wrong_context() -> None:
    model = Markov2Model(random_markov2(V, 12))
    cache = model.new_cache()
    _forward(model, cache, [1, 2, 3], [0, 1, 2])
    cache.advance()
    tree = Tree.from_arrays([4, 0, 1], [-1, 0, 0])
    bad = torch.ones(3, 3, dtype=torch.bool)  # siblings see each other
    with pytest.raises(AssertionError, match="sees positions"):
        _forward(model, cache, tree.tokens, [3, 4, 4], bad)
    cache.discard()
    with pytest.raises(AssertionError, match="cannot see itself"):
        _forward(model, cache, tree.tokens, [3, 4, 4], tree.ancestor_mask() & ~torch.eye(3, dtype=torch.bool))


def test_closed_form_matches_sequential_product() -> None:
    t = random_markov2(V, 13, zero_frac=0.3)
    prompt = PROMPTS["sparse"]
    a, b = prompt[-2], prompt[-1]
    law = closed_form(t, prompt)
    for x in [(0, 0, 0), (1, 5, 2), (5, 4, 3), (3, 3, 1)]:
        expect = float(t[a, b, x[0]] * t[b, x[0], x[1]] * t[x[0], x[1], x[2]])
        assert abs(float(law[x]) - expect) < 1e-15
    p = processed(t, 0.7, 3)
    assert int((p > 0).sum(-1).max()) <= 3 and torch.allclose(p.sum(-1), torch.ones(V, V, dtype=F64))
    row = t[a, b] ** (1 / 0.7)
    top = torch.topk(row, 3).indices
    ref = torch.zeros(V, dtype=F64)
    ref[top] = row[top] / row[top].sum()
    assert torch.allclose(p[a, b], ref, rtol=0, atol=1e-15)


# --------------------------------------------------------------------------------------------
# The output law
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("strategy", ["plain", "tree", "staged"])
def test_law_dense_shrinks(strategy: str) -> None:
    small, large = check_law("dense", strategy, (N, 4 * N))
    assert large < small, f"TV did not shrink from N={N} ({small:.4f}) to 4N ({large:.4f})"


@pytest.mark.parametrize("strategy", ["plain", "tree", "staged"])
def test_law_sparse_draft_and_oracle(strategy: str) -> None:
    check_law("sparse", strategy, (N,))


@pytest.mark.parametrize("strategy", ["plain", "tree", "staged"])
def test_law_top_k_temperature(strategy: str) -> None:
    check_law("dense", strategy, (N,), temperature=0.7, top_k=3)


@pytest.mark.slow
@pytest.mark.parametrize("case,temperature,top_k", [("sparse", 1.0, 0), ("dense", 0.7, 3)])
@pytest.mark.parametrize("strategy", ["tree", "staged"])
def test_law_shrinks_slow(case: str, strategy: str, temperature: float, top_k: int) -> None:
    small, large = check_law(case, strategy, (N, 4 * N), temperature, top_k)
    assert large < small


@pytest.mark.parametrize("case,temperature,top_k", [("dense", 1.0, 0), ("sparse", 1.0, 0), ("dense", 0.7, 3)])
@pytest.mark.parametrize("strategy", ["tree", "staged"])
def test_speculation_was_exercised_and_is_drafter_invariant(case: str, strategy: str, temperature: float,
                                                            top_k: int) -> None:
    """Drafts were rejected at the root and accepted down to full depth, the n-gram stage added
    draft nodes, and each seed gives plain decoding's tokens."""
    outs, lengths = samples(case, strategy, N, temperature, top_k)
    for other in ("tree", "staged"):
        samples(case, other, N, temperature, top_k)
    keys = {s: (case, s, temperature, top_k) for s in ("tree", "staged")}
    draft_nodes = {s: _DRAFT_NODES[key] / len(_SAMPLES[key][0]) for s, key in keys.items()}
    hist = Counter(lengths)
    print(f"{case} {strategy} T={temperature} top_k={top_k}: accepted lengths {sorted(hist.items())}, "
          f"tokens/oracle call {sum(lengths) / len(lengths):.3f}, draft nodes per generate "
          + ", ".join(f"{k} {v:.1f}" for k, v in draft_nodes.items()))
    assert hist[1] > 0.1 * len(lengths) and hist[3] > 0.05 * len(lengths)
    assert draft_nodes["staged"] > draft_nodes["tree"] > 0  # the n-gram mini-trees were evaluated
    eng = engine(case)
    for i in range(300):
        ref = eng.generate(PROMPTS[case], max_new_tokens=STEPS, strategy="plain", temperature=temperature,
                           top_k=top_k, seed=SEED_OFFSET[strategy] + i, stop_at_eos=False)
        assert tuple(ref.token_ids) == outs[i], f"seed {SEED_OFFSET[strategy] + i}"
