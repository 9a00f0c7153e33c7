"""The native linear kernel alone: what bounds an N-node pass on this machine.

An N-node forward pass is mostly products y (N, M) = x (N, K) W^T. The decoder streams W once
per register block of up to 6 rows and, for fp16 checkpoints, widens each weight to fp32 in
registers before its FMAs (csrc/cpu_forward.cpp). This script times that kernel alone
(``_cpu.linear_seconds``: the decoder's packing, prefetch rule and thread split, no attention,
norms or barriers between layers) on weights the size of the demo draft, the demo oracle and
GPT-2 small, at 1-64 rows, in the same run as

- the **bandwidth bound**: packed weight bytes over the read bandwidth measured here on a
  buffer of the same size (cache-resident when it fits the last-level cache), as the roofline
  bench measures it (the best of three measurements);
- the **compute bound**: 2 M K N FLOP at the fp32 GEMM rate torch's BLAS reaches here (the best
  of three; the kernel itself may exceed it at 4-6 rows);
- torch's ``x @ W.T`` in fp32 at the same shapes;
- the same kernel on fp32-packed weights (twice the bytes, no widening), where they fit;
- the **widening bound**: the packed fp16 bytes at the rate this CPU widens float16 to float32
  as a one-row product does, from L1, each widened vector into its FMA (``_cpu.widen_seconds``,
  the best of three). Where the time the fp16
  kernel takes beyond the fp32-packed one at 6 rows (the same FMAs) is about this bound, the
  widening does not overlap the FMAs: it takes their pipes, and a pass pays both.

Within one register block (1-6 rows) it fits t(N) = a + b N by least squares: ``a`` is what a
pass pays whatever its rows (streaming and widening the weights), ``b`` what each row adds
(its FMAs). Where ``a`` is close to the bandwidth bound and ``b`` to the compute bound but the
two add instead of overlapping, an N-node pass costs about their sum: that is the machine's
limit for this kernel, and why ``bench roofline``'s N-node ratios sit where they do.

Writes bench/results/linear_cpu.json and bench/results/plots/linear.png.

    python bench/linear.py [--threads 2] [--repeats 40]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

from common import machine, plot_path, progress, publish, run_main, timed
from roofline import gemm_rate, read_bandwidth, widening_rate

ROWS = (1, 2, 3, 4, 5, 6, 8, 12, 16, 32, 64)
FIT_ROWS = (1, 2, 3, 4, 5, 6)  # one register block: each weight streamed and widened once
# (name, out features M, in features K): about the weights a token reads in each model.
SHAPES = (("demo draft", 8192, 112), ("demo oracle", 16384, 512), ("GPT-2-small", 24576, 5120))
FP32_MAX_PARAMS = 16 << 20  # fp32 packing beyond this would only measure DRAM


def best_bandwidth(nbytes: int, tries: int = 3) -> float:
    """The best of a few read-bandwidth measurements (each a median): on a shared VM a single
    one can land in a slow moment and make a bound that the kernel itself beats."""
    return max(read_bandwidth(nbytes, repeats=15) for _ in range(tries))


def best_gemm_rate(tries: int = 3) -> float:
    return max(gemm_rate() for _ in range(tries))


def fit(rows: list[int], seconds: list[float]) -> tuple[float, float]:
    """Least-squares (a, b) of seconds = a + b * rows."""
    n = len(rows)
    mx, my = sum(rows) / n, sum(seconds) / n
    sxx = sum((x - mx) ** 2 for x in rows)
    b = sum((x - mx) * (y - my) for x, y in zip(rows, seconds)) / sxx
    return my - b * mx, b


def native(w: torch.Tensor, rows: int, repeats: int) -> tuple[float, bool, int]:
    from staged_engine.model.backend import _cpu

    seconds, half, nbytes = _cpu.linear_seconds(w, rows, repeats)
    return statistics.median(seconds[max(1, repeats // 10):]), half, nbytes


def torch_matmul(w: torch.Tensor, rows: int, repeats: int) -> float:
    """Median seconds of torch's fp32 ``x @ W.T`` over ``rows`` rows."""
    x = torch.randn(rows, w.shape[1])
    return statistics.median(timed(lambda: x @ w.T, repeats)[0])


def measure(name: str, m: int, k: int, repeats: int, rate: float, widen: float | None) -> dict:
    g = torch.Generator().manual_seed(0)
    w16 = (torch.randn(m, k, generator=g) * 0.02).half().float()  # fp16-exact: packed as fp16
    fp32 = m * k <= FP32_MAX_PARAMS
    w32 = w16 + 1e-7 * torch.randn(m, k, generator=g) if fp32 else None  # not fp16-exact
    reps = max(5, int(repeats * min(1.0, (2 << 20) / (m * k))) if m * k > (2 << 20) else repeats)
    _, half, nbytes = native(w16, 1, 2)
    assert half, "an fp16-exact weight must pack as fp16"
    bw = best_bandwidth(nbytes)
    out = {"out_features": m, "in_features": k, "params": m * k, "packed_bytes": nbytes,
           "read_bandwidth_GBps": bw / 1e9, "bandwidth_bound_us": nbytes / bw * 1e6,
           "widening_bound_us": nbytes / widen * 1e6 if widen else None, "rows": {}}
    for n in ROWS:
        progress(f"{name}: {n} rows ...")
        t16, _, _ = native(w16, n, reps)
        row = {"fp16_us": t16 * 1e6, "compute_bound_us": 2 * m * k * n / rate * 1e6,
               "torch_fp32_us": torch_matmul(w16, n, reps) * 1e6}
        row["bound_us"] = max(out["bandwidth_bound_us"], row["compute_bound_us"])
        row["fp16_over_bound"] = row["fp16_us"] / row["bound_us"]
        row["fp16_GFLOPs"] = 2 * m * k * n / t16 / 1e9
        if fp32:
            t32, half32, nbytes32 = native(w32, n, reps)
            assert not half32 and nbytes32 == 2 * nbytes
            row["fp32_packed_us"] = t32 * 1e6
        out["rows"][str(n)] = row
    a, b = fit(list(FIT_ROWS), [out["rows"][str(n)]["fp16_us"] for n in FIT_ROWS])
    out["fit_us"] = {"a": a, "b": b}
    out["a_over_bandwidth_bound"] = a / out["bandwidth_bound_us"]
    out["b_over_compute_per_row"] = b / (2 * m * k / rate * 1e6)
    if out["widening_bound_us"]:
        out["a_over_widening_bound"] = a / out["widening_bound_us"]
        r6 = out["rows"]["6"]
        if "fp32_packed_us" in r6:  # the same FMAs: what widening adds to them
            out["fp16_minus_fp32_at_6_over_widening_bound"] = \
                (r6["fp16_us"] - r6["fp32_packed_us"]) / out["widening_bound_us"]
    return out


def table(result: dict) -> str:
    m = result["machine"]
    ext = ", ".join(v for v in m.get("vector_extensions", []) if v in ("avx2", "avx512f", "avx512_bf16", "f16c"))
    lines = [f"The native linear kernel alone ({m['cpu']}, {ext}; {result['threads']} threads; fp32 GEMM "
             f"{result['gemm_GFLOPs']:.0f} GFLOP/s"
             + (f"; float16 widened at {result['widening_GBps']:.1f} GB/s" if result.get("widening_GBps") else "")
             + "): microseconds per product over N rows, fp16-packed weights "
             "(widened in registers), and time over max(bandwidth bound, compute bound):", "",
             "| weights | packed | read bandwidth there | " + " | ".join(f"N={n}" for n in ROWS) + " |",
             "|---|---|---|" + "---|" * len(ROWS)]
    for name, s in result["shapes"].items():
        lines.append(f"| {name} ({s['params'] / 1e6:.1f}M) | {s['packed_bytes'] / 1e6:.1f} MB | "
                     f"{s['read_bandwidth_GBps']:.0f} GB/s | "
                     + " | ".join(f"{s['rows'][str(n)]['fp16_us']:.0f} ({s['rows'][str(n)]['fp16_over_bound']:.2f})"
                                  for n in ROWS) + " |")
    lines += ["", "Fit over one register block (N = 1-6): t(N) = a + b N, against the bounds; torch fp32 "
              "`x @ W.T` and the kernel on fp32-packed weights (twice the bytes, no widening) at N = 1 and 6; "
              "the widening bound, and what fp16 packing adds to fp32 packing's time at N = 6 over it:", "",
              "| weights | a (us) | a / bandwidth bound | b (us a row) | b / compute bound a row | "
              "torch N=1 | torch N=6 | fp32-packed N=1 | fp32-packed N=6 | widening bound (us) | "
              "a / widening bound | (fp16 - fp32-packed) at N=6 / widening bound |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, s in result["shapes"].items():
        r1, r6 = s["rows"]["1"], s["rows"]["6"]
        f32 = (f"{r1['fp32_packed_us']:.0f} | {r6['fp32_packed_us']:.0f}" if "fp32_packed_us" in r1 else " | ")
        wb = s.get("widening_bound_us")
        extra = s.get("fp16_minus_fp32_at_6_over_widening_bound")
        widen = " | ".join([f"{wb:.0f}", f"{s['a_over_widening_bound']:.2f}", f"{extra:.2f}" if extra is not None else ""]
                           if wb else ["n/a", "", ""])
        lines.append(f"| {name} | {s['fit_us']['a']:.0f} | {s['a_over_bandwidth_bound']:.2f} | {s['fit_us']['b']:.1f} | "
                     f"{s['b_over_compute_per_row']:.2f} | {r1['torch_fp32_us']:.0f} | {r6['torch_fp32_us']:.0f} | {f32} | "
                     f"{widen} |")
    return "\n".join(lines) + "\n"


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["shapes"])
    fig, axes = plt.subplots(1, len(names), figsize=(5 * len(names), 4.2))
    for ax, name in zip(axes, names):
        s = result["shapes"][name]
        rows = [s["rows"][str(n)] for n in ROWS]
        ax.plot(ROWS, [r["fp16_us"] for r in rows], marker="o", color="#1f77b4", label="native, fp16 widened")
        if "fp32_packed_us" in rows[0]:
            ax.plot(ROWS, [r["fp32_packed_us"] for r in rows], marker="s", color="#ff7f0e", label="native, fp32 packed")
        ax.plot(ROWS, [r["torch_fp32_us"] for r in rows], marker="^", color="#2ca02c", label="torch x @ W.T (fp32)")
        ax.plot(ROWS, [r["bound_us"] for r in rows], color="gray", ls="--", label="max(bandwidth, compute bound)")
        a, b = s["fit_us"]["a"], s["fit_us"]["b"]
        if b > 0:  # (flat when the weights stream from DRAM: the FMAs hide under the stream)
            ax.plot(FIT_ROWS, [a + b * n for n in FIT_ROWS], color="black", lw=0.8, ls=":", label=f"fit a + bN (a={a:.0f}, b={b:.0f})")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("rows (tree nodes)")
        ax.set_ylabel("microseconds per product")
        ax.set_title(f"{name}: {s['packed_bytes'] / 1e6:.1f} MB fp16")
        ax.legend(fontsize=7)
    fig.suptitle(f"{result['machine']['cpu']} ({result['machine'].get('isa', '')}), {result['threads']} threads")
    fig.tight_layout()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--threads", type=int, default=2, help="threads for the kernel and torch (default 2)")
    ap.add_argument("--repeats", type=int, default=40, help="calls per point on small weights (fewer on large)")
    ap.add_argument("--out", default="linear_cpu.json", help="file name under bench/results/ (default linear_cpu.json)")
    args = ap.parse_args(argv)
    if args.threads < 1 or args.repeats < 3:
        raise ValueError(f"--threads must be >= 1 and --repeats >= 3, got {args.threads} and {args.repeats}")
    torch.set_num_threads(args.threads)
    progress("measuring the GEMM rate ...")
    rate = best_gemm_rate()
    widen = widening_rate(3)
    result = {"benchmark": "native linear kernel", "machine": machine(), "threads": args.threads,
              "gemm_GFLOPs": rate / 1e9, "widening_GBps": widen / 1e9 if widen else None, "shapes": {}}
    for name, m, k in SHAPES:
        result["shapes"][name] = measure(name, m, k, args.repeats, rate, widen)
    publish(result, table(result), args.out)
    png = plot_path(args.out, "linear_cpu.json", "linear")
    plot(result, png)
    print(f"saved {png}")
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
