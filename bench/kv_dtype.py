"""The oracle's K/V cache in float16 against float32, at short and long contexts, in one run.

``Engine(kv_dtype="float16")`` keeps the oracle's cache in float16: a pass's attention reads half
the bytes, and at long contexts those bytes are as many as the weights' (the demo oracle: 16.4 MB
of float32 K/V at 1,000 tokens against 16.8 MB of float16 weights). The entries are rounded, so
its logits are not float32's: this bench measures both sides of that trade.

Prompts of three lengths, each ending as a held-out prompt does (a function's signature and
docstring, from packages the demo pair never saw): the prompt alone, and that prompt after the
held-out prompts before it in the set, joined until the prompt reaches ~450 or ~850 tokens (a
file's worth of code above the function). Per prompt and mode (greedy, T 0.8 / top-p 0.95): plain
and staged decoding and 4 beams (beam sampling under the mode's rule; in greedy mode every beam
takes the argmax, so the 4 beams are the greedy path 4 times over, which times the beams' work) of
``--new-tokens`` tokens, with a float32-cache engine and a float16-cache engine (the demo pair,
each its own models), alternating, their order swapped every repeat. Reported per length: median
decode tokens/s of each (new tokens over the decode's seconds, the prompt's prefill apart), the
median of the per-prompt ratios, the same ratio with the prefill counted, how many prompts'
outputs are the same tokens under both caches (and where the first difference falls), and the
float16 cache's logits against float32's over the prompt (max |difference| over max |logit|).
Before them, the one-row pass of each model over both caches at 64-1,000 cached tokens.

    python bench/kv_dtype.py                      # 8 prompts a length, 3 repeats
    python bench/kv_dtype.py --limit 4 --repeats 1 --new-tokens 64

Writes bench/results/kv_dtype.json and bench/results/plots/kv_dtype.png.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings

import torch
from common import (
    first_divergence,
    fmt,
    load_prompts,
    machine,
    plot_path,
    progress,
    progress_bar,
    publish,
    run_main,
)

LENGTHS = (0, 450, 850)  # 0: the prompt alone; else the least prompt length in tokens, context joined before it
MODES = {"greedy": {}, "top-p": dict(temperature=0.8, top_p=0.95)}
# Plain and staged decoding, and beams (4, the engine's default layout): beam sampling under the
# mode's rule (greedy: 4 copies of the greedy path, whose warning the run silences in main). Each
# beam reads its context's K/V.
STRATEGIES = {"plain": {"strategy": "plain"}, "staged": {"strategy": "staged"},
              "4 beams": {"strategy": "beam", "num_beams": 4}}
CONTEXTS = (64, 256, 512, 1000)  # cached tokens below the timed one-row passes
BLOCK = 32  # passes of one cache before the other's


def long_prompts(texts: list[str], encode, count: int, least: int, room: int) -> list[str]:
    """``count`` prompts of at least ``least`` tokens (0: each prompt as it is), each the i-th
    prompt of ``texts`` after as many of the prompts before it (nearest first, cycling past the
    start) as reach ``least`` tokens, joined by blank lines; none longer than ``room`` tokens."""
    out = []
    for i in range(len(texts)):
        if len(out) == count:
            break
        text, j = texts[i], i
        while len(encode(text)) < least:
            j = (j - 1) % len(texts)
            if j == i:
                raise ValueError(f"the prompt set holds fewer than {least} tokens")
            text = texts[j].rstrip("\n") + "\n\n\n" + text
        if len(encode(text)) <= room:
            out.append(text)
    if len(out) < count:
        raise ValueError(f"only {len(out)} prompts of {least}-{room} tokens could be made, {count} asked for")
    return out


def pass_times(model, backend, contexts: list[int], blocks: int, bar) -> dict:
    """The model's one-row pass over each context with a float32 and a float16 cache (two runners
    of the one model: the same packed weights), in blocks of ``BLOCK`` passes a cache, the caches
    taking turns block by block and the first of each pair swapped every time; medians in us."""
    from staged_engine.model.runner import ModelRunner

    runners = {}
    for dtype in (None, torch.float16):
        model.kv_dtype = dtype
        runners["float16" if dtype else "float32"] = ModelRunner(model, backend)
    model.kv_dtype = None
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    out = {}
    for ctx in contexts:
        ids = torch.randint(0, vocab, (ctx + 1,), generator=g).tolist()
        seconds: dict[str, list[float]] = {k: [] for k in runners}
        for r in runners.values():
            r.reset()
            r.prefill(ids[:-1])
        for b in range(blocks + 1):
            for name in (list(runners) if b % 2 == 0 else list(reversed(runners))):
                r = runners[name]
                for i in range(BLOCK):
                    before = r.forward_seconds
                    r.forward_nodes([ids[-1]], [ctx], None)
                    r.discard()
                    if b > 0 and i >= BLOCK // 4:  # past the first block (both warm) and a block's first passes
                        seconds[name].append(r.forward_seconds - before)
            bar.update(1)
        med = {k: statistics.median(v) * 1e6 for k, v in seconds.items()}
        out[str(ctx)] = {"pass_us": med, "float16_speedup": med["float32"] / med["float16"]}
    return out


def measure(engines: dict, prompts: dict[int, list[str]], new_tokens: int, repeats: int, bar) -> dict:
    """Per length and (mode, strategy): tokens/s of each engine per prompt (median over repeats),
    the outputs' agreement, and the logit error of the float16 cache against float32's."""
    out = {}
    for least, texts in prompts.items():
        row: dict = {"prompt_tokens": [len(engines["float32"].encode(t)) for t in texts], "runs": {}}
        errors = []
        for text in texts:
            ids = engines["float32"].encode(text)
            ref = engines["float32"].logits(ids)
            got = engines["float16"].logits(ids)
            errors.append(((got - ref).abs().max() / ref.abs().max()).item())
        row["logit_error_max"] = max(errors)
        row["logit_error_median"] = statistics.median(errors)
        for mode, knobs in MODES.items():
            for strategy, how in STRATEGIES.items():
                rates = {k: [[] for _ in texts] for k in engines}  # decode: new tokens over decode seconds
                totals = {k: [[] for _ in texts] for k in engines}  # with the prompt's prefill
                tokens = {k: [None] * len(texts) for k in engines}
                for rep in range(repeats):
                    for i, text in enumerate(texts):
                        order = list(engines) if (rep + i) % 2 == 0 else list(reversed(engines))
                        for name in order:
                            seed = {"seed": 1000 + i} if knobs else {}
                            t0 = time.perf_counter()
                            res = engines[name].generate(text, max_new_tokens=new_tokens, **how,
                                                         stop_at_eos=False, **knobs, **seed)
                            totals[name][i].append(len(res.token_ids) / (time.perf_counter() - t0))
                            rates[name][i].append(len(res.token_ids) / res.stats["decode_seconds"])
                            tokens[name][i] = res.token_ids
                        bar.update(1)
                med = {k: [statistics.median(r) for r in v] for k, v in rates.items()}
                med_total = {k: [statistics.median(r) for r in v] for k, v in totals.items()}
                diffs = [first_divergence(a, b) for a, b in zip(tokens["float32"], tokens["float16"])]
                row["runs"][f"{mode} {strategy}"] = {
                    "tokens_per_s": {k: statistics.median(v) for k, v in med.items()},
                    "per_prompt_tokens_per_s": med,
                    "ratio": statistics.median(b / a for a, b in zip(med["float32"], med["float16"])),
                    "with_prefill_tokens_per_s": {k: statistics.median(v) for k, v in med_total.items()},
                    "with_prefill_ratio": statistics.median(b / a for a, b in zip(med_total["float32"],
                                                                                  med_total["float16"])),
                    "same_output": sum(d is None for d in diffs),
                    "first_difference": [d for d in diffs if d is not None],
                }
        out[str(least)] = row
    return out


def table(result: dict) -> str:
    m = result["machine"]
    head = (f"Plain and staged decoding and 4 beams of {result['new_tokens']} tokens with the oracle's K/V cache in float32 "
            f"(the default) and in float16 (`kv_dtype=\"float16\"`), demo pair, {result['prompts']} held-out prompts "
            f"a length, medians of {result['repeats']} repeats ({m['cpu']}, {m['isa']}, {result['threads']} threads). "
            "Decode tok/s: new tokens over the decode's seconds (the prefill apart); ratio: the median over prompts "
            "of float16's over float32's, also with the prefill counted. Same output: prompts whose tokens "
            "are the same under both caches (else the first difference's index); logit error: max |float16 - "
            "float32| over max |float32| across the prompt's positions.\n")
    lines = [head, ("| prompt tokens | mode | float32 decode tok/s | float16 decode tok/s | float16 / float32 "
                    "| with prefill | same output | first differences | logit error (max) |"),
             "|---|---|---|---|---|---|---|---|---|"]
    for row in result["lengths"].values():
        n = row["prompt_tokens"]
        span = f"{min(n)}-{max(n)}"
        for name, run in row["runs"].items():
            diffs = ", ".join(map(str, sorted(run["first_difference"]))) or "-"
            lines.append(f"| {span} | {name} | {run['tokens_per_s']['float32']:.0f} | {run['tokens_per_s']['float16']:.0f} "
                         f"| {fmt(run['ratio'], 'x')} | {fmt(run['with_prefill_ratio'], 'x')} "
                         f"| {run['same_output']}/{len(n)} | {diffs} "
                         f"| {row['logit_error_max']:.1e} |")
    if "passes" in result:
        ctxs = list(next(iter(result["passes"].values())))
        lines += ["", f"One-row passes over float32 and float16 caches of one model (blocks of {BLOCK} passes a "
                      "cache, taking turns; medians in us, float32 / float16, and float16's speedup):", "",
                  "| model | " + " | ".join(f"{c} tokens" for c in ctxs) + " |", "|---|" + "---|" * len(ctxs)]
        for role, per in result["passes"].items():
            cells = [f"{per[c]['pass_us']['float32']:.0f} / {per[c]['pass_us']['float16']:.0f} "
                     f"({per[c]['float16_speedup']:.2f}x)" for c in ctxs]
            lines.append(f"| {role} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    rows = list(result["lengths"].values())
    x = [statistics.median(r["prompt_tokens"]) for r in rows]
    for name, style in (("greedy plain", "o-"), ("top-p plain", "s-"), ("greedy staged", "^--")):
        for dtype, colour in (("float32", "tab:blue"), ("float16", "tab:orange")):
            ax.plot(x, [r["runs"][name]["tokens_per_s"][dtype] for r in rows], style, color=colour,
                    label=f"{name}, {dtype} cache")
    ax.set_xlabel("prompt tokens (median of the length's prompts)")
    ax.set_ylabel("decode tokens/s (median over prompts)")
    ax.set_title(f"Oracle K/V cache: float16 against float32 ({result['machine']['cpu']}, {result['machine']['isa']})")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--limit", type=int, default=8, help="prompts of each length (default 8)")
    ap.add_argument("--repeats", type=int, default=3, help="repeats of every generation (default 3)")
    ap.add_argument("--new-tokens", type=int, default=128, help="tokens each generation writes (default 128)")
    ap.add_argument("--lengths", type=int, nargs="+", default=list(LENGTHS),
                    help="least prompt tokens of each length, 0 for the prompts as they are (default 0 450 850)")
    ap.add_argument("--blocks", type=int, default=40,
                    help=f"blocks of {BLOCK} one-row passes a cache and context in the pass timings (default 40)")
    ap.add_argument("--threads", type=int, default=2, help="threads of the forward pass (default 2)")
    ap.add_argument("--out", default="kv_dtype.json", help="file name under bench/results/")
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore", message=r"num_beams=\d+ at temperature 0")  # greedy's beams, on purpose
    for flag, value, least in (("--limit", args.limit, 1), ("--repeats", args.repeats, 1),
                               ("--new-tokens", args.new_tokens, 1), ("--threads", args.threads, 1),
                               ("--blocks", args.blocks, 2)):
        if value < least:
            raise ValueError(f"{flag} must be >= {least}, got {value}")
    from staged_engine import Engine

    engines = {"float32": Engine.demo(), "float16": Engine.demo(kv_dtype="float16")}
    room = engines["float32"].config.n_positions - args.new_tokens
    if max(args.lengths) >= room or min(args.lengths) < 0:
        raise ValueError(f"--lengths must be in [0, {room}) (the context window less --new-tokens), got {args.lengths}")
    torch.set_num_threads(args.threads)
    texts = [p["prompt"] for p in load_prompts(["heldout"], None)]
    tokenizer = engines["float32"].tokenizer

    def encode(text: str) -> list[int]:  # no context check: a joined prompt may overshoot, then is left out
        return tokenizer.encode(text).ids

    prompts = {least: long_prompts(texts, encode, args.limit, least, room) for least in sorted(set(args.lengths))}
    result = {"benchmark": "kv dtype", "machine": machine(), "threads": args.threads, "repeats": args.repeats,
              "prompts": args.limit, "new_tokens": args.new_tokens}
    total = len(prompts) * len(MODES) * len(STRATEGIES) * args.repeats * args.limit + 2 * len(CONTEXTS) * (args.blocks + 1)
    progress(f"{args.limit} prompts at each of {len(prompts)} lengths, {len(MODES)} modes x {len(STRATEGIES)} "
             f"strategies x 2 caches, {args.repeats} repeats")
    with torch.inference_mode(), progress_bar(total, "kv dtype", "prompts") as bar:
        for eng in engines.values():  # pack the models and load (or measure) their cost profiles
            eng.warm_up()
        result["passes"] = {role: pass_times(getattr(engines["float32"], role), engines["float32"].backend,
                                             list(CONTEXTS), args.blocks, bar) for role in ("oracle", "draft")}
        result["lengths"] = measure(engines, prompts, args.new_tokens, args.repeats, bar)
    publish(result, table(result), args.out)
    png = plot_path(args.out, "kv_dtype.json", "kv_dtype")
    plot(result, png)
    print(f"saved {png}")
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
