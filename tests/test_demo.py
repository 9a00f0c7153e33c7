"""The embedded demo pair: loads in transformers with the engine's logits, carries its training
record, and every speculative strategy reproduces plain decoding on it."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from staged_engine import Engine
from staged_engine.demo import DEMO_PROMPTS
from staged_engine.engine import DEMO_DIR

CODE = '''def merge(a, b):
    """Merge two sorted lists."""
    out = []
    i = j = 0
    while i < len(a) and j < len(b):
        if a[i] <= b[j]:
            out.append(a[i])
            i += 1
'''


@pytest.fixture(scope="module")
def demo():
    return Engine.demo()


@pytest.mark.parametrize("role", ["oracle", "draft"])
def test_demo_models_match_transformers(demo, role):
    from transformers import GPT2LMHeadModel

    path = os.path.join(DEMO_DIR, role)
    hf = GPT2LMHeadModel.from_pretrained(path, torch_dtype=torch.float32).eval()
    eng = demo if role == "oracle" else Engine.from_pretrained(path)
    ids = demo.tokenizer.encode(CODE * 3).ids
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    ours = eng.logits(ids)
    assert ((ours - ref).abs().max() / ref.abs().max()).item() <= 1e-4


def test_training_records():
    oracle = json.load(open(os.path.join(DEMO_DIR, "oracle", "training.json")))
    draft = json.load(open(os.path.join(DEMO_DIR, "draft", "training.json")))
    assert oracle["num_params"] >= 10e6 and oracle["num_params"] >= 8 * draft["num_params"]
    for rec in (oracle, draft):
        assert rec["tokens_seen"] > 0 and rec["wall_time_s"] > 0
        assert rec["validation"]["perplexity"] == pytest.approx(2.718281828 ** rec["validation"]["loss"], rel=1e-3)
    assert draft["top1_agreement_with_oracle"] >= 0.6


@pytest.mark.parametrize("strategy", ["chain", "tree", "staged"])
def test_strategies_reproduce_plain_on_the_demo_pair(demo, strategy):
    for prompt in DEMO_PROMPTS[:3]:
        for kw in (dict(), dict(temperature=1.0, top_k=50, seed=5)):
            ref = demo.generate(prompt, max_new_tokens=48, strategy="plain", stop_at_eos=False, **kw)
            res = demo.generate(prompt, max_new_tokens=48, strategy=strategy, stop_at_eos=False, **kw)
            assert res.token_ids == ref.token_ids


def test_demo_command_runs():
    out = subprocess.run([sys.executable, "-m", "staged_engine.cli", "demo", "--prompts", "1",
                          "--max-new-tokens", "24"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "tok/s" in out.stdout and "identical to plain" in out.stdout
