"""The embedded demo pair: loads in transformers with the engine's logits, carries its training
record, and every speculative strategy reproduces plain decoding on it."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from staged_engine import Engine
from staged_engine.demo_pair import DEMO_DIR, DEMO_PROMPTS, loops

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


def _loops(text: str) -> bool:
    """Issue 13's definition, written out here rather than imported from the bench: a non-blank
    line repeated 4 or more times, or fewer than 8 distinct words."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return any(lines.count(ln) >= 4 for ln in set(lines)) or len(set(text.split())) < 8


def test_training_records():
    oracle = json.load(open(os.path.join(DEMO_DIR, "oracle", "training.json")))
    draft = json.load(open(os.path.join(DEMO_DIR, "draft", "training.json")))
    assert oracle["num_params"] >= 8 * draft["num_params"]
    for rec in (oracle, draft):
        assert rec["tokens_seen"] > 0 and rec["wall_time_s"] > 0
        assert rec["command"].startswith("staged-engine train-demo ")
        assert rec["cpu"]["model"] and rec["cpu"]["cores"] >= 1
        man = rec["corpus"]["manifest"]
        held = set(man["held_out_packages"])
        assert held and all(p["version"] for p in man["packages"])
        assert {p["name"] for p in man["packages"] if p["role"] == "held_out"} == held
        for split in ("val", "held_out"):
            ev = rec["evaluation"][split]
            assert ev["perplexity"] == pytest.approx(math.exp(ev["loss"]), rel=1e-3)
            # bits per byte from the loss: loss (nats/token) * tokens / ln 2 / bytes
            assert ev["bits_per_byte"] == pytest.approx(ev["loss"] * ev["tokens"] / math.log(2) / ev["bytes"],
                                                        rel=1e-3)
    assert draft["teacher"] and 0.0 < draft["evaluation"]["held_out"]["top1_agreement"] <= 1.0
    with open(os.path.join(DEMO_DIR, "oracle", "tokenizer.json"), "rb") as a, \
            open(os.path.join(DEMO_DIR, "draft", "tokenizer.json"), "rb") as b:
        assert a.read() == b.read()


def test_prompts_ending_in_newline_get_code(demo):
    """The pair writes code after a prompt that ends in a line break, as users write them: on the
    held-out docstring prompts of the bench (third-party packages the pair never saw), greedy
    continuations are never blank, and at most half of them loop (issue 13, line 3)."""
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench", "prompts",
                        "heldout.jsonl")
    with open(path, encoding="utf-8") as f:
        prompts = [json.loads(line)["prompt"] for line in f][:24]
    assert all(p.endswith("\n") for p in prompts)
    looping = 0
    for prompt in prompts:
        text = demo.generate(prompt, max_new_tokens=128, strategy="plain").text
        assert text.strip(), f"blank continuation after {prompt[-60:]!r}"
        looping += _loops(text)
    assert looping <= len(prompts) // 2


@pytest.mark.parametrize("strategy", ["chain", "tree", "staged"])
def test_strategies_reproduce_plain_on_the_demo_pair(demo, strategy):
    for prompt in DEMO_PROMPTS[:3]:
        for kw in (dict(), dict(temperature=1.0, top_k=50, seed=5)):
            ref = demo.generate(prompt, max_new_tokens=48, strategy="plain", stop_at_eos=False, **kw)
            res = demo.generate(prompt, max_new_tokens=48, strategy=strategy, stop_at_eos=False, **kw)
            assert res.token_ids == ref.token_ids


def _chain_tokens_a_pass(demo, chain_length: int, **rule) -> float:
    """Tokens a fixed draft chain emits an oracle pass over the demo prompts (3 seeds each, 64
    tokens), every output checked equal to plain sampling's."""
    tokens = passes = 0
    for prompt in DEMO_PROMPTS:
        for seed in range(3):
            kw = dict(max_new_tokens=64, seed=seed, stop_at_eos=False, **rule)
            res = demo.generate(prompt, strategy="chain", chain_length=chain_length, **kw)
            assert res.token_ids == demo.generate(prompt, strategy="plain", **kw).token_ids
            tokens += res.stats["new_tokens"]
            passes += res.stats["oracle_calls"]
    return tokens / passes


def _draft_rule(monkeypatch, params_of) -> None:
    """Make every SamplingConfig's draft propose under ``params_of(its request's params)``."""
    from staged_engine.sampling import SamplingConfig, _rule

    monkeypatch.setattr(SamplingConfig, "draft_params", property(lambda self: params_of(self.params)))
    monkeypatch.setattr(SamplingConfig, "draft_rule", property(lambda self: _rule(self.draft_params)))


def test_a_draft_that_scores_its_whole_vocabulary_is_kept_more_often_than_one_held_to_64(demo, monkeypatch):
    """At T 1 (no top-k) the demo draft proposes from every token (``SamplingConfig.draft_params``):
    a fixed chain of one emits more tokens an oracle pass than the same draft held to its 64
    likeliest tokens, the rule drafts used to follow (1.60 against 1.51 on these prompts; over 24
    held-out prompts x 128 tokens, 1.61 against 1.48), and both emit plain sampling's tokens."""
    from dataclasses import replace

    whole = _chain_tokens_a_pass(demo, 1, temperature=1.0)
    _draft_rule(monkeypatch, lambda p: replace(p, top_k=min(p.top_k or 64, 64), top_p=1.0))
    assert whole > 1.03 * _chain_tokens_a_pass(demo, 1, temperature=1.0)


def test_a_draft_under_top_p_proposes_among_the_tokens_the_cut_keeps(demo, monkeypatch):
    """At T 1 / top-p 0.9 the demo draft's children are the best perturbed scores among the
    tokens the request's cut keeps (``SamplingConfig.draft_params`` keeps top-p): a fixed chain of
    two emits more tokens an oracle pass than the same draft with no cut (1.97 against 1.89 on
    these prompts; over 24 held-out prompts x 128 tokens, 1.96 against 1.89), and both emit plain
    sampling's tokens."""
    from dataclasses import replace

    cut = _chain_tokens_a_pass(demo, 2, temperature=1.0, top_p=0.9)
    _draft_rule(monkeypatch, lambda p: replace(p, top_p=1.0))
    assert cut > 1.02 * _chain_tokens_a_pass(demo, 2, temperature=1.0, top_p=0.9)


def test_loops_flags_repeats_within_a_line_as_well_as_repeated_lines():
    code = CODE + "        else:\n            out.append(b[j])\n            j += 1\n    return out + a[i:] + b[j:]\n"
    assert not loops(code)
    assert loops("    f = fibi(f, " + "fibi, " * 30)  # one word 8+ times in a row, on one line
    assert not loops("    f = fibi(f, " + "fibi, " * 7 + "x)\n" + code)  # 7 in a row is no loop
    assert loops(code + '    """Return the file."""\n' * 4)  # a line 4 times
    assert not loops(code + '    """Return the file."""\n' * 3)
    assert loops("a b c d e f g a b c d e f g")  # fewer than 8 distinct words
    # issue 13's definition (the test of the pair above) misses the loop within one line
    assert not _loops("    f = fibi(f, " + "fibi, " * 30 + "\n" + code)
    assert loops("    f = fibi(f, " + "fibi, " * 30 + "\n" + code)


def test_demo_command_runs():
    out = subprocess.run([sys.executable, "-m", "staged_engine.cli", "demo", "--prompts", "1",
                          "--max-new-tokens", "24", "--repeats", "2"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "tok/s" in out.stdout and "identical to plain" in out.stdout
    assert "median of 2 runs each, alternating" in out.stdout
    assert out.stdout.count("x plain decoding (median over 1 prompt") == 2, out.stdout  # greedy and sampled


def test_demo_command_names_a_bad_repeat_count(capsys):
    from staged_engine.cli.main import main

    assert main(["demo", "--repeats", "0"]) == 2
    assert "--repeats must be >= 1, got 0" in capsys.readouterr().err


def test_generate_with_ids_names_a_word_that_is_no_token_id(capsys):
    from staged_engine.cli.main import main

    for prompt, bad in (("1, 2 x", "'x'"), ("1 --5", "'--5'"), ("1 \u00b2", "'\u00b2'")):
        assert main(["generate", "--prompt", prompt, "--ids", "--max-new-tokens", "2"]) == 2
        err = capsys.readouterr().err
        assert "with --ids the prompt must be token ids" in err and bad in err, (prompt, err)
    assert main(["generate", "--prompt", "1, 2 3", "--ids", "--max-new-tokens", "2", "--strategy", "plain"]) == 0
