"""Token healing: HF transformers' generate(token_healing=True) is the reference; every strategy
equals plain decoding with healing on; extensions equal a brute-force scan of the vocabulary."""
from __future__ import annotations

import pytest
import torch
from ckpt_util import make_hf_checkpoint, perturbed_copy

from staged_engine import Engine
from staged_engine.training.tokenizer import train_tokenizer

CODE = ["import os\nimport os.path\nx = os.path.join(a, b)\nparser = argparse.ArgumentParser()\n",
        "def parse(items):\n    return [item.strip() for item in items if item]\n",
        "http = 'https://example.org'\nprint(http, https)\nfor i in range(10):\n    pass\n"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("heal")
    tok = train_tokenizer(CODE * 30, vocab_size=420)
    oracle = make_hf_checkpoint(str(root / "oracle"), seed=3, std=0.05, vocab_size=tok.get_vocab_size(),
                                n_positions=128, n_embd=64, n_layer=2, n_head=2)
    tok.save(str(root / "oracle" / "tokenizer.json"))
    draft = perturbed_copy(oracle, str(root / "draft"), 0.02, seed=4)
    from staged_engine.ngram import NGramModel

    ngram = NGramModel.build([tok.encode(t).ids for t in CODE * 3], order=3, vocab_size=tok.get_vocab_size())
    ngram.save(str(root / "t.ngram"))
    eng = Engine.from_pretrained(oracle, draft=draft, ngram=str(root / "t.ngram"))
    return eng, tok, oracle


def test_extensions_equal_brute_force(setup):
    eng, tok, _ = setup
    h = eng.healer()
    raw = {i: tok.decode([i]).encode("utf-8") for i in range(tok.get_vocab_size()) if i != 0}
    for t in list(raw)[::7]:
        brute = sorted(i for i, b in raw.items() if b.startswith(raw[t]) and "\ufffd" not in tok.decode([i]))
        got = [i for i in h.extensions(t) if "\ufffd" not in tok.decode([i])]
        assert got == brute, tok.id_to_token(t)
    assert h.extensions(0) == []  # <|endoftext|> is never healed


@pytest.mark.parametrize("prompt", ["x = os.pa", "parser = argparse.Argum", "print(htt", "for i in ra"])
def test_greedy_healing_matches_transformers(setup, prompt):
    from transformers import GPT2LMHeadModel, PreTrainedTokenizerFast

    eng, tok, oracle = setup
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|endoftext|>",
                                     pad_token="<|endoftext|>")
    model = GPT2LMHeadModel.from_pretrained(oracle).eval()
    ids = hf_tok(prompt, return_tensors="pt").input_ids
    n = 12
    with torch.no_grad():
        ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                             token_healing=True, tokenizer=hf_tok, pad_token_id=0)[0].tolist()
    trimmed = ids[0, :-1].tolist()
    assert ref[:len(trimmed)] == trimmed  # HF backed up exactly one token
    res = eng.generate(prompt, max_new_tokens=n + 1, strategy="plain", stop_at_eos=False, token_healing=True)
    assert res.token_ids == ref[len(trimmed):]
    assert res.stats["healed_token"] == ids[0, -1].item()
    # The text continues the prompt as written: prompt + text == decode(trimmed + new tokens).
    assert prompt + res.text == tok.decode(trimmed + res.token_ids)


@pytest.mark.parametrize("strategy", ["chain", "tree", "staged"])
@pytest.mark.parametrize("knobs", [dict(), dict(temperature=0.8, top_p=0.95, seed=11),
                                   dict(temperature=1.0, top_k=20, seed=2)])
def test_every_strategy_equals_plain_with_healing(setup, strategy, knobs):
    eng, _, _ = setup
    for prompt in ("x = os.pa", "def parse(it", "    return [item.st"):
        ref = eng.generate(prompt, max_new_tokens=24, strategy="plain", token_healing=True, stop_at_eos=False, **knobs)
        res = eng.generate(prompt, max_new_tokens=24, strategy=strategy, token_healing=True, stop_at_eos=False,
                           **knobs)
        assert res.token_ids == ref.token_ids and res.text == ref.text
        assert "".join(eng.stream(prompt, max_new_tokens=24, strategy=strategy, token_healing=True,
                                  stop_at_eos=False, **knobs)) == ref.text


def test_healed_token_extends_the_removed_one_and_bad_values_are_refused(setup):
    eng, tok, _ = setup
    for seed in range(6):
        res = eng.generate("x = os.pa", max_new_tokens=3, strategy="plain", temperature=1.5, seed=seed,
                           token_healing=True, stop_at_eos=False)
        removed = tok.decode([tok.encode("x = os.pa").ids[-1]])
        assert res.stats["healed_token"] == tok.encode("x = os.pa").ids[-1]
        assert tok.decode([res.token_ids[0]]).startswith(removed)
        assert ("x = os" + tok.decode(res.token_ids)).startswith("x = os.pa")
        assert "x = os.pa" + res.text == "x = os" + tok.decode(res.token_ids)
    one = eng.generate("x", max_new_tokens=4, strategy="plain", token_healing=True, stop_at_eos=False)
    assert "healed_token" not in one.stats  # a one-token prompt has nothing before it to heal from
    with pytest.raises(ValueError, match="token_healing must be True or False"):
        eng.generate("x = os.pa", max_new_tokens=3, token_healing="yes")
