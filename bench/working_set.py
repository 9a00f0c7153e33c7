"""What a pass's working set costs it: the caches against the context and the other model.

A one-row decode pass reads the model's weights and, in every layer, the float32 K and V of the
whole context. Where weights and K/V together fit the last-level cache, the pass streams them
from it; past its size the read rate falls toward DRAM's, and a longer context costs more than
its own bytes. A speculative round adds the draft's weights and cache to what the oracle's next
pass finds in the caches, and the oracle's to what the draft's next pass finds. This bench
measures both on this machine, one run, side by side:

- **the read rate against the bytes read**: the native probe (``_cpu.read_seconds``: a buffer
  read as a weight stream is read) over buffers of 1 MiB to at least 4x the last-level cache,
  the sizes alternating in order from round to round, each size the median of its rounds;
- **a one-row pass against the context**: the oracle's and the draft's pass (``--oracle``,
  ``--draft``, default the demo pair) over one new token below ``--contexts`` cached tokens, the
  pass timed by the native clock (``ModelRunner.forward_seconds``) after two back to back, the
  pending entry discarded after each; its working set is the packed weights plus the K/V it
  reads (2 x layers x (context + 1) x width x 4 bytes). The draft sees the oracle's whole context
  here; in the engine a catch-up over more than ``draft_window`` tokens (64 by default) restarts
  its cache from the last of them, so its context there is often shorter;
- **each model's pass after the other's**: the same oracle pass right after 1 and after 3 draft
  passes (as a chain round runs them) against the pass right after another oracle pass, and the
  draft's pass right after the oracle's one-row and two-row pass (a chain round's, which the
  next round's first draft pass follows) against the draft's pass right after its own; the arms
  alternate within every repeat (their order flipped every repeat), so the machine's drift
  cancels, and each figure is the median over ``--repeats`` repeats. The contexts run one after
  another, each for many passes, as a generation does (visiting them in turn, each pass would
  find the caches holding another context's K/V, which no decoding does).

Writes bench/results/working_set.json and bench/results/plots/working_set.png.

    python bench/working_set.py [--contexts 64 128 256 512 1000] [--repeats 100] [--threads 2]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys

import torch
from common import machine, plot_path, progress, progress_bar, publish, run_main
from roofline import read_bandwidth

CONTEXTS = [64, 128, 256, 512, 1000]
DRAFT_PASSES = [1, 3]  # draft passes between two oracle passes, against none
MIB = 1 << 20


def last_level_cache_bytes() -> int | None:
    """The last-level cache size the OS reports (the engine's reading of sysfs), None where it
    reports none."""
    from staged_engine.model.backend import last_level_cache_bytes as llc

    return llc() or None


def probe_sizes(llc: int | None) -> list[int]:
    """Buffer sizes for the read-rate curve: 1 MiB up to at least 4x the last-level cache
    (128 MiB where none is reported), denser around the cache's size."""
    top = max(128 * MIB, 4 * (llc or 0))
    sizes, s = [], MIB
    while s <= top:
        sizes.append(s)
        if s >= 8 * MIB:  # quarter steps where a cache's edge may lie
            sizes += [s + s // 4 * k for k in (1, 2, 3) if s + s // 4 * k <= top]
        s *= 2
    return sorted(set(sizes))


def read_curve(sizes: list[int], rounds: int, bar) -> dict[int, float]:
    """Median read rate (bytes/s) of each size over ``rounds`` rounds, each round the roofline
    bench's probe (``read_bandwidth``: the median of 7 reads after one warm-up); the order of the
    sizes flips every round."""
    rates: dict[int, list[float]] = {s: [] for s in sizes}
    for k in range(rounds):
        for s in (sizes if k % 2 == 0 else list(reversed(sizes))):
            rates[s].append(read_bandwidth(s))
        bar.update(1)
    return {s: statistics.median(r) for s, r in rates.items()}


def kv_bytes(model, context: int) -> int:
    """Bytes of float32 K and V a one-row pass over one new token below ``context`` reads."""
    cfg = model.config
    return 2 * cfg.n_layer * (context + 1) * cfg.n_embd * 4


def passes(oracle_dir: str, draft_dir: str, contexts: list[int], repeats: int, bar) -> dict:
    """Per context (each below both models' n_positions: ``main`` checks): the oracle's and the
    draft's one-row pass back to back, the oracle's after 1 and 3 draft passes and the draft's
    after the oracle's one- and two-row pass (seconds, medians over ``repeats``)."""
    from staged_engine.model.backend import TorchBackend
    from staged_engine.model.checkpoint import load_model
    from staged_engine.model.runner import ModelRunner

    backend = TorchBackend()
    runners = {}
    for role, path in (("oracle", oracle_dir), ("draft", draft_dir)):
        model = load_model(path)
        native = backend.native_model(model)
        if native is None:
            raise RuntimeError(f"--{role} {path}: the native decode path does not take this checkpoint here; "
                               "this bench times the native pass")
        runners[role] = (ModelRunner(model, backend), native.weight_bytes)
    vocab = min(r.model.config.vocab_size for r, _ in runners.values())
    g = torch.Generator().manual_seed(0)

    def one(runner, token: int, position: int, rows: int = 1) -> float:
        """One pass over ``rows`` new tokens (a chain) below ``position``, discarded; its seconds."""
        before = runner.forward_seconds
        if rows == 1:
            runner.forward_nodes([token], [position], None)
        else:
            runner.forward_nodes([token] * rows, list(range(position, position + rows)),
                                 torch.tril(torch.ones(rows, rows, dtype=torch.bool)))
        runner.discard()
        return runner.forward_seconds - before

    (oracle, o_bytes), (draft, d_bytes) = runners["oracle"], runners["draft"]
    arms = ["after oracle"] + [f"after {k} draft pass" + ("es" if k > 1 else "") for k in DRAFT_PASSES]
    # The draft's pass right after the oracle's, over one row and over two (a chain round's pass
    # over the root and the drafted token, which the next round's first draft pass follows).
    draft_arms = [f"after the oracle's {n}-row pass" for n in (1, 2)]
    out = {}
    with torch.inference_mode():
        for ctx in contexts:
            ids = torch.randint(0, vocab, (ctx + 1,), generator=g).tolist()
            for runner in (oracle, draft):
                runner.reset()
                runner.prefill(ids[:-1])
                for _ in range(64):  # past the slow first passes after a prefill (a context's
                    # working set settles in the caches over a few passes)
                    one(runner, ids[-1], ctx)
            seconds: dict[str, list[float]] = {a: [] for a in arms + draft_arms}
            draft_alone: list[float] = []
            order = arms + draft_arms
            for rep in range(repeats):
                for arm in (order if rep % 2 == 0 else list(reversed(order))):
                    if arm in draft_arms:
                        one(draft, ids[-1], ctx)
                        one(draft, ids[-1], ctx)
                        one(oracle, ids[-1], ctx, rows=int(arm.split("'s ")[1][0]))
                        seconds[arm].append(one(draft, ids[-1], ctx))
                        continue
                    one(oracle, ids[-1], ctx)
                    one(oracle, ids[-1], ctx)
                    k = 0 if arm == "after oracle" else int(arm.split()[1])
                    for i in range(k):
                        t = one(draft, ids[-1], ctx)
                        if i == k - 1 and k == DRAFT_PASSES[-1]:
                            draft_alone.append(t)  # the draft's pass after its own
                    seconds[arm].append(one(oracle, ids[-1], ctx))
                bar.update(1)
            med = {a: statistics.median(s) for a, s in seconds.items()}
            base, d_base = med["after oracle"], statistics.median(draft_alone)
            out[str(ctx)] = {
                "oracle_pass_us": base * 1e6,
                "oracle_working_set_bytes": o_bytes + kv_bytes(oracle.model, ctx),
                "oracle_kv_bytes": kv_bytes(oracle.model, ctx),
                "draft_pass_us": d_base * 1e6,
                "draft_working_set_bytes": d_bytes + kv_bytes(draft.model, ctx),
                "oracle_after_draft_us": {a: med[a] * 1e6 for a in arms[1:]},
                "oracle_after_draft_ratio": {a: med[a] / base for a in arms[1:]},
                "draft_after_oracle_us": {a: med[a] * 1e6 for a in draft_arms},
                "draft_after_oracle_ratio": {a: med[a] / d_base for a in draft_arms},
                "oracle_pass_quartiles_us": {a: [q * 1e6 for q in statistics.quantiles(s, n=4)]
                                             for a, s in seconds.items()},
            }
    return {"oracle": {"path": oracle_dir, "weight_bytes": o_bytes, "params": oracle.model.config.num_params},
            "draft": {"path": draft_dir, "weight_bytes": d_bytes, "params": draft.model.config.num_params},
            "contexts": out}


def rate_at(curve: dict[str, float], nbytes: int) -> float:
    """The probe's read rate at ``nbytes``, interpolated in log size between its two neighbours."""
    pts = sorted((int(s), r) for s, r in curve.items())
    if nbytes <= pts[0][0]:
        return pts[0][1]
    for (s0, r0), (s1, r1) in zip(pts, pts[1:]):
        if nbytes <= s1:
            f = (math.log(nbytes) - math.log(s0)) / (math.log(s1) - math.log(s0))
            return r0 + f * (r1 - r0)
    return pts[-1][1]


def table(result: dict) -> str:
    m = result["machine"]
    ext = ", ".join(v for v in m.get("vector_extensions", []) if v in ("avx2", "avx512f", "avx512_bf16"))
    curve = result["read_rate_GBps"]
    llc = result.get("last_level_cache_bytes")
    sizes = sorted(int(s) for s in curve)
    lines = [f"The read rate against the bytes read ({m['cpu']}, {ext}; {result['threads']} threads; last-level "
             f"cache {llc / MIB:.0f} MiB as the OS reports it; the native probe, each size the median of "
             f"{result['rounds']} rounds):" if llc else
             f"The read rate against the bytes read ({m['cpu']}, {ext}; {result['threads']} threads; the native "
             f"probe, each size the median of {result['rounds']} rounds):", "",
             "| MiB | " + " | ".join(f"{s / MIB:g}" for s in sizes) + " |", "|---|" + "---|" * len(sizes),
             "| GB/s | " + " | ".join(f"{curve[str(s)]:.0f}" for s in sizes) + " |", ""]
    p = result["passes"]
    first = next(iter(p["contexts"].values()))
    arms = list(first["oracle_after_draft_ratio"])
    d_arms = list(first.get("draft_after_oracle_ratio", {}))  # none in the runs at c923e9c
    lines += [f"A one-row pass against the context (oracle {p['oracle']['weight_bytes'] / 1e6:.1f} MB and draft "
              f"{p['draft']['weight_bytes'] / 1e6:.1f} MB of packed weights, plus the float32 K/V the pass reads; "
              "native clock, medians of "
              f"{result['repeats']} repeats); the oracle's pass right after the draft's against the same pass "
              "right after another oracle pass"
              + ("; and the draft's pass right after the oracle's against the draft's right after its own" if d_arms
                 else "") + ":", "",
              "| context | oracle working set | probe's rate there | oracle pass | its bytes at the probe's rate | "
              "draft working set | draft pass | " + " | ".join(f"oracle pass {a}" for a in arms)
              + "".join(f" | draft pass {a}" for a in d_arms) + " |",
              "|---|---|---|---|---|---|---|" + "---|" * (len(arms) + len(d_arms))]
    for ctx, r in p["contexts"].items():
        ws = r["oracle_working_set_bytes"]
        rate = rate_at({s: v * 1e9 for s, v in curve.items()}, ws)
        lines.append(f"| {ctx} | {ws / 1e6:.1f} MB | {rate / 1e9:.0f} GB/s | {r['oracle_pass_us']:.0f} us | "
                     f"{ws / rate * 1e6:.0f} us | {r['draft_working_set_bytes'] / 1e6:.1f} MB | "
                     f"{r['draft_pass_us']:.0f} us | "
                     + " | ".join(f"{r['oracle_after_draft_us'][a]:.0f} us ({r['oracle_after_draft_ratio'][a]:.2f}x)"
                                  for a in arms)
                     + "".join(f" | {r['draft_after_oracle_us'][a]:.0f} us ({r['draft_after_oracle_ratio'][a]:.2f}x)"
                               for a in d_arms) + " |")
    return "\n".join(lines) + "\n"


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    curve = sorted((int(s), r) for s, r in result["read_rate_GBps"].items())
    a.plot([s / MIB for s, _ in curve], [r for _, r in curve], marker=".", color="black", label="read probe")
    p = result["passes"]
    ctxs = list(p["contexts"])
    for i, ctx in enumerate(ctxs):
        r = p["contexts"][ctx]
        ws = r["oracle_working_set_bytes"]
        a.scatter([ws / MIB], [ws / (r["oracle_pass_us"] * 1e-6) / 1e9], color=f"C{i}", zorder=3,
                  label=f"oracle pass, context {ctx}")
    if result.get("last_level_cache_bytes"):
        a.axvline(result["last_level_cache_bytes"] / MIB, color="gray", ls="--", lw=0.8, label="last-level cache")
    a.set_xscale("log", base=2)
    a.set_xlabel("bytes read, MiB (a pass: packed weights + the K/V it reads)")
    a.set_ylabel("GB/s")
    a.set_title("read rate against the bytes read")
    a.legend(fontsize=8)
    first = p["contexts"][ctxs[0]]
    arms = [("oracle_after_draft_ratio", a, f"oracle {a}") for a in first["oracle_after_draft_ratio"]]
    arms += [("draft_after_oracle_ratio", a, f"draft {a}") for a in first.get("draft_after_oracle_ratio", {})]
    width = 0.8 / len(arms)
    for j, (key, arm, label) in enumerate(arms):
        b.bar([i + (j - (len(arms) - 1) / 2) * width for i in range(len(ctxs))],
              [p["contexts"][c][key][arm] for c in ctxs], width=width, label=label)
    b.axhline(1.0, color="gray", lw=0.8, ls="--")
    b.set_xticks(range(len(ctxs)), ctxs)
    b.set_xlabel("context, tokens")
    b.set_ylabel("a pass / the same pass after its own model's")
    b.set_title("each model's pass after the other's")
    ratios = [p["contexts"][c][key][a] for c in ctxs for key, a, _ in arms]
    b.set_ylim(min(0.9, *ratios), max(ratios) + 0.12)  # room above the bars for the legend
    b.legend(fontsize=7, ncol=2, loc="upper left")
    fig.suptitle(f"{result['machine']['cpu']} ({result['machine'].get('isa', '')}), {result['threads']} threads",
                 fontsize=9)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--oracle", help="oracle checkpoint directory (default: the demo oracle)")
    ap.add_argument("--draft", help="draft checkpoint directory (default: the demo draft)")
    ap.add_argument("--contexts", type=int, nargs="+", default=CONTEXTS,
                    help=f"cached tokens below the timed pass (default {' '.join(map(str, CONTEXTS))})")
    ap.add_argument("--repeats", type=int, default=100, help="repeats of every pass comparison (default 100)")
    ap.add_argument("--rounds", type=int, default=5, help="rounds of the read-rate curve (default 5)")
    ap.add_argument("--threads", type=int, default=2, help="threads of the forward pass (default 2)")
    ap.add_argument("--out", default="working_set.json", help="file name under bench/results/")
    args = ap.parse_args(argv)
    if args.repeats < 2 or args.rounds < 1 or args.threads < 1:
        raise ValueError(f"--repeats must be >= 2, --rounds and --threads >= 1, got {args.repeats}, {args.rounds} "
                         f"and {args.threads}")
    if min(args.contexts) < 1:
        raise ValueError(f"--contexts must be >= 1 token, got {args.contexts}")
    from staged_engine.demo_pair import DEMO_DIR

    oracle = args.oracle or os.path.join(DEMO_DIR, "oracle")
    draft = args.draft or os.path.join(DEMO_DIR, "draft")
    limit = None
    for flag, path in (("--oracle", oracle), ("--draft", draft)):
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise FileNotFoundError(f"{flag} {path}: no config.json there (a checkpoint directory was expected)")
        with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
            n_positions = json.load(f).get("n_positions", 1024)
        limit = n_positions if limit is None else min(limit, n_positions)
    if max(args.contexts) + 1 > limit:  # before anything is measured
        raise ValueError(f"--contexts must be at most {limit - 1} (the models' n_positions minus the new token), "
                         f"got {max(args.contexts)}")
    torch.set_num_threads(args.threads)
    llc = last_level_cache_bytes()
    sizes = probe_sizes(llc)
    result = {"benchmark": "working set", "machine": machine(), "threads": args.threads, "rounds": args.rounds,
              "repeats": args.repeats, "last_level_cache_bytes": llc}
    progress(f"read-rate curve over {len(sizes)} sizes, then one-row passes at contexts {args.contexts}")
    with progress_bar(args.rounds + args.repeats * len(args.contexts), "working set", "rounds") as bar:
        result["read_rate_GBps"] = {str(s): r / 1e9 for s, r in read_curve(sizes, args.rounds, bar).items()}
        result["passes"] = passes(oracle, draft, sorted(set(args.contexts)), args.repeats, bar)
    publish(result, table(result), args.out)
    png = plot_path(args.out, "working_set.json", "working_set")
    plot(result, png)
    print(f"saved {png}")
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
