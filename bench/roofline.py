"""Roofline of the decode path, per model, everything measured in one run on this machine.

For each model (the demo oracle, the demo draft, a GPT-2-small-shaped checkpoint with random
fp16 weights, or ``--models DIR ...``; ``--bf16`` adds a copy of each stored in bfloat16):

- plain decoding, ms per token (forward passes only, as plain decoding runs them: greedy steps
  in native calls of 8, the median over 16 calls of their passes' seconds per step, after a
  64-token prompt) against the **weight-streaming bound**: the bytes of weights a token reads (NativeGPT2's
  packed linears and LM head) over the read bandwidth measured here on a buffer of the same size
  by a native probe that reads it as a weight stream is read (cache-resident when the weights
  fit the last-level cache), and over DRAM bandwidth (a 512 MiB buffer); also each round's
  decode against the bound of the probe run just before it, the median of those shares (the
  machine's state the same for both);
- an N-node pass (N = 1..64, a random tree below a 128-token prefix, on the engine's path:
  ``ModelRunner.forward_nodes``, one native call from lists) against the larger of its
  **bandwidth bound** (the weights and the float32 K/V cache the pass attends over, prefix and
  nodes, at that read bandwidth) and its **compute bound** (2 x weights x N FLOP for the
  products plus 4 x layers x width FLOP for each key a node scores and each value it weighs, at
  the fp32 GEMM rate torch's BLAS reaches here on a 1024^3 product); for models packed float16,
  also against the
  **widening bound** (their packed bytes at the rate a one-row product widens float16 to
  float32 from L1, each widened vector into its FMA: ``_cpu.widen_seconds``) plus the compute
  bound of the rows beyond the first: what the pass costs where the widening and the other rows'
  FMAs take turns on the same pipes (on the AVX2 Zen 1 they mostly do; a ratio under 1 shows
  them overlapping);
- a chain of N tokens (N = 1..8) below the same prefix, passes back to back in one native call
  (``NativeGPT2.region_passes``, the regime of plain decoding's steps and of fixed chains'
  rounds: no call from Python a pass, which the phases bench finds costing a one-row pass up to
  1.5x), against the same bounds;
- plain decoding tokens/s through the Engine against HF transformers ``generate`` (greedy, fp32)
  and against **llama.cpp** (``llama-bench -p 0 -n 128``) on the same checkpoint converted to
  GGUF at the same precision (f16 when the weights are fp16-exact, bf16 when bf16-exact), same
  thread count. llama.cpp is
  built once from the llama-cpp-python source package (bench/llamacpp.py); if it cannot be built
  or run here, the result says why and the rest is still measured.

Writes bench/results/roofline.json and bench/results/plots/roofline.png.

    python bench/roofline.py [--models DIR ...] [--threads 2] [--no-llama-cpp] [--no-hf]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time

import torch
from common import (
    checkpoint_dirs,
    machine,
    plot_path,
    progress,
    publish,
    result_path,
    round_to_bfloat16_,
    run_main,
)
from forward_cost import random_tree_mask

NODES = [1, 2, 4, 8, 16, 32, 64]
GPT2_SMALL = dict(vocab_size=50257, n_positions=1024, n_embd=768, n_layer=12, n_head=12)


def read_bandwidth(nbytes: int, repeats: int = 7) -> float:
    """Bytes/s of reading a buffer of ``nbytes`` (warm: a second pass onwards) on every thread,
    the median of ``repeats`` reads. The native probe (``_cpu.read_seconds``: vector loads into
    independent accumulators, as a weight stream is read); torch's sum where the extension is
    not built, which reads a cache-resident buffer at about half the rate (its reduction, not the
    caches, is then the limit, and a bound made from it is loose)."""
    from staged_engine.model.backend import _cpu

    if _cpu is not None and hasattr(_cpu, "read_seconds"):
        seconds = _cpu.read_seconds(max(nbytes, 4096), repeats + 1)[1:]
        return max(nbytes, 4096) // 4 * 4 / statistics.median(seconds)
    x = torch.ones(max(nbytes // 4, 1 << 16))
    x.sum()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - t0)
    return x.numel() * 4 / statistics.median(times)


def gemm_rate() -> float:
    """FLOP/s of a 1024^3 fp32 product with torch's BLAS at the current thread count."""
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    a @ b
    times = []
    for _ in range(7):
        t0 = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - t0)
    return 2 * 1024 ** 3 / statistics.median(times)


def widening_rate(tries: int = 1, nbytes: int = 8 << 20, repeats: int = 7) -> float | None:
    """Bytes/s of float16 weights widened to float32 on every thread with no weight stream to
    wait on (``_cpu.widen_seconds``: F16C's conversion in the vector form a one-row product uses,
    each widened vector into an FMA as there, from slices the L1 cache holds): the best of
    ``tries`` medians of ``repeats`` passes over ``nbytes``. A pass over fp16-packed weights
    cannot run faster than its weights widen, whatever the weight stream delivers. None where
    the extension is not built."""
    from staged_engine.model.backend import _cpu

    if _cpu is None or not hasattr(_cpu, "widen_seconds"):
        return None
    return max(nbytes / statistics.median(_cpu.widen_seconds(nbytes, repeats + 1)[1:]) for _ in range(tries))


def widening_reference(n: int, compute: float, bound_bw: float, bound_widen: float,
                       float32_from: int | None, kv_bw: float = 0.0, first_row: float = 0.0) -> float:
    """Seconds an ``n``-node pass of a float16-packed model costs where the widening and the FMAs
    take turns: its widening bound plus its compute bound less ``first_row``, the products' FMAs
    of one row, which the widening probe already runs (at least its bandwidth bound; results
    measured before the probe ran them have none); from ``float32_from`` rows on, where the pass
    reads the model's float32 packing instead (``TorchBackend.wide_rows``), twice the weight
    stream and no widening: the larger of that bandwidth bound (the K/V cache's ``kv_bw`` part of
    ``bound_bw`` read once) and the compute bound."""
    if float32_from is not None and n >= float32_from:
        return max(2 * bound_bw - kv_bw, compute)
    return max(bound_widen + compute - first_row, bound_bw)


def derive_widening_ratios(row: dict) -> None:
    """Each N-node pass of ``row`` (a model's result) over ``widening_reference``, from the row's
    own measurements (nothing for a model packed float32)."""
    if not row.get("widening_bound_ms"):
        return
    float32_from = (row.get("packing") or {}).get("float32_from_rows")
    row["float32_from_rows"] = float32_from
    for n, node in row["nodes"].items():
        node["ratio_to_widening_plus_compute"] = node["seconds"] / widening_reference(
            int(n), node["compute_bound_s"], node["bandwidth_bound_s"], row["widening_bound_ms"] / 1e3, float32_from,
            node.get("kv_bound_s", 0.0), node.get("row_compute_s", 0.0))


def gpt2_small_checkpoint(tokenizer_from: str) -> str:
    """A GPT-2-small-shaped checkpoint with random weights stored in fp16, made once and cached
    (llama.cpp's converter needs a tokenizer: the demo's, its vocabulary padded)."""
    from staged_engine.demo_pair import (
        cache_dir as engine_cache,  # $STAGED_ENGINE_CACHE, ~/.cache/staged-engine
    )

    root = engine_cache()
    path = os.path.join(root, "gpt2-small-shaped-random-fp16")
    if not os.path.isfile(os.path.join(path, "model.safetensors")):
        from transformers import GPT2Config, GPT2LMHeadModel

        progress("making a GPT-2-small-shaped checkpoint (random weights, fp16) ...")
        torch.manual_seed(0)
        model = GPT2LMHeadModel(GPT2Config(bos_token_id=0, eos_token_id=0, **GPT2_SMALL)).eval().half()
        model.save_pretrained(path + ".tmp")
        shutil.copy(os.path.join(tokenizer_from, "tokenizer.json"), os.path.join(path + ".tmp", "tokenizer.json"))
        os.replace(path + ".tmp", path)
    return path


def bf16_checkpoint(src: str) -> str:
    """``src`` stored in bfloat16 (``round_to_bfloat16_``), with its tokenizer, in the cache
    directory (named by a hash of its weights, so a retrained demo pair gets a new copy)."""
    import hashlib

    from staged_engine.demo_pair import cache_dir as engine_cache

    with open(os.path.join(src, "model.safetensors"), "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()[:12]
    path = os.path.join(engine_cache(), f"{os.path.basename(os.path.normpath(src))}-bf16-{digest}")
    if not os.path.isfile(os.path.join(path, "model.safetensors")):
        from transformers import GPT2LMHeadModel

        progress(f"making a bfloat16 copy of {src} ...")
        model = GPT2LMHeadModel.from_pretrained(src, dtype=torch.float32).eval()
        round_to_bfloat16_(model)
        model.to(torch.bfloat16).save_pretrained(path + ".tmp")
        if os.path.isfile(os.path.join(src, "tokenizer.json")):  # llama.cpp's converter needs it
            shutil.copy(os.path.join(src, "tokenizer.json"), os.path.join(path + ".tmp", "tokenizer.json"))
        if os.path.isdir(path):
            shutil.rmtree(path)
        os.replace(path + ".tmp", path)
    return path


def decode_ms(model, backend, steps: int = 128, prompt: int = 64, chunk: int = 8) -> float:
    """Median time of one plain decoding step's forward pass, as plain decoding runs it: greedy
    steps in native calls of ``chunk`` (``ModelRunner.steps``: a pass, the choice, fed back),
    the passes' own seconds per step (the choice is not a forward pass; llama-bench does not
    sample either). Off the native path, a Python ``step`` each, timed whole."""
    from staged_engine.model.runner import ModelRunner

    runner = ModelRunner(model, backend)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (prompt + steps,), generator=g).tolist()
    times = []
    with torch.inference_mode():
        runner.reset()
        runner.prefill(ids[:prompt])
        if runner.native is not None:
            root = ids[prompt]
            for _ in range(steps // chunk):
                before = runner.forward_seconds
                out = runner.steps(root, chunk, (0.0, 0, 1.0, 0))
                times.append((runner.forward_seconds - before) / len(out))
                root = out[-1]
            return statistics.median(times[1:])
        for t in ids[prompt:]:
            t0 = time.perf_counter()
            runner.step(t)
            times.append(time.perf_counter() - t0)
    return statistics.median(times[8:])


PREFIX = 128  # committed tokens below every N-node pass's tree


def node_curve(model, backend, prefix: int = PREFIX, repeats: int = 15) -> tuple[dict[int, float], dict[int, int]]:
    """Median wall time of an N-node pass (a random tree below a ``prefix``-token context) on the
    path the engine's rounds take: ``ModelRunner.forward_nodes`` (one native call from lists for
    a one-row cache), the pending entries discarded after each pass; and per N the keys the
    tree's nodes score in all (each node: the prefix, its ancestors and itself). The trees come
    from a fixed seed: the same every call."""
    from staged_engine.model.runner import ModelRunner

    runner = ModelRunner(model, backend)
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    out, keys = {}, {}
    with torch.inference_mode():
        runner.reset()
        runner.prefill(torch.randint(0, vocab, (prefix,), generator=g).tolist())
        for n in NODES:
            mask = random_tree_mask(n, g)
            toks = torch.randint(0, vocab, (n,), generator=g).tolist()
            pos = (prefix + mask.sum(1) - 1).tolist()
            times = []
            for r in range(repeats + 2):
                t0 = time.perf_counter()
                runner.forward_nodes(toks, pos, mask)
                times.append(time.perf_counter() - t0)
                runner.discard()
            out[n] = statistics.median(times[2:])
            keys[n] = n * prefix + int(mask.sum())
    return out, keys


CHAIN_NODES = [n for n in NODES if n <= 9]  # the most tokens a step region's pass takes (NativeGPT2::kStepRows)


def chain_curve(model, backend, prefix: int = PREFIX, repeats: int = 15, passes: int = 8) -> dict[int, float]:
    """Median seconds of a pass over a chain of N tokens below a ``prefix``-token context (N in
    ``CHAIN_NODES``), ``passes`` back to back in one native call (``NativeGPT2.region_passes``:
    the regime of plain decoding's steps and of fixed chains' rounds, no call from Python in
    between), the first pass of each call left out (it pays the threads' fork). Empty off the
    native path."""
    from staged_engine.model.runner import ModelRunner

    runner = ModelRunner(model, backend)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (prefix + max(CHAIN_NODES),), generator=g).tolist()
    out = {}
    with torch.inference_mode():
        runner.reset()
        runner.prefill(ids[:prefix])
        for n in CHAIN_NODES:
            times = []
            for r in range(repeats + 2):
                seconds = runner.region_passes(ids[prefix:prefix + n], passes)
                if seconds is None:  # off the native path
                    return {}
                if r >= 2:
                    times += seconds[1:]
            out[n] = statistics.median(times)
    return out


def chain_keys(n: int, prefix: int = PREFIX) -> int:
    """Keys a chain of n tokens below ``prefix`` committed ones scores in all: each token the
    prefix, the tokens before it and itself."""
    return n * prefix + n * (n + 1) // 2


def pass_bounds(n: int, keys: int, n_layer: int, n_embd: int, weight_bytes: float, flop_per_node: float,
                bandwidth: float, rate: float, prefix: int = PREFIX) -> dict:
    """The bounds of an ``n``-node pass below ``prefix`` committed tokens whose nodes score
    ``keys`` keys in all, at ``bandwidth`` bytes/s and ``rate`` FLOP/s. Besides the weights it
    reads the float32 K and V of every layer for the prefix and the nodes (``kv_bytes``), and
    besides the products' ``flop_per_node`` a node it computes 2 FLOP per key it scores and per
    value it weighs in each of the width's columns, in every layer (``attention_flop``): at the
    128-token prefix, for the demo oracle, 2.1 MB against 16.8 MB of weights and 1.1 MFLOP a
    node against 16.8. ``weights_bound_s``: the larger bound of the weights alone (the products',
    the only ones this bench counted before); ``row_compute_s``: the products' FMAs of one row
    (the part of the compute bound the widening probe runs too: ``widening_reference``)."""
    kv_bytes = 2 * n_layer * (prefix + n) * n_embd * 4
    attention_flop = 4 * n_layer * n_embd * keys
    return {"compute_bound_s": (flop_per_node * n + attention_flop) / rate,
            "bandwidth_bound_s": (weight_bytes + kv_bytes) / bandwidth, "kv_bound_s": kv_bytes / bandwidth,
            "kv_bytes": kv_bytes, "attention_flop": attention_flop, "row_compute_s": flop_per_node / rate,
            "weights_bound_s": max(flop_per_node * n / rate, weight_bytes / bandwidth)}


def engine_tokens_per_s(path: str, tokens: int = 128) -> float:
    from staged_engine import Engine

    eng = Engine.from_pretrained(oracle=path)
    ids = torch.randint(0, eng.config.vocab_size, (64,), generator=torch.Generator().manual_seed(1)).tolist()
    eng.generate(ids, max_new_tokens=8, strategy="plain", stop_at_eos=False)
    runs = [eng.generate(ids, max_new_tokens=tokens, strategy="plain", stop_at_eos=False).stats["tokens_per_second"]
            for _ in range(3)]
    return statistics.median(runs)


def hf_tokens_per_s(path: str, tokens: int = 128) -> float:
    from transformers import GPT2LMHeadModel

    model = GPT2LMHeadModel.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.randint(0, model.config.vocab_size, (1, 64), generator=torch.Generator().manual_seed(1))
    kw = dict(max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, pad_token_id=0)
    with torch.inference_mode():
        model.generate(ids, **dict(kw, max_new_tokens=8, min_new_tokens=8))
        runs = []
        for _ in range(3):
            t0 = time.perf_counter()
            model.generate(ids, **kw)
            runs.append(tokens / (time.perf_counter() - t0))
    return statistics.median(runs)


LLAMA_TYPES = {"float16": "f16", "bfloat16": "bf16"}  # llama.cpp's converter's --outtype at the same precision


def stored_format(model) -> str:
    """The precision the checkpoint's matrices hold: float16 or bfloat16 where every one of their
    values is one (float16 first), else float32."""
    mats = [p for p in model.parameters() if p.dim() == 2]
    for name, dtype in (("float16", torch.float16), ("bfloat16", torch.bfloat16)):
        if all(torch.equal(p, p.to(dtype).float()) for p in mats):
            return name
    return "float32"


def measure(name: str, path: str, args, dram_bw: float, rate: float, widen: float | None = None) -> dict:
    from staged_engine.model.backend import TorchBackend
    from staged_engine.model.checkpoint import load_model

    model = load_model(path)
    backend = TorchBackend()
    native = backend.native_model(model)
    # The bound is the checkpoint's bytes (float16 where its weights are float16 values), however
    # the engine packed them (float32 where that ran faster here: TorchBackend._pack).
    nbytes = native.checkpoint_bytes
    half = nbytes < native.weight_bytes or native.half
    stored = stored_format(model)
    progress(f"{name}: {model.config.num_params / 1e6:.1f}M params, {nbytes / 1e6:.1f} MB of weights a token")
    # ``rounds`` rounds of every measurement, one after the other: a shared VM's speed drifts by
    # tens of percent over minutes, so the figures are medians over rounds and the bounds use the
    # best bandwidth seen (the hardware's ceiling, not a slow moment's).
    raw = []
    for k in range(args.rounds):
        progress(f"{name}: round {k + 1} of {args.rounds} ...")
        curve, keys = node_curve(model, backend)
        r = {"bw": read_bandwidth(nbytes), "ms": decode_ms(model, backend), "curve": curve,
             "chain": chain_curve(model, backend)}
        if not args.no_hf:
            r["engine"], r["hf"] = engine_tokens_per_s(path), hf_tokens_per_s(path)
        if not args.no_llama_cpp:
            import llamacpp

            try:
                r["llama_cpp"] = llamacpp.llama_bench(path, LLAMA_TYPES.get(stored, "f32"), torch.get_num_threads())
            except llamacpp.LlamaCppUnavailable as exc:
                r["llama_cpp"] = {"unavailable": str(exc)}
                progress(f"  llama.cpp unavailable: {exc}")
        raw.append(r)
    med = statistics.median
    bw, ms = max(r["bw"] for r in raw), med(r["ms"] for r in raw)
    curve = {n: med(r["curve"][n] for r in raw) for n in raw[0]["curve"]}
    bound_bw, bound_dram = nbytes / bw, nbytes / dram_bw
    flop_per_node = 2 * nbytes / (2 if half else 4)
    # The widening bound: the packed float16 bytes at the rate this CPU widens them alone (F16C;
    # None for weights packed otherwise: float32 is not widened, bfloat16 by a shift).
    bound_widen = native.weight_bytes / widen if widen and native.weight_format == "float16" else None
    cfg = model.config
    nodes = {}
    for n, t in curve.items():
        node = pass_bounds(n, keys[n], cfg.n_layer, cfg.n_embd, nbytes, flop_per_node, bw, rate)
        node.update(seconds=t, ratio_to_bound=t / max(node["compute_bound_s"], node["bandwidth_bound_s"]),
                    ratio_to_weights_bound=t / node["weights_bound_s"])
        nodes[str(n)] = node
    chains = {}
    for n in raw[0]["chain"]:
        t = med(r["chain"][n] for r in raw)
        chain = pass_bounds(n, chain_keys(n), cfg.n_layer, cfg.n_embd, nbytes, flop_per_node, bw, rate)
        chain.update(seconds=t, ratio_to_bound=t / max(chain["compute_bound_s"], chain["bandwidth_bound_s"]))
        chains[str(n)] = chain
    # Each round's decode against the bound its own bandwidth probe, run just before, set: the
    # machine's state is the same for both (on a shared VM the DRAM read rate moves between
    # rounds by up to 1.6x, and the best probe of one round against the median decode of others
    # reads that drift as the engine's).
    paired = [nbytes / r["bw"] / r["ms"] for r in raw]
    row = {"path": path, "params": model.config.num_params, "weight_bytes": nbytes,
           "weights": stored, "packed_as": native.weight_format,
           "packing": backend.packing.get(id(model)), "rounds": args.rounds,
           "read_bandwidth_at_weight_size_GBps": bw / 1e9, "ms_per_token": ms * 1e3,
           "ms_per_token_rounds": [r["ms"] * 1e3 for r in raw],
           "read_bandwidth_rounds_GBps": [r["bw"] / 1e9 for r in raw],
           "share_of_bound_rounds": paired, "share_of_bound_paired": med(paired),
           "bound_ms": bound_bw * 1e3, "share_of_bound": bound_bw / ms,
           "dram_bound_ms": bound_dram * 1e3, "share_of_dram_bound": bound_dram / ms, "nodes": nodes,
           "chains": chains,
           "widening_bound_ms": bound_widen * 1e3 if bound_widen else None}
    derive_widening_ratios(row)
    if not args.no_hf:
        row["engine_tokens_per_s"] = med(r["engine"] for r in raw)
        row["hf_tokens_per_s"] = med(r["hf"] for r in raw)
    if not args.no_llama_cpp:
        ok = [r["llama_cpp"] for r in raw if "tokens_per_s" in r["llama_cpp"]]
        row["llama_cpp"] = sorted(ok, key=lambda x: x["tokens_per_s"])[len(ok) // 2] if ok else raw[0]["llama_cpp"]
        if ok:
            row["llama_cpp"]["tokens_per_s_rounds"] = [x["tokens_per_s"] for x in ok]
        if ok and not args.no_hf:  # each round's engine run against the llama.cpp run beside it
            row["engine_vs_llama_cpp"] = med(r["engine"] / r["llama_cpp"]["tokens_per_s"] for r in raw
                                             if "tokens_per_s" in r["llama_cpp"])
    return row


def _pct(x: float | None) -> str:
    return f"{x:.0%}" if x is not None else "n/a"


def _num(x: float | None) -> str:
    return f"{x:.0f}" if x is not None else "n/a"


def table(result: dict) -> str:
    m = result["machine"]
    lines = [f"Plain decoding against the weight-streaming bound, N-node passes against the larger of the "
             f"bandwidth and compute bounds ({m['cpu']}, {', '.join(v for v in m.get('vector_extensions', []) if v in ('avx2', 'avx512f', 'avx512_bf16'))}; "
             f"{result['threads']} threads; DRAM read {result['dram_read_GBps']:.1f} GB/s, fp32 GEMM "
             f"{result['gemm_GFLOPs']:.0f} GFLOP/s"
             + (f", float16 widened to float32 at {result['widening_GBps']:.1f} GB/s"
                if result.get("widening_GBps") else "")
             + f"; every time a median of {result.get('rounds', 1)} rounds, "
             "the bandwidths and the GEMM rate the best of them):", "",
             "| model | weights a token | read bandwidth there | ms/token | bound | share of bound | "
             "share of bound, each round against its own probe (median) | share of DRAM bound "
             "| widening bound (fp16-packed) | engine tok/s | HF generate tok/s | llama.cpp tok/s "
             "| engine vs llama.cpp (median of rounds) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in result["models"].items():
        lc = r.get("llama_cpp", {})
        lc_ts = lc.get("tokens_per_s")
        eng = r.get("engine_tokens_per_s")
        lines.append(
            f"| {name} ({r['params'] / 1e6:.1f}M) | {r['weight_bytes'] / 1e6:.1f} MB {r['weights']} | "
            f"{r['read_bandwidth_at_weight_size_GBps']:.0f} GB/s | {r['ms_per_token']:.3f} | {r['bound_ms']:.3f} | "
            f"{r['share_of_bound']:.0%} | {_pct(r.get('share_of_bound_paired'))} | {r['share_of_dram_bound']:.0%} | "
            + (f"{r['widening_bound_ms']:.3f} | " if r.get("widening_bound_ms")
               else f"none ({r.get('packed_as', 'float32')}) | ")
            + f"{_num(eng)} | {_num(r.get('hf_tokens_per_s'))} | "
            + (f"{lc_ts:.0f} | {r.get('engine_vs_llama_cpp', eng / lc_ts):.2f}x |" if lc_ts and eng else f"n/a ({lc.get('unavailable', 'not run')[:80]}) | |"))
    lines += ["", f"N-node pass time over max(bandwidth bound, compute bound), a tree below a {PREFIX}-token prefix; "
              "each bound counts the weights and what attention reads (the K/V cache) and computes:", "",
              "| model | " + " | ".join(f"N={n}" for n in NODES) + " |", "|---|" + "---|" * len(NODES)]
    for name, r in result["models"].items():
        lines.append(f"| {name} | " + " | ".join(f"{r['nodes'][str(n)]['ratio_to_bound']:.2f}" for n in NODES) + " |")
    chained = {name: r for name, r in result["models"].items() if r.get("chains")}
    if chained:  # the regime of plain steps and fixed chains' rounds, no call from Python a pass
        lines += ["", f"A chain of N tokens below the same prefix, passes back to back in one native call (as plain "
                  "decoding's steps and fixed chains' rounds run), over the same bounds:", "",
                  "| model | " + " | ".join(f"N={n}" for n in CHAIN_NODES) + " |", "|---|" + "---|" * len(CHAIN_NODES)]
        for name, r in chained.items():
            lines.append(f"| {name} | " + " | ".join(
                f"{r['chains'][str(n)]['ratio_to_bound']:.2f}" if str(n) in r["chains"] else "" for n in CHAIN_NODES)
                + " |")
    widened = {name: r for name, r in result["models"].items() if r.get("widening_bound_ms")}
    if widened:  # where the widening competes with the FMAs for the same pipes, their times add
        lines += ["", "The same passes of fp16-packed models over max(bandwidth bound, widening bound + compute "
                  "bound of the rows beyond the first: the widening probe runs one row's FMAs); marked *, passes "
                  "from the row count at which the model takes its float32 packing, over "
                  "max(twice the bandwidth bound, compute bound):", "",
                  "| model | " + " | ".join(f"N={n}" for n in NODES) + " |", "|---|" + "---|" * len(NODES)]
        for name, r in widened.items():
            start = r.get("float32_from_rows")
            lines.append(f"| {name} | " + " | ".join(
                f"{r['nodes'][str(n)]['ratio_to_widening_plus_compute']:.2f}" + ("*" if start and n >= start else "")
                for n in NODES) + " |")
    return "\n".join(lines) + "\n"


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["models"])
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    ours = [result["models"][n]["share_of_bound"] for n in names]
    a.bar([i - 0.18 for i in range(len(names))], ours, width=0.35, color="#1f77b4", label="staged-engine")
    lc = [result["models"][n].get("llama_cpp", {}).get("ms_per_token") for n in names]
    lc_share = [result["models"][n]["bound_ms"] / x if x else 0 for n, x in zip(names, lc)]
    a.bar([i + 0.18 for i in range(len(names))], lc_share, width=0.35, color="#ff7f0e", label="llama.cpp")
    a.axhline(1.0, color="gray", lw=0.8, ls="--")
    a.set_xticks(range(len(names)), names)
    a.set_ylabel("weight-streaming bound / ms per token")
    a.set_title("plain decoding: share of the bandwidth bound")
    a.legend()
    for n in names:
        nodes = result["models"][n]["nodes"]
        line, = b.plot(NODES, [nodes[str(k)]["ratio_to_bound"] for k in NODES], marker="o", label=n)
        if "ratio_to_widening_plus_compute" in nodes[str(NODES[0])]:
            b.plot(NODES, [nodes[str(k)]["ratio_to_widening_plus_compute"] for k in NODES], ls=":",
                   color=line.get_color(), label=f"{n}: over widening + compute")
    b.axhline(1.3, color="gray", lw=0.8, ls="--")
    b.set_xscale("log", base=2)
    b.set_xlabel("tree nodes per pass")
    b.set_ylabel("pass time / max(bandwidth, compute bound)")
    b.set_title("N-node passes against the roofline")
    b.legend()
    fig.suptitle(f"{result['machine']['cpu']} ({result['machine'].get('isa', '')}), {result['threads']} threads")
    fig.tight_layout()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="*", help="checkpoint directories (default: demo oracle, demo draft, "
                                                "a GPT-2-small-shaped random fp16 checkpoint)")
    ap.add_argument("--bf16", action="store_true",
                    help="also each model stored in bfloat16 (its weights rounded; made once in the cache "
                         "directory): the engine's bfloat16 packing against llama.cpp's bf16")
    ap.add_argument("--threads", type=int, default=2, help="threads for every system (default 2)")
    ap.add_argument("--no-llama-cpp", action="store_true", help="skip llama.cpp (its first build takes minutes)")
    ap.add_argument("--no-hf", action="store_true", help="skip the engine and HF generate comparison")
    ap.add_argument("--rounds", type=int, default=3,
                    help="rounds of every measurement; figures are medians over them (default 3)")
    ap.add_argument("--out", default="roofline.json")
    ap.add_argument("--render", action="store_true",
                    help="measure nothing: re-derive the ratios, table and plot of the saved --out result from its "
                         "own measurements (after a change to how they are derived)")
    args = ap.parse_args(argv)
    if args.render:
        with open(result_path(args.out)) as f:
            result = json.load(f)
        for row in result["models"].values():
            derive_widening_ratios(row)
        publish(result, table(result), args.out)
        plot(result, plot_path(args.out, "roofline.json", "roofline"))
        return 0
    if args.threads < 1 or args.rounds < 1:
        raise ValueError(f"--threads and --rounds must be >= 1, got {args.threads} and {args.rounds}")
    torch.set_num_threads(args.threads)
    from staged_engine.demo_pair import DEMO_DIR

    models = checkpoint_dirs(args.models, lambda: {
        "demo oracle": os.path.join(DEMO_DIR, "oracle"), "demo draft": os.path.join(DEMO_DIR, "draft"),
        "GPT-2-small shape": gpt2_small_checkpoint(os.path.join(DEMO_DIR, "oracle"))})
    if args.bf16:
        models.update({f"{name}, bf16 copy": bf16_checkpoint(path) for name, path in list(models.items())})
    progress("measuring DRAM read bandwidth and the GEMM rate ...")
    dram = max(read_bandwidth(512 << 20) for _ in range(args.rounds))
    rate = max(gemm_rate() for _ in range(args.rounds))
    widen = widening_rate(args.rounds)
    result = {"benchmark": "decode roofline", "machine": machine(), "threads": args.threads, "rounds": args.rounds,
              "dram_read_GBps": dram / 1e9, "gemm_GFLOPs": rate / 1e9,
              "widening_GBps": widen / 1e9 if widen else None, "models": {}}
    for name, path in models.items():
        result["models"][name] = measure(name, path, args, dram, rate, widen)
    publish(result, table(result), args.out)
    png = plot_path(args.out, "roofline.json", "roofline")
    plot(result, png)
    print(f"saved {png}")
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
