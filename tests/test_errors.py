"""Every error case of DESIGN.md: the exception type, and a message that names the culprit."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from ckpt_util import make_hf_checkpoint

from staged_engine import Engine
from staged_engine.model.checkpoint import load_model


@pytest.fixture(scope="module")
def eng(checkpoints):
    return Engine.from_pretrained(checkpoints["odd96"])


@pytest.mark.parametrize("kwargs,needle", [
    (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(max_new_tokens=2.5), "max_new_tokens"),
    (dict(temperature=-0.1), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-1), "top_k"),
    (dict(strategy="nope"), "strategy"),
    (dict(strategy="plain", num_beams=0), "num_beams"),
    (dict(strategy="plain", num_beams=3), "num_beams"),
    (dict(strategy="plain", temperature=1.0, seed=-3), "seed"),
    (dict(strategy="plain", budget=4), "plain"),
    (dict(strategy="tree"), "draft"),
])
def test_bad_generate_arguments(eng, kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        eng.generate([1, 2, 3], **kwargs)


@pytest.mark.parametrize("prompt,needle", [
    ([], "empty"),
    ("", "empty"),
    ([1, 997], "997"),
    ([1, -1], "-1"),
    ([1, 2.0], "token ids"),
    (list(range(200)), "context window"),
    ("text", "tokenizer"),  # odd96 has no tokenizer.json
    (3.5, "prompt"),
])
def test_bad_prompts(eng, prompt, needle):
    with pytest.raises(ValueError, match=needle):
        eng.generate(prompt, strategy="plain")


def test_generation_stops_at_the_context_window(eng):
    res = eng.generate(list(range(190)), max_new_tokens=50, strategy="plain")
    assert res.stats["finish_reason"] == "context"
    assert len(res.token_ids) == 10


def test_missing_paths(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere"):
        Engine.from_pretrained(str(tmp_path / "nowhere"))
    os.makedirs(tmp_path / "empty")
    with pytest.raises(FileNotFoundError, match="config"):
        load_model(str(tmp_path / "empty"))


@pytest.fixture
def ckpt_copy(checkpoints, tmp_path):
    dst = tmp_path / "copy"
    shutil.copytree(checkpoints["eps64"], dst)
    return str(dst)


def test_missing_safetensors(ckpt_copy):
    os.remove(os.path.join(ckpt_copy, "model.safetensors"))
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_model(ckpt_copy)


def test_pickles_are_refused(ckpt_copy):
    os.remove(os.path.join(ckpt_copy, "model.safetensors"))
    with open(os.path.join(ckpt_copy, "pytorch_model.bin"), "wb") as f:
        f.write(b"\x80\x04not loaded")
    with pytest.raises(ValueError, match="safetensors"):
        load_model(ckpt_copy)


@pytest.mark.parametrize("keep", [0, 5, 100, -1000])
def test_truncated_safetensors(ckpt_copy, keep):
    path = os.path.join(ckpt_copy, "model.safetensors")
    data = open(path, "rb").read()
    with open(path, "wb") as f:
        f.write(data[:keep] if keep >= 0 else data[:keep])
    with pytest.raises(ValueError, match="model.safetensors"):
        load_model(ckpt_copy)


def _rewrite(path: str, fn) -> None:
    from safetensors.torch import load_file, save_file

    f = os.path.join(path, "model.safetensors")
    tensors = load_file(f)
    fn(tensors)
    save_file(tensors, f)


def test_nan_weights(ckpt_copy):
    def poison(t):
        t["transformer.h.1.mlp.c_fc.weight"][3, 7] = float("nan")
    _rewrite(ckpt_copy, poison)
    with pytest.raises(ValueError, match="h.1.mlp.c_fc.weight"):
        load_model(ckpt_copy)


def test_wrong_shape(ckpt_copy):
    def reshape(t):
        t["transformer.wpe.weight"] = t["transformer.wpe.weight"][:-1].clone()
    _rewrite(ckpt_copy, reshape)
    with pytest.raises(ValueError, match="wpe.weight"):
        load_model(ckpt_copy)


def test_unknown_and_missing_tensors(ckpt_copy):
    _rewrite(ckpt_copy, lambda t: t.update(extra=torch.zeros(2)))
    with pytest.raises(ValueError, match="extra"):
        load_model(ckpt_copy)
    _rewrite(ckpt_copy, lambda t: (t.pop("extra"), t.pop("transformer.h.0.ln_1.bias")))
    with pytest.raises(ValueError, match="missing"):
        load_model(ckpt_copy)


def test_bad_config(ckpt_copy):
    cfg_path = os.path.join(ckpt_copy, "config.json")
    cfg = json.load(open(cfg_path))
    json.dump({**cfg, "n_head": 5}, open(cfg_path, "w"))
    with pytest.raises(ValueError, match="n_head"):
        load_model(ckpt_copy)
    open(cfg_path, "w").write("{not json")
    with pytest.raises(ValueError, match="config.json"):
        load_model(ckpt_copy)


def test_draft_vocabulary_must_match(checkpoints):
    with pytest.raises(ValueError, match="vocabulary"):
        Engine.from_pretrained(checkpoints["odd96"], draft=checkpoints["relu80"])


@pytest.mark.parametrize("kwargs,needle", [
    (dict(device="tpu"), "device"),
    (dict(dtype="float8"), "dtype"),
    (dict(backend="cuda-graphs"), "backend"),
])
def test_bad_engine_arguments(checkpoints, kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        Engine.from_pretrained(checkpoints["odd96"], **kwargs)


def test_triton_backend_on_cpu_needs_the_interpreter(checkpoints, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        Engine.from_pretrained(checkpoints["odd96"], backend="triton")


def test_eos_outside_vocab_is_ignored(tmp_path):
    path = make_hf_checkpoint(str(tmp_path / "e"), seed=1, vocab_size=101, n_positions=64,
                              n_embd=32, n_layer=1, n_head=2)
    cfg = json.load(open(os.path.join(path, "config.json")))
    json.dump({**cfg, "eos_token_id": 50256}, open(os.path.join(path, "config.json"), "w"))
    assert len(Engine.from_pretrained(path).generate([1], max_new_tokens=5, strategy="plain").token_ids) == 5
