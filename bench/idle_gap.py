"""A forward pass after idle time: what the time between two passes of a model costs the second.

Plain decoding runs a model's passes back to back. A speculative round puts the draft's passes,
the sampling rule and the round's Python between two oracle passes (a few hundred microseconds),
and the oracle's pass between two bursts of the draft. This bench measures what that gap costs
the pass after it, on this machine, one model at a time:

- the model (the demo oracle and draft, or ``--models DIR ...``) prefills ``--context`` random
  tokens, runs a few plain steps back to back, then waits ``gap`` microseconds in a busy loop on
  the calling thread (the interpreter's work in a round, touching little memory), and takes one
  more step; that step's pass is timed by the native clock (``ModelRunner.forward_seconds``);
- the gaps (default 0, 50, 200, 500, 1000 and 3000 us) alternate within every repeat, so each
  ratio compares passes taken minutes apart at most and the machine's drift cancels out;
- each gap's figure is the median over ``--repeats`` repeats, reported against the gap-0 pass.

On a dedicated machine the ratios stay near 1. Where they grow, the caches lose the model's
weights while it idles (other guests sharing the L3, or the core) and the thread pool's idle
worker takes time to wake: speculation then pays less than a back-to-back forward-cost
curve says.

Writes bench/results/idle_gap.json and bench/results/plots/idle_gap.png.

    python bench/idle_gap.py [--models DIR ...] [--gaps 0 200 1000] [--repeats 40] [--threads 2]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
from common import checkpoint_dirs, machine, plot_path, progress_bar, publish, run_main

GAPS_US = [0, 50, 200, 500, 1000, 3000]


def busy(us: float) -> None:
    """Wait ``us`` microseconds on this thread without sleeping (the core stays in use)."""
    end = time.perf_counter() + us * 1e-6
    while time.perf_counter() < end:
        pass


def measure(name: str, path: str, args, bar) -> dict:
    from staged_engine.model.backend import TorchBackend
    from staged_engine.model.checkpoint import load_model
    from staged_engine.model.runner import ModelRunner

    model = load_model(path)
    runner = ModelRunner(model, TorchBackend())
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (args.context + 1,), generator=g).tolist()
    rule = (0.0, 0, 1.0, 0)  # greedy steps: the pass, its argmax, fed back
    seconds: dict[int, list[float]] = {gap: [] for gap in args.gaps}
    with torch.inference_mode():
        for rep in range(args.repeats):
            # alternate the order of the gaps from one repeat to the next
            for gap in (args.gaps if rep % 2 == 0 else list(reversed(args.gaps))):
                runner.reset()
                runner.prefill(ids[:-1])
                out = runner.steps(ids[-1], 4, rule)  # back to back: the weights are warm
                busy(gap)
                before = runner.forward_seconds
                runner.steps(out[-1], 1, rule)
                seconds[gap].append(runner.forward_seconds - before)
            bar.update(1)
    base = statistics.median(seconds[args.gaps[0]])
    return {"path": path, "params": model.config.num_params, "weight_bytes": model.weight_bytes(),
            "context": args.context, "repeats": args.repeats,
            "pass_us": {str(gap): statistics.median(s) * 1e6 for gap, s in seconds.items()},
            "ratio_to_first_gap": {str(gap): statistics.median(s) / base for gap, s in seconds.items()},
            "pass_us_quartiles": {str(gap): [q * 1e6 for q in statistics.quantiles(s, n=4)]
                                  for gap, s in seconds.items()}}


def table(result: dict) -> str:
    m = result["machine"]
    ext = ", ".join(v for v in m.get("vector_extensions", []) if v in ("avx2", "avx512f", "avx512_bf16"))
    gaps = result["gaps_us"]
    lines = [f"A pass after idle time: one model's 1-row pass, native clock, after `gap` us of a busy loop "
             f"on the calling thread, against the same pass with no gap ({m['cpu']}, {ext}; {result['threads']} "
             f"threads; {result['context']}-token context; median of {result['repeats']} repeats, the gaps "
             "alternating within each):", "",
             "| model | " + " | ".join(f"gap {g} us" for g in gaps) + " |",
             "|---|" + "---|" * len(gaps)]
    for name, r in result["models"].items():
        cells = [f"{r['pass_us'][str(g)]:.0f} us ({r['ratio_to_first_gap'][str(g)]:.2f}x)" for g in gaps]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    gaps = result["gaps_us"]
    for name, r in result["models"].items():
        ax.plot([max(g, 10) for g in gaps], [r["ratio_to_first_gap"][str(g)] for g in gaps], marker="o", label=name)
    ax.axhline(1.0, color="gray", lw=0.8, ls="--")
    ax.set_xscale("log")
    ax.set_xlabel("idle time before the pass, us (0 drawn at 10)")
    ax.set_ylabel(f"pass time / pass time at gap {gaps[0]} us")
    ax.set_title("a forward pass after idle time")
    ax.legend()
    fig.suptitle(f"{result['machine']['cpu']}, {result['threads']} threads", fontsize=9)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="*", help="checkpoint directories (default: the demo oracle and draft)")
    ap.add_argument("--gaps", type=int, nargs="+", default=GAPS_US,
                    help="idle times before the timed pass, microseconds, the first the reference "
                         f"(default {' '.join(map(str, GAPS_US))})")
    ap.add_argument("--repeats", type=int, default=40, help="repeats of every gap (default 40)")
    ap.add_argument("--context", type=int, default=200, help="tokens in the cache before the pass (default 200)")
    ap.add_argument("--threads", type=int, default=2, help="threads of the forward pass (default 2)")
    ap.add_argument("--out", default="idle_gap.json", help="file name under bench/results/")
    args = ap.parse_args(argv)
    if args.repeats < 2 or args.threads < 1 or args.context < 1:
        raise ValueError(f"--repeats must be >= 2, --threads and --context >= 1, got {args.repeats}, "
                         f"{args.threads} and {args.context}")
    if any(g < 0 for g in args.gaps):
        raise ValueError(f"--gaps must be >= 0 microseconds, got {args.gaps}")
    from staged_engine.demo_pair import DEMO_DIR

    models = checkpoint_dirs(args.models, lambda: {"demo oracle": os.path.join(DEMO_DIR, "oracle"),
                                                    "demo draft": os.path.join(DEMO_DIR, "draft")})
    torch.set_num_threads(args.threads)
    result = {"benchmark": "idle gap", "machine": machine(), "threads": args.threads, "context": args.context,
              "repeats": args.repeats, "gaps_us": args.gaps, "models": {}}
    with progress_bar(args.repeats * len(models), "idle gap", "repeats") as bar:
        for name, path in models.items():
            bar.set_postfix_str(name)
            result["models"][name] = measure(name, path, args, bar)
    publish(result, table(result), args.out)
    png = plot_path(args.out, "idle_gap.json", "idle_gap")
    plot(result, png)
    print(f"saved {png}")
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
