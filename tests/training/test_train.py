"""Training of the demo models: schedule, a few steps that lower the loss, resume, distillation,
atomic export, bad input, and the train-demo command end to end on a tiny configuration."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_corpus_tokenizer import CODE

from staged_engine.cli.main import main as cli_main
from staged_engine.model.checkpoint import load_model
from staged_engine.model.config import GPT2Config
from staged_engine.model.gpt2 import GPT2
from staged_engine.training.tokenizer import EOS_TOKEN, train_tokenizer
from staged_engine.training.train import (
    DemoPaths,
    TrainConfig,
    _distill_terms,
    batch_at,
    encode_docs,
    eval_windows,
    evaluate,
    export_model,
    lr_at,
    parse_size,
    token_byte_lengths,
    train_model,
)

TEXTS = [CODE.replace("Stack", f"Stack{i}").replace("10", str(i)) for i in range(40)]


@pytest.fixture(scope="module")
def tiny():
    tok = train_tokenizer(TEXTS, vocab_size=400)
    eos = tok.token_to_id(EOS_TOKEN)
    return tok, eos, encode_docs(tok, TEXTS[:36], eos), encode_docs(tok, TEXTS[36:], eos)


def _data_dir(tmp_path, tok, eos, train_ids, val_ids) -> DemoPaths:
    """A train-demo run dir holding the tokenizer and data stages' outputs."""
    paths = DemoPaths(str(tmp_path / "run"), str(tmp_path / "out"))
    os.makedirs(paths.data)
    tok.save(paths.tokenizer)
    for name, ids in (("train", train_ids), ("val", val_ids), ("held_out", val_ids)):
        np.save(os.path.join(paths.data, f"{name}.npy"), ids)
    meta = {"python": "3", "eos_token_id": eos, "vocab_size": tok.get_vocab_size(), "manifest": {},
            "tokens_train": len(train_ids)}
    with open(os.path.join(paths.data, "meta.json"), "w", encoding="utf-8") as f:
        json.dump(meta, f)
    return paths


def test_schedule_and_batches_are_fixed():
    hp = TrainConfig(steps=100, warmup_steps=10, lr=1e-3, min_lr=1e-4, seq_len=8, batch_size=3)
    assert lr_at(0, hp) == pytest.approx(1e-4)
    assert lr_at(9, hp) == pytest.approx(1e-3)
    assert lr_at(99, hp) == pytest.approx(1e-4, rel=1e-2)
    assert lr_at(50, hp, time_frac=1.0) == pytest.approx(1e-4)
    tokens = np.arange(1000, dtype=np.uint16)
    a, b = batch_at(tokens, 7, hp), batch_at(tokens, 7, hp)
    assert a.shape == (3, 9) and torch.equal(a, b)
    assert not torch.equal(a, batch_at(tokens, 8, hp))
    assert torch.equal(a[:, 1:], a[:, :-1] + 1)  # contiguous windows


def test_distillation_terms_match_torch_references():
    g = torch.Generator().manual_seed(3)
    lg, t_lg = torch.randn(37, 300, generator=g) * 3, torch.randn(37, 300, generator=g) * 3
    y = torch.randint(0, 300, (37,), generator=g)
    kl, ce = _distill_terms(lg, t_lg, y)
    ref_kl = F.kl_div(F.log_softmax(lg, -1), F.log_softmax(t_lg, -1), log_target=True, reduction="batchmean")
    assert kl.item() == pytest.approx(ref_kl.item(), rel=1e-5)
    assert ce.item() == pytest.approx(F.cross_entropy(lg, y).item(), rel=1e-5)
    assert _distill_terms(t_lg, t_lg, y)[0].abs().item() < 1e-5  # KL of a distribution to itself


def test_bits_per_byte_is_loss_over_bytes(tiny):
    tok, eos, _, val_ids = tiny
    cfg = GPT2Config(vocab_size=tok.get_vocab_size(), n_positions=64, n_embd=32, n_layer=1, n_head=2)
    m = GPT2(cfg)
    m.init_weights(torch.Generator().manual_seed(0))
    w = eval_windows(val_ids, 32, 3)
    lengths = token_byte_lengths(tok)
    ev = evaluate(m, w, byte_lengths=lengths)
    nbytes = sum(len(tok.decode([int(t)]).encode("utf-8")) for t in w[:, 1:].reshape(-1) if int(t) != eos)
    assert ev["bytes"] == nbytes
    assert ev["bits_per_byte"] == pytest.approx(ev["loss"] * ev["tokens"] / np.log(2) / nbytes)


def test_few_steps_lower_the_loss_resume_and_export(tiny, tmp_path):
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
    # Distillation runs; the export reloads as float32 with the figures recorded.
    hp_kd = TrainConfig(steps=5, batch_size=2, seq_len=64, warmup_steps=1, distill="kl", bf16=False,
                        threads=1, eval_every=1000, log_every=5)
    draft, _ = train_model(cfg, train_ids, None, hp_kd, None, teacher=model, log=logs.append)
    paths = _data_dir(tmp_path, tok, eos, train_ids, val_ids)
    streams = {"val": val_ids, "held_out": val_ids}
    export_model(model, paths.export("oracle"), paths, {"role": "oracle"}, streams, 64, 2, None, logs.append)
    rec = export_model(draft, paths.export("draft"), paths, {"role": "draft"}, streams, 64, 2,
                       paths.export("oracle"), logs.append)
    assert 0.0 <= rec["top1_agreement_with_oracle"] <= 1.0
    with open(os.path.join(paths.export("oracle"), "training.json"), encoding="utf-8") as f:
        assert json.load(f)["evaluation"]["held_out"]["bits_per_byte"] > 0
    reloaded = load_model(paths.export("oracle"))
    assert reloaded.wte.weight.dtype == torch.float32
    assert sorted(os.listdir(paths.out_dir)) == ["draft", "oracle"]  # no temporary directories left


def test_failed_export_keeps_the_previous_weights(tiny, tmp_path, monkeypatch):
    tok, eos, train_ids, val_ids = tiny
    paths = _data_dir(tmp_path, tok, eos, train_ids, val_ids)
    cfg = GPT2Config(vocab_size=tok.get_vocab_size(), n_positions=64, n_embd=32, n_layer=1, n_head=2)
    m = GPT2(cfg)
    m.init_weights()
    streams = {"val": val_ids, "held_out": val_ids}
    export_model(m, paths.export("oracle"), paths, {"role": "oracle"}, streams, 64, 2, None, lambda s: None)
    before = open(os.path.join(paths.export("oracle"), "model.safetensors"), "rb").read()
    import staged_engine.training.train as train_mod

    def boom(*a, **k):
        raise RuntimeError("interrupted")
    monkeypatch.setattr(train_mod, "measure", boom)
    m2 = GPT2(cfg)
    m2.init_weights(torch.Generator().manual_seed(5))
    with pytest.raises(RuntimeError, match="interrupted"):
        export_model(m2, paths.export("oracle"), paths, {"role": "oracle"}, streams, 64, 2, None, lambda s: None)
    assert open(os.path.join(paths.export("oracle"), "model.safetensors"), "rb").read() == before


def test_corrupt_resume_checkpoint_is_named(tiny, tmp_path):
    tok, eos, train_ids, val_ids = tiny
    cfg = GPT2Config(vocab_size=tok.get_vocab_size(), n_positions=64, n_embd=32, n_layer=1, n_head=2)
    run = tmp_path / "run"
    run.mkdir()
    (run / "ckpt.pt").write_bytes(b"not a checkpoint")
    hp = TrainConfig(steps=2, batch_size=2, seq_len=16, bf16=False, threads=1)
    with pytest.raises(ValueError, match="resume checkpoint .*ckpt.pt is corrupt"):
        train_model(cfg, train_ids, None, hp, str(run), log=lambda s: None)


def test_bad_sizes_and_missing_data_are_refused(tmp_path, capsys):
    with pytest.raises(ValueError, match="--size must be"):
        parse_size("256x8")
    with pytest.raises(ValueError, match="divisible"):
        parse_size("100x2x3")
    rc = cli_main(["train-demo", "--run-dir", str(tmp_path / "empty"), "--out", str(tmp_path / "o"),
                   "--stages", "oracle"])
    assert rc == 2 and "meta.json not found" in capsys.readouterr().err


def test_train_demo_command_runs_both_stages(tiny, tmp_path):
    """The recorded command shape, on a tiny configuration: oracle, then a draft distilled from it."""
    tok, eos, train_ids, val_ids = tiny
    paths = _data_dir(tmp_path, tok, eos, train_ids, val_ids)
    rc = cli_main(["train-demo", "--run-dir", paths.run_dir, "--out", paths.out_dir, "--stages", "oracle,draft",
                   "--oracle-size", "32x1x2", "--oracle-steps", "6", "--draft-size", "16x1x1",
                   "--draft-steps", "4", "--seq-len", "32", "--threads", "1", "--fp32", "--eval-windows", "2",
                   "--no-verify"])
    assert rc == 0
    with open(os.path.join(paths.export("draft"), "training.json"), encoding="utf-8") as f:
        rec = json.load(f)
    assert rec["train"]["distill"] == "kl" and rec["teacher"] == "oracle"
    assert rec["command"].startswith("staged-engine train-demo --run-dir")
    assert load_model(paths.export("draft")).config.n_embd == 16
