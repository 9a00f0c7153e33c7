"""PNG plots of the benchmark results in bench/results/ (written to bench/results/plots/).

    python bench/plots.py                              # all plots from bench/results/*.json
    python bench/plots.py --e2e e2e_sampled.json       # the end-to-end plots of another run
    staged-engine bench plots --out /tmp/plots

Plots, each skipped with a note when its input file is missing:

  <e2e>_speedup.png           median speedup over HF generate per system and mode, from the
                              e2e results (--e2e, default e2e.json; <e2e> is the file's name
                              without .json, so the default run gives e2e_speedup.png)
  <e2e>_accepted_lengths.png  tokens emitted per oracle call (accepted length) of chain, tree
                              and staged, as fractions of oracle calls, one panel per mode
  forward_cost.png            oracle forward time against tree nodes (forward_cost.json):
                              milliseconds, and relative to a 1-node pass
  temperature.png             tokens/s against sampling temperature for plain decoding, the best
                              fixed chain and the planned staged default (temperature.json;
                              temperature_avx2.png from temperature_avx2.json)
  round_cost.png              what a round of a fixed chain of 1-4 drafted tokens costs in plain
                              steps (the draft's passes, the oracle's pass, the rest) beside the
                              tokens it emits, one panel per mode (sweep_<mode>.json)

Needs matplotlib, a benchmark-only extra: `pip install matplotlib` (or `pip install -e .[bench]`).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from common import chain_round_costs, run_main

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")
SYSTEM_ORDER = ("hf", "hf_assisted", "hf_lookup", "plain", "chain", "tree", "staged", "chain_1", "chain_2",
                "chain_3", "chain_4")
SPECULATIVE = ("chain", "tree", "staged", "chain_1", "chain_2", "chain_3", "chain_4")
MODE_COLORS = {"greedy": "#4C72B0", "sampled": "#DD8452"}
SYSTEM_COLORS = {"chain": "#55A868", "tree": "#C44E52", "staged": "#8172B3"}
FALLBACK_COLORS = ("#937860", "#DA8BC3", "#8C8C8C", "#CCB974", "#64B5CD")
LINE_COLORS = ("#4C72B0", "#DD8452") + FALLBACK_COLORS
MISSING_MPL = "bench/plots.py needs matplotlib: pip install matplotlib"


def _load(path: str) -> dict | None:
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _machine(d: dict) -> str:
    m = d.get("machine", {})
    return f"{m.get('cpu', 'unknown CPU')}, {m.get('cores', '?')} cores"


def _systems(d: dict) -> list[str]:
    """Systems of any mode, in the usual order (HF baselines first), unknown ones after."""
    seen: list[str] = []
    for rows in d["modes"].values():
        seen += [s for s in rows if s not in seen]
    return [s for s in SYSTEM_ORDER if s in seen] + [s for s in seen if s not in SYSTEM_ORDER]


def _color(i: int, key: str, table: dict) -> str:
    return table.get(key, FALLBACK_COLORS[i % len(FALLBACK_COLORS)])


def plot_e2e_speedup(plt, d: dict, path: str) -> str | None:
    """Grouped bars: median speedup per system (groups) and mode (bars); None without data."""
    modes = list(d["modes"])
    base = "hf" if any("median_speedup_vs_hf" in r for rows in d["modes"].values() for r in rows.values()) \
        else "plain"
    key = f"median_speedup_vs_{base}"
    systems = [s for s in _systems(d) if any(key in d["modes"][m].get(s, {}) for m in modes)]
    if not systems:
        return None
    fig, ax = plt.subplots(figsize=(max(7.0, 0.75 * len(systems) * len(modes) + 1.0), 5.2))
    width = 0.8 / len(modes)
    top = max(d["modes"][m][s][key] for m in modes for s in systems if key in d["modes"][m].get(s, {}))
    for j, mode in enumerate(modes):
        xs, ys, tps = [], [], []
        for i, s in enumerate(systems):
            r = d["modes"][mode].get(s, {})
            if key in r:
                xs.append(i + (j - (len(modes) - 1) / 2) * width)
                ys.append(r[key])
                tps.append(r.get("median_tokens_per_s"))
        bars = ax.bar(xs, ys, width * 0.92, label=mode, color=_color(j, mode, MODE_COLORS), zorder=2)
        for b, y, tp in zip(bars, ys, tps):  # above each bar: speedup, and tokens/s under it
            x = b.get_x() + b.get_width() / 2
            label = dict(xycoords="data", textcoords="offset points", ha="center", va="bottom", zorder=4,
                         bbox=dict(boxstyle="square,pad=0.05", facecolor="white", edgecolor="none"))
            if tp is not None:
                ax.annotate(f"{tp:.0f} tok/s", (x, y), xytext=(0, 2), fontsize=7, color="#444444", **label)
            ax.annotate(f"{y:.2f}x", (x, y), xytext=(0, 11 if tp is not None else 2), fontsize=8.5,
                        fontweight="bold", **label)
    ax.axhline(1.0, color="#555555", linestyle="--", linewidth=1, zorder=3)
    ax.set_xticks(range(len(systems)), systems)
    ax.set_xlim(-0.6, len(systems) - 0.4)
    ax.set_ylim(0, top * 1.18)
    ax.set_ylabel(f"speedup vs {'HF generate' if base == 'hf' else 'our plain decoding'} (median over prompts)")
    ax.set_xlabel("system (labels: median speedup, median tokens/s)")
    ax.grid(axis="y", alpha=0.3, zorder=0)
    ax.legend(title="mode", loc="upper left")
    ax.set_title(f"End-to-end decoding speed: {_machine(d)}\n"
                 f"{d.get('n_prompts', '?')} prompts x {d.get('new_tokens', '?')} new tokens, fp32",
                 fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _histograms(d: dict) -> dict[str, dict[str, dict[int, int]]]:
    """mode -> system -> {accepted length: count}, for the speculative systems that have one."""
    out: dict[str, dict[str, dict[int, int]]] = {}
    for mode, rows in d["modes"].items():
        hs = {s: {int(k): int(v) for k, v in rows[s]["accepted_length_histogram"].items()}
              for s in SPECULATIVE if isinstance(rows.get(s, {}).get("accepted_length_histogram"), dict)}
        hs = {s: h for s, h in hs.items() if sum(h.values()) > 0}
        if hs:
            out[mode] = hs
    return out


def plot_accepted_lengths(plt, d: dict, path: str) -> str | None:
    """Side-by-side bars of the accepted-length distribution, one panel per mode; None without data."""
    hists = _histograms(d)
    if not hists:
        return None
    fig, axes = plt.subplots(1, len(hists), figsize=(6.2 * len(hists), 4.6), squeeze=False, sharey=True)
    for ax, (mode, hs) in zip(axes[0], hists.items()):
        lengths = range(1, max(max(h) for h in hs.values()) + 1)
        width = 0.8 / len(hs)
        for j, (s, h) in enumerate(hs.items()):
            total = sum(h.values())
            mean = sum(k * v for k, v in h.items()) / total
            xs = [n + (j - (len(hs) - 1) / 2) * width for n in lengths]
            ax.bar(xs, [h.get(n, 0) / total for n in lengths], width * 0.92, zorder=2,
                   color=_color(j, s, SYSTEM_COLORS), label=f"{s} (mean {mean:.2f}, {total} calls)")
        ax.set_xticks(list(lengths))
        ax.set_xlabel("tokens emitted per oracle call (accepted length)")
        ax.set_title(mode)
        ax.grid(axis="y", alpha=0.3, zorder=0)
        ax.legend(fontsize=8.5, loc="upper left")
    top = max(v / sum(h.values()) for hs in hists.values() for h in hs.values() for v in h.values())
    axes[0][0].set_ylim(0, top / 0.72)  # headroom: the legend sits above the bars
    axes[0][0].set_ylabel("fraction of oracle calls")
    fig.suptitle(f"Accepted lengths: {_machine(d)}; {d.get('n_prompts', '?')} prompts x "
                 f"{d.get('new_tokens', '?')} new tokens", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_forward_cost(plt, r: dict, path: str) -> str | None:
    """Forward time against tree nodes: ms (left) and relative to 1 node (right); None without data."""
    curves = {name: sorted((int(n), v) for n, v in c.items()) for name, c in r.get("curves", {}).items() if c}
    if not curves:
        return None
    fig, (ax_ms, ax_rel) = plt.subplots(1, 2, figsize=(11, 4.6))
    ticks: set[int] = set()
    for i, (name, pts) in enumerate(curves.items()):
        nodes = [n for n, _ in pts]
        ms = [v["seconds"] * 1e3 for _, v in pts]
        one = dict(pts).get(1, {}).get("seconds")
        rel = [v.get("relative_to_1", v["seconds"] / one if one else float("nan")) for _, v in pts]
        style = dict(marker="o", markersize=4, color=LINE_COLORS[i % len(LINE_COLORS)], label=name)
        ax_ms.plot(nodes, ms, **style)
        ax_rel.plot(nodes, rel, **style)
        ticks.update(nodes)
    ax_rel.axhline(1.0, color="black", linestyle="--", linewidth=1)
    for ax, ylabel in ((ax_ms, "oracle forward time (ms)"), (ax_rel, "time relative to a 1-node pass")):
        ax.set_xscale("log", base=2)
        major = sorted(t for t in ticks if t & (t - 1) == 0)  # powers of two: readable, no overlap
        ax.set_xticks(major, [str(t) for t in major])
        ax.set_xticks([], minor=True)
        ax.set_xlabel("tree nodes verified in one pass (log2)")
        ax.set_ylabel(ylabel)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3, which="both")
        ax.legend(loc="upper left")
    ax_ms.set_title("absolute")
    ax_rel.set_title("relative to 1 node")
    fig.suptitle(f"Oracle forward cost against tree nodes: {_machine(r)}; prefix {r.get('prefix', '?')} tokens, "
                 f"{r.get('params', 0) / 1e6:.1f}M parameters", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_temperature(plt, r: dict, path: str) -> str | None:
    """Tokens/s against temperature: plain, the best fixed chain at each temperature, staged."""
    rows = sorted(r.get("rows", []), key=lambda x: x["temperature"])
    if not rows:
        return None
    ts = [x["temperature"] for x in rows]
    fig, ax = plt.subplots(figsize=(7, 4.4))
    series = (("plain decoding", [x["tokens_per_s"]["plain"] for x in rows], "#4C72B0", "o"),
              ("best fixed chain (chosen afterwards)", [x["tokens_per_s"][x["best_fixed"]] for x in rows], "#55A868", "s"),
              ("staged, planned each round (default)", [x["tokens_per_s"]["staged"] for x in rows], "#8172B3", "^"))
    for label, ys, color, marker in series:
        ax.plot(ts, ys, marker=marker, color=color, label=label)
    for x, t in zip(rows, ts):
        ax.annotate(x["best_fixed"].replace("chain ", "k="), (t, x["tokens_per_s"][x["best_fixed"]]),
                    textcoords="offset points", xytext=(0, 6), ha="center", fontsize=7, color="#55A868")
    ax.set_xlabel("temperature (0 = greedy; no top-k / top-p)")
    ax.set_ylabel("tokens / s (all tokens over all seconds)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower left", fontsize=8)
    ax.set_title(f"Demo pair, {r.get('n_prompts', '?')} held-out prompts x {r.get('new_tokens', '?')} tokens: "
                 f"{_machine(r)}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


ROUND_COST_MODES = ("greedy", "topp", "sampled")
MODE_TITLES = {"greedy": "greedy", "topp": "T 0.8, top-p 0.95", "sampled": "T 1, top-k 50"}


def plot_round_cost(plt, sweeps: list[dict], path: str) -> str | None:
    """Per mode, what a round of a fixed chain of 1-4 drafted tokens costs in plain steps (the
    draft's passes, the oracle's pass, the rest, stacked) beside the tokens it emits: a chain
    pays where its tokens stand above its bar (a plain step is one of each)."""
    panels = [(r, rows) for r in sweeps if (rows := chain_round_costs(r))]
    if not panels:
        return None
    fig, axes = plt.subplots(1, len(panels), figsize=(3.6 * len(panels) + 0.6, 4.2), sharey=True, squeeze=False)
    for ax, (r, rows) in zip(axes[0], panels):
        ks = [x["options"]["chain_length"] for x in rows]
        draft = [x["draft_plain_steps"] for x in rows]
        oracle = [x["oracle_pass_plain_steps"] for x in rows]
        rest = [max(0.0, x["round_plain_steps"] - d - o) for x, d, o in zip(rows, draft, oracle)]
        ax.bar(ks, oracle, color="#4C72B0", label="oracle pass")
        ax.bar(ks, draft, bottom=oracle, color="#DD8452", label="draft passes")
        ax.bar(ks, rest, bottom=[a + b for a, b in zip(oracle, draft)], color="#BBBBBB", label="rest")
        ax.plot(ks, [x["tokens_per_oracle_call"] for x in rows], "D", color="black", label="tokens a round")
        for k, x in zip(ks, rows):
            top = max(x["round_plain_steps"], x["tokens_per_oracle_call"])
            ax.annotate(f"{x['speedup_vs_plain']:.2f}x", (k, top), textcoords="offset points", xytext=(0, 7),
                        ha="center", fontsize=7)
        ax.axhline(1.0, color="#4C72B0", lw=0.8, ls=":", label="a plain step (one token)")
        ax.set_xticks(ks)
        ax.set_xlabel("drafted tokens a round (fixed chain)")
        ax.set_title(MODE_TITLES.get(r.get("mode"), str(r.get("mode"))), fontsize=9)
        ax.grid(axis="y", alpha=0.3)
    top = max(max(x["round_plain_steps"], x["tokens_per_oracle_call"]) for _, rows in panels for x in rows)
    axes[0][0].set_ylim(0, 1.12 * top)  # room for the labels above the tallest bar
    axes[0][0].set_ylabel("plain steps (bars) / tokens (diamonds) a round")
    axes[0][0].legend(loc="upper left", fontsize=7)
    fig.suptitle(f"What a chain's round costs, labelled with its speed against plain decoding: "
                 f"{_machine(panels[0][0])}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", default=RESULTS, metavar="DIR",
                    help="directory with the benchmark JSON files (default: bench/results)")
    ap.add_argument("--out", default=None, metavar="DIR", help="where the PNGs go (default: RESULTS/plots)")
    ap.add_argument("--e2e", default="e2e.json", metavar="FILE",
                    help="end-to-end results: a path, or a file name in RESULTS (default: e2e.json)")
    return ap


def _e2e_path(results: str, e2e: str) -> str:
    if os.path.isfile(e2e) or os.path.isabs(e2e):
        return e2e
    return os.path.join(results, e2e)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        import matplotlib
    except ImportError:
        print(MISSING_MPL, file=sys.stderr)
        return 2
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = args.out or os.path.join(args.results, "plots")
    os.makedirs(out, exist_ok=True)
    written = 0
    e2e_path = _e2e_path(args.results, args.e2e)
    d = _load(e2e_path)
    if d is None:
        print(f"skipping the end-to-end plots: {e2e_path} not found")
    else:
        stem = os.path.splitext(os.path.basename(e2e_path))[0]
        for fn, name, what in ((plot_e2e_speedup, "speedup", "speedups"),
                               (plot_accepted_lengths, "accepted_lengths", "accepted-length histograms")):
            path = fn(plt, d, os.path.join(out, f"{stem}_{name}.png"))
            if path:
                print(path)
                written += 1
            else:
                print(f"skipping {stem}_{name}.png: no {what} in {e2e_path}")
    fc_path = os.path.join(args.results, "forward_cost.json")
    r = _load(fc_path)
    if r is None:
        print(f"skipping forward_cost.png: {fc_path} not found")
    else:
        path = plot_forward_cost(plt, r, os.path.join(out, "forward_cost.png"))
        print(path if path else f"skipping forward_cost.png: no curves in {fc_path}")
        written += bool(path)
    for stem in ("temperature", "temperature_avx2"):
        t_path = os.path.join(args.results, f"{stem}.json")
        r = _load(t_path)
        if r is None:
            print(f"skipping {stem}.png: {t_path} not found")
        else:
            path = plot_temperature(plt, r, os.path.join(out, f"{stem}.png"))
            print(path if path else f"skipping {stem}.png: no rows in {t_path}")
            written += bool(path)
    sweeps = [r for r in (_load(os.path.join(args.results, f"sweep_{m}.json")) for m in ROUND_COST_MODES) if r]
    path = plot_round_cost(plt, sweeps, os.path.join(out, "round_cost.png"))
    print(path if path else "skipping round_cost.png: no sweep with a round-cost split in " + args.results)
    written += bool(path)
    if not written:
        print("no plots written")
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
