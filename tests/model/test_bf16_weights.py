"""Checkpoints stored in bfloat16 on the native path: packed as bfloat16 (half the bytes of the
float32 packing they took before), plain greedy decoding against HF generate on the same
checkpoint, and every strategy equal to plain decoding, greedy and seeded."""
from __future__ import annotations

import pytest
import torch
from ckpt_util import bfloat16_copy

from staged_engine import Engine, NGramModel
from staged_engine.model.backend import TorchBackend, _cpu
from staged_engine.model.checkpoint import load_model

pytestmark = pytest.mark.skipif(_cpu is None, reason="the bfloat16 packing is the native CPU pass's")

VOCAB = 997  # odd96's


@pytest.fixture(scope="module")
def paths(pair, tmp_path_factory) -> tuple[str, str]:
    oracle, draft = pair
    root = tmp_path_factory.mktemp("bf16pair")
    return bfloat16_copy(oracle, str(root / "oracle")), bfloat16_copy(draft, str(root / "draft"))


@pytest.fixture(scope="module")
def engine(paths):
    """Both models packed as bfloat16 for every pass (left to the backend, a model whose float32
    copy fits in the last-level cache takes whichever packing times faster: the same bits)."""
    oracle, draft = paths
    eng = Engine(load_model(oracle), draft=load_model(draft), backend=TorchBackend(wide_weights=False, wide_rows=None))
    # An n-gram model of text the oracle itself writes, so the staged stage has real hits.
    corpus = [eng.generate(p, max_new_tokens=60, strategy="plain").token_ids for p in _prompts(8, seed=99)]
    eng.ngram = NGramModel.build(corpus, order=3, vocab_size=VOCAB)
    return eng


def _prompts(n: int, seed: int = 5) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (int(torch.randint(2, 40, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def test_both_models_are_packed_as_bfloat16(engine, paths):
    backend = engine.backend
    for model, role in ((engine.oracle, "oracle"), (engine.draft, "draft")):
        assert model.wte.weight.dtype == torch.float32  # widened at load, as every checkpoint on CPU
        native = backend.native_rows(model)
        assert native.weight_format == backend.packing[id(model)]["packed"] == "bfloat16", role
        assert native.checkpoint_bytes == native.weight_bytes
        assert 2 * native.weight_bytes == TorchBackend(wide_weights=True).native_model(model).weight_bytes
        assert engine.cost_profile(role).key["packed"] == "bfloat16"
    # Left to the backend: whichever packing it chose, named so in the profile's key.
    auto = Engine.from_pretrained(paths[0])
    auto.warm_up()
    assert auto.cost_profile("oracle").key["packed"] == auto.backend.packing[id(auto.oracle)]["packed"] in (
        "bfloat16", "float32")


def test_plain_greedy_equals_hf_generate_on_a_bfloat16_checkpoint(engine, paths):
    from transformers import GPT2LMHeadModel

    hf = GPT2LMHeadModel.from_pretrained(paths[0], dtype=torch.float32).eval()
    for prompt in _prompts(3, seed=8):
        ours = engine.generate(prompt, max_new_tokens=40, strategy="plain").token_ids
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=40, do_sample=False, eos_token_id=None,
                              pad_token_id=0)[0, len(prompt):].tolist()
        if ours != ref:  # allowed only at a near-tie of the oracle's logits
            i = next(j for j, (a, b) in enumerate(zip(ours, ref)) if a != b)
            top2 = torch.topk(engine.logits(prompt + ref[:i])[-1], 2).values
            assert (top2[0] - top2[1]).item() < 1e-4, (prompt, i)


SHAPES = [("chain", dict(chain_length=3)), ("tree", dict(budget=5, max_depth=2, children=2, expand=1)),
          ("staged", {}), ("staged", dict(budget=12, max_depth=5, draft_window=3))]


@pytest.mark.parametrize("strategy,opts", SHAPES)
def test_every_strategy_equals_plain_decoding(engine, strategy, opts):
    for prompt in _prompts(3):
        ref = engine.generate(prompt, max_new_tokens=40, strategy="plain").token_ids
        assert engine.generate(prompt, max_new_tokens=40, strategy=strategy, **opts).token_ids == ref
        for kw in (dict(temperature=0.8, top_p=0.9, seed=3), dict(temperature=1.0, top_k=20, seed=4)):
            ref = engine.generate(prompt, max_new_tokens=40, strategy="plain", **kw).token_ids
            assert engine.generate(prompt, max_new_tokens=40, strategy=strategy, **kw).token_ids == ref


def test_a_float16_cache_over_bfloat16_weights(paths):
    """The two 16-bit options together: weights packed bfloat16, the oracle's K/V in float16;
    a chain of two still writes plain decoding's tokens, greedy and seeded."""
    oracle, draft = paths
    eng = Engine(load_model(oracle), draft=load_model(draft), backend=TorchBackend(wide_weights=False, wide_rows=None),
                 kv_dtype="float16")
    assert eng.backend.native_rows(eng.oracle).weight_format == "bfloat16" and eng.oracle.kv_dtype == torch.float16
    for prompt in _prompts(2, seed=13):
        for kw in ({}, dict(temperature=0.8, top_p=0.9, seed=5)):
            ref = eng.generate(prompt, max_new_tokens=32, strategy="plain", **kw).token_ids
            assert eng.generate(prompt, max_new_tokens=32, strategy="chain", chain_length=2, **kw).token_ids == ref
