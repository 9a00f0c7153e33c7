"""Training of the embedded demo pair: a byte-level BPE tokenizer and two GPT-2 models.

Corpus: the ``.py`` files of the running Python's standard library (site-packages excluded),
split into train and validation by a hash of each file's relative path. Models are the
engine's own ``GPT2`` trained with ``forward_train``; the draft may be distilled from the
oracle. Every stage writes its output under a run directory and is skipped when that output
exists; model training checkpoints as it goes and resumes from the latest checkpoint, so an
interrupted ``train-demo`` is simply run again with the same arguments.

    run_dir/tokenizer.json                 stage "tokenizer"
    run_dir/data/{train,val}.npy, meta.json stage "data" (uint16 token streams, eos-separated)
    run_dir/{oracle,draft}/ckpt.pt         training checkpoints (model, optimizer, step)
    out_dir/{oracle,draft}/                exported HF directories (float16) + training.json
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys
import sysconfig
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Iterable

import numpy as np
import torch
import torch.nn.functional as F

from .checkpoint import load_model, save_model
from .config import GPT2Config
from .model import GPT2

EOS_TOKEN = "<|endoftext|>"
DEFAULT_OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets", "demo")

Log = Callable[[str], None]


def _print(msg: str) -> None:
    print(msg, flush=True)


# --------------------------------------------------------------------------------------------
# Corpus


def stdlib_root() -> str:
    """Directory of the running Python's standard library sources."""
    return sysconfig.get_path("stdlib")


def list_corpus(root: str) -> list[str]:
    """Sorted posix relative paths of the ``.py`` files under ``root``, site-packages excluded."""
    if not os.path.isdir(root):
        raise FileNotFoundError(f"corpus root not found: {root}")
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in ("site-packages", "dist-packages", "__pycache__")]
        for name in filenames:
            if name.endswith(".py"):
                rel = os.path.relpath(os.path.join(dirpath, name), root)
                out.append(rel.replace(os.sep, "/"))
    return sorted(out)


def split_of(relpath: str, val_fraction: float = 0.05) -> str:
    """'val' or 'train', from sha256 of the posix relative path (stable across machines)."""
    h = int.from_bytes(hashlib.sha256(relpath.encode("utf-8")).digest()[:8], "big")
    return "val" if h / 2.0 ** 64 < val_fraction else "train"


def split_corpus(relpaths: Iterable[str], val_fraction: float = 0.05) -> tuple[list[str], list[str]]:
    """(train, val) lists of relative paths, each sorted."""
    train, val = [], []
    for rel in sorted(relpaths):
        (val if split_of(rel, val_fraction) == "val" else train).append(rel)
    return train, val


def read_texts(root: str, relpaths: list[str]) -> tuple[list[str], list[str], int]:
    """(kept relpaths, their texts, number skipped as not valid UTF-8). Empty files are dropped."""
    kept, texts, skipped = [], [], 0
    for rel in relpaths:
        with open(os.path.join(root, rel), "rb") as f:
            raw = f.read()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            skipped += 1
            continue
        if text:
            kept.append(rel)
            texts.append(text)
    return kept, texts, skipped


# --------------------------------------------------------------------------------------------
# Tokenizer


def train_tokenizer(texts: Iterable[str], vocab_size: int = 8192, min_frequency: int = 2):
    """Byte-level BPE (GPT-2 pre-tokenizer and decoder) with ``<|endoftext|>`` as id 0."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def encode_docs(tok, texts: list[str], eos_id: int) -> np.ndarray:
    """One uint16 stream: each document's ids followed by ``eos_id``."""
    parts = []
    for i in range(0, len(texts), 256):
        for enc in tok.encode_batch(texts[i:i + 256], add_special_tokens=False):
            parts.append(np.asarray(enc.ids, dtype=np.uint16))
            parts.append(np.asarray([eos_id], dtype=np.uint16))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint16)


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


def lr_at(step: int, hp: TrainConfig) -> float:
    """Linear warmup then cosine decay to min_lr at the last step."""
    if step < hp.warmup_steps:
        return hp.lr * (step + 1) / hp.warmup_steps
    frac = (step - hp.warmup_steps) / max(1, hp.steps - hp.warmup_steps)
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
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        return model.forward_train(x).float()  # (B, T, V)


@torch.no_grad()
def evaluate(model: GPT2, windows: torch.Tensor, bf16: bool = False, batch: int = 4,
             teacher: GPT2 | None = None) -> dict:
    """Mean next-token loss (nats) over ``windows`` (N, T+1); with ``teacher``, also the top-1
    agreement of ``model`` with it (teacher-forced)."""
    was_training = model.training
    model.eval()
    tot_loss, tot_n, agree = 0.0, 0, 0
    for i in range(0, len(windows), batch):
        w = windows[i:i + batch]
        x, y = w[:, :-1], w[:, 1:]
        lg = _logits(model, x, bf16)
        tot_loss += F.cross_entropy(lg.reshape(-1, lg.shape[-1]), y.reshape(-1), reduction="sum").item()
        tot_n += y.numel()
        if teacher is not None:
            agree += (lg.argmax(-1) == _logits(teacher, x, bf16).argmax(-1)).sum().item()
    model.train(was_training)
    out = {"loss": tot_loss / tot_n, "tokens": tot_n}
    out["perplexity"] = math.exp(out["loss"])
    if teacher is not None:
        out["top1_agreement"] = agree / tot_n
    return out


def _loss(model: GPT2, batch: torch.Tensor, hp: TrainConfig, teacher: GPT2 | None) -> tuple[torch.Tensor, float]:
    """(loss to minimise, CE for logging)."""
    x, y = batch[:, :-1], batch[:, 1:]
    lg = _logits(model, x, hp.bf16)
    v = lg.shape[-1]
    ce = F.cross_entropy(lg.reshape(-1, v), y.reshape(-1))
    if hp.distill == "ce":
        return ce, ce.item()
    if teacher is None:
        raise ValueError(f"distill={hp.distill!r} needs a teacher model")
    with torch.no_grad():
        t_logp = F.log_softmax(_logits(teacher, x, hp.bf16), -1).reshape(-1, v)
    kl = F.kl_div(F.log_softmax(lg, -1).reshape(-1, v), t_logp, log_target=True, reduction="batchmean")
    if hp.distill == "kl":
        return kl, ce.item()
    if hp.distill == "mix":
        return hp.distill_alpha * ce + (1 - hp.distill_alpha) * kl, ce.item()
    raise ValueError(f"distill must be 'ce', 'kl' or 'mix', got {hp.distill!r}")


def _atomic_save(obj, path: str) -> None:
    tmp = path + ".tmp"
    torch.save(obj, tmp)
    os.replace(tmp, path)


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
        state = torch.load(ckpt_path, map_location="cpu", weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start, wall, history = state["step"], state["wall_s"], json.loads(state["history"])
        log(f"resumed from {ckpt_path} at step {start}/{hp.steps}")
    if run_dir:
        os.makedirs(run_dir, exist_ok=True)
    if teacher is not None:
        teacher.eval().requires_grad_(False)
    val_w = eval_windows(val_tokens, hp.seq_len, hp.eval_windows) if val_tokens is not None else None
    tok_per_step = hp.batch_size * hp.seq_len
    model.train()
    recent, t_mark, s_mark = [], time.time(), start
    t_seg = time.time()
    for step in range(start, hp.steps):
        lr = lr_at(step, hp)
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
            eta = (hp.steps - done) * tok_per_step / max(tps, 1e-9)
            mean_ce = sum(recent) / len(recent)
            history.append({"step": done, "train_ce": round(mean_ce, 4), "lr": lr, "tok_s": round(tps),
                            "grad_norm": round(gnorm, 3), "elapsed_s": round(elapsed, 1)})
            log(f"step {done}/{hp.steps}  ce {mean_ce:.4f}  lr {lr:.2e}  |g| {gnorm:.2f}  "
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
    if ckpt_path and start == hp.steps:
        wall = wall  # nothing trained in this call; wall time is the checkpoint's
    train_ces = [h["train_ce"] for h in history if "train_ce" in h]
    summary = {"steps": hp.steps, "tokens_seen": hp.steps * tok_per_step, "wall_s": round(wall, 1),
               "final_train_loss": round(sum(train_ces[-5:]) / max(1, len(train_ces[-5:])), 4) if train_ces else None,
               "history": history}
    model.eval()
    return model, summary


# --------------------------------------------------------------------------------------------
# The demo pipeline


ORACLE = dict(n_embd=384, n_layer=6, n_head=6)
DRAFT = dict(n_embd=128, n_layer=2, n_head=2)


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


def stage_tokenizer(paths: DemoPaths, root: str, vocab_size: int, val_fraction: float, log: Log) -> None:
    if os.path.isfile(paths.tokenizer):
        log(f"tokenizer: {paths.tokenizer} exists, skipped")
        return
    train, _ = split_corpus(list_corpus(root), val_fraction)
    _, texts, skipped = read_texts(root, train)
    t0 = time.time()
    log(f"tokenizer: training byte-level BPE (vocab {vocab_size}) on {len(texts)} train files "
        f"({skipped} skipped as not UTF-8)")
    tok = train_tokenizer(texts, vocab_size)
    os.makedirs(paths.run_dir, exist_ok=True)
    tok.save(paths.tokenizer + ".tmp")
    os.replace(paths.tokenizer + ".tmp", paths.tokenizer)
    log(f"tokenizer: vocab {tok.get_vocab_size()} written to {paths.tokenizer} in {time.time() - t0:.0f} s")


def stage_data(paths: DemoPaths, root: str, val_fraction: float, log: Log) -> dict:
    meta_path = os.path.join(paths.data, "meta.json")
    if os.path.isfile(meta_path):
        with open(meta_path, encoding="utf-8") as f:
            meta = json.load(f)
        log(f"data: {meta_path} exists, skipped ({meta['tokens_train']} train / {meta['tokens_val']} val tokens)")
        return meta
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(paths.tokenizer)
    eos = tok.token_to_id(EOS_TOKEN)
    os.makedirs(paths.data, exist_ok=True)
    files = list_corpus(root)
    train, val = split_corpus(files, val_fraction)
    meta = {"root": root, "python": sys.version.split()[0], "val_fraction": val_fraction,
            "split": "sha256(posix relpath)[:8] / 2**64 < val_fraction -> val",
            "files_total": len(files), "eos_token_id": eos, "vocab_size": tok.get_vocab_size()}
    t0 = time.time()
    for name, rels in (("train", train), ("val", val)):
        kept, texts, skipped = read_texts(root, rels)
        ids = encode_docs(tok, texts, eos)
        np.save(os.path.join(paths.data, f"{name}.npy"), ids)
        meta.update({f"files_{name}": len(kept), f"skipped_non_utf8_{name}": skipped,
                     f"tokens_{name}": int(len(ids)), f"bytes_{name}": sum(len(t.encode()) for t in texts)})
        with open(os.path.join(paths.data, f"{name}_files.txt"), "w", encoding="utf-8") as f:
            f.write("\n".join(kept) + "\n")
    with open(meta_path, "w", encoding="utf-8") as f:
        json.dump(meta, f, indent=2)
    log(f"data: {meta['files_train']} train / {meta['files_val']} val files, {meta['tokens_train']:,} / "
        f"{meta['tokens_val']:,} tokens ({meta['skipped_non_utf8_train'] + meta['skipped_non_utf8_val']} "
        f"skipped as not UTF-8) in {time.time() - t0:.0f} s")
    return meta


def load_data(paths: DemoPaths) -> tuple[np.ndarray, np.ndarray, dict]:
    with open(os.path.join(paths.data, "meta.json"), encoding="utf-8") as f:
        meta = json.load(f)
    return (np.load(os.path.join(paths.data, "train.npy")), np.load(os.path.join(paths.data, "val.npy")), meta)


def model_config(sizes: dict, vocab_size: int, eos_id: int, n_positions: int = 1024) -> GPT2Config:
    return GPT2Config(vocab_size=vocab_size, n_positions=n_positions, eos_token_id=eos_id,
                      bos_token_id=eos_id, **sizes)


def export_model(model: GPT2, out: str, tokenizer_path: str, record: dict,
                 val_tokens: np.ndarray, seq_len: int, eval_max_windows: int | None,
                 teacher_dir: str | None, log: Log) -> dict:
    """Save float16 HF weights, reload as float32, evaluate, write training.json."""
    from tokenizers import Tokenizer

    save_model(model, out, dtype=torch.float16, tokenizer=Tokenizer.from_file(tokenizer_path))
    reloaded = load_model(out)
    windows = eval_windows(val_tokens, seq_len, eval_max_windows)
    teacher = load_model(teacher_dir) if teacher_dir else None
    t0 = time.time()
    ev = evaluate(reloaded, windows, bf16=False, teacher=teacher)
    log(f"export: {out}: val loss {ev['loss']:.4f}, ppl {ev['perplexity']:.2f} on {ev['tokens']:,} tokens"
        + (f", top-1 agreement with the oracle {ev['top1_agreement']:.4f}" if teacher else "")
        + f" ({time.time() - t0:.0f} s, fp16 weights as fp32)")
    record["validation"] = {"loss": round(ev["loss"], 4), "perplexity": round(ev["perplexity"], 3),
                            "tokens": ev["tokens"], "windows": len(windows), "window_len": seq_len,
                            "weights": "float16 model.safetensors loaded back as float32, fp32 forward"}
    if teacher is not None:
        record["top1_agreement_with_oracle"] = round(ev["top1_agreement"], 4)
    with open(os.path.join(out, "training.json"), "w", encoding="utf-8") as f:
        json.dump(record, f, indent=2)
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


def stage_model(role: str, paths: DemoPaths, hp: TrainConfig, sizes: dict, command: str,
                log: Log, teacher_dir: str | None = None, eval_max_windows: int | None = None) -> dict:
    out = paths.export(role)
    done_marker = os.path.join(out, "training.json")
    if os.path.isfile(done_marker):
        log(f"{role}: {done_marker} exists, skipped")
        with open(done_marker, encoding="utf-8") as f:
            return json.load(f)
    train_tokens, val_tokens, meta = load_data(paths)
    cfg = model_config(sizes, meta["vocab_size"], meta["eos_token_id"])
    teacher = load_model(teacher_dir) if teacher_dir and hp.distill != "ce" else None
    log(f"{role}: {cfg.num_params / 1e6:.2f}M parameters, {hp.steps} steps x {hp.batch_size} x "
        f"{hp.seq_len} tokens = {hp.steps * hp.batch_size * hp.seq_len / 1e6:.1f}M tokens, "
        f"loss {hp.distill}" + (f" (teacher {teacher_dir})" if teacher is not None else ""))
    model, summary = train_model(cfg, train_tokens, val_tokens, hp, paths.model_run(role), teacher, log)
    record = {
        "role": role,
        "corpus": {"path": meta["root"], "python": meta["python"], "split": meta["split"],
                   "val_fraction": meta["val_fraction"], "files_train": meta["files_train"],
                   "files_val": meta["files_val"],
                   "skipped_non_utf8": meta["skipped_non_utf8_train"] + meta["skipped_non_utf8_val"],
                   "tokens_train": meta["tokens_train"], "tokens_val": meta["tokens_val"]},
        "tokenizer": {"type": "byte-level BPE (tokenizers)", "vocab_size": meta["vocab_size"],
                      "eos_token": EOS_TOKEN, "eos_token_id": meta["eos_token_id"]},
        "command": command, "seeds": {"init_and_data": hp.seed},
        "config": cfg.to_hf_dict(), "num_params": cfg.num_params, "train": asdict(hp),
        "steps": summary["steps"], "tokens_seen": summary["tokens_seen"], "wall_time_s": summary["wall_s"],
        "tokens_per_s": round(summary["tokens_seen"] / max(summary["wall_s"], 1e-9)),
        "final_train_loss": summary["final_train_loss"],
        "torch": torch.__version__, "threads": hp.threads, "history": summary["history"],
    }
    if teacher is not None:
        record["teacher"] = os.path.relpath(teacher_dir, paths.out_dir)
    if role == "draft" and teacher_dir:
        record["agreement_reference"] = os.path.relpath(teacher_dir, paths.out_dir)
    return export_model(model, out, paths.tokenizer, record, val_tokens, hp.seq_len, eval_max_windows,
                        teacher_dir if role == "draft" else None, log)


def run_demo(args: argparse.Namespace, log: Log = _print) -> None:
    paths = DemoPaths(os.path.abspath(args.run_dir), os.path.abspath(args.out))
    stages = [s.strip() for s in args.stages.split(",") if s.strip()]
    unknown = set(stages) - {"tokenizer", "data", "oracle", "draft"}
    if unknown:
        raise ValueError(f"--stages: unknown stage(s) {sorted(unknown)}; expected tokenizer,data,oracle,draft")
    command = "staged-engine " + " ".join(sys.argv[1:]) if sys.argv else "train-demo"
    root = args.corpus or stdlib_root()
    if "tokenizer" in stages:
        stage_tokenizer(paths, root, args.vocab_size, args.val_fraction, log)
    if "data" in stages:
        stage_data(paths, root, args.val_fraction, log)
    common = dict(seq_len=args.seq_len, seed=args.seed, threads=args.threads, bf16=not args.fp32)
    if "oracle" in stages:
        hp = TrainConfig(steps=args.oracle_steps, batch_size=args.oracle_batch, lr=args.oracle_lr,
                         min_lr=args.oracle_lr / 10, warmup_steps=min(200, args.oracle_steps // 10 + 1), **common)
        stage_model("oracle", paths, hp, ORACLE, command, log, eval_max_windows=args.eval_windows)
    if "draft" in stages:
        hp = TrainConfig(steps=args.draft_steps, batch_size=args.draft_batch, lr=args.draft_lr,
                         min_lr=args.draft_lr / 10, warmup_steps=min(100, args.draft_steps // 10 + 1),
                         distill=args.draft_loss, distill_alpha=args.distill_alpha, **common)
        stage_model("draft", paths, hp, DRAFT, command, log, teacher_dir=paths.export("oracle"),
                    eval_max_windows=args.eval_windows)
    for role in ("oracle", "draft"):
        d = paths.export(role)
        if role in stages and os.path.isfile(os.path.join(d, "model.safetensors")) and args.verify:
            try:
                err = verify_hf(d, load_data(paths)[1])
                log(f"verify: {d}: transformers GPT2LMHeadModel vs engine, max rel err {err:.2e}")
            except ImportError:
                log("verify: transformers not installed, skipped")


def run_tokenizer(args: argparse.Namespace, log: Log = _print) -> None:
    root = args.corpus or stdlib_root()
    train, _ = split_corpus(list_corpus(root), args.val_fraction)
    _, texts, skipped = read_texts(root, train)
    tok = train_tokenizer(texts, args.vocab_size)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    tok.save(args.out)
    log(f"tokenizer: vocab {tok.get_vocab_size()} from {len(texts)} train files ({skipped} skipped as not "
        f"UTF-8) written to {args.out}")


def register_cli(subparsers) -> None:
    """Add ``train-tokenizer`` and ``train-demo`` to an argparse subparsers object."""
    p = subparsers.add_parser(
        "train-tokenizer", help="train the demo byte-level BPE tokenizer on the stdlib sources",
        description="Train a byte-level BPE tokenizer (tokenizers library, GPT-2 pre-tokenizer, "
                    f"{EOS_TOKEN} as id 0) on the training split of the Python standard library.")
    p.add_argument("--out", required=True, help="tokenizer.json to write")
    p.add_argument("--vocab-size", type=int, default=8192, help="vocabulary size (default 8192)")
    p.add_argument("--corpus", default=None, help="corpus root (default: this Python's stdlib)")
    p.add_argument("--val-fraction", type=float, default=0.05, help="validation share (default 0.05)")
    p.set_defaults(func=run_tokenizer)

    d = subparsers.add_parser(
        "train-demo", help="train the embedded demo oracle/draft pair (resumable)",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="Build the demo pair from the Python standard library sources: tokenizer -> "
                    "token streams -> oracle -> draft (optionally distilled from the oracle). Each "
                    "stage is skipped when its output exists and training resumes from the latest "
                    "checkpoint in --run-dir, so an interrupted run is continued by running the same "
                    "command again. Writes HF GPT-2 directories (float16) with training.json.")
    d.add_argument("--run-dir", default="runs/demo", help="scratch directory: tokenizer, data, checkpoints")
    d.add_argument("--out", default=DEFAULT_OUT, help="where oracle/ and draft/ are written")
    d.add_argument("--stages", default="tokenizer,data,oracle,draft", help="comma-separated stages to run")
    d.add_argument("--corpus", default=None, help="corpus root (default: this Python's stdlib)")
    d.add_argument("--val-fraction", type=float, default=0.05, help="validation share of files")
    d.add_argument("--vocab-size", type=int, default=8192, help="tokenizer vocabulary size")
    d.add_argument("--seq-len", type=int, default=1024, help="training window length (tokens)")
    d.add_argument("--seed", type=int, default=1234, help="seed of init and data order")
    d.add_argument("--threads", type=int, default=2, help="torch threads")
    d.add_argument("--fp32", action="store_true", help="train in fp32 instead of bf16 autocast")
    d.add_argument("--oracle-steps", type=int, default=2000, help="oracle optimizer steps")
    d.add_argument("--oracle-batch", type=int, default=4, help="oracle windows per step")
    d.add_argument("--oracle-lr", type=float, default=1.2e-3, help="oracle peak learning rate")
    d.add_argument("--draft-steps", type=int, default=2400, help="draft optimizer steps")
    d.add_argument("--draft-batch", type=int, default=4, help="draft windows per step")
    d.add_argument("--draft-lr", type=float, default=2e-3, help="draft peak learning rate")
    d.add_argument("--draft-loss", choices=("ce", "kl", "mix"), default="ce",
                   help="draft objective: CE on data, KL to the oracle, or a mix")
    d.add_argument("--distill-alpha", type=float, default=0.5, help="CE weight when --draft-loss mix")
    d.add_argument("--eval-windows", type=int, default=None,
                   help="cap on validation windows for the final figures (default: all)")
    d.add_argument("--no-verify", dest="verify", action="store_false",
                   help="skip the transformers-vs-engine logits check")
    d.set_defaults(func=run_demo)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m staged_engine.train")
    register_cli(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main()
