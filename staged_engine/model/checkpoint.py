"""Load and save HuggingFace GPT-2 checkpoint directories (safetensors only, never pickles).

A directory holds ``config.json``, ``model.safetensors`` (or a sharded
``model.safetensors.index.json``) and optionally ``tokenizer.json``. HF's Conv1D layers store
weights as (in, out); the model holds (out, in), so those four weights per block are
transposed. Names may carry the ``transformer.`` prefix or not; ``lm_head.weight`` must equal
``wte`` (GPT-2 ties them). Anything unknown, missing, misshapen or non-finite is refused with a
ValueError naming the file and tensor.
"""
from __future__ import annotations

import json
import os

import torch

from staged_engine.model.config import GPT2Config
from staged_engine.model.gpt2 import GPT2

_CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
_IGNORED_SUFFIXES = ("attn.bias", "attn.masked_bias")  # causal-mask buffers of old HF versions


def _expected_hf_shapes(cfg: GPT2Config) -> dict[str, tuple[int, ...]]:
    c, f = cfg.n_embd, cfg.mlp_dim
    shapes = {"wte.weight": (cfg.vocab_size, c), "wpe.weight": (cfg.n_positions, c),
              "ln_f.weight": (c,), "ln_f.bias": (c,)}
    for i in range(cfg.n_layer):
        p = f"h.{i}."
        shapes.update({
            p + "ln_1.weight": (c,), p + "ln_1.bias": (c,), p + "ln_2.weight": (c,), p + "ln_2.bias": (c,),
            p + "attn.c_attn.weight": (c, 3 * c), p + "attn.c_attn.bias": (3 * c,),
            p + "attn.c_proj.weight": (c, c), p + "attn.c_proj.bias": (c,),
            p + "mlp.c_fc.weight": (c, f), p + "mlp.c_fc.bias": (f,),
            p + "mlp.c_proj.weight": (f, c), p + "mlp.c_proj.bias": (c,),
        })
    return shapes


def _safetensors_files(directory: str) -> list[str]:
    single = os.path.join(directory, "model.safetensors")
    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.isfile(single):
        return [single]
    if os.path.isfile(index):
        try:
            with open(index, encoding="utf-8") as f:
                weight_map = json.load(f)["weight_map"]
            names = sorted(set(weight_map.values()))
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{index}: not a valid safetensors index ({exc})") from exc
        files = []
        for name in names:
            path = os.path.join(directory, name)
            if os.path.basename(name) != name or not os.path.isfile(path):
                raise FileNotFoundError(f"{index}: shard {name!r} not found in {directory}")
            files.append(path)
        return files
    if any(os.path.isfile(os.path.join(directory, n)) for n in ("pytorch_model.bin", "model.pt")):
        raise ValueError(f"{directory}: only safetensors weights are loaded (pickled .bin files are "
                         "never executed); convert with transformers save_pretrained(safe_serialization=True)")
    raise FileNotFoundError(f"no model.safetensors in checkpoint directory {directory}")


def _read_tensors(files: list[str]) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for path in files:
        size = os.path.getsize(path)
        if size < 8:
            raise ValueError(f"{path}: truncated safetensors file ({size} bytes)")
        with open(path, "rb") as f:
            header_len = int.from_bytes(f.read(8), "little")
        if header_len > size - 8:
            raise ValueError(f"{path}: truncated or corrupt safetensors file (header of {header_len} "
                             f"bytes in a {size}-byte file)")
        try:
            part = load_file(path, device="cpu")
        except (SafetensorError, OSError, RuntimeError, ValueError) as exc:
            raise ValueError(f"{path}: truncated or corrupt safetensors file ({exc})") from exc
        tensors.update(part)
    return tensors


def load_state_dict(directory: str, cfg: GPT2Config, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The model's state dict ((out, in) linears) from an HF checkpoint directory, validated."""
    raw = _read_tensors(_safetensors_files(directory))
    expected = _expected_hf_shapes(cfg)
    state: dict[str, torch.Tensor] = {}
    lm_head = None
    for name, tensor in raw.items():
        key = name[len("transformer."):] if name.startswith("transformer.") else name
        if key == "lm_head.weight":
            lm_head = tensor
            continue
        if key.endswith(_IGNORED_SUFFIXES) and key not in expected:
            continue
        if key not in expected:
            raise ValueError(f"{directory}: unexpected tensor {name!r} in the checkpoint")
        if tuple(tensor.shape) != expected[key]:
            raise ValueError(f"{directory}: tensor {name!r} has shape {tuple(tensor.shape)}, "
                             f"expected {expected[key]} for this config.json")
        if not tensor.is_floating_point():
            raise ValueError(f"{directory}: tensor {name!r} has dtype {tensor.dtype}, expected floating point")
        if not torch.isfinite(tensor).all():
            raise ValueError(f"{directory}: tensor {name!r} contains NaN or infinite values")
        t = tensor.to(dtype)
        state[key] = t.t().contiguous() if key.endswith(_CONV1D) else t
    missing = sorted(set(expected) - set(state))
    if missing:
        raise ValueError(f"{directory}: checkpoint is missing tensors {missing[:5]}"
                         f"{' ...' if len(missing) > 5 else ''}")
    if lm_head is not None:
        if tuple(lm_head.shape) != expected["wte.weight"] or not torch.equal(
                lm_head.to(dtype), state["wte.weight"]):
            raise ValueError(f"{directory}: lm_head.weight differs from wte.weight; only tied GPT-2 "
                             "heads are supported")
    return state


def load_model(directory: str, device: torch.device | str = "cpu",
               dtype: torch.dtype = torch.float32) -> GPT2:
    """A GPT2 in eval mode on ``device`` from an HF GPT-2 directory."""
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"checkpoint directory not found: {directory}")
    cfg = GPT2Config.from_file(os.path.join(directory, "config.json"))
    state = load_state_dict(directory, cfg, dtype)
    with torch.device("meta"):
        model = GPT2(cfg)
    model.load_state_dict(state, assign=True)
    return model.to(device).eval().requires_grad_(False)


def load_tokenizer(directory: str):
    """tokenizers.Tokenizer from ``tokenizer.json``, or None when the directory has none."""
    path = os.path.join(directory, "tokenizer.json")
    if not os.path.isfile(path):
        return None
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(path)
    except Exception as exc:  # tokenizers raises its own Exception subclass
        raise ValueError(f"{path}: not a valid tokenizers file ({exc})") from exc


def save_model(model: GPT2, directory: str, dtype: torch.dtype = torch.float32,
               tokenizer=None, extra_config: dict | None = None) -> None:
    """Write ``model`` as an HF GPT-2 directory that GPT2LMHeadModel.from_pretrained loads."""
    from safetensors.torch import save_file

    os.makedirs(directory, exist_ok=True)
    state = {}
    for key, t in model.state_dict().items():
        t = t.detach().to("cpu", dtype)
        state["transformer." + key] = (t.t() if key.endswith(_CONV1D) else t).contiguous()
    save_file(state, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    cfg = model.config.to_hf_dict()
    cfg["torch_dtype"] = str(dtype).replace("torch.", "")
    cfg.update(extra_config or {})
    with open(os.path.join(directory, "config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=2)
    if tokenizer is not None:
        tokenizer.save(os.path.join(directory, "tokenizer.json"))
