"""Training of the embedded demo pair: a byte-level BPE tokenizer and two GPT-2 models.

Corpus (``corpus.py``): the standard library and the installed requirement closure, deduplicated
by content and split by content hash; a few whole third-party packages are held out. Models are
the engine's own ``GPT2`` trained with ``forward_train``; the draft is distilled from the oracle.
Every stage writes its output under a run directory and is skipped when that output exists;
training checkpoints as it goes and resumes from the latest checkpoint, so an interrupted
``train-demo`` is simply run again with the same arguments.

    run_dir/tokenizer.json                      stage "tokenizer"
    run_dir/data/{train,val,held_out}.npy, meta.json   stage "data" (uint16 streams, eos-separated)
    run_dir/{oracle,draft}/ckpt.pt              training checkpoints (model, optimizer, step)
    out_dir/{oracle,draft}/                     exported HF directories (float16) + training.json

Exports are written to a temporary directory and renamed into place, so an interrupted or
failed run never leaves half-written weights where the engine loads them.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F

from staged_engine.checks import atomic_path
from staged_engine.model.checkpoint import load_model, save_model
from staged_engine.model.config import GPT2Config
from staged_engine.model.gpt2 import GPT2

from . import corpus as corpus_mod
from .tokenizer import EOS_TOKEN, train_tokenizer

Log = Callable[[str], None]


def _print(msg: str) -> None:
    print(msg, flush=True)


def encode_docs(tok, texts: list[str], eos_id: int) -> np.ndarray:
    """One uint16 stream: each document's ids followed by ``eos_id``."""
    if tok.get_vocab_size() > 65536:
        raise ValueError(f"vocab size {tok.get_vocab_size()} does not fit uint16 token streams")
    parts = []
    for i in range(0, len(texts), 256):
        for enc in tok.encode_batch(texts[i:i + 256], add_special_tokens=False):
            parts.append(np.asarray(enc.ids, dtype=np.uint16))
            parts.append(np.asarray([eos_id], dtype=np.uint16))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint16)


def token_byte_lengths(tok) -> torch.Tensor:
    """(V,) float64: bytes each token stands for (special tokens: 0), for bits per byte. In a
    byte-level BPE every symbol of a token's string is exactly one byte."""
    specials = {t.content for t in tok.get_added_tokens_decoder().values()}
    out = torch.zeros(tok.get_vocab_size(), dtype=torch.float64)
    for piece, i in tok.get_vocab().items():
        if piece not in specials:
            out[i] = len(piece)
    return out


# --------------------------------------------------------------------------------------------
# Training


@dataclass
class TrainConfig:
    steps: int = 1000  # optimizer steps (fixed: the run is reproducible, not time-bounded)
    batch_size: int = 4  # windows per step
    seq_len: int = 1024  # tokens per window (positions 0..seq_len-1 are trained)
    lr: float = 1e-3  # peak learning rate
    min_lr: float = 1e-4  # cosine floor
    warmup_steps: int = 100  # linear warmup from 0
    weight_decay: float = 0.1  # AdamW decay on matrices (not biases, LayerNorms)
    betas: tuple[float, float] = (0.9, 0.95)  # AdamW betas
    grad_clip: float = 1.0  # max global grad norm
    seed: int = 1234  # init and data order
    bf16: bool = True  # bf16 autocast for matmuls (master weights stay fp32)
    distill: str = "ce"  # "ce", "kl" (to the teacher) or "mix" (alpha CE + (1-alpha) KL)
    distill_alpha: float = 0.5  # CE weight for "mix"
    ckpt_every: int = 100  # steps between checkpoints
    eval_every: int = 250  # steps between quick validation losses
    eval_windows: int = 8  # windows of the quick validation loss
    log_every: int = 10  # steps between progress lines
    threads: int = 2  # torch.set_num_threads
    max_seconds: float | None = None  # pilots: stop after this much training time; the schedule
    #                                   then runs on the elapsed fraction instead of the step
    compile: bool = False  # torch.compile the training forward


def lr_at(step: int, hp: TrainConfig, time_frac: float | None = None) -> float:
    """Linear warmup then cosine decay to min_lr at the last step (or, for a time-bounded pilot,
    at the end of its time budget: ``time_frac`` is the elapsed share of it)."""
    if step < hp.warmup_steps:
        return hp.lr * (step + 1) / hp.warmup_steps
    frac = (step - hp.warmup_steps) / max(1, hp.steps - hp.warmup_steps) if time_frac is None else time_frac
    return hp.min_lr + 0.5 * (hp.lr - hp.min_lr) * (1.0 + math.cos(math.pi * min(1.0, frac)))


def batch_at(tokens: np.ndarray, step: int, hp: TrainConfig) -> torch.Tensor:
    """(B, T+1) int64 windows at offsets drawn from a generator seeded by (seed, step)."""
    rng = np.random.default_rng([hp.seed, step])
    hi = len(tokens) - hp.seq_len - 1
    if hi < 1:
        raise ValueError(f"token stream of {len(tokens)} tokens is shorter than seq_len+1={hp.seq_len + 1}")
    offs = rng.integers(0, hi, size=hp.batch_size)
    return torch.from_numpy(np.stack([tokens[o:o + hp.seq_len + 1] for o in offs]).astype(np.int64))


def eval_windows(tokens: np.ndarray, seq_len: int, max_windows: int | None = None) -> torch.Tensor:
    """Non-overlapping (N, seq_len+1) windows from the start of the stream (deterministic)."""
    n = (len(tokens) - 1) // seq_len
    if max_windows is not None:
        n = min(n, max_windows)
    if n < 1:
        raise ValueError(f"token stream of {len(tokens)} tokens holds no window of {seq_len + 1}")
    return torch.from_numpy(np.stack([tokens[i * seq_len:i * seq_len + seq_len + 1]
                                      for i in range(n)]).astype(np.int64))


def _param_groups(model: GPT2, weight_decay: float) -> list[dict]:
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def _logits(model: GPT2, x: torch.Tensor, bf16: bool) -> torch.Tensor:
    fwd = getattr(model, "_compiled_forward_train", None) or model.forward_train
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        return fwd(x).float()  # (B, T, V)


@torch.no_grad()
def evaluate(model: GPT2, windows: torch.Tensor, bf16: bool = False, batch: int = 4,
             teacher: GPT2 | None = None, byte_lengths: torch.Tensor | None = None) -> dict:
    """Mean next-token loss (nats) over ``windows`` (N, T+1); with ``byte_lengths`` (bytes per
    token id), also bits per byte of the predicted text; with ``teacher``, also the top-1
    agreement of ``model`` with it (teacher-forced)."""
    was_training = model.training
    model.eval()
    tot_loss, tot_n, agree, tot_bytes = 0.0, 0, 0, 0.0
    for i in range(0, len(windows), batch):
        w = windows[i:i + batch]
        x, y = w[:, :-1], w[:, 1:]
        lg = _logits(model, x, bf16)
        tot_loss += F.cross_entropy(lg.reshape(-1, lg.shape[-1]), y.reshape(-1), reduction="sum").item()
        tot_n += y.numel()
        if byte_lengths is not None:
            tot_bytes += byte_lengths[y].sum().item()
        if teacher is not None:
            agree += (lg.argmax(-1) == _logits(teacher, x, bf16).argmax(-1)).sum().item()
    model.train(was_training)
    out = {"loss": tot_loss / tot_n, "tokens": tot_n}
    out["perplexity"] = math.exp(out["loss"])
    if byte_lengths is not None:
        out["bits_per_byte"] = tot_loss / math.log(2) / max(tot_bytes, 1.0)
        out["bytes"] = int(tot_bytes)
    if teacher is not None:
        out["top1_agreement"] = agree / tot_n
    return out


def _distill_terms(lg: torch.Tensor, t_lg: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(KL(teacher || student) per token, CE of the student) from (N, V) logits and (N,) targets.

    Written as plain elementwise math so that ``torch.compile`` fuses it into a pass or two over
    the (N, V) logits; eager, it costs three times as much as the draft's own forward."""
    t = F.log_softmax(t_lg.float(), -1)
    s = F.log_softmax(lg.float(), -1)
    kl = (t.exp() * (t - s)).sum() / lg.shape[0]
    ce = -s.gather(1, y[:, None]).mean()
    return kl, ce


_compiled_distill_terms = None


def _loss(model: GPT2, batch: torch.Tensor, hp: TrainConfig, teacher: GPT2 | None) -> tuple[torch.Tensor, float]:
    """(loss to minimise, CE for logging)."""
    global _compiled_distill_terms
    x, y = batch[:, :-1], batch[:, 1:]
    lg = _logits(model, x, hp.bf16)
    v = lg.shape[-1]
    if hp.distill == "ce":
        ce = F.cross_entropy(lg.reshape(-1, v), y.reshape(-1))
        return ce, ce.item()
    if hp.distill not in ("kl", "mix"):
        raise ValueError(f"distill must be 'ce', 'kl' or 'mix', got {hp.distill!r}")
    if teacher is None:
        raise ValueError(f"distill={hp.distill!r} needs a teacher model")
    with torch.no_grad():
        t_lg = _logits(teacher, x, hp.bf16)
    terms = _distill_terms
    if hp.compile:
        if _compiled_distill_terms is None:
            _compiled_distill_terms = torch.compile(_distill_terms)
        terms = _compiled_distill_terms
    kl, ce = terms(lg.reshape(-1, v), t_lg.reshape(-1, v), y.reshape(-1))
    if hp.distill == "kl":
        return kl, ce.item()
    return hp.distill_alpha * ce + (1 - hp.distill_alpha) * kl, ce.item()


def _atomic_save(obj, path: str) -> None:
    with atomic_path(path) as tmp:
        torch.save(obj, tmp)


def train_model(cfg: GPT2Config, train_tokens: np.ndarray, val_tokens: np.ndarray | None,
                hp: TrainConfig, run_dir: str | None = None, teacher: GPT2 | None = None,
                log: Log = _print) -> tuple[GPT2, dict]:
    """Train a GPT2 for ``hp.steps`` steps; resumes from ``run_dir/ckpt.pt`` when present.

    Returns the model (fp32, train mode off) and a summary dict (steps, tokens_seen, wall_s,
    final_train_loss, history)."""
    torch.set_num_threads(hp.threads)
    model = GPT2(cfg)
    model.init_weights(torch.Generator().manual_seed(hp.seed))
    opt = torch.optim.AdamW(_param_groups(model, hp.weight_decay), lr=hp.lr, betas=hp.betas)
    start, wall, history = 0, 0.0, []
    ckpt_path = os.path.join(run_dir, "ckpt.pt") if run_dir else None
    if ckpt_path and os.path.isfile(ckpt_path):
        try:
            state = torch.load(ckpt_path, map_location="cpu", weights_only=True)
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["opt"])
            start, wall, history = int(state["step"]), float(state["wall_s"]), json.loads(state["history"])
        except Exception as exc:  # truncated file, foreign pickle, other shapes: never guess
            raise ValueError(f"resume checkpoint {ckpt_path} is corrupt or from another configuration "
                             f"({type(exc).__name__}: {exc}); delete it to start this stage afresh") from exc
        log(f"resumed from {ckpt_path} at step {start}/{hp.steps}")
    if run_dir:
        os.makedirs(run_dir, exist_ok=True)
    if teacher is not None:
        teacher.eval().requires_grad_(False)
    val_w = eval_windows(val_tokens, hp.seq_len, hp.eval_windows) if val_tokens is not None else None
    tok_per_step = hp.batch_size * hp.seq_len
    if hp.compile:
        model._compiled_forward_train = torch.compile(model.forward_train)
        if teacher is not None:  # the teacher's forward is most of a distillation step
            teacher._compiled_forward_train = torch.compile(teacher.forward_train)
    model.train()
    recent, t_mark, s_mark = [], time.time(), start
    t_seg = time.time()
    for step in range(start, hp.steps):
        time_frac = None
        if hp.max_seconds is not None:
            time_frac = (wall + time.time() - t_seg) / hp.max_seconds
            if time_frac >= 1.0:
                hp.steps = step  # the budget is spent: this is the last step
                break
        lr = lr_at(step, hp, time_frac)
        for g in opt.param_groups:
            g["lr"] = lr
        loss, ce = _loss(model, batch_at(train_tokens, step, hp), hp, teacher)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), hp.grad_clip).item()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if not math.isfinite(loss.item()):
            raise RuntimeError(f"loss became {loss.item()} at step {step}")
        recent.append(ce)
        done = step + 1
        if done % hp.log_every == 0 or done == hp.steps:
            now = time.time()
            tps = (done - s_mark) * tok_per_step / max(now - t_mark, 1e-9)
            elapsed = wall + now - t_seg
            eta = ((hp.steps - done) * tok_per_step / max(tps, 1e-9) if hp.max_seconds is None
                   else max(0.0, hp.max_seconds - elapsed))
            mean_ce = sum(recent) / len(recent)
            history.append({"step": done, "train_ce": round(mean_ce, 4), "lr": lr, "tok_s": round(tps),
                            "grad_norm": round(gnorm, 3), "elapsed_s": round(elapsed, 1)})
            log(f"step {done}/{hp.steps if hp.max_seconds is None else '-'}  ce {mean_ce:.4f}  lr {lr:.2e}  |g| {gnorm:.2f}  "
                f"{tps:,.0f} tok/s  elapsed {elapsed / 60:.1f} min  ETA {eta / 60:.1f} min")
            recent, t_mark, s_mark = [], now, done
        if val_w is not None and (done % hp.eval_every == 0 or done == hp.steps):
            ev = evaluate(model, val_w, bf16=hp.bf16)
            history.append({"step": done, "val_loss": round(ev["loss"], 4)})
            log(f"step {done}: quick val loss {ev['loss']:.4f} (ppl {ev['perplexity']:.2f}, "
                f"{ev['tokens']} tokens)")
        if ckpt_path and (done % hp.ckpt_every == 0 or done == hp.steps):
            _atomic_save({"model": model.state_dict(), "opt": opt.state_dict(), "step": done,
                          "wall_s": wall + time.time() - t_seg, "history": json.dumps(history)}, ckpt_path)
    wall += time.time() - t_seg
    if hp.max_seconds is not None and ckpt_path:
        _atomic_save({"model": model.state_dict(), "opt": opt.state_dict(), "step": hp.steps,
                      "wall_s": wall, "history": json.dumps(history)}, ckpt_path)
    model.__dict__.pop("_compiled_forward_train", None)
    if teacher is not None:
        teacher.__dict__.pop("_compiled_forward_train", None)
    train_ces = [h["train_ce"] for h in history if "train_ce" in h]
    summary = {"steps": hp.steps, "tokens_seen": hp.steps * tok_per_step, "wall_s": round(wall, 1),
               "final_train_loss": round(sum(train_ces[-5:]) / max(1, len(train_ces[-5:])), 4) if train_ces else None,
               "history": history}
    model.eval()
    return model, summary


# --------------------------------------------------------------------------------------------
# The demo pipeline


DATA_FILES = ("train", "val", "held_out")


def parse_size(text: str, name: str = "--size") -> dict:
    """'256x8x4' -> dict(n_embd=256, n_layer=8, n_head=4), checked."""
    try:
        c, l, h = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise ValueError(f"{name} must be N_EMBDxN_LAYERxN_HEAD such as 256x8x4, got {text!r}") from None
    if min(c, l, h) < 1 or c % h:
        raise ValueError(f"{name}: sizes must be positive and n_embd divisible by n_head, got {text!r}")
    return dict(n_embd=c, n_layer=l, n_head=h)


def cpu_info() -> dict:
    """CPU model and the vector extensions that matter for these kernels (Linux /proc/cpuinfo)."""
    model, flags = "unknown", set()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name") and model == "unknown":
                    model = line.split(":", 1)[1].strip()
                elif line.startswith("flags") and not flags:
                    flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    keep = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni", "amx_bf16")
    return {"model": model, "vector_extensions": [k for k in keep if k in flags], "cores": os.cpu_count()}


@dataclass
class DemoPaths:
    run_dir: str
    out_dir: str

    @property
    def tokenizer(self) -> str:
        return os.path.join(self.run_dir, "tokenizer.json")

    @property
    def data(self) -> str:
        return os.path.join(self.run_dir, "data")

    def model_run(self, role: str) -> str:
        return os.path.join(self.run_dir, role)

    def export(self, role: str) -> str:
        return os.path.join(self.out_dir, role)


def _corpus(args, log: Log) -> corpus_mod.Corpus:
    held = [h for h in args.held_out.split(",") if h.strip()]
    c = corpus_mod.build(val_fraction=args.val_fraction, held_out=held, log=log)
    if not c.train:
        raise ValueError("corpus: no training files found (is requirements.txt installed?)")
    return c


def stage_tokenizer(paths: DemoPaths, c: corpus_mod.Corpus, vocab_size: int, sample_every: int, log: Log) -> None:
    if os.path.isfile(paths.tokenizer):
        log(f"tokenizer: {paths.tokenizer} exists, skipped")
        return
    texts = [t for _, t in c.train[::sample_every]]
    t0 = time.time()
    log(f"tokenizer: training byte-level BPE (vocab {vocab_size}) on {len(texts)} train files "
        f"(every {sample_every}th, {sum(map(len, texts)) / 1e6:.0f} MB)")
    tok = train_tokenizer(texts, vocab_size)
    os.makedirs(paths.run_dir, exist_ok=True)
    with atomic_path(paths.tokenizer) as tmp:
        tok.save(tmp)
    log(f"tokenizer: vocab {tok.get_vocab_size()} written to {paths.tokenizer} in {time.time() - t0:.0f} s")


def stage_data(paths: DemoPaths, c: corpus_mod.Corpus, log: Log) -> dict:
    meta_path = os.path.join(paths.data, "meta.json")
    if os.path.isfile(meta_path):
        with open(meta_path, encoding="utf-8") as f:
            meta = json.load(f)
        log(f"data: {meta_path} exists, skipped ({meta['tokens_train']:,} train tokens)")
        return meta
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(paths.tokenizer)
    eos = tok.token_to_id(EOS_TOKEN)
    os.makedirs(paths.data, exist_ok=True)
    meta = {"python": sys.version.split()[0], "eos_token_id": eos, "vocab_size": tok.get_vocab_size(),
            "manifest": c.manifest}
    t0 = time.time()
    for name in DATA_FILES:
        docs = getattr(c, name)
        ids = encode_docs(tok, [t for _, t in docs], eos)
        np.save(os.path.join(paths.data, f"{name}.npy"), ids)
        meta[f"tokens_{name}"] = int(len(ids))
        meta[f"bytes_{name}"] = c.manifest[f"bytes_{name}"]
        with open(os.path.join(paths.data, f"{name}_files.txt"), "w", encoding="utf-8") as f:
            f.write("\n".join(rel for rel, _ in docs) + "\n")
    with atomic_path(meta_path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        json.dump(meta, f, indent=2)
    log(f"data: {meta['tokens_train']:,} train / {meta['tokens_val']:,} val / {meta['tokens_held_out']:,} "
        f"held-out tokens ({meta['bytes_train'] / meta['tokens_train']:.2f} bytes per token) "
        f"in {time.time() - t0:.0f} s")
    return meta


def load_data(paths: DemoPaths) -> tuple[dict[str, np.ndarray], dict]:
    meta_path = os.path.join(paths.data, "meta.json")
    if not os.path.isfile(meta_path):
        raise FileNotFoundError(f"{meta_path} not found: run the tokenizer and data stages first")
    with open(meta_path, encoding="utf-8") as f:
        meta = json.load(f)
    streams = {n: np.load(os.path.join(paths.data, f"{n}.npy")) for n in DATA_FILES}
    if len(streams["train"]) < 2:
        raise ValueError(f"{paths.data}/train.npy is empty: the corpus had no usable training text")
    return streams, meta


def model_config(sizes: dict, vocab_size: int, eos_id: int, n_positions: int = 1024) -> GPT2Config:
    return GPT2Config(vocab_size=vocab_size, n_positions=n_positions, eos_token_id=eos_id,
                      bos_token_id=eos_id, **sizes)


def _byte_lengths(paths: DemoPaths) -> torch.Tensor:
    from tokenizers import Tokenizer

    return token_byte_lengths(Tokenizer.from_file(paths.tokenizer))


def measure(model: GPT2, streams: dict, byte_lengths: torch.Tensor, seq_len: int, max_windows: int | None,
            teacher: GPT2 | None = None, bf16: bool = False) -> dict:
    """Validation and held-out figures: loss, perplexity, bits per byte (and agreement)."""
    out = {}
    for name in ("val", "held_out"):
        ev = evaluate(model, eval_windows(streams[name], seq_len, max_windows), bf16=bf16,
                      teacher=teacher, byte_lengths=byte_lengths)
        out[name] = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in ev.items()}
    return out


def _replace_dir(tmp: str, out: str) -> None:
    """Move the finished ``tmp`` directory to ``out``; the old ``out`` is removed only after."""
    old = out + ".old"
    if os.path.isdir(old):
        shutil.rmtree(old)
    if os.path.isdir(out):
        os.replace(out, old)
    os.replace(tmp, out)
    if os.path.isdir(old):
        shutil.rmtree(old)


def export_model(model: GPT2, out: str, paths: DemoPaths, record: dict, streams: dict, seq_len: int,
                 eval_max_windows: int | None, teacher_dir: str | None, log: Log) -> dict:
    """Save float16 HF weights to a temporary directory, reload as float32, evaluate, write
    training.json, then move the directory into place (never a half-written export)."""
    from tokenizers import Tokenizer

    tmp = f"{out}.tmp-{os.getpid()}"
    if os.path.isdir(tmp):
        shutil.rmtree(tmp)
    save_model(model, tmp, dtype=torch.float16, tokenizer=Tokenizer.from_file(paths.tokenizer))
    reloaded = load_model(tmp)
    teacher = load_model(teacher_dir) if teacher_dir else None
    t0 = time.time()
    figures = measure(reloaded, streams, _byte_lengths(paths), seq_len, eval_max_windows, teacher)
    for name, ev in figures.items():
        log(f"export: {name}: loss {ev['loss']:.4f}, {ev['bits_per_byte']:.3f} bits/byte on {ev['tokens']:,} tokens"
            + (f", top-1 agreement with the oracle {ev['top1_agreement']:.4f}" if teacher else ""))
    log(f"export: evaluated in {time.time() - t0:.0f} s (fp16 weights loaded as fp32)")
    record["evaluation"] = dict(figures, weights="float16 model.safetensors loaded back as float32, fp32 forward",
                                window_len=seq_len)
    if teacher is not None:
        record["top1_agreement_with_oracle"] = figures["held_out"]["top1_agreement"]
    with open(os.path.join(tmp, "training.json"), "w", encoding="utf-8") as f:
        json.dump(record, f, indent=2)
    _replace_dir(tmp, out)
    log(f"export: {out} written")
    return record


def verify_hf(directory: str, tokens: np.ndarray, n: int = 256) -> float:
    """Max relative error between transformers' GPT2LMHeadModel and the engine on ``n`` tokens."""
    from transformers import GPT2LMHeadModel

    hf = GPT2LMHeadModel.from_pretrained(directory, torch_dtype=torch.float32).eval()
    ours = load_model(directory)
    x = torch.from_numpy(tokens[:n].astype(np.int64))[None]
    with torch.no_grad():
        a = hf(x).logits
        b = ours.forward_train(x)
    return ((a - b).abs().max() / b.abs().max()).item()


def _record(role: str, meta: dict, cfg: GPT2Config, hp: TrainConfig, summary: dict, command: str) -> dict:
    return {
        "role": role,
        "corpus": {k: v for k, v in meta.items() if k not in ("eos_token_id", "vocab_size")},
        "tokenizer": {"type": "byte-level BPE (tokenizers), newline-safe split (training/tokenizer.py)",
                      "vocab_size": meta["vocab_size"], "eos_token": EOS_TOKEN, "eos_token_id": meta["eos_token_id"]},
        "command": command, "seeds": {"init_and_data": hp.seed},
        "config": cfg.to_hf_dict(), "num_params": cfg.num_params, "train": asdict(hp),
        "steps": summary["steps"], "tokens_seen": summary["tokens_seen"], "wall_time_s": summary["wall_s"],
        "tokens_per_s": round(summary["tokens_seen"] / max(summary["wall_s"], 1e-9)),
        "final_train_loss": summary["final_train_loss"],
        "torch": torch.__version__, "threads": hp.threads, "cpu": cpu_info(), "history": summary["history"],
    }


def stage_model(role: str, paths: DemoPaths, hp: TrainConfig, sizes: dict, command: str,
                log: Log, teacher_dir: str | None = None, eval_max_windows: int | None = None,
                extra: dict | None = None) -> dict:
    out = paths.export(role)
    done_marker = os.path.join(out, "training.json")
    if os.path.isfile(done_marker):
        with open(done_marker, encoding="utf-8") as f:
            rec = json.load(f)
        if rec.get("command") == command:
            log(f"{role}: {done_marker} exists, skipped")
            return rec
    streams, meta = load_data(paths)
    cfg = model_config(sizes, meta["vocab_size"], meta["eos_token_id"])
    teacher = load_model(teacher_dir) if teacher_dir and hp.distill != "ce" else None
    log(f"{role}: {cfg.num_params / 1e6:.2f}M parameters, {hp.steps} steps x {hp.batch_size} x "
        f"{hp.seq_len} tokens = {hp.steps * hp.batch_size * hp.seq_len / 1e6:.1f}M tokens, "
        f"loss {hp.distill}" + (f" (teacher {teacher_dir})" if teacher is not None else ""))
    model, summary = train_model(cfg, streams["train"], streams["val"], hp, paths.model_run(role), teacher, log)
    record = _record(role, meta, cfg, hp, summary, command)
    record.update(extra or {})
    if teacher_dir:
        record["teacher"] = os.path.relpath(teacher_dir, paths.out_dir)
    return export_model(model, out, paths, record, streams, hp.seq_len, eval_max_windows,
                        teacher_dir if role == "draft" else None, log)


def _command(args: argparse.Namespace) -> str:
    """The command line that reproduces this run (as given to ``staged-engine``)."""
    import shlex

    argv = getattr(args, "argv", None) or ["train-demo"]
    return "staged-engine " + " ".join(shlex.quote(a) for a in argv)


def _pilots(run_dir: str) -> list[dict]:
    """Pilot results found under ``run_dir``/pilots, for the oracle's training.json."""
    out = []
    root = os.path.join(run_dir, "pilots")
    if os.path.isdir(root):
        for name in sorted(os.listdir(root)):
            f = os.path.join(root, name, "pilot.json")
            if os.path.isfile(f):
                with open(f, encoding="utf-8") as fh:
                    rec = json.load(fh)
                out.append({k: rec[k] for k in ("name", "size", "num_params", "lr", "batch_size", "seq_len",
                                                "threads", "seconds", "tokens_seen", "held_out", "val")})
    return out


def run_demo(args: argparse.Namespace, log: Log = _print) -> None:
    paths = DemoPaths(os.path.abspath(args.run_dir), os.path.abspath(args.out))
    stages = [s.strip() for s in args.stages.split(",") if s.strip()]
    unknown = set(stages) - {"tokenizer", "data", "oracle", "draft"}
    if unknown:
        raise ValueError(f"--stages: unknown stage(s) {sorted(unknown)}; expected tokenizer,data,oracle,draft")
    command = _command(args)
    if "tokenizer" in stages or "data" in stages:
        c = _corpus(args, log)
        if "tokenizer" in stages:
            stage_tokenizer(paths, c, args.vocab_size, args.tokenizer_sample, log)
        if "data" in stages:
            stage_data(paths, c, log)
    common = dict(seq_len=args.seq_len, seed=args.seed, threads=args.threads, bf16=not args.fp32,
                  compile=args.compile)
    if "oracle" in stages:
        hp = TrainConfig(steps=args.oracle_steps, batch_size=args.oracle_batch, lr=args.oracle_lr,
                         min_lr=args.oracle_lr / 10, warmup_steps=min(200, args.oracle_steps // 10 + 1),
                         ckpt_every=50, **common)
        stage_model("oracle", paths, hp, parse_size(args.oracle_size, "--oracle-size"), command, log,
                    eval_max_windows=args.eval_windows, extra={"pilots": _pilots(paths.run_dir)})
    if "draft" in stages:
        hp = TrainConfig(steps=args.draft_steps, batch_size=args.draft_batch, lr=args.draft_lr,
                         min_lr=args.draft_lr / 10, warmup_steps=min(100, args.draft_steps // 10 + 1),
                         distill=args.draft_loss, distill_alpha=args.distill_alpha, ckpt_every=50, **common)
        stage_model("draft", paths, hp, parse_size(args.draft_size, "--draft-size"), command, log,
                    teacher_dir=paths.export("oracle"), eval_max_windows=args.eval_windows)
    for role in ("oracle", "draft"):
        d = paths.export(role)
        if role in stages and os.path.isfile(os.path.join(d, "model.safetensors")) and args.verify:
            try:
                err = verify_hf(d, load_data(paths)[0]["held_out"])
                log(f"verify: {d}: transformers GPT2LMHeadModel vs engine, max rel err {err:.2e}")
            except ImportError:
                log("verify: transformers not installed, skipped")


def run_pilot(args: argparse.Namespace, log: Log = _print) -> None:
    pilot(args, log)


def pilot(args: argparse.Namespace, log: Log = _print) -> dict:
    """A short time-bounded run: the figures that choose the long run's shape and knobs."""
    paths = DemoPaths(os.path.abspath(args.run_dir), os.path.abspath(args.run_dir))
    streams, meta = load_data(paths)
    sizes = parse_size(args.size)
    cfg = model_config(sizes, meta["vocab_size"], meta["eos_token_id"])
    hp = TrainConfig(steps=10 ** 9, batch_size=args.batch, seq_len=args.seq_len, lr=args.lr, min_lr=args.lr / 10,
                     warmup_steps=args.warmup, threads=args.threads, max_seconds=args.minutes * 60,
                     ckpt_every=10 ** 9, eval_every=10 ** 9, compile=args.compile, seed=args.seed)
    run = os.path.join(paths.run_dir, "pilots", args.name)
    log(f"pilot {args.name}: {cfg.num_params / 1e6:.2f}M parameters, {args.minutes} min, lr {args.lr}, "
        f"batch {args.batch} x {args.seq_len}, {args.threads} thread(s)")
    model, summary = train_model(cfg, streams["train"], None, hp, run, None, log)
    figures = measure(model, streams, _byte_lengths(paths), 512, args.eval_windows)
    rec = {"name": args.name, "size": args.size, "num_params": cfg.num_params, "lr": args.lr,
           "batch_size": args.batch, "seq_len": args.seq_len, "threads": args.threads,
           "seconds": summary["wall_s"], "steps": summary["steps"],
           "tokens_seen": summary["steps"] * args.batch * args.seq_len, "cpu": cpu_info(), **figures}
    with open(os.path.join(run, "pilot.json"), "w", encoding="utf-8") as f:
        json.dump(rec, f, indent=2)
    log(f"pilot {args.name}: held-out {figures['held_out']['bits_per_byte']:.3f} bits/byte, val "
        f"{figures['val']['bits_per_byte']:.3f}, {rec['tokens_seen'] / 1e6:.1f}M tokens in {summary['wall_s']:.0f} s")
    return rec
