"""Checkpoint factories shared by the tests (imported as a plain module)."""
from __future__ import annotations

import torch

# Odd shapes on purpose: vocabularies that are not multiples of 64, head dims 32/16/20,
# several layer-norm epsilons and activations, short context windows.
CHECKPOINT_CONFIGS = {
    "odd96": dict(vocab_size=997, n_positions=200, n_embd=96, n_layer=3, n_head=3,
                  layer_norm_epsilon=1e-5, activation_function="gelu_new"),
    "eps64": dict(vocab_size=1001, n_positions=128, n_embd=64, n_layer=2, n_head=4,
                  layer_norm_epsilon=1e-3, activation_function="gelu"),
    "relu80": dict(vocab_size=515, n_positions=96, n_embd=80, n_layer=2, n_head=4,
                   layer_norm_epsilon=1e-6, activation_function="relu"),
}


def make_hf_checkpoint(path: str, seed: int, std: float = 0.2, **cfg) -> str:
    """Save a random GPT2LMHeadModel with ``save_pretrained`` (safetensors). A larger init std
    than HF's default makes the logits far from uniform, so greedy paths are not all ties."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(bos_token_id=None, eos_token_id=None, **cfg)
    config.initializer_range = std
    model = GPT2LMHeadModel(config).eval()
    model.save_pretrained(path)
    return path


def perturbed_copy(src: str, dst: str, noise: float, seed: int) -> str:
    """A 'draft' that agrees often with ``src``: the same weights plus Gaussian noise."""
    from transformers import GPT2LMHeadModel

    torch.manual_seed(seed)
    model = GPT2LMHeadModel.from_pretrained(src).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(noise * p.std() * torch.randn_like(p))
    model.save_pretrained(dst)
    return dst


def bfloat16_copy(src: str, dst: str) -> str:
    """``src`` stored in bfloat16, as checkpoints trained in bf16 are. Each matrix gets one value
    bfloat16 holds and float16 cannot (1e-7, below float16's subnormal spacing there), as the tiny
    weights of a real bf16 checkpoint are, so that it packs as bfloat16 rather than float16."""
    from transformers import GPT2LMHeadModel

    model = GPT2LMHeadModel.from_pretrained(src, dtype=torch.float32).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.view(-1)[0] = 1e-7
    model.to(torch.bfloat16).save_pretrained(dst)
    return dst


def round_weights(model, fmt: str) -> None:
    """Round a loaded model's weights in place to float16 or bfloat16 values (kept in float32),
    as a checkpoint stored at that precision holds. For bfloat16 each matrix also gets one value
    float16 cannot hold (see ``bfloat16_copy``)."""
    with torch.no_grad():
        for p in model.parameters():
            if fmt == "bfloat16" and p.dim() == 2:
                p.view(-1)[0] = 1e-7
            p.copy_(p.to(torch.float16 if fmt == "float16" else torch.bfloat16).float())
