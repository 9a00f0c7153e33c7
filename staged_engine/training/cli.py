"""The ``train-demo`` and ``train-pilot`` commands' arguments. Building the parser imports neither
torch nor the training code (``train``), which the commands import when they run."""
from __future__ import annotations

import argparse
import os

from staged_engine.training.corpus import HELD_OUT

DEFAULT_OUT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets", "demo")
ORACLE = "256x8x4"  # n_embd x n_layer x n_head, chosen by the pilots recorded in training.json
DRAFT = "96x2x2"


def _train(name: str):
    """The command ``train.<name>``, imported when it runs."""

    def run(args):
        from staged_engine.training import train

        return getattr(train, name)(args)

    return run


def register_cli(subparsers) -> None:
    """Add ``train-demo`` and ``train-pilot`` to an argparse subparsers object."""
    d = subparsers.add_parser(
        "train-demo", help="train the embedded demo oracle/draft pair (resumable)",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="Build the demo pair: corpus (stdlib + the requirement closure, some packages "
                    "held out) -> tokenizer -> token streams -> oracle -> draft distilled from the "
                    "oracle. Each stage is skipped when its output exists and training resumes from "
                    "the latest checkpoint in --run-dir, so an interrupted run is continued by running "
                    "the same command again. Writes HF GPT-2 directories (float16) with training.json.")
    d.add_argument("--run-dir", default="runs/demo", help="scratch directory: tokenizer, data, checkpoints")
    d.add_argument("--out", default=DEFAULT_OUT, help="where oracle/ and draft/ are written")
    d.add_argument("--stages", default="tokenizer,data,oracle,draft", help="comma-separated stages to run")
    d.add_argument("--held-out", default=",".join(HELD_OUT), help="packages kept out of training")
    d.add_argument("--val-fraction", type=float, default=0.02, help="validation share of files")
    d.add_argument("--vocab-size", type=int, default=8192, help="tokenizer vocabulary size")
    d.add_argument("--tokenizer-sample", type=int, default=3, help="train the tokenizer on every Nth file")
    d.add_argument("--seq-len", type=int, default=1024, help="training window length (tokens)")
    d.add_argument("--seed", type=int, default=1234, help="seed of init and data order")
    d.add_argument("--threads", type=int, default=2, help="torch threads")
    d.add_argument("--fp32", action="store_true", help="train in fp32 instead of bf16 autocast")
    d.add_argument("--compile", action="store_true", help="torch.compile the training forward")
    d.add_argument("--oracle-size", default=ORACLE, help="oracle N_EMBDxN_LAYERxN_HEAD")
    d.add_argument("--oracle-steps", type=int, default=2000, help="oracle optimizer steps")
    d.add_argument("--oracle-batch", type=int, default=4, help="oracle windows per step")
    d.add_argument("--oracle-lr", type=float, default=2e-3, help="oracle peak learning rate")
    d.add_argument("--draft-size", default=DRAFT, help="draft N_EMBDxN_LAYERxN_HEAD")
    d.add_argument("--draft-steps", type=int, default=1000, help="draft optimizer steps")
    d.add_argument("--draft-batch", type=int, default=4, help="draft windows per step")
    d.add_argument("--draft-lr", type=float, default=3e-3, help="draft peak learning rate")
    d.add_argument("--draft-loss", choices=("ce", "kl", "mix"), default="kl",
                   help="draft objective: CE on data, KL to the oracle, or a mix")
    d.add_argument("--distill-alpha", type=float, default=0.5, help="CE weight when --draft-loss mix")
    d.add_argument("--eval-windows", type=int, default=200,
                   help="cap on evaluation windows per set for the final figures")
    d.add_argument("--no-verify", dest="verify", action="store_false",
                   help="skip the transformers-vs-engine logits check")
    d.set_defaults(func=_train("run_demo"))

    p = subparsers.add_parser(
        "train-pilot", help="a short time-bounded training run that scores a model shape",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="Train one shape for a fixed wall time on the data of a train-demo run dir (its "
                    "tokenizer and data stages must have run) and report bits per byte on the "
                    "validation files and the held-out packages. Run pilots side by side with "
                    "--threads 1 to compare them at equal wall time.")
    p.add_argument("--run-dir", default="runs/demo", help="train-demo run directory with data/")
    p.add_argument("--name", required=True, help="pilot name (its directory under run-dir/pilots)")
    p.add_argument("--size", required=True, help="N_EMBDxN_LAYERxN_HEAD")
    p.add_argument("--minutes", type=float, default=10.0, help="training wall time")
    p.add_argument("--lr", type=float, default=2e-3, help="peak learning rate")
    p.add_argument("--warmup", type=int, default=50, help="warmup steps")
    p.add_argument("--batch", type=int, default=4, help="windows per step")
    p.add_argument("--seq-len", type=int, default=512, help="window length")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--seed", type=int, default=1234, help="seed of init and data order")
    p.add_argument("--compile", action="store_true", help="torch.compile the training forward")
    p.add_argument("--eval-windows", type=int, default=48, help="evaluation windows of 512 per set")
    p.set_defaults(func=_train("run_pilot"))
