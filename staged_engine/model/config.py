"""GPT-2 model configuration, read from a HuggingFace ``config.json``."""
from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field

_ACTIVATIONS = ("gelu_new", "gelu", "gelu_pytorch_tanh", "gelu_fast", "relu")


@dataclass
class GPT2Config:
    vocab_size: int = 50257  # number of token ids the embedding and the LM head cover
    n_positions: int = 1024  # context window: learned position embeddings, KV cache slots
    n_embd: int = 768  # residual stream width C
    n_layer: int = 12  # transformer blocks
    n_head: int = 12  # attention heads; head_dim = n_embd / n_head
    layer_norm_epsilon: float = 1e-5  # epsilon of every LayerNorm
    activation_function: str = "gelu_new"  # MLP nonlinearity (HF name)
    n_inner: int | None = None  # MLP hidden width; None means 4 * n_embd
    bos_token_id: int | None = None  # HF metadata, carried through save/load
    eos_token_id: int | None = None  # stops generation when stop_at_eos is set
    # Derived in __post_init__ (gpt-fast style); not read from config.json.
    head_dim: int = field(init=False)  # n_embd // n_head
    mlp_dim: int = field(init=False)  # n_inner or 4 * n_embd
    num_params: int = field(init=False)  # parameter count with a tied LM head
    weight_bytes_fp32: int = field(init=False)  # bytes read per forward pass in fp32

    def __post_init__(self) -> None:
        for name in ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"config.json: {name} must be a positive integer, got {value!r}")
        if self.n_embd % self.n_head:
            raise ValueError(
                f"config.json: n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})"
            )
        if not (isinstance(self.layer_norm_epsilon, (int, float)) and self.layer_norm_epsilon > 0):
            raise ValueError(
                f"config.json: layer_norm_epsilon must be a positive number, got {self.layer_norm_epsilon!r}"
            )
        if self.activation_function not in _ACTIVATIONS:
            raise ValueError(
                f"config.json: activation_function must be one of {_ACTIVATIONS}, "
                f"got {self.activation_function!r}"
            )
        if self.n_inner is not None and (not isinstance(self.n_inner, int) or self.n_inner < 1):
            raise ValueError(f"config.json: n_inner must be a positive integer or null, got {self.n_inner!r}")
        self.head_dim = self.n_embd // self.n_head
        self.mlp_dim = self.n_inner or 4 * self.n_embd
        c, f = self.n_embd, self.mlp_dim
        per_layer = 2 * 2 * c + (c * 3 * c + 3 * c) + (c * c + c) + (c * f + f) + (f * c + c)
        self.num_params = self.vocab_size * c + self.n_positions * c + self.n_layer * per_layer + 2 * c
        self.weight_bytes_fp32 = 4 * self.num_params

    @classmethod
    def from_dict(cls, raw: dict) -> "GPT2Config":
        """Build from an HF GPT-2 config dict; unknown HF keys are ignored, required ones checked."""
        if raw.get("model_type", "gpt2") != "gpt2":
            raise ValueError(f"config.json: model_type must be 'gpt2', got {raw.get('model_type')!r}")
        missing = [k for k in ("vocab_size", "n_embd", "n_layer", "n_head") if k not in raw]
        if missing:
            raise ValueError(f"config.json: missing required keys {missing}")
        if raw.get("scale_attn_by_inverse_layer_idx") or raw.get("reorder_and_upcast_attn"):
            raise ValueError(
                "config.json: scale_attn_by_inverse_layer_idx / reorder_and_upcast_attn are not supported"
            )
        if raw.get("scale_attn_weights", True) is False:
            raise ValueError("config.json: scale_attn_weights=false is not supported")
        kwargs = {k: raw[k] for k in (
            "vocab_size", "n_embd", "n_layer", "n_head", "layer_norm_epsilon",
            "activation_function", "n_inner", "bos_token_id", "eos_token_id",
        ) if k in raw}
        kwargs["n_positions"] = raw.get("n_positions", raw.get("n_ctx", 1024))
        return cls(**kwargs)

    @classmethod
    def from_file(cls, path: str) -> "GPT2Config":
        if not os.path.isfile(path):
            raise FileNotFoundError(f"config file not found: {path}")
        try:
            with open(path, encoding="utf-8") as f:
                raw = json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"config.json: {path} is not valid JSON ({exc})") from exc
        if not isinstance(raw, dict):
            raise ValueError(f"config.json: {path} must hold a JSON object")
        return cls.from_dict(raw)

    def to_hf_dict(self) -> dict:
        """The config.json that transformers' GPT2LMHeadModel loads."""
        d = {k: v for k, v in asdict(self).items()
             if k not in ("head_dim", "mlp_dim", "num_params", "weight_bytes_fp32")}
        d.update(model_type="gpt2", architectures=["GPT2LMHeadModel"], n_ctx=self.n_positions,
                 tie_word_embeddings=True, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        return d

    @property
    def attn_scale(self) -> float:
        return 1.0 / math.sqrt(self.head_dim)
