"""One Engine shared by threads and interleaved streams: every output equals its stand-alone run."""
from __future__ import annotations

import threading

import pytest
from ckpt_util import make_hf_checkpoint, perturbed_copy

from staged_engine import Engine
from staged_engine.ngram import NGramModel
from staged_engine.training.tokenizer import train_tokenizer

TEXT = ["def add(a, b):\n    return a + b\n", "for item in items:\n    print(item.name, item.value)\n",
        "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n"]
PROMPTS = ["def add(", "for item in", "class Point:\n    def"]
CALLS = [("plain", {}), ("staged", dict(temperature=0.8, top_p=0.95, seed=3)), ("tree", {}),
         ("chain", dict(temperature=1.0, top_k=20, seed=9)), ("beam", dict(num_beams=2, temperature=1.0, seed=1)),
         ("staged", {}), ("plain", dict(temperature=1.0, seed=5)), ("dsbd", dict(num_beams=2, temperature=1.0, seed=2)),
         ("tree", dict(temperature=0.7, seed=8))]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    root = tmp_path_factory.mktemp("conc")
    tok = train_tokenizer(TEXT * 30, vocab_size=400)
    oracle = make_hf_checkpoint(str(root / "oracle"), seed=7, std=0.05, vocab_size=tok.get_vocab_size(),
                                n_positions=160, n_embd=64, n_layer=2, n_head=2)
    tok.save(str(root / "oracle" / "tokenizer.json"))
    draft = perturbed_copy(oracle, str(root / "draft"), 0.02, seed=8)
    ng = NGramModel.build([tok.encode(t).ids for t in TEXT * 3], order=3, vocab_size=tok.get_vocab_size())
    ng.save(str(root / "t.ngram"))
    return Engine.from_pretrained(oracle, draft=draft, ngram=str(root / "t.ngram"))


def _alone(eng, i):
    strategy, kw = CALLS[i % len(CALLS)]
    return eng.generate(PROMPTS[i % len(PROMPTS)], max_new_tokens=40, strategy=strategy, stop_at_eos=False,
                        **kw).token_ids


def test_three_threads_three_calls_mixed_strategies(engine):
    expected = {i: _alone(engine, i) for i in range(9)}
    got, errors = {}, []

    def worker(t):
        try:
            for j in range(3):
                i = 3 * t + j
                got[i] = _alone(engine, i)
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(3)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors
    assert got == expected


@pytest.mark.parametrize("strategy,kw", [("staged", dict(temperature=0.8, top_p=0.95, seed=4)), ("beam", dict(num_beams=2)),
                                         ("tree", {})])
def test_two_streams_consumed_alternately(engine, strategy, kw):
    args = dict(max_new_tokens=48, strategy=strategy, stop_at_eos=False, **kw)
    want = [engine.generate(p, **args).text for p in PROMPTS[:2]]
    a, b = (engine.stream(p, **args) for p in PROMPTS[:2])
    out = [[], []]
    live = [a, b]
    while any(live):
        for k, s in enumerate(live):
            if s is None:
                continue
            try:
                out[k].append(next(s))
            except StopIteration:
                live[k] = None
    assert ["".join(x) for x in out] == want


def test_abandoned_stream_resumes_exactly_after_other_calls(engine):
    args = dict(max_new_tokens=48, strategy="staged", stop_at_eos=False, temperature=1.0, seed=12)
    want = engine.generate(PROMPTS[2], **args).text
    s = engine.stream(PROMPTS[2], **args)
    head = next(s)
    for i in range(4):
        _alone(engine, i)  # other generations in between, on the same engine
    assert head + "".join(s) == want


def test_exhausted_pool_waits_then_names_the_limit(engine, tmp_path):
    eng = Engine(engine.oracle, engine.draft, engine.tokenizer, pool_size=1, pool_timeout=0.2)
    held = eng.stream(PROMPTS[0], max_new_tokens=20, strategy="plain")
    next(held)
    with pytest.raises(TimeoutError, match="pool_size=1"):
        eng.generate(PROMPTS[1], max_new_tokens=4, strategy="plain")
    held.close()  # closing a stream frees its state
    assert eng.generate(PROMPTS[1], max_new_tokens=4, strategy="plain").token_ids
    mem = eng.memory()
    assert mem["states_allocated"] == 1 and mem["per_state"] > 0
    assert mem["total"] == mem["weights"] + mem["packed"] + mem["per_state"]
    # The native path's packing of the oracle's products (float32 here: random weights), counted
    # from the model's own matrices: each at least once, padding at most a quarter more.
    products = 4 * sum(p.numel() for n, p in eng.oracle.named_parameters() if p.dim() == 2 and "wpe" not in n)
    if eng.backend.native_rows(eng.oracle) is None:
        assert mem["packed"] == 0
    else:
        assert products <= mem["packed"] <= 1.25 * products
    with pytest.raises(ValueError, match="pool_size"):
        Engine(engine.oracle, pool_size=0)


def test_a_suspended_stream_leaves_no_inference_mode_behind(engine):
    import torch

    s = engine.stream(PROMPTS[0], max_new_tokens=30, strategy="staged", stop_at_eos=False)
    next(s)
    assert not torch.is_inference_mode_enabled()
    s.close()
    assert not torch.is_inference_mode_enabled()


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2 ** 20


def test_random_api_calls_raise_only_value_error_and_do_not_grow_memory(engine):
    import random

    rng = random.Random(1234)
    choices = {
        "prompt": ["def add(", "", "x", [1, 2, 3], [10 ** 9], None, "é" * 3, "for item in items:\n"],
        "max_new_tokens": [1, 8, 30, 0, -1, 2.5, True, "3"],
        "strategy": ["plain", "chain", "tree", "staged", "beam", "dsbd", "warp", None],
        "temperature": [0.0, 0.7, 1.0, -1.0, float("nan"), "hot"],
        "top_k": [0, 5, 50, -2, 1.5],
        "top_p": [1.0, 0.9, 0.0, 1.5],
        "seed": [None, 0, 7, -1, 2 ** 70, "s"],
        "num_beams": [1, 2, 0],
        "token_healing": [False, True, "yes"],
        "budget": [None, 4, 0, 10 ** 6],
    }
    rss = []
    for i in range(150):
        kw = {k: rng.choice(v) for k, v in choices.items()}
        budget = kw.pop("budget")
        if budget is not None and kw["strategy"] in ("tree", "staged"):
            kw["budget"] = budget
        prompt = kw.pop("prompt")
        try:
            engine.generate(prompt, stop_at_eos=False, **kw)
        except ValueError:
            pass
        if i in (29, 149):
            rss.append(_rss_mb())
    assert rss[1] - rss[0] < 30, rss
