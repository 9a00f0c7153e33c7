"""Where a forward pass goes: the time of each of its phases, per model, context and row count.

The native forward pass times its own phases when asked (``_cpu.set_phase_timing``): each thread
adds the wall time between marks in its part of a pass to one of the phases: the layer norms,
its share of the fused QKV product, attention over the cache (its heads), the attention's
projection, the MLP's two products (fc, mproj), the LM head, and its waits at the barriers
inside the pass for the other thread(s). This bench runs passes of N new tokens (a chain: each
attends to the context and to the tokens before it in the pass, as a drafted chain's
verification does) after C cached tokens, for each model, C in ``--contexts`` and N in
``--rows``, the row counts alternating within each repeat, one native call a pass
(``ModelRunner.forward_nodes``), and reports per pass:

- the wall time of the call;
- each phase's time: the mean over the threads of their seconds in it (a thread waiting for
  another is time the pass spends), and its share of the wall time; what the marks do not
  cover (the call from Python, the threads' fork and join) is ``outside``;
- each thread's busy time (its phases but its waits), thread 0 first: the threads split every
  product evenly, so a thread busy longer than the other is one its core ran slower, and the
  other waits that long at the barriers (the JSON keeps each thread's phases, ``thread_us``).

With ``--region`` each repeat runs 8 passes of a row count back to back in one native call
(``NativeGPT2.region_passes``: one step region, the threads spinning between passes), as plain
decoding's steps run, and reports their means; ``outside`` is then the call, the fork and join
shared by 8 passes, and thread 0's turn between them. A plain step is such a pass, so this is
the one-row figure a verified row is to be weighed against. On the demo oracle (AVX2 Zen 3,
both ways in one sitting, at a846dbd) one-row passes back to back took 0.75-0.81x the time of
one call a pass, and a second row added 31-40% to them (their products 28-42%), where in calls
it added 9-22% (the products 1-7%) to a slower pass; back to back the figures also held still:
two runs 25 minutes apart within 3% at each context, one call a pass 9-14% apart. In later
sittings back to back took 0.64-0.96x a call and a second row added 30-40%, in calls 32-35%
(502f92e), then 0.82-0.89x, 37-43% and 26-27% (2c5639e): what a row adds moves with the hour.

Every figure is a mean over the repeats whose wall time is among the fastest 80% (a scheduler
hiccup skews one pass by milliseconds), so the phases add up to the wall time; the first
``WARM`` repeats of each context are not timed.

Writes bench/results/phases.json and bench/results/plots/phases.png.

    python bench/phases.py [--models DIR ...] [--contexts 64 256 512] [--rows 1 2 3 4 8] [--repeats 100]
    python bench/phases.py --region --out phases_region.json
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch
from common import checkpoint_dirs, machine, plot_path, progress_bar, publish, run_main

CONTEXTS = [64, 256, 512]
ROWS = [1, 2, 3, 4, 8]
KEEP = 0.8  # the fastest share of the repeats the means are taken over
# Untimed repeats of each context first: they warm the caches and let the model choose its
# register-block form for each row count (the native FormChooser compares the forms over its
# first passes of each). With two, the first context's passes over 2-3 rows ran 1.2-1.3x the
# time the same passes took after the others (AVX2 Zen 3, demo oracle, the order reversed).
WARM = 10
# Passes a repeat with --region: back to back in one native call (``NativeGPT2.region_passes``).
REGION_PASSES = 8
REGION_ROWS = 9  # the most rows a step region's pass takes (NativeGPT2::kStepRows)


def kept(walls: list[float]) -> list[int]:
    """The repeats whose wall time is among the fastest ``KEEP`` of them (at least one)."""
    return sorted(range(len(walls)), key=lambda i: walls[i])[:max(1, int(len(walls) * KEEP))]


def trimmed(walls: list[float], phases: list[list[float]]) -> tuple[float, list[float]]:
    """Means of the wall times and of each phase over the repeats ``kept``."""
    order = kept(walls)
    wall = sum(walls[i] for i in order) / len(order)
    return wall, [sum(phases[i][p] for i in order) / len(order) for p in range(len(phases[0]))]


def by_thread(walls: list[float], threads: list[list[list[float]]], names: list[str]) -> list[dict]:
    """Each thread's mean seconds a pass in each phase over the repeats ``kept`` (the same ones as
    ``trimmed``), in microseconds: where one thread works longer than the other, the other waits."""
    order = kept(walls)
    return [{name: sum(threads[i][t][p] for i in order) / len(order) * 1e6 for p, name in enumerate(names)}
            for t in range(len(threads[0]))]


def measure(path: str, args, bar) -> dict:
    from staged_engine.model.backend import TorchBackend, _cpu
    from staged_engine.model.checkpoint import load_model
    from staged_engine.model.runner import ModelRunner

    model = load_model(path)
    runner = ModelRunner(model, TorchBackend())
    runner.reset()
    if runner.native is None:
        raise RuntimeError(f"{path}: this model does not run on the native forward pass here, which the phases time")
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (max(args.contexts) + max(args.rows),), generator=g).tolist()
    out = {"path": path, "params": model.config.num_params, "weight_bytes": model.weight_bytes(), "contexts": {}}
    names: list[str] = []
    with torch.inference_mode():
        for ctx in args.contexts:
            runner.reset()
            runner.prefill(ids[:ctx])
            start = runner.length
            walls: dict[int, list[float]] = {n: [] for n in args.rows}
            phases: dict[int, list[list[float]]] = {n: [] for n in args.rows}
            threads: dict[int, list[list[list[float]]]] = {n: [] for n in args.rows}  # [repeat][thread][phase]
            for rep in range(WARM + args.repeats):
                for n in (args.rows if rep % 2 == 0 else list(reversed(args.rows))):
                    _cpu.phase_seconds()  # the totals start from zero
                    if args.region:  # REGION_PASSES back to back in one native call
                        t0 = time.perf_counter()
                        runner.region_passes(ids[ctx:ctx + n], REGION_PASSES)
                        wall = (time.perf_counter() - t0) / REGION_PASSES
                        expected = REGION_PASSES
                    else:
                        t0 = time.perf_counter()
                        runner.forward_nodes(ids[ctx:ctx + n], list(range(start, start + n)), None)
                        wall = time.perf_counter() - t0
                        expected = 1
                        runner.discard()
                    passes, names, seconds = _cpu.phase_seconds()
                    if passes != expected or not seconds:
                        raise RuntimeError(f"expected {expected} timed passes over {n} rows, the native clock saw {passes}")
                    if rep >= WARM:
                        walls[n].append(wall)
                        phases[n].append([sum(t[p] for t in seconds) / len(seconds) / passes for p in range(len(names))])
                        threads[n].append([[t[p] / passes for p in range(len(names))] for t in seconds])
                bar.update(1)
            rows = {}
            for n in args.rows:
                wall, mean = trimmed(walls[n], phases[n])
                us = {name: s * 1e6 for name, s in zip(names, mean)}
                us["outside"] = max(0.0, wall * 1e6 - sum(us.values()))
                per = by_thread(walls[n], threads[n], names)
                rows[str(n)] = {"wall_us": wall * 1e6, "phase_us": us,
                                "share": {k: v / (wall * 1e6) for k, v in us.items()}, "thread_us": per,
                                "busy_us": [sum(v for k, v in t.items() if k != "wait") for t in per]}
            out["contexts"][str(ctx)] = rows
    out["phases"] = names + ["outside"]
    return out


def table(result: dict) -> str:
    m = result["machine"]
    ext = ", ".join(v for v in m.get("vector_extensions", []) if v in ("avx2", "avx512f", "avx512_bf16"))
    region = result.get("regime", "").startswith("region")
    how = (f"{REGION_PASSES} passes back to back in one native call (as plain decoding's steps run)" if region
           else "one native call")
    busy = any("busy_us" in row for r in result["models"].values() for rows in r["contexts"].values()
               for row in rows.values())
    lines = [f"Where a forward pass goes: a pass over N new tokens (a chain) after C cached tokens, {how}, "
             f"microseconds a pass and share of its wall time; each phase the mean over the threads, their "
             f"waits for each other apart, `outside` the call and the threads' fork and join ({m['cpu']}, {ext}; "
             f"{result['threads']} threads; means over the fastest {KEEP:.0%} of {result['repeats']} repeats, the "
             "row counts alternating within each)" + (
                 "; `busy by thread`: each thread's time in the phases other than its waits, thread 0 first (the "
                 "others wait for the slowest at every barrier)" if busy else "") + ":", ""]
    for name, r in result["models"].items():
        phases = r["phases"]
        lines += [f"**{name}** ({r['params'] / 1e6:.1f}M parameters)", "",
                  "| C | N | wall | " + " | ".join(phases) + (" | busy by thread" if busy else "") + " |",
                  "|---|---|---|" + "---|" * (len(phases) + busy)]
        for ctx, rows in r["contexts"].items():
            for n, row in rows.items():
                cells = [f"{row['phase_us'][p]:.0f} ({row['share'][p]:.0%})" for p in phases]
                if busy:
                    cells.append(" / ".join(f"{b:.0f}" for b in row.get("busy_us", [])))
                lines.append(f"| {ctx} | {n} | {row['wall_us']:.0f} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines).rstrip()


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(result["models"].items())
    fig, axes = plt.subplots(1, len(models), figsize=(6.5 * len(models), 4.4), squeeze=False)
    for ax, (name, r) in zip(axes[0], models):
        cols = [(ctx, n, row) for ctx, rows in r["contexts"].items() for n, row in rows.items()]
        bottoms = [0.0] * len(cols)
        for phase in r["phases"]:
            heights = [row["phase_us"][phase] for _, _, row in cols]
            ax.bar(range(len(cols)), heights, bottom=bottoms, label=phase)
            bottoms = [b + h for b, h in zip(bottoms, heights)]
        labels = [f"C{ctx}\nN{n}" for ctx, n, _ in cols]
        ax.set_xticks(range(len(cols)), labels, fontsize=7)
        ax.set_ylabel("microseconds a pass")
        ax.set_title(f"{name}: a pass by phase")
    axes[0][-1].legend(fontsize=7, loc="upper left")
    fig.suptitle(f"{result['machine']['cpu']}, {result['threads']} threads", fontsize=9)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="*", help="checkpoint directories (default: the demo oracle and draft)")
    ap.add_argument("--contexts", type=int, nargs="+", default=CONTEXTS,
                    help=f"cached tokens before the pass (default {' '.join(map(str, CONTEXTS))})")
    ap.add_argument("--rows", type=int, nargs="+", default=ROWS,
                    help=f"new tokens a pass (default {' '.join(map(str, ROWS))})")
    ap.add_argument("--repeats", type=int, default=100, help="passes of every context and row count (default 100)")
    ap.add_argument("--threads", type=int, default=2, help="threads of the forward pass (default 2)")
    ap.add_argument("--region", action="store_true",
                    help=f"{REGION_PASSES} passes a repeat back to back in one native call, as plain decoding's steps "
                         "run (rows at most 9), instead of one call a pass")
    ap.add_argument("--out", default="phases.json", help="file name under bench/results/")
    args = ap.parse_args(argv)
    args.contexts, args.rows = list(dict.fromkeys(args.contexts)), list(dict.fromkeys(args.rows))
    if args.repeats < 5 or args.threads < 1:
        raise ValueError(f"--repeats must be >= 5 and --threads >= 1, got {args.repeats} and {args.threads}")
    if any(c < 1 for c in args.contexts):
        raise ValueError(f"--contexts must be >= 1 cached tokens, got {args.contexts}")
    if any(not 1 <= n <= 64 for n in args.rows):
        raise ValueError(f"--rows must be in [1, 64], got {args.rows}")
    if args.region and max(args.rows) > REGION_ROWS:
        raise ValueError(f"--rows must be at most {REGION_ROWS} with --region (a step region's passes), got {args.rows}")
    from staged_engine.demo_pair import DEMO_DIR
    from staged_engine.model.backend import _cpu
    from staged_engine.model.config import GPT2Config

    models = checkpoint_dirs(args.models, lambda: {"demo oracle": os.path.join(DEMO_DIR, "oracle"),
                                                    "demo draft": os.path.join(DEMO_DIR, "draft")})
    for name, path in models.items():
        n_pos = GPT2Config.from_file(os.path.join(path, "config.json")).n_positions
        if max(args.contexts) + max(args.rows) > n_pos:
            raise ValueError(f"--contexts and --rows must fit {name}'s {n_pos} positions: "
                             f"{max(args.contexts)} + {max(args.rows)} do not")
    if _cpu is None:
        raise RuntimeError("the native extension is not built here: the phases are timed by it "
                           "(pip install --no-build-isolation -e .)")
    torch.set_num_threads(args.threads)
    result = {"benchmark": "forward pass phases", "machine": machine(), "threads": args.threads,
              "repeats": args.repeats, "rows": args.rows,
              "regime": f"region: {REGION_PASSES} passes back to back a call" if args.region else "one call a pass",
              "models": {}}
    _cpu.set_phase_timing(True)
    try:
        with progress_bar((WARM + args.repeats) * len(args.contexts) * len(models), "phases", "repeats") as bar:
            for name, path in models.items():
                bar.set_postfix_str(name)
                result["models"][name] = measure(path, args, bar)
    finally:
        _cpu.set_phase_timing(False)
    publish(result, table(result), args.out)
    png = plot_path(args.out, "phases.json", "phases")
    plot(result, png)
    print(f"saved {png}")
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
