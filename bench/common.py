"""Shared benchmark plumbing: machine description, timing, JSON output."""
from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time


def machine() -> dict:
    """What ran the benchmark: CPU model, cores, memory, versions."""
    cpu = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((ln for ln in f if ln.startswith("flags")), "")
    except OSError:
        pass
    isa = "avx512" if "avx512f" in flags else ("avx2" if "avx2" in flags else "baseline")
    mem_gb = None
    try:
        mem_gb = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError):
        pass
    import torch

    info = {"cpu": cpu, "isa": isa, "cores": os.cpu_count(), "memory_gib": mem_gb,
            "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
            "torch_threads": torch.get_num_threads(), "python": sys.version.split()[0],
            "torch": torch.__version__, "platform": platform.platform()}
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    try:
        info["git_commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                            text=True, cwd=os.path.dirname(__file__)).stdout.strip()
    except OSError:
        pass
    return info


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def timed(fn, repeats: int, warmup: int = 1) -> tuple[list[float], object]:
    """Run ``fn`` warmup + repeats times; return the repeat wall times (s) and the last result."""
    out = None
    for _ in range(warmup):
        out = fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return times, out


def save(result: dict, name: str) -> str:
    out_dir = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, name)
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
    return path


def progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def add_model_and_prompt_args(ap) -> None:
    """The options every end-to-end benchmark shares: which checkpoints, which prompts, how long."""
    ap.add_argument("--oracle", help="oracle checkpoint directory (default: the demo pair)")
    ap.add_argument("--draft", help="draft checkpoint directory")
    ap.add_argument("--ngram", help="n-gram table for the staged strategy")
    ap.add_argument("--prompt-sets", nargs="+", default=["stdlib", "humaneval"],
                    help="stdlib, humaneval, or paths to JSONL files with a 'prompt' field")
    ap.add_argument("--limit", type=int, default=None, help="first N prompts of each set")
    ap.add_argument("--new-tokens", type=int, default=128)


def fmt(x, unit: str = "", digits: int = 2) -> str:
    """A table cell: empty for None, else the number with ``digits`` decimals and ``unit``."""
    return "" if x is None else f"{x:.{digits}f}{unit}"
