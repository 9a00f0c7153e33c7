"""Kernel microbenchmarks: tree attention, KV append, KV commit, tree verification.

On CUDA each Triton kernel is timed with ``triton.testing.do_bench`` (median) against the
torch paths it replaces, measured in the same run:

    tree attention   vs  SDPA with an explicit (B, 1, N, span) bool mask (TorchBackend's path)
                     vs  the naive torch path (Q K^T, masked softmax, P V; tree_attention_ref)
    KV append        vs  torch view/permute + slice assignment (kv_append_ref)
    KV commit        vs  torch advanced indexing over the whole (L, B, H, S, D) cache
    tree verify      vs  torch choice (sampling.py's rule) + the walk in Python

and every figure is also given as achieved GB/s (bytes the operation must move / time), next to
the measured device copy bandwidth (a large tensor copy: read + write).

On a machine without CUDA the Triton kernels do not run (the interpreter is for tests only), so
the script times the torch paths alone with time.perf_counter (warm-up excluded, median of
--repeats) and says so in its output and JSON.

Results go to bench/results/kernels_<device>.json (machine, versions, config, every figure).

    python bench/kernels.py                 # full grid on the default device
    python bench/kernels.py --quick         # a small grid (a minute on a laptop CPU)
    python bench/kernels.py --interpret     # CPU smoke test of the Triton code path (tiny
                                            # sizes, interpreter; timings meaningless)
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

from common import run_main

_DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}


def _ints(text: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from exc
    if not vals or min(vals) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return vals


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="bench/kernels.py",
        description="Microbenchmarks of the Triton kernels (tree attention, KV append / commit, "
                    "tree verify) against the torch paths they replace. On CUDA: do_bench medians "
                    "and GB/s against the measured copy bandwidth. Without CUDA: the torch paths "
                    "only (perf_counter medians). Writes bench/results/kernels_<device>.json.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="auto = cuda when available")
    p.add_argument("--dtype", choices=["auto", *sorted(_DTYPES)], default="auto",
                   help="element type; auto = bf16 on CUDA, fp32 on CPU")
    p.add_argument("--heads", type=int, default=20, help="attention heads H (GPT-2 L: 20)")
    p.add_argument("--head-dim", type=int, default=64, help="head dim D (GPT-2: 64)")
    p.add_argument("--layers", type=int, default=36, help="layers L of the cache for KV commit")
    p.add_argument("--vocab", type=int, default=50257, help="vocabulary V for tree verify")
    p.add_argument("--prefixes", type=_ints, default=[128, 512, 2048, 8192],
                   help="committed prefix lengths")
    p.add_argument("--nodes", type=_ints, default=[1, 8, 32, 128], help="new tokens / tree nodes N")
    p.add_argument("--repeats", type=int, default=5, help="timed repeats per figure on CPU")
    p.add_argument("--quick", action="store_true",
                   help="small grid: prefixes 128,1024; nodes 1,16; 6 layers; V = 8192")
    p.add_argument("--interpret", action="store_true",
                   help="run the Triton kernels on CPU under TRITON_INTERPRET=1 at tiny sizes: a "
                        "smoke test of this script's Triton path; the timings mean nothing")
    p.add_argument("--out", type=Path, default=None,
                   help="JSON path (default bench/results/kernels_<device>.json; --interpret writes "
                        "nothing unless given)")
    args = p.parse_args(argv)
    if args.quick:
        args.prefixes, args.nodes, args.layers, args.vocab = [128, 1024], [1, 16], 6, 8192
    if args.interpret:
        if args.device == "cuda":
            p.error("--interpret runs on CPU; drop --device cuda")
        args.device = "cpu"
        args.prefixes, args.nodes, args.layers, args.vocab = [70], [1, 9], 2, 3000
        args.heads, args.repeats = 2, 1
        os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton
    for name in ("heads", "head_dim", "layers", "vocab", "repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


# ---------------------------------------------------------------------------------------------

class Timer:
    """ms per call: do_bench median on CUDA, perf_counter median elsewhere."""

    def __init__(self, device, repeats: int) -> None:
        self.cuda = device.type == "cuda"
        self.repeats = repeats

    def __call__(self, fn: Callable[[], object]) -> float:
        if self.cuda:
            from triton.testing import do_bench

            return float(do_bench(fn, warmup=25, rep=100, return_mode="median"))
        fn()  # warm-up
        times = []
        for _ in range(self.repeats):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)


def _gbps(nbytes: int, ms: float) -> float:
    return nbytes / (ms * 1e-3) / 1e9


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _machine(torch, device) -> dict:
    info = {"platform": platform.platform(), "processor": _cpu_name(),
            "cpu_count": os.cpu_count(), "device": str(device)}
    if device.type == "cuda":
        prop = torch.cuda.get_device_properties(device)
        info.update(gpu=prop.name, sm_count=prop.multi_processor_count,
                    gpu_memory_GiB=round(prop.total_memory / 2**30, 1),
                    capability=".".join(map(str, torch.cuda.get_device_capability(device))))
    return info


def _versions(torch) -> dict:
    out = {"python": platform.python_version(), "torch": torch.__version__}
    try:
        import triton

        out["triton"] = triton.__version__
    except ImportError:
        out["triton"] = None
    if torch.version.cuda:
        out["cuda"] = torch.version.cuda
    return out


def _random_tree(n: int, gen) -> tuple[list[int], list[int]]:
    """Parents of a bushy random tree (like a best-first draft tree) and its depths."""
    import torch

    parents = [-1] + [int(torch.randint(max(0, i // 2 - 2), i, (1,), generator=gen)) for i in range(1, n)]
    depth = [0] * n
    for i in range(1, n):
        depth[i] = depth[parents[i]] + 1
    return parents, depth


def _tree_mask(parents: list[int], torch, device):
    n = len(parents)
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j >= 0:
            mask[i, j] = True
            j = parents[j]
    return mask.to(device)


def copy_bandwidth(torch, device, timer: Timer, small: bool) -> dict:
    nbytes = (8 if small else 512) * 2**20
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    ms = timer(lambda: dst.copy_(src))
    return {"bytes": nbytes, "ms": ms, "GBps": _gbps(2 * nbytes, ms)}


def bench_attention(args, torch, device, dtype, timer, run_triton) -> list[dict]:
    import torch.nn.functional as F
    from staged_engine.kernels.tree_attention import tree_attention_ref

    if run_triton:
        from staged_engine.kernels.tree_attention import tree_attention
    h, d, el = args.heads, args.head_dim, torch.tensor([], dtype=dtype).element_size()
    gen = torch.Generator().manual_seed(0)
    rows = []
    for prefix in args.prefixes:
        for n in args.nodes:
            s = prefix + n
            q = torch.randn(1, h, n, d, generator=gen).to(dtype).to(device)
            k = torch.randn(1, h, s, d, generator=gen).to(dtype).to(device)
            v = torch.randn(1, h, s, d, generator=gen).to(dtype).to(device)
            parents, _ = _random_tree(n, gen)
            tree = _tree_mask(parents, torch, device)  # (N, N)
            mask3 = tree[None].contiguous()  # (1, N, N)
            starts = torch.tensor([prefix], dtype=torch.int64, device=device)
            full = torch.zeros(1, 1, n, s, dtype=torch.bool, device=device)  # (B, 1, N, span)
            full[0, 0, :, :prefix] = True
            full[0, 0, :, prefix:] = tree
            scale = d ** -0.5
            impls = {
                "sdpa_mask": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=full, scale=scale),
                "naive": lambda: tree_attention_ref(q, k, v, starts, mask3, scale, upcast=False),
            }
            if run_triton:
                impls = {"triton": lambda: tree_attention(q, k, v, starts, mask3, scale,
                                                          max_prefix=prefix), **impls}
            nbytes = (2 * s * h * d + 2 * n * h * d) * el  # K, V read once; Q read, O written
            ms = {name: timer(fn) for name, fn in impls.items()}
            rows.append({"prefix": prefix, "nodes": n, "bytes": nbytes, "ms": ms,
                         "GBps": {k2: _gbps(nbytes, t) for k2, t in ms.items()}})
            _print_row("attention", f"prefix={prefix:5d} N={n:3d}", ms, rows[-1]["GBps"])
    return rows


def bench_append(args, torch, device, dtype, timer, run_triton) -> list[dict]:
    from staged_engine.kernels.kv_cache import kv_append_ref

    if run_triton:
        from staged_engine.kernels.kv_cache import kv_append
    h, d, el = args.heads, args.head_dim, torch.tensor([], dtype=dtype).element_size()
    slots = max(args.prefixes) + max(args.nodes)
    k = torch.zeros(1, h, slots, d, dtype=dtype, device=device)
    v = torch.zeros_like(k)
    rows = []
    for n in args.nodes:
        qkv = torch.randn(1, n, 3 * h * d).to(dtype).to(device)
        starts = torch.tensor([max(args.prefixes)], dtype=torch.int64, device=device)
        impls = {"torch": lambda: kv_append_ref(qkv, k, v, starts)}
        if run_triton:
            impls = {"triton": lambda: kv_append(qkv, k, v, starts, max_start=max(args.prefixes)),
                     **impls}
        nbytes = 2 * 3 * n * h * d * el  # qkv read, q / k / v written
        ms = {name: timer(fn) for name, fn in impls.items()}
        rows.append({"nodes": n, "bytes": nbytes, "ms": ms,
                     "GBps": {k2: _gbps(nbytes, t) for k2, t in ms.items()}})
        _print_row("kv_append", f"N={n:3d}", ms, rows[-1]["GBps"])
    return rows


def bench_commit(args, torch, device, dtype, timer, run_triton) -> list[dict]:
    from staged_engine.kernels.kv_cache import kv_commit_ref

    if run_triton:
        from staged_engine.kernels.kv_cache import kv_commit
    h, d, el = args.heads, args.head_dim, torch.tensor([], dtype=dtype).element_size()
    prefix = min(args.prefixes)
    slots = prefix + max(args.nodes)
    k = torch.zeros(args.layers, 1, h, slots, d, dtype=dtype, device=device)  # (L, B, H, S, D)
    v = torch.zeros_like(k)
    rows = []
    for n in args.nodes:
        m = max(1, min(n // 2, 8))  # accepted path length: a few nodes, spread over the tree
        path = [0] + [round(i * (n - 1) / max(1, m - 1)) for i in range(1, m)] if m > 1 else [0]
        path = sorted(set(path))
        t = lambda x: torch.tensor(x, dtype=torch.int64, device=device)  # noqa: E731
        rows_t, starts, path_t, plen = t([0]), t([prefix]), t([path]), t([len(path)])
        impls = {"torch": lambda: kv_commit_ref(k, v, rows_t, starts, path_t, plen)}
        if run_triton:
            impls = {"triton": lambda: kv_commit(k, v, rows_t, starts, path_t, plen), **impls}
        moved = sum(1 for i, p in enumerate(path) if p != i)
        nbytes = 2 * 2 * args.layers * h * moved * d * el  # k and v, read + write per moved slot
        ms = {name: timer(fn) for name, fn in impls.items()}
        rows.append({"nodes": n, "path_len": len(path), "moved": moved, "bytes": nbytes, "ms": ms,
                     "GBps": {k2: _gbps(nbytes, t2) for k2, t2 in ms.items()} if nbytes else {}})
        _print_row("kv_commit", f"N={n:3d} path={len(path)}", ms, rows[-1]["GBps"])
    return rows


def bench_verify(args, torch, device, dtype, timer, run_triton) -> list[dict]:
    from staged_engine.kernels.verify import verify_tree_ref

    from staged_engine.sampling import noise_key

    if run_triton:
        from staged_engine.kernels.verify import unpack_verify, verify_tree
    el = torch.tensor([], dtype=dtype).element_size()
    gen = torch.Generator().manual_seed(1)
    rows = []
    for n in args.nodes:
        parents, depth = _random_tree(n, gen)
        logits = torch.randn(n, args.vocab, generator=gen).to(dtype).to(device)
        tokens = torch.randint(0, args.vocab, (n,), generator=gen)
        t = lambda x: torch.as_tensor(x, dtype=torch.int64).to(device)  # noqa: E731
        tokens_t, parents_t = t(tokens), t(parents)
        keys = t([noise_key(1234, 100 + dd + 1) for dd in depth])
        for temperature in (0.0, 1.0):
            impls = {"torch": lambda: verify_tree_ref(logits, tokens_t, parents_t, keys, temperature).tolist()}
            if run_triton:
                impls = {"triton": lambda: unpack_verify(verify_tree(logits, tokens_t, parents_t, keys,
                                                                     temperature)), **impls}
            passes = 1 if temperature == 0 else 2
            nbytes = passes * n * args.vocab * el
            ms = {name: timer(fn) for name, fn in impls.items()}
            rows.append({"nodes": n, "temperature": temperature, "vocab": args.vocab, "bytes": nbytes,
                         "ms": ms, "GBps": {k2: _gbps(nbytes, t2) for k2, t2 in ms.items()}})
            _print_row("verify", f"N={n:3d} T={temperature}", ms, rows[-1]["GBps"])
    return rows


_COPY_GBPS = [0.0]  # the run's measured copy bandwidth, for the printed percentages


def _print_row(kind: str, label: str, ms: dict, gbps: dict) -> None:
    ceiling = _COPY_GBPS[0] or float("inf")
    parts = "  ".join(f"{name} {t:8.3f} ms {gbps.get(name, 0):7.1f} GB/s "
                      f"({100 * gbps.get(name, 0) / ceiling:3.0f}%)" for name, t in ms.items())
    print(f"{kind:10s} {label:22s} {parts}", flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda but torch sees no CUDA device", file=sys.stderr)
        return 2
    device = torch.device(args.device)
    dtype_name = args.dtype if args.dtype != "auto" else ("bf16" if device.type == "cuda" else "fp32")
    dtype = getattr(torch, _DTYPES[dtype_name])
    run_triton = device.type == "cuda" or args.interpret
    if run_triton:
        try:
            import triton  # noqa: F401
        except ImportError:
            print("error: the Triton kernels need the triton package", file=sys.stderr)
            return 2
    if not run_triton:
        print("No CUDA device: timing the torch reference paths only (the Triton kernels run on "
              "CUDA; on CPU only under the test interpreter).", flush=True)
    elif args.interpret:
        print("--interpret: Triton kernels under the CPU interpreter at tiny sizes; timings are "
              "meaningless (smoke test of the Triton path).", flush=True)

    timer = Timer(device, args.repeats)
    copy = copy_bandwidth(torch, device, timer, small=args.interpret)
    _COPY_GBPS[0] = copy["GBps"]
    print(f"copy bandwidth {copy['GBps']:.1f} GB/s ({copy['bytes'] // 2**20} MiB read + write); "
          "(%) = achieved / copy bandwidth", flush=True)
    results = {
        "benchmark": "kernels",
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": _machine(torch, device),
        "versions": _versions(torch),
        "triton_kernels_timed": run_triton and not args.interpret,
        "note": ("torch reference paths only: no CUDA device" if not run_triton else
                 "interpreter smoke test: timings meaningless" if args.interpret else
                 "triton.testing.do_bench medians"),
        "config": {"dtype": dtype_name, "heads": args.heads, "head_dim": args.head_dim,
                   "layers": args.layers, "vocab": args.vocab, "prefixes": args.prefixes,
                   "nodes": args.nodes, "repeats": args.repeats if device.type != "cuda" else None,
                   "batch": 1, "threads": torch.get_num_threads()},
        "copy_bandwidth": copy,
    }
    with torch.inference_mode():
        results["attention"] = bench_attention(args, torch, device, dtype, timer, run_triton)
        results["kv_append"] = bench_append(args, torch, device, dtype, timer, run_triton)
        results["kv_commit"] = bench_commit(args, torch, device, dtype, timer, run_triton)
        results["verify"] = bench_verify(args, torch, device, dtype, timer, run_triton)
    for kind in ("attention", "kv_append", "kv_commit", "verify"):
        for row in results[kind]:
            row["fraction_of_copy"] = {k: g / copy["GBps"] for k, g in row["GBps"].items()}

    if args.interpret and args.out is None:
        print("--interpret: no JSON written (pass --out to keep it)")
        return 0
    out = args.out or (Path(__file__).resolve().parent / "results" / f"kernels_{device.type}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
