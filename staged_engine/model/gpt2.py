"""GPT-2, hand-written: one forward pass for decoding over a static KV cache, one for training.

Weight names follow HF/OpenAI (``wte``, ``wpe``, ``h.{i}.attn.c_attn``, ``ln_f``...). Linear
weights are held as (out, in), the layout ``F.linear`` and the few-row GEMMs want; HF's Conv1D
files store (in, out) and ``checkpoint.py`` transposes on load and save. The LM head is tied
to ``wte``.

The model knows nothing of speculation: ``forward(tokens, positions, cache, tree_mask)``
writes the new tokens' K/V at each row's next free slots and returns logits.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from staged_engine.model.backend import Backend, TorchBackend
from staged_engine.model.config import GPT2Config
from staged_engine.model.kv_cache import KVCache

_default: list[Backend] = []


def default_backend() -> Backend:
    """The kernels of a bare model call (no runner): ``TorchBackend()``, made on first use."""
    if not _default:
        _default.append(TorchBackend())
    return _default[0]


def _activation_kind(name: str) -> str:
    """The activation's kind, as the native block kernel names it: gelu_tanh, gelu or relu."""
    if name in ("gelu_new", "gelu_pytorch_tanh", "gelu_fast"):
        return "gelu_tanh"
    return "gelu" if name == "gelu" else "relu"


def _activation(kind: str):
    if kind == "gelu_tanh":
        return lambda x: F.gelu(x, approximate="tanh")
    return F.gelu if kind == "gelu" else F.relu


class Attention(nn.Module):
    def __init__(self, cfg: GPT2Config) -> None:
        super().__init__()
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)  # weight (3C, C): q | k | v
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd)


class MLP(nn.Module):
    def __init__(self, cfg: GPT2Config) -> None:
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, cfg.mlp_dim)
        self.c_proj = nn.Linear(cfg.mlp_dim, cfg.n_embd)


class Block(nn.Module):
    def __init__(self, cfg: GPT2Config) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon)
        self.attn = Attention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon)
        self.mlp = MLP(cfg)


class GPT2(nn.Module):
    def __init__(self, config: GPT2Config) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.n_positions, config.n_embd)
        self.h = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.act_kind = _activation_kind(config.activation_function)
        self.act = _activation(self.act_kind)
        self._flat: list[tuple[torch.Tensor, ...]] | None = None
        # None, or a drafting model's head over token ids [0, head_rows) alone: the rest get -inf
        # logits and are never proposed (``Engine(draft_head_rows=)``; never set on an oracle).
        self.head_rows: int | None = None
        # None (the weights' dtype), or the dtype of the K/V caches this model's runners make
        # (``Engine(kv_dtype=)``: float16 halves what attention reads, and rounds each entry).
        self.kv_dtype: torch.dtype | None = None

    def _apply(self, fn, *args, **kwargs):  # .to(), .float(), ... make new tensors: drop the cache
        self._flat = None
        return super()._apply(fn, *args, **kwargs)

    def _layer_tensors(self) -> list[tuple[torch.Tensor, ...]]:
        """Per block, its 12 tensors in forward order. nn.Module attribute lookups cost ~0.1 ms
        per decoding step at these sizes, so forward reads them from this list (built once;
        rebuilt after ``_apply``; in-place updates such as load_state_dict keep the tensors)."""
        if self._flat is None:
            self._flat = [(b.ln_1.weight, b.ln_1.bias, b.attn.c_attn.weight, b.attn.c_attn.bias,
                           b.attn.c_proj.weight, b.attn.c_proj.bias, b.ln_2.weight, b.ln_2.bias,
                           b.mlp.c_fc.weight, b.mlp.c_fc.bias, b.mlp.c_proj.weight, b.mlp.c_proj.bias)
                          for b in self.h]
        return self._flat

    def weight_bytes(self) -> int:
        """Bytes of weights one forward pass reads at the model's dtype (LM head tied; over its
        first ``head_rows`` rows when set)."""
        skipped = 0 if self.head_rows is None else (self.config.vocab_size - self.head_rows) * self.config.n_embd * 4
        return (self.config.weight_bytes_fp32 - skipped) * self.wte.weight.element_size() // 4

    def init_weights(self, generator: torch.Generator | None = None) -> None:
        """GPT-2 initialisation: N(0, 0.02), residual projections scaled by 1/sqrt(2 n_layer)."""
        std_proj = 0.02 / (2 * self.config.n_layer) ** 0.5
        for name, p in self.named_parameters():
            if name.endswith("bias") or ".ln_" in name or name.startswith("ln_f"):
                p.data.fill_(1.0 if name.endswith("weight") else 0.0)
            else:
                std = std_proj if name.endswith("c_proj.weight") else 0.02
                p.data.normal_(0.0, std, generator=generator)

    def new_cache(self, batch: int = 1, max_len: int | None = None) -> KVCache:
        c = self.config
        return KVCache(c.n_layer, batch, c.n_head, max_len or c.n_positions, c.head_dim,
                       self.kv_dtype or self.wte.weight.dtype, self.wte.weight.device)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                tree_mask: torch.Tensor | None = None, last_only: bool = False,
                backend: Backend | None = None) -> torch.Tensor:
        """Logits for N new tokens per row; their K/V become pending cache entries.

        tokens, positions: (B, N) int64. With P entries already pending, the new tokens go to
        slots [cache.lengths[b] + P, + N). tree_mask: None (the P + N uncommitted entries are one
        chain) or bool (N, P + N) / (B, N, P + N), mask[i, j] = entry j is token i's ancestor
        or itself. Returns (B, N, V) logits in the model dtype, or (B, 1, V) with last_only.
        ``backend``: the kernels (the runner's; ``default_backend()`` when None).
        """
        cfg, be = self.config, backend or default_backend()
        b, n = tokens.shape
        writes, starts, m = cache.append(n, tree_mask)
        logits = be.forward_model(self, tokens, positions, cache.k, cache.v, writes, starts, m, tree_mask,
                                  last_only)
        if logits is not None:  # the whole pass in one native call
            return logits
        c, eps = (cfg.n_embd,), cfg.layer_norm_epsilon
        x = F.embedding(tokens, self.wte.weight) + F.embedding(positions, self.wpe.weight)  # (B, N, C)
        for layer, (ln1w, ln1b, qkvw, qkvb, aow, aob, ln2w, ln2b, fcw, fcb, mpw, mpb) in \
                enumerate(self._layer_tensors()):
            h = F.layer_norm(x, c, ln1w, ln1b, eps)
            qkv = be.linear(h, qkvw, qkvb)  # (B, N, 3C)
            q = be.append_qkv(qkv, cache.k[layer], cache.v[layer], writes, cfg.n_head)  # (B, H, N, D)
            a = be.attention(q, cache.k[layer], cache.v[layer], starts, m, tree_mask, cfg.attn_scale)
            a = a.transpose(1, 2).reshape(b, n, cfg.n_embd)  # (B, N, C)
            x = x + be.linear(a, aow, aob)
            h = F.layer_norm(x, c, ln2w, ln2b, eps)
            h = self.act(be.linear(h, fcw, fcb))  # (B, N, 4C)
            x = x + be.linear(h, mpw, mpb)
        if last_only:
            x = x[:, -1:]
        x = F.layer_norm(x, (cfg.n_embd,), self.ln_f.weight, self.ln_f.bias, cfg.layer_norm_epsilon)
        logits = be.linear(x, self.wte.weight, None)  # (B, N, V)
        if self.head_rows is not None:
            logits[..., self.head_rows:] = float("-inf")
        return logits

    def forward_train(self, idx: torch.Tensor) -> torch.Tensor:
        """Full causal pass without a cache, for training: idx (B, T) -> logits (B, T, V)."""
        cfg = self.config
        b, t = idx.shape
        pos = torch.arange(t, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)  # (B, T, C)
        for blk in self.h:
            h = blk.ln_1(x)
            q, k, v = blk.attn.c_attn(h).view(b, t, 3, cfg.n_head, cfg.head_dim).permute(2, 0, 3, 1, 4)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, D)
            x = x + blk.attn.c_proj(a.transpose(1, 2).reshape(b, t, cfg.n_embd))
            x = x + blk.mlp.c_proj(self.act(blk.mlp.c_fc(blk.ln_2(x))))
        return F.linear(self.ln_f(x), self.wte.weight)
