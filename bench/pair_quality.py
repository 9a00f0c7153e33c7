"""Quality of the demo pair on the held-out packages: bits per byte and draft agreement.

The held-out packages (click, jinja2, networkx, rich) never entered training. Their source is
re-read from this machine's installation, tokenized with the pair's tokenizer, and scored on
windows spread evenly over each package (not just the first files): the oracle's and the
draft's bits per byte, and how often the draft's top-1 token equals the oracle's
(teacher-forced). Writes bench/results/pair_quality.json.

    python bench/pair_quality.py --windows 24
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np
import torch
from common import machine, publish, run_main


def run(args) -> dict:
    from tokenizers import Tokenizer

    from staged_engine.demo_pair import DEMO_DIR
    from staged_engine.model.checkpoint import load_model
    from staged_engine.training import corpus
    from staged_engine.training.train import encode_docs, evaluate, token_byte_lengths

    oracle_dir = args.oracle or os.path.join(DEMO_DIR, "oracle")
    draft_dir = args.draft or os.path.join(DEMO_DIR, "draft")
    tok = Tokenizer.from_file(os.path.join(oracle_dir, "tokenizer.json"))
    oracle, draft = load_model(oracle_dir), load_model(draft_dir)
    lengths = token_byte_lengths(tok)
    eos = tok.token_to_id("<|endoftext|>")
    docs = corpus.build(log=lambda m: None).held_out
    out = {"benchmark": "demo pair on held-out packages", "machine": machine(), "oracle": oracle_dir,
           "oracle_params": oracle.config.num_params, "draft_params": draft.config.num_params, "window": args.window,
           "windows_per_package": args.windows, "packages": {}}
    tot = {"oracle_bits": 0.0, "draft_bits": 0.0, "bytes": 0.0, "agree": 0.0, "tokens": 0}
    for pkg in sorted({rel.split("/")[0] for rel, _ in docs}):
        stream = encode_docs(tok, [t for rel, t in docs if rel.split("/")[0] == pkg], eos)
        n = (len(stream) - 1) // args.window
        picks = np.unique(np.linspace(0, n - 1, min(n, args.windows)).astype(int))
        w = torch.from_numpy(np.stack([stream[i * args.window:(i + 1) * args.window + 1] for i in picks]).astype(np.int64))
        eo = evaluate(oracle, w, byte_lengths=lengths)
        ed = evaluate(draft, w, byte_lengths=lengths, teacher=oracle)
        out["packages"][pkg] = {"tokens": eo["tokens"], "bytes": eo["bytes"], "stream_tokens": int(len(stream)),
                                "oracle_bits_per_byte": round(eo["bits_per_byte"], 4),
                                "draft_bits_per_byte": round(ed["bits_per_byte"], 4),
                                "draft_top1_agreement": round(ed["top1_agreement"], 4)}
        tot["oracle_bits"] += eo["bits_per_byte"] * eo["bytes"]
        tot["draft_bits"] += ed["bits_per_byte"] * ed["bytes"]
        tot["bytes"] += eo["bytes"]
        tot["agree"] += ed["top1_agreement"] * ed["tokens"]
        tot["tokens"] += ed["tokens"]
    out["all"] = {"oracle_bits_per_byte": round(tot["oracle_bits"] / tot["bytes"], 4),
                  "draft_bits_per_byte": round(tot["draft_bits"] / tot["bytes"], 4),
                  "draft_top1_agreement": round(tot["agree"] / tot["tokens"], 4), "tokens": tot["tokens"]}
    return out


def markdown(r: dict) -> str:
    lines = [f"Windows of {r['window']} tokens spread evenly over each held-out package "
             f"({r['windows_per_package']} per package):\n",
             "| package | tokens scored | oracle bits/byte | draft bits/byte | draft top-1 agreement |",
             "|---|---|---|---|---|"]
    for name, p in list(r["packages"].items()) + [("all", r["all"])]:
        lines.append(f"| {name} | {p['tokens']:,} | {p['oracle_bits_per_byte']:.3f} | {p['draft_bits_per_byte']:.3f} | "
                     f"{p['draft_top1_agreement']:.3f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--oracle", help="oracle directory (default: the demo oracle)")
    ap.add_argument("--draft", help="draft directory (default: the demo draft)")
    ap.add_argument("--windows", type=int, default=24, help="windows per package")
    ap.add_argument("--window", type=int, default=1024, help="tokens per window")
    ap.add_argument("--out", default="pair_quality.json", help="file name under bench/results/")
    args = ap.parse_args(argv)
    if args.windows < 1 or args.window < 2:
        raise SystemExit("--windows must be >= 1 and --window >= 2")
    r = run(args)
    publish(r, markdown(r), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
