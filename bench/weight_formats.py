"""A checkpoint stored in bfloat16 on the native path: packed as bfloat16 against float32, in one run.

Weights are packed at 16 bits where every value of a product is a float16 one (checkpoints stored
in fp16), or a bfloat16 one (stored in bf16; their smallest values float16 cannot hold), else as
float32. Before the bfloat16 packing, a bf16 checkpoint took the float32 one: the same values,
so the same bits out of every pass, at twice the bytes. This bench measures what that costs.

Each demo model (oracle, draft) three ways: as stored (float16, packed float16), its weights
rounded to bfloat16 with one value in each matrix float16 cannot hold (as a bf16 checkpoint's tiny
weights are) packed as bfloat16, and that same bf16 copy packed as float32. First each one's pass
over 1, 2, 4 and 8 rows after 64 cached tokens, in blocks of 32 passes taking turns; then plain
greedy decoding of the oracle's three forms on held-out prompts, alternating, with a check that
the bf16 copy's two packings write the same tokens.

    python bench/weight_formats.py                   # 8 prompts, 3 repeats
    python bench/weight_formats.py --limit 2 --repeats 1 --blocks 4

Writes bench/results/weight_formats.json and bench/results/plots/weight_formats.png.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch
from common import (
    fmt,
    load_prompts,
    machine,
    plot_path,
    progress,
    progress_bar,
    publish,
    round_to_bfloat16_,
    run_main,
)

ROWS = (1, 2, 4, 8)
CONTEXT = 64  # cached tokens below the timed passes
BLOCK = 32  # passes of one form before the next's
FORMS = ("float16", "bfloat16", "bfloat16 as float32")  # as stored; the bf16 copy packed bf16; packed float32


def bf16_copy(model):
    """A copy of ``model`` with its weights rounded to bfloat16 (``round_to_bfloat16_``), kept in
    float32 as the engine loads any checkpoint on CPU."""
    import copy

    with torch.inference_mode(False):  # plain tensors: the backend reads their version counters
        out = copy.deepcopy(model)
        round_to_bfloat16_(out)
    return out


def forms(model) -> dict:
    """(model, backend) of each form, the packing fixed for passes of every row count."""
    from staged_engine.model.backend import TorchBackend

    bf = bf16_copy(model)
    out = {"float16": (model, TorchBackend(native=True, wide_weights=False, wide_rows=None)),
           "bfloat16": (bf, TorchBackend(native=True, wide_weights=False, wide_rows=None)),
           "bfloat16 as float32": (bf, TorchBackend(native=True, wide_weights=True, wide_rows=None))}
    want = {"float16": "float16", "bfloat16": "bfloat16", "bfloat16 as float32": "float32"}
    for name, (m, backend) in out.items():
        got = backend.native_model(m).weight_format
        if got != want[name]:
            raise RuntimeError(f"{name}: packed as {got}, expected {want[name]}")
    return out


def pass_times(model, blocks: int, bar) -> dict:
    """Each form's pass over ``ROWS`` rows after ``CONTEXT`` cached tokens, in blocks of ``BLOCK``
    passes a form, the forms taking turns (their order reversed every block); medians in us."""
    from staged_engine.model.runner import ModelRunner

    fs = forms(model)
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (CONTEXT + max(ROWS),), generator=torch.Generator().manual_seed(0)).tolist()
    runners = {}
    for name, (m, backend) in fs.items():
        r = ModelRunner(m, backend)
        r.prefill(ids[:CONTEXT])
        runners[name] = r
    out = {"weight_bytes": {name: fs[name][1].native_model(fs[name][0]).weight_bytes for name in fs}, "rows": {}}
    for rows in ROWS:
        nodes, positions = ids[CONTEXT:CONTEXT + rows], list(range(CONTEXT, CONTEXT + rows))
        seconds: dict[str, list[float]] = {k: [] for k in runners}
        for b in range(blocks + 1):
            for name in (list(runners) if b % 2 == 0 else list(reversed(runners))):
                r = runners[name]
                for i in range(BLOCK):
                    before = r.forward_seconds
                    r.forward_nodes(nodes, positions, None)
                    r.discard()
                    if b > 0 and i >= BLOCK // 4:  # past the first block (all warm) and a block's first passes
                        seconds[name].append(r.forward_seconds - before)
            bar.update(1)
        med = {k: statistics.median(v) * 1e6 for k, v in seconds.items()}
        out["rows"][str(rows)] = {"pass_us": med,
                                  "bfloat16_speedup_over_float32": med["bfloat16 as float32"] / med["bfloat16"],
                                  "bfloat16_over_float16": med["bfloat16"] / med["float16"]}
    return out


def decode(demo, texts: list[str], new_tokens: int, repeats: int, bar) -> dict:
    """Plain greedy decoding with the oracle in each form: decode tokens/s per prompt (median of
    the repeats, forms alternating, order swapped every prompt and repeat) and whether the bf16
    copy's two packings wrote the same tokens."""
    from staged_engine import Engine

    engines = {name: Engine(m, tokenizer=demo.tokenizer, backend=backend) for name, (m, backend) in forms(demo.oracle).items()}
    for eng in engines.values():
        eng.warm_up()
    rates = {k: [[] for _ in texts] for k in engines}
    tokens = {k: [None] * len(texts) for k in engines}
    for rep in range(repeats):
        for i, text in enumerate(texts):
            order = list(engines) if (rep + i) % 2 == 0 else list(reversed(engines))
            for name in order:
                res = engines[name].generate(text, max_new_tokens=new_tokens, strategy="plain", stop_at_eos=False)
                rates[name][i].append(len(res.token_ids) / res.stats["decode_seconds"])
                tokens[name][i] = res.token_ids
            bar.update(1)
    med = {k: [statistics.median(r) for r in v] for k, v in rates.items()}
    same = sum(a == b for a, b in zip(tokens["bfloat16"], tokens["bfloat16 as float32"]))
    return {"tokens_per_s": {k: statistics.median(v) for k, v in med.items()}, "per_prompt_tokens_per_s": med,
            "bfloat16_speedup_over_float32": statistics.median(
                b / a for a, b in zip(med["bfloat16 as float32"], med["bfloat16"])),
            "bfloat16_over_float16": statistics.median(b / a for a, b in zip(med["float16"], med["bfloat16"])),
            "bfloat16_packings_same_output": same, "prompts": len(texts)}


def table(result: dict) -> str:
    m = result["machine"]
    lines = [f"The demo models as stored (float16), their weights rounded to bfloat16 and packed as bfloat16, and that "
             f"bf16 copy packed as float32 (what a bf16 checkpoint took before the bfloat16 packing: the same bits) "
             f"({m['cpu']}, {m['isa']}, {result['threads']} threads). Passes after {CONTEXT} cached tokens, blocks of "
             f"{BLOCK} a form taking turns, medians in us:", "",
             "| model | rows | float16 | bfloat16 | bfloat16 as float32 | bf16 speedup over its float32 packing "
             "| bfloat16 / float16 |", "|---|---|---|---|---|---|---|"]
    for role, per in result["passes"].items():
        for rows, r in per["rows"].items():
            us = r["pass_us"]
            lines.append(f"| {role} | {rows} | {us['float16']:.1f} | {us['bfloat16']:.1f} | {us['bfloat16 as float32']:.1f} "
                         f"| {fmt(r['bfloat16_speedup_over_float32'], 'x')} | {fmt(r['bfloat16_over_float16'], 'x')} |")
    d = result["decode"]
    tps = d["tokens_per_s"]
    lines += ["", f"Plain greedy decoding of the oracle, {d['prompts']} held-out prompts x {result['new_tokens']} "
                  f"tokens, median of {result['repeats']} repeats (decode tok/s, the prefill apart; ratios are "
                  "medians over prompts):", "",
              "| float16 | bfloat16 | bfloat16 as float32 | bf16 speedup over its float32 packing | bfloat16 / float16 "
              "| bf16 packings' outputs identical |", "|---|---|---|---|---|---|",
              f"| {tps['float16']:.0f} | {tps['bfloat16']:.0f} | {tps['bfloat16 as float32']:.0f} "
              f"| {fmt(d['bfloat16_speedup_over_float32'], 'x')} | {fmt(d['bfloat16_over_float16'], 'x')} "
              f"| {d['bfloat16_packings_same_output']}/{d['prompts']} |"]
    return "\n".join(lines) + "\n"


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    roles = list(result["passes"])
    fig, axes = plt.subplots(1, len(roles), figsize=(5 * len(roles), 3.8))
    for ax, role in zip(axes, roles):
        per = result["passes"][role]["rows"]
        rows = list(per)
        width = 0.27
        for k, (name, colour) in enumerate(zip(FORMS, ("tab:blue", "tab:orange", "tab:gray"))):
            ax.bar([i + (k - 1) * width for i in range(len(rows))], [per[r]["pass_us"][name] for r in rows], width,
                   label=name, color=colour)
        ax.set_xticks(range(len(rows)), rows)
        ax.set_xlabel("rows a pass")
        ax.set_ylabel("pass time (us, median)")
        ax.set_title(f"demo {role}")
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"Weights packed float16 / bfloat16 / float32 ({result['machine']['cpu']}, {result['machine']['isa']})",
                 fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--limit", type=int, default=8, help="held-out prompts for plain decoding (default 8)")
    ap.add_argument("--repeats", type=int, default=3, help="repeats of every generation (default 3)")
    ap.add_argument("--new-tokens", type=int, default=128, help="tokens each generation writes (default 128)")
    ap.add_argument("--blocks", type=int, default=20,
                    help=f"blocks of {BLOCK} passes a form and row count in the pass timings (default 20)")
    ap.add_argument("--threads", type=int, default=2, help="threads of the forward pass (default 2)")
    ap.add_argument("--out", default="weight_formats.json", help="file name under bench/results/")
    args = ap.parse_args(argv)
    for flag, value, least in (("--limit", args.limit, 1), ("--repeats", args.repeats, 1),
                               ("--new-tokens", args.new_tokens, 1), ("--threads", args.threads, 1),
                               ("--blocks", args.blocks, 2)):
        if value < least:
            raise ValueError(f"{flag} must be >= {least}, got {value}")
    from staged_engine import Engine

    torch.set_num_threads(args.threads)
    demo = Engine.demo()
    texts = [p["prompt"] for p in load_prompts(["heldout"], args.limit)]
    result = {"benchmark": "weight formats", "machine": machine(), "threads": args.threads, "repeats": args.repeats,
              "new_tokens": args.new_tokens}
    total = 2 * len(ROWS) * (args.blocks + 1) + args.repeats * len(texts)
    progress(f"pass timings of 2 models x {len(ROWS)} row counts x 3 forms, then {len(texts)} prompts x "
             f"{args.repeats} repeats x 3 forms")
    with torch.inference_mode(), progress_bar(total, "weight formats", "steps") as bar:
        result["passes"] = {role: pass_times(getattr(demo, role), args.blocks, bar) for role in ("oracle", "draft")}
        result["decode"] = decode(demo, texts, args.new_tokens, args.repeats, bar)
    publish(result, table(result), args.out)
    png = plot_path(args.out, "weight_formats.json", "weight_formats")
    plot(result, png)
    print(f"saved {png}")
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
