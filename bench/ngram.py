"""Benchmark the n-gram draft model: build throughput, topk / propose / update latency.

Corpus: by default the Python standard library's own sources (sysconfig 'stdlib' path, no
site-packages), one document per file, tokenized by a simple regex splitter (newline+indent
runs, space runs, words, single punctuation characters) with a vocabulary of the 50,256 most
frequent pieces plus one <unk> id, so ids span a GPT-2-sized range. With --tokenizer the same
files (or --corpus DIR) are tokenized with that tokenizer.json instead.

    python bench/ngram.py                                   # stdlib, regex tokens
    python bench/ngram.py --tokenizer path/to/tokenizer.json [--corpus DIR]
    python bench/ngram.py --quick                           # smaller, for a smoke run

Latencies are per call from Python (the call path a drafter uses: a Python list in, Python
lists out) over many different contexts: the median over chunks of 50 calls, the mean CPU time,
and single-call percentiles. Builds report wall and process CPU time: on a shared machine the
wall time also counts other processes' turns, while this code is single-threaded, so CPU time
is what a quiet machine's wall time would be. Results go to bench/results/ngram.json (see
--out) with the machine (load average included) and versions.
"""
from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import platform
import random
import re
import statistics
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
from common import machine, run_main

from staged_engine import ngram as ngram_mod
from staged_engine.ngram import NGramModel

PIECE = re.compile(r"\n[ \t]*|[ \t]+|\w+|[^\w\s]|\s")
PAPER_WIDTHS = [12, 7, 4, 1, 1, 1]
TARGETS = {"build_tokens_per_s": 5e6, "propose_median_us": 10.0}


# ----------------------------------------------------------------------------------------------
# Corpus


def stdlib_files(limit: int | None) -> tuple[str, list[Path]]:
    root = Path(sysconfig.get_path("stdlib"))
    files = sorted(p for p in root.rglob("*.py")
                   if "site-packages" not in p.parts and "dist-packages" not in p.parts)
    return str(root), files[:limit] if limit else files


def regex_corpus(files: list[Path], vocab_size: int) -> tuple[list[np.ndarray], int]:
    """Documents of ids: the vocab_size-1 most frequent regex pieces, the rest -> <unk>."""
    texts = [p.read_text(encoding="utf-8", errors="replace") for p in files]
    pieces = [PIECE.findall(t) for t in texts]
    freq = collections.Counter(p for doc in pieces for p in doc)
    vocab = {p: i for i, (p, _) in enumerate(freq.most_common(vocab_size - 1))}
    unk = len(vocab)
    docs = [np.fromiter((vocab.get(p, unk) for p in doc), dtype=np.int64, count=len(doc))
            for doc in pieces]
    return docs, unk + 1


def tokenizer_corpus(files: list[Path], tokenizer_path: str) -> tuple[list[np.ndarray], int]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(tokenizer_path)
    docs = []
    for i in range(0, len(files), 64):
        texts = [p.read_text(encoding="utf-8", errors="replace") for p in files[i:i + 64]]
        docs += [np.asarray(e.ids, dtype=np.int64)
                 for e in tok.encode_batch(texts, add_special_tokens=False)]
    return docs, tok.get_vocab_size(with_added_tokens=True)


# ----------------------------------------------------------------------------------------------
# Timing helpers


def time_calls(fn: Callable[[Any], Any], args: list[Any], repeats: int,
               chunk: int = 50) -> dict[str, float]:
    """Per-call microseconds of fn over args (different contexts).

    median_us: median over chunks of `chunk` consecutive calls (repeated `repeats` times) of
    the chunk's wall time / chunk; a chunk that the scheduler interrupted is an outlier, not
    the median. cpu_mean_us: process CPU time / calls over all chunks. single_p50 / p99: each
    call timed alone (perf_counter_ns; includes ~0.05 us of timer overhead).
    """
    for a in args[:200]:  # warm-up
        fn(a)
    per_call = []
    calls = 0
    cpu0 = time.process_time()
    for _ in range(repeats):
        for i in range(0, len(args) - chunk + 1, chunk):
            part = args[i:i + chunk]
            t0 = time.perf_counter()
            for a in part:
                fn(a)
            per_call.append((time.perf_counter() - t0) / chunk * 1e6)
            calls += chunk
    cpu_us = (time.process_time() - cpu0) / calls * 1e6
    single = []
    clock = time.perf_counter_ns
    for a in args:
        t0 = clock()
        fn(a)
        single.append(clock() - t0)
    single.sort()
    return {"median_us": round(statistics.median(per_call), 3), "cpu_mean_us": round(cpu_us, 3),
            "single_p50_us": round(single[len(single) // 2] / 1e3, 3),
            "single_p99_us": round(single[int(len(single) * 0.99)] / 1e3, 3),
            "calls": calls, "chunk": chunk}


def contexts(docs: list[np.ndarray], n: int, length: int, vocab: int, seen: bool,
             rng: random.Random) -> list[list[int]]:
    """Python-list contexts: corpus windows (seen) or random ids (mostly unseen)."""
    out = []
    while len(out) < n:
        if seen:
            d = docs[rng.randrange(len(docs))]
            if len(d) <= length:
                continue
            end = rng.randrange(length, len(d))
            out.append(d[end - length:end].tolist())
        else:
            out.append([rng.randrange(vocab) for _ in range(length)])
    return out


def versions() -> dict[str, Any]:
    out: dict[str, Any] = {"python": platform.python_version(), "numpy": np.__version__,
                           "ngram_format": ngram_mod.FORMAT_VERSION,
                           "ngram_extension_built": ngram_mod.cpp_available()}
    for name in ("torch", "tokenizers"):
        try:
            out[name] = __import__(name).__version__
        except ImportError:
            out[name] = None
    try:
        import subprocess

        root = Path(__file__).resolve().parents[1]
        out["git_commit"] = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True,
                                           text=True, cwd=root).stdout.strip() or None
        measured = ["csrc", "staged_engine/ngram.py", "bench/ngram.py"]
        out["measured_code_uncommitted"] = bool(subprocess.run(
            ["git", "status", "--porcelain", "--", *measured], capture_output=True, text=True,
            cwd=root).stdout.strip())
    except OSError:
        out["git_commit"] = None
    return out


# ----------------------------------------------------------------------------------------------
# Benchmarks


def bench_build(docs: list[np.ndarray], vocab: int, orders: list[int], repeats: int,
                n_tokens: int) -> list[dict[str, Any]]:
    rows = []
    configs = [(o, None, 1) for o in orders] + [(3, 32, 2)]
    for order, top_m, min_count in configs:
        times, cpu_times = [], []
        model = None
        for _ in range(repeats):
            model = None
            t0, c0 = time.perf_counter(), time.process_time()
            model = NGramModel.build(docs, order=order, vocab_size=vocab, top_m=top_m,
                                     min_count=min_count, backend="cpp")
            times.append(time.perf_counter() - t0)
            cpu_times.append(time.process_time() - c0)
        med, cpu_med = statistics.median(times), statistics.median(cpu_times)
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "m.ngram")
            t0 = time.perf_counter()
            model.save(path)
            t_save = time.perf_counter() - t0
            size = os.path.getsize(path)
            t0 = time.perf_counter()
            NGramModel.load(path, backend="cpp")
            t_load = time.perf_counter() - t0
        rows.append({"order": order, "top_m": top_m, "min_count": min_count, "backend": "cpp",
                     "input": "list of int64 numpy arrays (one per file)",
                     "seconds_median": round(med, 4), "seconds_all": [round(t, 4) for t in times],
                     "cpu_seconds_median": round(cpu_med, 4),
                     "tokens_per_s": round(n_tokens / med),
                     "tokens_per_cpu_s": round(n_tokens / cpu_med),
                     "tokens_per_s_best": round(n_tokens / min(times)),
                     "num_contexts": model.num_contexts,
                     "num_entries": model.num_entries, "file_bytes": size,
                     "save_seconds": round(t_save, 3), "load_seconds": round(t_load, 3)})
        print(f"build  order {order} top_m {top_m} min_count {min_count}: {med:.3f} s wall "
              f"({n_tokens / med / 1e6:.1f} M tokens/s; best {n_tokens / min(times) / 1e6:.1f}), "
              f"{cpu_med:.3f} s CPU ({n_tokens / cpu_med / 1e6:.1f} M tokens/CPU-s), "
              f"{model.num_contexts} contexts, "
              f"file {size / 1e6:.1f} MB (save {t_save:.2f} s, load {t_load:.2f} s)", flush=True)
    # the same build from plain Python lists (conversion included)
    lists = [d.tolist() for d in docs]
    t0, c0 = time.perf_counter(), time.process_time()
    NGramModel.build(lists, order=3, vocab_size=vocab, backend="cpp")
    t, c = time.perf_counter() - t0, time.process_time() - c0
    rows.append({"order": 3, "top_m": None, "min_count": 1, "backend": "cpp",
                 "input": "list of Python int lists (conversion included)",
                 "seconds_median": round(t, 4), "cpu_seconds_median": round(c, 4),
                 "tokens_per_s": round(n_tokens / t), "tokens_per_cpu_s": round(n_tokens / c)})
    print(f"build  order 3 from Python lists: {t:.3f} s wall, {c:.3f} s CPU "
          f"({n_tokens / c / 1e6:.1f} M tokens/CPU-s)")
    return rows


def bench_queries(model: NGramModel, docs: list[np.ndarray], vocab: int, n_ctx: int,
                  repeats: int, label: str) -> dict[str, list[dict[str, Any]]]:
    rng = random.Random(0)
    out: dict[str, list[dict[str, Any]]] = {"topk": [], "propose": [], "update": []}
    ctx_len = 16  # a drafter passes a longer context; only its last order-1 ids are read
    for seen in (True, False):
        ctxs = contexts(docs, n_ctx, ctx_len, vocab, seen, rng)
        kind = "seen" if seen else "random"
        for k in (1, 4, 12):
            r = time_calls(lambda c, k=k: model.topk(c, k), ctxs, repeats)
            r.update(order=model.order, k=k, contexts=kind, backend=model.backend, model=label)
            out["topk"].append(r)
            print(f"topk   {label} k={k:<2} {kind:6}: {r['median_us']:.2f} us/call "
                  f"(CPU {r['cpu_mean_us']:.2f}; single p50 {r['single_p50_us']:.2f}, "
                  f"p99 {r['single_p99_us']:.2f})")
        r = time_calls(lambda c: model.propose(c, PAPER_WIDTHS), ctxs, repeats)
        nodes = statistics.mean(len(model.propose(c, PAPER_WIDTHS)[0]) for c in ctxs[:500])
        r.update(order=model.order, widths=PAPER_WIDTHS, contexts=kind, backend=model.backend,
                 mean_nodes=round(nodes, 2), model=label)
        out["propose"].append(r)
        print(f"propose {label} {PAPER_WIDTHS} {kind:6}: {r['median_us']:.2f} us/call "
              f"(CPU {r['cpu_mean_us']:.2f}; single p50 {r['single_p50_us']:.2f}, "
              f"p99 {r['single_p99_us']:.2f}), "
              f"{nodes:.1f} nodes")
    # online update: 8 new tokens with their preceding context (a drafter's accepted chunk)
    chunks = [(c[:3], c[3:]) for c in contexts(docs, n_ctx, 11, vocab, True, rng)]
    r = time_calls(lambda a: model.update(a[1], context=a[0]), chunks, 1)
    r.update(order=model.order, tokens_per_call=8, backend=model.backend, model=label)
    out["update"].append(r)
    print(f"update {label} 8 tokens: {r['median_us']:.2f} us/call (CPU {r['cpu_mean_us']:.2f}; "
          f"single p50 {r['single_p50_us']:.2f}, p99 {r['single_p99_us']:.2f})")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokenizer", help="tokenizer.json to tokenize the corpus with")
    ap.add_argument("--corpus", help="directory of .py files (default: the Python stdlib)")
    ap.add_argument("--orders", type=int, nargs="+", default=[2, 3, 4])
    ap.add_argument("--repeats", type=int, default=5, help="build / latency repeats")
    ap.add_argument("--contexts", type=int, default=5000, help="contexts per latency loop")
    ap.add_argument("--quick", action="store_true", help="300 files, fewer repeats")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "ngram.json"))
    args = ap.parse_args()
    if ngram_mod._ngram is None:
        sys.exit("staged_engine._ngram is not built: pip install --no-build-isolation -e .")
    limit = 300 if args.quick else None
    repeats = 2 if args.quick else args.repeats

    t0 = time.perf_counter()
    if args.corpus:
        root, files = args.corpus, sorted(Path(args.corpus).rglob("*.py"))[:limit]
    else:
        root, files = stdlib_files(limit)
    if args.tokenizer:
        docs, vocab = tokenizer_corpus(files, args.tokenizer)
        tokenization = f"tokenizer.json: {args.tokenizer}"
    else:
        docs, vocab = regex_corpus(files, 50257)
        tokenization = "regex pieces (newline+indent, spaces, words, punctuation), top 50256 + <unk>"
    n_tokens = int(sum(len(d) for d in docs))
    t_tok = time.perf_counter() - t0
    print(f"corpus {root}: {len(files)} files, {n_tokens / 1e6:.2f} M tokens, vocab {vocab} "
          f"({t_tok:.1f} s to tokenize)", flush=True)

    result: dict[str, Any] = {
        "benchmark": "ngram", "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": machine(), "versions": versions(),
        "corpus": {"root": root, "files": len(files), "tokens": n_tokens, "vocab_size": vocab,
                   "tokenization": tokenization, "tokenize_seconds": round(t_tok, 1)},
        "targets": TARGETS,
    }
    result["build"] = bench_build(docs, vocab, args.orders, repeats, n_tokens)

    queries: dict[str, list[dict[str, Any]]] = {"topk": [], "propose": [], "update": []}
    for order in (3, 4):
        model = NGramModel.build(docs, order=order, vocab_size=vocab, backend="cpp")
        for key, rows in bench_queries(model, docs, vocab, args.contexts, repeats,
                                       f"order{order}").items():
            queries[key] += rows
    # the pure-Python fallback on a slice of the corpus, for comparison
    sub = docs[: max(1, len(docs) // 20)]
    sub_tokens = int(sum(len(d) for d in sub))
    t0, c0 = time.perf_counter(), time.process_time()
    py_model = NGramModel.build(sub, order=3, vocab_size=vocab, backend="python")
    t_py, c_py = time.perf_counter() - t0, time.process_time() - c0
    print(f"build  python backend order 3: {sub_tokens / c_py / 1e6:.2f} M tokens/CPU-s "
          f"({sub_tokens} tokens)")
    result["build"].append({"order": 3, "backend": "python", "tokens": sub_tokens,
                            "input": "list of int64 numpy arrays (first 5% of the files)",
                            "seconds_median": round(t_py, 3), "cpu_seconds_median": round(c_py, 3),
                            "tokens_per_s": round(sub_tokens / t_py),
                            "tokens_per_cpu_s": round(sub_tokens / c_py)})
    for key, rows in bench_queries(py_model, sub, vocab, min(args.contexts, 2000), 2,
                                   "order3-python-subset").items():
        queries[key] += rows
    result.update(queries)

    cpp_builds = [r for r in result["build"]
                  if r["backend"] == "cpp" and r["input"].startswith("list of int64")]
    cpp_propose = [r for r in result["propose"] if r["backend"] == "cpp"]
    result["meets_targets"] = {
        "build_tokens_per_s_wall": all(r["tokens_per_s"] >= TARGETS["build_tokens_per_s"]
                                       for r in cpp_builds),
        "build_tokens_per_cpu_s": all(r["tokens_per_cpu_s"] >= TARGETS["build_tokens_per_s"]
                                      for r in cpp_builds),
        "propose_median_us": all(r["median_us"] <= TARGETS["propose_median_us"]
                                 for r in cpp_propose),
    }
    result["machine"]["loadavg_at_end"] = list(os.getloadavg())
    print(f"targets: {result['meets_targets']}")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    sys.exit(run_main(main))
