"""backend="triton" end to end (interpreted on CPU): logits equal the torch backend's and greedy
plain and staged generations are identical, on a small random checkpoint with a draft."""
from __future__ import annotations

import pytest
import torch
from ckpt_util import make_hf_checkpoint, perturbed_copy

from staged_engine import Engine, NGramModel


@pytest.fixture(scope="module")
def small_pair(tmp_path_factory, device):
    root = tmp_path_factory.mktemp("tri")
    oracle = make_hf_checkpoint(str(root / "o"), seed=3, vocab_size=203, n_positions=64, n_embd=80,
                                n_layer=2, n_head=2)  # head dim 40
    return oracle, perturbed_copy(oracle, str(root / "d"), 0.05, seed=4)


def test_logits_match_torch_backend(small_pair, device):
    oracle, draft = small_pair
    ids = torch.randint(0, 203, (37,), generator=torch.Generator().manual_seed(0)).tolist()
    ref = Engine.from_pretrained(oracle, backend="torch").logits(ids)
    tri = Engine.from_pretrained(oracle, backend="triton", device=device, dtype="float32").logits(ids)
    torch.testing.assert_close(tri.cpu(), ref, rtol=1e-4, atol=1e-4)


def test_greedy_plain_and_staged_identical(small_pair, device):
    oracle, draft = small_pair
    ref_eng = Engine.from_pretrained(oracle, draft=draft, backend="torch")
    tri_eng = Engine.from_pretrained(oracle, draft=draft, backend="triton", device=device, dtype="float32")
    assert tri_eng.backend.name == "triton"
    corpus = [ref_eng.generate([i, i + 1], max_new_tokens=30, strategy="plain").token_ids for i in range(6)]
    ref_eng.ngram = tri_eng.ngram = NGramModel.build(corpus, order=3, vocab_size=203)
    for prompt in ([5, 6, 7], [100]):
        ref = ref_eng.generate(prompt, max_new_tokens=16, strategy="plain").token_ids
        assert tri_eng.generate(prompt, max_new_tokens=16, strategy="plain").token_ids == ref
        res = tri_eng.generate(prompt, max_new_tokens=16, strategy="staged", budget=8, max_depth=4)
        assert res.token_ids == ref
        assert res.stats["oracle_calls"] < 16


def test_seeded_sampling_invariance_on_triton(small_pair, device):
    oracle, draft = small_pair
    eng = Engine.from_pretrained(oracle, draft=draft, backend="triton", device=device, dtype="float32")
    kw = dict(max_new_tokens=12, temperature=1.0, top_k=20, seed=9)
    assert eng.generate([3, 4], strategy="tree", budget=6, **kw).token_ids == \
        eng.generate([3, 4], strategy="plain", **kw).token_ids
