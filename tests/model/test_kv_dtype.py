"""A float16 K/V cache (``Engine(kv_dtype="float16")``): the native pass against the torch
reference over the same float16 cache, both against HF within float16's rounding, every strategy
equal to plain decoding with that cache, and bad values refused by name."""
from __future__ import annotations

import pytest
import torch
from ckpt_util import CHECKPOINT_CONFIGS

from staged_engine import Engine, NGramModel
from staged_engine.model.backend import TorchBackend, _cpu
from staged_engine.model.checkpoint import load_model

pytestmark = pytest.mark.skipif(_cpu is None, reason="the float16 cache's fast path is the native CPU pass")


def _decode(model, backend, ids: list[int], prefix: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Logits of a prefill over ``prefix`` tokens, one-token steps over the rest, then a pass over
    a 5-node tree; the K and V entries the passes left in the cache."""
    cache = model.new_cache()
    out = []
    with torch.inference_mode():
        out.append(model(torch.tensor([ids[:prefix]]), torch.arange(prefix)[None], cache, backend=backend)[0])
        cache.advance()
        for i in range(prefix, len(ids)):
            out.append(model(torch.tensor([[ids[i]]]), torch.tensor([[i]]), cache, backend=backend)[0])
            cache.advance()
        n = len(ids)
        mask = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0], [1, 0, 1, 0, 1]],
                            dtype=torch.bool)
        out.append(model(torch.tensor([ids[:5]]), torch.tensor([[n, n + 1, n + 1, n + 2, n + 2]]), cache, mask,
                         backend=backend)[0])
        span = n + 5
        return torch.cat(out), cache.k[:, 0, :, :span].clone(), cache.v[:, 0, :, :span].clone()


def _ids(name: str, n: int) -> list[int]:
    g = torch.Generator().manual_seed(len(name))
    return torch.randint(0, CHECKPOINT_CONFIGS[name]["vocab_size"], (n,), generator=g).tolist()


@pytest.mark.parametrize("name", sorted(CHECKPOINT_CONFIGS))  # head dims 32, 16 and 20 (a tail)
def test_native_pass_over_a_float16_cache_matches_the_torch_reference(checkpoints, name):
    model = load_model(checkpoints[name])
    model.kv_dtype = torch.float16
    ids = _ids(name, CHECKPOINT_CONFIGS[name]["n_positions"] - 10)
    ours, k, v = _decode(model, TorchBackend(), ids, 20)
    ref, k_ref, v_ref = _decode(model, TorchBackend(native=False), ids, 20)
    assert k.dtype == torch.float16 and k_ref.dtype == torch.float16
    rel = ((ours - ref).abs().max() / ref.abs().max()).item()
    assert rel <= 1e-4, rel  # the same rounded entries, read in another order
    # Each entry is the float32 one rounded to nearest. The first layer's K/V come from the same
    # embeddings in both paths: where the float32 products differ in their last bits (relative to
    # the terms summed, so more in an entry near 0) an entry may round one float16 step apart, no
    # more. Later layers also see the rounding's effects upstream.
    for a, b in ((k, k_ref), (v, v_ref)):
        scale = b.float().abs().max().item()
        assert torch.isclose(a[0].float(), b[0].float(), rtol=2 ** -10, atol=1e-5 * scale).all()
        assert (a[0] == b[0]).float().mean().item() >= 0.99
        assert (a.float() - b.float()).abs().max().item() <= 1e-3 * scale


@pytest.mark.parametrize("name", sorted(CHECKPOINT_CONFIGS))
def test_a_float16_cache_stays_within_its_rounding_of_hf(checkpoints, name):
    from transformers import GPT2LMHeadModel

    model = load_model(checkpoints[name])
    ids = _ids(name, CHECKPOINT_CONFIGS[name]["n_positions"] - 10)
    hf = GPT2LMHeadModel.from_pretrained(checkpoints[name]).eval()
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0, 19:]
    errors = {}
    for dtype in (None, torch.float16):
        model.kv_dtype = dtype
        got = _decode(model, TorchBackend(), ids, 20)[0][:-5]
        got = torch.cat([got[19:20], got[20:]])  # the prefill's last row, then the steps
        errors[dtype] = ((got - want).abs().max() / want.abs().max()).item()
    assert errors[None] <= 1e-4, errors
    assert errors[torch.float16] <= 2e-3, errors
    assert errors[torch.float16] > errors[None]  # the entries were rounded


SHAPES = [("chain", {}), ("chain", dict(chain_length=3)), ("tree", dict(budget=5, max_depth=2, children=2, expand=1)),
          ("staged", {}), ("staged", dict(budget=12, max_depth=5, draft_window=3))]


@pytest.fixture(scope="module")
def engine(pair):
    oracle, draft = pair
    eng = Engine.from_pretrained(oracle, draft=draft, kv_dtype="float16")
    # An n-gram model of text the oracle itself writes, so the staged stage has real hits.
    corpus = [eng.generate(p, max_new_tokens=60, strategy="plain").token_ids for p in _prompts(8, seed=99)]
    eng.ngram = NGramModel.build(corpus, order=3, vocab_size=997)
    return eng


def _prompts(n: int, seed: int = 5) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 997, (int(torch.randint(2, 40, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def test_the_engine_keeps_the_oracle_cache_in_float16(engine):
    assert engine.oracle.kv_dtype == torch.float16 and engine.draft.kv_dtype is None
    c = engine.oracle.config
    assert engine.memory()["per_state"] == 2 * c.n_layer * c.n_positions * c.n_embd * 2 + \
        2 * engine.draft.config.n_layer * engine.draft.config.n_positions * engine.draft.config.n_embd * 4
    assert engine.cost_profile("oracle").key["kv_dtype"] == "float16"
    assert "kv_dtype" not in engine.cost_profile("draft").key


@pytest.mark.parametrize("strategy,opts", SHAPES)
def test_every_strategy_equals_plain_decoding_over_a_float16_cache(engine, strategy, opts):
    for prompt in _prompts(4):
        ref = engine.generate(prompt, max_new_tokens=40, strategy="plain").token_ids
        assert engine.generate(prompt, max_new_tokens=40, strategy=strategy, **opts).token_ids == ref
        for kw in (dict(temperature=0.8, top_p=0.9, seed=3), dict(temperature=1.0, top_k=20, seed=4)):
            ref = engine.generate(prompt, max_new_tokens=40, strategy="plain", **kw).token_ids
            assert engine.generate(prompt, max_new_tokens=40, strategy=strategy, **kw).token_ids == ref


def test_beams_run_over_a_float16_cache(engine):
    prompt = _prompts(1)[0]
    ref = engine.generate(prompt, max_new_tokens=24, strategy="plain").token_ids
    for layout in ("tree", "rows"):
        assert engine.generate(prompt, max_new_tokens=24, strategy="beam", num_beams=3, layout=layout).token_ids == ref
        assert engine.generate(prompt, max_new_tokens=24, strategy="dsbd", num_beams=3, layout=layout).token_ids == ref
        res = engine.generate(prompt, max_new_tokens=24, strategy="dsbd", num_beams=4, layout=layout,
                              temperature=1.0, seed=2)
        assert res.stats["new_tokens"] == 24


def test_bad_kv_dtypes_are_refused_by_name(pair):
    oracle, draft = pair
    for bad in ("int8", "bfloat16", torch.int8, 16):
        with pytest.raises(ValueError, match="kv_dtype must be None, 'float32' or 'float16'"):
            Engine.from_pretrained(oracle, draft=draft, kv_dtype=bad)
    with pytest.raises(ValueError, match="kv_dtype='float16' needs float32 weights"):
        Engine.from_pretrained(oracle, dtype="bfloat16", kv_dtype="float16")
    eng = Engine.from_pretrained(oracle, kv_dtype="float32")  # the weights' own: nothing to change
    assert eng.oracle.kv_dtype is None
