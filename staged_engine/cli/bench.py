"""``staged-engine bench NAME [args]``: run a benchmark script from the checkout's bench/."""
from __future__ import annotations

import argparse
import os
import subprocess
import sys

BENCHES = {
    "e2e": "e2e.py",  # the engine's strategies against HF generate / assisted / prompt lookup
    "plain-vs-hf": "plain_vs_hf.py",  # plain decoding vs HF generate on GPT-2 small/large shapes
    "kernels": "kernels.py",  # Triton kernel microbenchmarks (torch references on CPU)
    "ngram": "ngram.py",  # n-gram build throughput and query latency
    "forward-cost": "forward_cost.py",  # oracle forward time against tree nodes
    "sweep": "sweep.py",  # fixed shapes against the planned default and plain decoding
    "temperature": "temperature.py",  # tokens/s against temperature: plain, best fixed chain, planned
    "dsbd": "dsbd.py",  # DSBD against beam sampling
    "serve-load": "serve_load.py",  # concurrent clients against staged-engine serve
    "pair-quality": "pair_quality.py",  # the demo pair's bits per byte and agreement on held-out code
    "draft-rule": "draft_rule.py",  # how often the draft's sampled proposal is the oracle's token, by rule
    "roofline": "roofline.py",  # decode against bandwidth/compute bounds, HF generate and llama.cpp
    "linear": "linear.py",  # the native linear kernel alone against its bounds, 1-64 rows
    "working-set": "working_set.py",  # a pass against its context and after the other model's
    "kv-dtype": "kv_dtype.py",  # the oracle's K/V cache in float16 against float32, short and long contexts
    "weight-formats": "weight_formats.py",  # a bf16 checkpoint packed bfloat16 against float32, and float16
    "idle-gap": "idle_gap.py",  # a forward pass after idle time, against the same pass back to back
    "phases": "phases.py",  # where a forward pass goes: norms, products, attention, waits, by rows and context
    "widening": "widening.py",  # what a row costs over float16 weights: F16C's widening against the FMAs
    "plots": "plots.py",  # PNG plots of bench/results/*.json (needs matplotlib)
    "report": "report.py",  # README results section from bench/results/
}


def bench_dir() -> str:
    """bench/ of the source checkout this package runs from (staged_engine/cli/bench.py is two
    levels below the checkout's root)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return os.path.join(root, "bench")


def _run(args: argparse.Namespace) -> int:
    script = os.path.join(bench_dir(), BENCHES[args.name])
    if not os.path.isfile(script):
        raise FileNotFoundError(f"{script} not found: benchmarks run from a source checkout "
                                "(pip install --no-build-isolation -e .)")
    # A child interpreter: the script's own folder is its first import path (bench/common.py).
    return subprocess.call([sys.executable, script, *args.rest])


def register_cli(subparsers) -> None:
    p = subparsers.add_parser(
        "bench", help="run a benchmark (results go to bench/results/)",
        description="Run one of the benchmarks in bench/; pass its own options after the name "
                    "(`staged-engine bench e2e --help`). Without a name: the end-to-end comparison.")
    p.add_argument("name", nargs="?", default="e2e", choices=sorted(BENCHES), help="which benchmark (default e2e)")
    p.add_argument("rest", nargs=argparse.REMAINDER, help="options passed to the benchmark")
    p.set_defaults(func=_run)
