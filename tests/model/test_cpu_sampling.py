"""The sampling rule, tree verification, the draft's perturbed child scoring and the KV path
commit in the native CPU extension (csrc/cpu_sampling.cpp), each against an independent
reference: float64 Gumbel-max over a kept set built by a float64 sort, a brute-force tree walk,
the torch reference in sampling.py, and plain tensor copies; beam sampling's processed
distributions against a float64 sort."""
from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch

from staged_engine.model.backend import _cpu
from staged_engine.model.kv_cache import move_entries
from staged_engine.sampling import NoiseTable, SamplingParams, choose, gumbel_noise, vocab_salt

pytestmark = pytest.mark.skipif(_cpu is None, reason="staged_engine._cpu is not built")


def _reference(row: torch.Tensor, seed: int, position: int, t: float, top_k: int, top_p: float) -> int:
    """ALGORITHMS.md sec. 3 in float64: the kept set by a stable sort, then argmax of log p' + g."""
    v = row.numel()
    if t == 0:
        return int(row.argmax())
    z = row.double() / t
    order = sorted(range(v), key=lambda i: (-float(z[i]), i))
    if 0 < top_k < v:
        order = order[:top_k]
    zk = torch.tensor([float(z[i]) for i in order], dtype=torch.float64)
    logp = torch.log_softmax(zk, 0)
    kept, mass = [], 0.0
    for j, tok in enumerate(order):
        if mass >= top_p:
            break
        kept.append((tok, float(logp[j])))
        mass += math.exp(float(logp[j]))
    g = gumbel_noise(seed, position, vocab_salt(v)).double()
    return max(kept, key=lambda kl: (kl[1] + float(g[kl[0]]), -kl[0]))[0]


@pytest.mark.parametrize("t,top_k,top_p", [(0.0, 0, 1.0), (1.0, 0, 1.0), (0.8, 0, 0.95), (0.7, 0, 0.3),
                                           (1.0, 50, 1.0), (1.3, 5, 0.9), (1.0, 100, 1.0), (0.9, 300, 0.5)])
def test_choose_rows_equals_the_float64_rule(t, top_k, top_p):
    g = torch.Generator().manual_seed(int(t * 100) + top_k)
    v, mismatches = 499, 0
    for trial in range(120):
        logits = torch.randn(3, v, generator=g) * float(torch.rand(1, generator=g) * 6 + 0.5)
        seed = trial * 7919 + 1
        positions = [trial, trial + 1, 1000 + trial]
        got = _cpu.choose_rows(logits, seed, positions, t, top_k, top_p)
        want = [_reference(logits[r], seed, positions[r], t, top_k, top_p) for r in range(3)]
        mismatches += sum(a != b for a, b in zip(got, want))
    assert mismatches == 0


@pytest.mark.parametrize("v", [8192, 50257])
def test_choose_rows_over_whole_vocabularies_equals_float64_gumbel_max(v):
    """The choice at T > 0 computes the noise only of tokens whose bound on g lets them reach the
    best score found so far (csrc: pruned_best). Over a language model's whole vocabulary, with
    rows peaked, flat, Zipf-shaped and partly masked, at low and high temperature, it must still
    be the float64 argmax of log p' + g over every token."""
    g = torch.Generator().manual_seed(v)
    ranks = torch.arange(1, v + 1, dtype=torch.float64)
    rows = [torch.randn(v, generator=g) * s for s in (0.2, 1.0, 4.0, 30.0)]
    rows.append((-1.1 * ranks.log()).float()[torch.randperm(v, generator=g)])  # Zipf: a small model's flat tail
    masked = torch.randn(v, generator=g) * 2
    masked[torch.rand(v, generator=g) < 0.9] = float("-inf")
    rows.append(masked)
    logits = torch.stack(rows)
    for t in (0.3, 0.8, 1.0, 1.7):
        for seed in range(12):
            positions = list(range(seed * 10, seed * 10 + len(rows)))
            z = logits.double() / t
            want = []
            for r in range(len(rows)):
                noise = gumbel_noise(seed, positions[r], vocab_salt(v)).double()
                want.append(int((torch.log_softmax(z[r], 0) + noise).argmax()))
            assert _cpu.choose_rows(logits, seed, positions, t, 0, 1.0) == want, (t, seed)


@pytest.mark.parametrize("top_p", [0.95, 0.6])
def test_top_p_over_a_nucleus_of_thousands_of_tokens_with_the_tail_winning_often(top_p):
    """A flat row over 4096 tokens (a nucleus of ~1000-3700) and a heavy tail: the best perturbed
    score often falls outside the nucleus, so the choice walks down the scores to the first kept
    token. Also rows whose nucleus ends inside a run of tied logits."""
    g = torch.Generator().manual_seed(int(top_p * 100))
    v, cut = 4096, 0
    for trial in range(40):
        logits = torch.randn(2, v, generator=g) * 0.7
        logits[1, 2000:2600] = logits[1, :2000].max() - 0.5  # 600 tied tokens
        seed, positions = trial * 31 + 3, [trial, trial + 500]
        got = _cpu.choose_rows(logits, seed, positions, 0.9, 0, top_p)
        assert got == [_reference(logits[r], seed, positions[r], 0.9, 0, top_p) for r in range(2)]
        cut += sum(a != b for a, b in zip(got, _cpu.choose_rows(logits, seed, positions, 0.9, 0, 1.0)))
    assert cut >= (2 if top_p > 0.9 else 10)  # the walk past cut tokens was exercised


def test_choose_rows_agrees_with_the_torch_rule_and_breaks_ties_by_id():
    v = 300
    logits = torch.randn(4, v, generator=torch.Generator().manual_seed(5)) * 3
    logits[1, 10:20] = logits[1].max() + 1.0  # ten tokens tied at the top
    logits[2] = 0.0  # every token tied
    for seed in range(200):
        for params in (SamplingParams(1.0, 0, 1.0, seed), SamplingParams(0.8, 0, 0.95, seed),
                       SamplingParams(1.0, 50, 1.0, seed)):
            want = choose(logits, [3, 4, 5, 6], params, NoiseTable(seed, v)).tolist()
            assert _cpu.choose_rows(logits, seed, [3, 4, 5, 6], params.temperature, params.top_k,
                                    params.top_p) == want
    assert _cpu.choose_rows(logits, 0, [0] * 4, 0.0, 0, 1.0)[1] == 10  # greedy: the first maximum


def _walk(tokens, parents, logits, seed, positions, t, top_k, top_p):
    node, path, emitted = 0, [0], []
    while True:
        y = _reference(logits[node], seed, positions[node] + 1, t, top_k, top_p)
        emitted.append(y)
        child = next((i for i in range(len(tokens)) if parents[i] == node and tokens[i] == y), None)
        if child is None:
            return path, emitted
        path.append(child)
        node = child


@pytest.mark.parametrize("t,top_k,top_p", [(0.0, 0, 1.0), (1.0, 0, 1.0), (0.8, 20, 0.9)])
def test_verify_tree_equals_a_brute_force_walk(t, top_k, top_p):
    g = torch.Generator().manual_seed(11)
    v, deep = 40, 0
    for trial in range(40):
        logits = torch.randn(12, v, generator=g) * 3
        tokens, parents = [int(torch.randint(v, (1,), generator=g))], [-1]
        for i in range(1, 12):
            p = int(torch.randint(i, (1,), generator=g))
            tok = int(logits[p].argmax()) if torch.rand(1, generator=g) < 0.6 else int(torch.randint(v, (1,), generator=g))
            if any(parents[j] == p and tokens[j] == tok for j in range(i)):
                tok = (tok + 1 + i) % v
                if any(parents[j] == p and tokens[j] == tok for j in range(i)):
                    tokens.append(tokens[-1])
                    parents.append(parents[-1])
                    break
            tokens.append(tok)
            parents.append(p)
        n = len(tokens)
        positions = [50 + trial + (0 if parents[i] < 0 else 1) for i in range(n)]
        got = _cpu.verify_tree(logits[:n].contiguous(), tokens, parents, 99 + trial, positions, t, top_k, top_p)
        assert tuple(map(list, got)) == _walk(tokens, parents, logits, 99 + trial, positions, t, top_k, top_p)
        deep += len(got[0]) > 1
    assert deep >= 5


@pytest.mark.parametrize("top_k", [0, 30])
def test_perturbed_children_are_the_best_perturbed_scores(top_k):
    """The k best tokens by log p' + g (dense torch reference) and log r = score - logsumexp."""
    g = torch.Generator().manual_seed(top_k)
    v = 257
    logits = torch.randn(5, v, generator=g) * 2
    positions = [7, 8, 9, 10, 11]
    idx, logr = _cpu.perturbed_children(logits, 3, positions, 0.9, top_k, 4)
    for r in range(5):
        z = torch.log_softmax(logits[r].double() / 0.9, 0)
        if top_k:
            keep = sorted(range(v), key=lambda i: (-float(logits[r, i]), i))[:top_k]
            mask = torch.full((v,), float("-inf"), dtype=torch.float64)
            mask[keep] = 0.0
            z = torch.log_softmax(z + mask, 0)
        s = z + gumbel_noise(3, positions[r], vocab_salt(v)).double()
        want = sorted(range(v), key=lambda i: (-float(s[i]), i))[:4]
        assert idx[r].tolist() == want
        lse = torch.logsumexp(s[torch.isfinite(s)], 0)
        assert torch.allclose(logr[r].double(), s[want] - lse, atol=1e-4)


def test_perturbed_children_over_whole_vocabularies_and_peaked_rows():
    """The dense children are ranked by p' / (-log u) and normalised by its sum, never computing g
    for every token (csrc: children_by_ratio). Over 8,192 tokens, flat and Zipf-shaped rows and
    rows so peaked that most p' underflow float32 (there the ratio cannot rank the tail, and the
    full scores must be taken), the k best must still be those of the float64 scores, and
    log r = s - logsumexp(s)."""
    g = torch.Generator().manual_seed(8)
    v = 8192
    ranks = torch.arange(1, v + 1, dtype=torch.float64)
    peaked = torch.randn(v, generator=g) * 3
    peaked[4321] = 120.0  # every other p' underflows
    rows = [torch.randn(v, generator=g) * 1.0, (-1.1 * ranks.log()).float()[torch.randperm(v, generator=g)],
            torch.randn(v, generator=g) * 60.0, peaked]
    logits = torch.stack(rows)
    for t, k in ((1.0, 1), (0.8, 4), (0.5, 3)):
        positions = [21, 22, 23, 24]
        idx, logr = _cpu.perturbed_children(logits, 17, positions, t, 0, k)
        for r in range(len(rows)):
            s = torch.log_softmax(logits[r].double() / t, 0) + gumbel_noise(17, positions[r], vocab_salt(v)).double()
            want = sorted(range(v), key=lambda i: (-float(s[i]), i))[:k]
            assert idx[r].tolist() == want, (t, k, r)
            assert torch.allclose(logr[r].double(), s[want] - torch.logsumexp(s, 0), atol=1e-4), (t, k, r)


@pytest.mark.parametrize("slope", [0.0, 1e-3])
@pytest.mark.parametrize("k", [1, 4])
def test_perturbed_children_under_top_p_keep_a_candidate_to_the_cut_and_not_past_it(k, slope):
    """The top-p cut keeps a token while the mass ranked ahead of it is < top_p. In a row whose
    logits fall with the id (or are flat: every token ties and ranks by id) the tokens ahead of
    token i are those of smaller id, and a top_p half a token either side of a candidate's mass
    ahead keeps it or cuts it: the children must be the best perturbed scores among ids 0..c (or
    0..c-1), brute force in float64. The candidates lie past the ten likeliest tokens, where the
    native path tests several at once (masses_before): counting a candidate's own mass as ahead
    of it, or missing the ties with smaller ids, moves the cut by a token."""
    v = 1000
    logits = -slope * torch.arange(v, dtype=torch.float32)[None]
    logp = torch.log_softmax(logits[0].double(), 0)
    ahead = torch.cumsum(logp.exp(), 0) - logp.exp()  # the mass ranked ahead of each id
    for seed, position in ((3, 40), (11, 7), (29, 123)):
        s = logp + gumbel_noise(seed, position, vocab_salt(v)).double()
        ranked = sorted(range(v), key=lambda i: (-float(s[i]), i))
        for c in [i for i in ranked if i >= 16][:3]:  # candidates outside the head of ten
            keep_c, cut_c = float(ahead[c] + logp[c].exp() / 2), float(ahead[c] - logp[c - 1].exp() / 2)
            for top_p, last in ((keep_c, c), (cut_c, c - 1)):
                idx, logr = _cpu.perturbed_children(logits, seed, [position], 1.0, 0, k, top_p)
                want = [i for i in ranked if i <= last][:k]
                assert idx[0].tolist() == want, (seed, c, top_p)
                assert torch.allclose(logr[0].double(), s[want] - torch.logsumexp(s, 0), atol=1e-4)


def _reference_probs(row: torch.Tensor, t: float, top_k: int, top_p: float) -> torch.Tensor:
    """p' in float64 by a full stable sort (ALGORITHMS.md sec. 2): softmax(z / T), top-k, then
    every token whose mass ranked ahead is < top_p, renormalised; one-hot at T = 0."""
    v = row.numel()
    out = torch.zeros(v, dtype=torch.float64)
    if t == 0:
        out[int(row.argmax())] = 1.0
        return out
    z = (row.double() / t).tolist()
    order = sorted(range(v), key=lambda i: (-z[i], i))
    if 0 < top_k < v:
        order = order[:top_k]
    p = torch.softmax(torch.tensor([z[i] for i in order], dtype=torch.float64), 0).tolist()
    kept, mass = [], 0.0
    for j in range(len(order)):
        if mass >= top_p:
            break
        kept.append(j)
        mass += p[j]
    total = math.fsum(p[j] for j in kept)
    for j in kept:
        out[order[j]] = p[j] / total
    return out


@pytest.mark.parametrize("t,top_k,top_p,width", [
    (0.0, 0, 1.0, 3.0), (1.0, 0, 1.0, 3.0), (0.8, 0, 0.95, 3.0), (0.8, 0, 0.95, 0.3), (1.0, 0, 0.999, 0.2),
    (0.7, 0, 0.3, 6.0), (1.0, 50, 1.0, 2.0), (1.3, 5, 0.9, 2.0), (0.9, 300, 0.5, 1.0),
])
def test_processed_probs_equals_a_float64_sort(t, top_k, top_p, width):
    """Beam sampling's conditionals: the same kept set as a full sort (nuclei from a few tokens to
    nearly all 2,000, so the ranked prefix grows past its first 256 and to the whole row), ties
    to the smaller id, the values within float rounding; the torch reference agrees too."""
    from staged_engine.sampling import processed_probs

    g = torch.Generator().manual_seed(int(t * 100) + top_k + int(width * 10))
    v = 2000
    for trial in range(6):
        logits = torch.randn(4, v, generator=g) * width
        logits[1, 100:400] = logits[1, 100]  # a run of ties
        got = _cpu.processed_probs(logits, t, top_k, top_p)
        assert got.dtype == torch.float64 and got.shape == (4, v)
        for r in range(4):
            want = _reference_probs(logits[r], t, top_k, top_p)
            assert torch.equal(got[r] > 0, want > 0), (trial, r, int((got[r] > 0).sum()), int((want > 0).sum()))
            assert float((got[r] - want).abs().max()) < 1e-6
        torch_ref = processed_probs(logits, SamplingParams(t, top_k, top_p)).double()
        assert float((got - torch_ref).abs().max()) < 1e-6


# No cut within rounding of a tie, nor in a tail of masses below float z's precision (~1e-7).
@pytest.mark.parametrize("top_p", [0.3005, 0.9005, 0.9905])
def test_processed_probs_top_p_over_masked_flat_and_two_level_rows(top_p):
    """Rows whose z sit in one value (every token tied), in two values 100 apart (beyond any
    bucket range), or with masked (-inf) tokens: the same kept set and values as a full sort."""
    g = torch.Generator().manual_seed(17)
    masked = torch.randn(1000, generator=g) * 2
    masked[torch.rand(1000, generator=g) < 0.3] = float("-inf")
    two_level = torch.full((1000,), -100.0)
    two_level[torch.randperm(1000, generator=g)[:10]] = 0.0
    rows = torch.stack([torch.zeros(1000), two_level, masked])
    got = _cpu.processed_probs(rows, 0.8, 0, top_p)
    for r in range(3):
        want = _reference_probs(rows[r], 0.8, 0, top_p)
        assert torch.equal(got[r] > 0, want > 0), (r, int((got[r] > 0).sum()), int((want > 0).sum()))
        assert float((got[r] - want).abs().max()) < 1e-6
    assert int((got[0] > 0).sum()) == math.ceil(top_p * 1000)  # all tied: the smallest ids first
    assert bool((got[0, :10] > 0).all())


def test_processed_probs_of_a_non_finite_row_is_nan_and_other_rows_are_kept():
    logits = torch.randn(3, 50)
    logits[1, 7] = float("nan")
    out = _cpu.processed_probs(logits, 1.0, 0, 0.9)
    assert bool(out[1].isnan().all()) and bool(torch.isfinite(out[[0, 2]]).all())
    assert torch.allclose(out[[0, 2]].sum(1), torch.ones(2, dtype=torch.float64))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_kv_move_equals_tensor_copies(dtype):
    g = torch.Generator().manual_seed(0)
    k = torch.randn(3, 2, 4, 20, 8, generator=g).to(dtype)
    v = torch.randn(3, 2, 4, 20, 8, generator=g).to(dtype)
    for path in ([0, 2, 5], [0, 1, 2], [0, 3], [0, 1, 4, 6, 9]):
        k1, v1, k2, v2 = k.clone(), v.clone(), k.clone(), v.clone()
        move_entries(k1, v1, 1, 6, path)
        _cpu.kv_move(k2, v2, 1, 6, path)
        assert torch.equal(k1, k2) and torch.equal(v1, v2)


@pytest.mark.parametrize("width,vocab", [(1, 1), (1, 7), (2, 8192), (5, 13), (8, 8192)])
def test_beam_joint_equals_the_formula(width, vocab):
    # S(b_i) p(v | b_i) / sum, written out here in float64 (beam/core.py's torch path is the other
    # copy of it); a -inf score is a beam with no mass, and its candidates get none.
    g = torch.Generator().manual_seed(width * 100 + vocab)
    probs = torch.softmax(torch.randn(width, vocab, generator=g, dtype=torch.float64) * 3, -1)
    scores = torch.randn(width, generator=g, dtype=torch.float64) * 4 - 30
    if width > 2:
        scores[1] = float("-inf")
    got = _cpu.beam_joint(scores, probs)
    want = torch.stack([math.exp(s - max(x for x in scores.tolist() if math.isfinite(x))) * probs[i]
                        for i, s in enumerate(scores.tolist())]).reshape(-1)
    want = want / want.sum()
    assert got.dtype == torch.float64 and got.shape == (width * vocab,)
    assert torch.allclose(got, want, rtol=1e-12, atol=0)
    if width > 2:
        assert not bool(got[vocab:2 * vocab].any())
    no_mass = torch.full((width,), float("-inf"), dtype=torch.float64)
    assert torch.equal(_cpu.beam_joint(no_mass, probs), torch.zeros(width * vocab, dtype=torch.float64))


def test_inverse_cdf_equals_searchsorted_and_never_draws_zero_mass():
    g = torch.Generator().manual_seed(5)
    for n in (1, 2, 9, 16384):
        probs = torch.rand(n, generator=g, dtype=torch.float64)
        probs[torch.rand(n, generator=g) < 0.3] = 0.0  # zero-mass entries, the last ones too
        probs[-1] = max(float(probs[-1]), 1e-3)
        if n > 2:  # zero mass first and last: u = 0 must not draw the first, u * total = total the last
            probs[0] = 0.0
            probs[-2:] = 0.0
            probs[n // 2] = 0.5
        probs = probs / probs.sum()
        # u = 1 (u * total is the total: the clamp to the last entry of positive mass) is outside
        # U[0, 1) but is where rounding can take u * total
        u = torch.cat([torch.rand(200, generator=g, dtype=torch.float64),
                       torch.tensor([0.0, 1.0 - 2.0 ** -53, 1.0], dtype=torch.float64)])
        got = _cpu.inverse_cdf(probs, u)
        cdf = torch.cumsum(probs, 0)
        want = torch.searchsorted(cdf, u * cdf[-1], right=True).clamp(max=int(torch.nonzero(probs > 0).max()))
        assert got == want.tolist()
        assert all(float(probs[i]) > 0 for i in got)


_BAD = r"""
import torch
from staged_engine import _cpu
x = torch.randn(2, 30)
k = torch.zeros(2, 1, 2, 8, 4)
cases = [
    ("positions must hold one entry per row", lambda: _cpu.choose_rows(x, 1, [0], 1.0, 0, 1.0)),
    ("temperature must be finite", lambda: _cpu.choose_rows(x, 1, [0, 1], float("nan"), 0, 1.0)),
    ("top_p must be in (0, 1]", lambda: _cpu.choose_rows(x, 1, [0, 1], 1.0, 0, 0.0)),
    ("logits must be float32", lambda: _cpu.choose_rows(x.double(), 1, [0, 1], 1.0, 0, 1.0)),
    ("parents[1] must be in", lambda: _cpu.verify_tree(x, [1, 2], [-1, 5], 0, [0, 1], 0.0, 0, 1.0)),
    ("node 0 must be the root", lambda: _cpu.verify_tree(x, [1, 2], [0, 0], 0, [0, 1], 0.0, 0, 1.0)),
    ("tokens, parents and positions", lambda: _cpu.verify_tree(x, [1], [-1], 0, [0], 0.0, 0, 1.0)),
    ("k must be in [1, 64]", lambda: _cpu.perturbed_children(x, 1, [0, 1], 1.0, 0, 65)),
    ("needs temperature > 0", lambda: _cpu.perturbed_children(x, 1, [0, 1], 0.0, 0, 2)),
    ("path reaches slot", lambda: _cpu.kv_move(k, k.clone(), 0, 6, [0, 1, 3])),
    ("row must be in", lambda: _cpu.kv_move(k, k.clone(), 1, 0, [0, 1])),
    ("strictly increasing", lambda: _cpu.kv_move(k, k.clone(), 0, 0, [0, 0])),
    ("logits must be float32", lambda: _cpu.processed_probs(x.double(), 1.0, 0, 0.9)),
    ("logits must be (N, V)", lambda: _cpu.processed_probs(x[0], 1.0, 0, 0.9)),
    ("top_p must be in (0, 1]", lambda: _cpu.processed_probs(x, 1.0, 0, 1.5)),
    ("top_k must be >= 0", lambda: _cpu.processed_probs(x, 1.0, -1, 0.9)),
    ("log_scores must be a 1-D float64", lambda: _cpu.beam_joint(x[:, 0], x.double())),
    ("probs must be a float64 CPU tensor (W, V) with W = 3", lambda: _cpu.beam_joint(torch.zeros(3).double(), x.double())),
    ("probs must be a non-empty 1-D float64", lambda: _cpu.inverse_cdf(x.double(), torch.rand(2).double())),
    ("probs must be a non-empty 1-D float64", lambda: _cpu.inverse_cdf(torch.zeros(0).double(), torch.rand(2).double())),
    ("u must be a 1-D float64", lambda: _cpu.inverse_cdf(x[0].double(), torch.rand(2))),
    ("probs must have positive mass", lambda: _cpu.inverse_cdf(torch.zeros(5).double(), torch.rand(2).double())),
    ("probs must have positive mass", lambda: _cpu.inverse_cdf(torch.full((3,), float("nan")).double(),
                                                               torch.rand(2).double())),
]
for expected, call in cases:
    try:
        call()
    except ValueError as exc:
        assert expected in str(exc), (expected, str(exc))
    else:
        raise AssertionError("no error for " + expected)
print("ok", len(cases))
"""


def test_bad_inputs_raise_value_error_in_a_subprocess():
    """Every bound is checked before it is read; run in a child so a crash fails one test."""
    out = subprocess.run([sys.executable, "-c", _BAD], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("ok")
