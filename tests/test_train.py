"""Training of the demo models: corpus split, tokenizer round trip, a few steps that lower the loss."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from staged_engine.checkpoint import load_model
from staged_engine.config import GPT2Config
from staged_engine.model import GPT2
from staged_engine.train import (
    EOS_TOKEN, TrainConfig, batch_at, encode_docs, evaluate, eval_windows, export_model, list_corpus,
    lr_at, read_texts, split_corpus, split_of, stdlib_root, train_model, train_tokenizer,
)


@pytest.fixture(scope="module")
def corpus():
    root = stdlib_root()
    files = list_corpus(root)
    return root, files


@pytest.fixture(scope="module")
def tiny(corpus):
    """A tiny tokenizer and token streams from a handful of small stdlib files."""
    root, files = corpus
    train, val = split_corpus(files)
    small = [f for f in train if 2_000 < os.path.getsize(os.path.join(root, f)) < 20_000][:12]
    _, texts, _ = read_texts(root, small)
    _, vtexts, _ = read_texts(root, [f for f in val if os.path.getsize(os.path.join(root, f)) < 40_000][:2])
    tok = train_tokenizer(texts, vocab_size=400)
    eos = tok.token_to_id(EOS_TOKEN)
    return tok, eos, encode_docs(tok, texts, eos), encode_docs(tok, vtexts, eos)


def test_corpus_excludes_site_packages(corpus):
    root, files = corpus
    assert len(files) > 500
    assert all(f.endswith(".py") and "site-packages" not in f.split("/") for f in files)
    assert files == sorted(files)


def test_split_is_deterministic_and_disjoint(corpus):
    _, files = corpus
    train, val = split_corpus(files)
    train2, val2 = split_corpus(reversed(files))
    assert (train, val) == (train2, val2)
    assert not set(train) & set(val)
    assert sorted(train + val) == files
    assert 0.02 < len(val) / len(files) < 0.10
    # The split depends on the path alone, not on which other files exist.
    assert [split_of(f) for f in val] == ["val"] * len(val)
    assert split_of("json/decoder.py") == split_of("json/decoder.py")


def test_tokenizer_round_trip_and_eos(tiny):
    tok, eos, train_ids, _ = tiny
    assert eos == 0 and tok.id_to_token(eos) == EOS_TOKEN
    text = "def f(x):\n    return x  # naïve ünïcode \t\r\n" + EOS_TOKEN
    assert tok.decode(tok.encode(text).ids, skip_special_tokens=False) == text
    assert train_ids.dtype == np.uint16 and int(train_ids.max()) < tok.get_vocab_size()
    assert (train_ids == eos).sum() == 12  # one separator after each document


def test_schedule_and_batches_are_fixed():
    hp = TrainConfig(steps=100, warmup_steps=10, lr=1e-3, min_lr=1e-4, seq_len=8, batch_size=3)
    assert lr_at(0, hp) == pytest.approx(1e-4)
    assert lr_at(9, hp) == pytest.approx(1e-3)
    assert lr_at(99, hp) == pytest.approx(1e-4, rel=1e-2)
    tokens = np.arange(1000, dtype=np.uint16)
    a, b = batch_at(tokens, 7, hp), batch_at(tokens, 7, hp)
    assert a.shape == (3, 9) and torch.equal(a, b)
    assert not torch.equal(a, batch_at(tokens, 8, hp))
    assert torch.equal(a[:, 1:], a[:, :-1] + 1)  # contiguous windows


def test_few_steps_lower_the_loss_and_resume(tiny, tmp_path):
    tok, eos, train_ids, val_ids = tiny
    cfg = GPT2Config(vocab_size=tok.get_vocab_size(), n_positions=64, n_embd=32, n_layer=1, n_head=2,
                     eos_token_id=eos, bos_token_id=eos)
    hp = TrainConfig(steps=40, batch_size=4, seq_len=64, lr=1e-2, warmup_steps=5, ckpt_every=20,
                     eval_every=1000, log_every=20, bf16=False, threads=1)
    windows = eval_windows(val_ids, 64, 4)
    m0 = GPT2(cfg)
    m0.init_weights(torch.Generator().manual_seed(hp.seed))
    before = evaluate(m0, windows)["loss"]
    logs: list[str] = []
    model, summary = train_model(cfg, train_ids, val_ids, hp, str(tmp_path / "run"), log=logs.append)
    after = evaluate(model, windows)["loss"]
    assert after < before - 0.4, (before, after)
    assert summary["tokens_seen"] == 40 * 4 * 64
    assert any("tok/s" in line and "ETA" in line for line in logs)
    # Resuming a finished run trains nothing and gives the same weights.
    again, _ = train_model(cfg, train_ids, val_ids, hp, str(tmp_path / "run"), log=logs.append)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values()))
    # Distillation runs and the export reloads as float32 with the figures recorded.
    hp_kd = TrainConfig(steps=5, batch_size=2, seq_len=64, warmup_steps=1, distill="kl", bf16=False,
                        threads=1, eval_every=1000, log_every=5)
    draft, _ = train_model(cfg, train_ids, None, hp_kd, None, teacher=model, log=logs.append)
    tok.save(str(tmp_path / "tok.json"))
    export_model(model, str(tmp_path / "oracle"), str(tmp_path / "tok.json"), {"role": "oracle"},
                 val_ids, 64, 2, None, logs.append)
    rec = export_model(draft, str(tmp_path / "draft"), str(tmp_path / "tok.json"), {"role": "draft"},
                       val_ids, 64, 2, str(tmp_path / "oracle"), logs.append)
    assert 0.0 <= rec["top1_agreement_with_oracle"] <= 1.0
    with open(tmp_path / "oracle" / "training.json", encoding="utf-8") as f:
        assert json.load(f)["validation"]["loss"] > 0
    with open(tmp_path / "oracle" / "config.json", encoding="utf-8") as f:
        assert json.load(f)["eos_token_id"] == eos
    reloaded = load_model(str(tmp_path / "oracle"))
    assert reloaded.wte.weight.dtype == torch.float32
