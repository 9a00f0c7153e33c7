"""End-to-end decoding speed: the engine's strategies against HuggingFace transformers.

Systems, side by side in one run on the same weights, prompts, precision (fp32) and number of
new tokens: HF `generate` (greedy, top-k 50 at T = 1, or top-p 0.95 at T = 0.8), HF assisted
generation with the same draft, HF prompt-lookup decoding, and the engine's plain, chain, tree
and staged strategies. Greedy outputs of every system are compared with the engine's plain
output (a difference counts as a tie when the oracle's top-2 logits at the first divergence are
within 1e-4). Per system: median tokens/s over prompts (after a warm-up), median speedup over HF
generate and over our plain, tokens per oracle call, relative memory traffic, overhead share.
Plain decoding also runs a second time as a system of its own (``plain_again``, an A/A control;
``--no-aa`` skips it): its slowest prompt "vs plain" is what noise alone makes of that column.

    python bench/e2e.py                          # demo pair, both prompt sets, all three modes
    python bench/e2e.py --oracle DIR --draft DIR --ngram FILE --limit 20 --systems plain staged
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
from common import (
    add_model_and_prompt_args,
    balanced_orders,
    first_divergence,
    fmt,
    load_prompts,
    machine,
    order_of,
    progress,
    progress_bar,
    publish,
    run_main,
)

from staged_engine.demo_pair import loops

HERE = os.path.dirname(os.path.abspath(__file__))
ENGINE_SYSTEMS = ("plain", "chain", "tree", "staged")  # each strategy as a user gets it: planned rounds
# chain_K: a chain of K drafted tokens every round (a fixed shape; --chains picks the K), the
# competition the planned default must beat.
HF_SYSTEMS = ("hf", "hf_assisted", "hf_lookup")
# plain decoding run a second time, as a system of its own (an A/A control): its figures "vs our
# plain" are what the machine's noise alone makes of a system no faster or slower than plain.
AA = "plain_again"
CUT = "staged_cut"  # staged_cutN: --draft-head-rows N
TIE = 1e-4
# The sampled modes: (engine knobs, HF generate knobs). Greedy needs none.
SAMPLED_MODES = {"sampled": (dict(temperature=1.0, top_k=50), dict(top_k=50, temperature=1.0)),
                 "topp": (dict(temperature=0.8, top_p=0.95), dict(top_k=0, top_p=0.95, temperature=0.8))}


class HFRunner:
    """HF transformers on the same checkpoints, fp32, greedy or sampled; never stops at EOS."""

    def __init__(self, oracle_dir: str, draft_dir: str | None) -> None:
        from transformers import GPT2LMHeadModel

        self.model = GPT2LMHeadModel.from_pretrained(oracle_dir, torch_dtype=torch.float32).eval()
        self.draft = (GPT2LMHeadModel.from_pretrained(draft_dir, torch_dtype=torch.float32).eval()
                      if draft_dir else None)
        for m in (self.model, self.draft):
            if m is not None:
                m.generation_config.eos_token_id = None
                m.generation_config.pad_token_id = 0

    def run(self, system: str, ids: list[int], new_tokens: int, mode: str, seed: int) -> list[int]:
        x = torch.tensor([ids])
        kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, eos_token_id=None, pad_token_id=0)
        if mode in SAMPLED_MODES:
            torch.manual_seed(seed)
            kw.update(do_sample=True, **SAMPLED_MODES[mode][1])
        else:
            kw.update(do_sample=False)
        if system == "hf_assisted":
            kw["assistant_model"] = self.draft
        elif system == "hf_lookup":
            kw["prompt_lookup_num_tokens"] = 10
        with torch.inference_mode():
            return self.model.generate(x, **kw)[0, len(ids):].tolist()


def run(args) -> dict:
    from staged_engine import Engine

    def load(**kw):
        if args.oracle:
            return Engine.from_pretrained(args.oracle, draft=args.draft, ngram=args.ngram, **kw)
        return Engine.demo(**kw)

    eng = load()
    # staged_cutN: the default staged strategy with the draft's LM head cut to token ids below N
    # (draft_head_rows), on an engine of its own (its models loaded again, its planner's own memory).
    cut_engines = {f"{CUT}{n}": load(draft_head_rows=n) for n in args.draft_head_rows}
    if args.oracle:
        oracle_dir, draft_dir = args.oracle, args.draft
    else:
        from staged_engine.demo_pair import DEMO_DIR

        oracle_dir, draft_dir = os.path.join(DEMO_DIR, "oracle"), os.path.join(DEMO_DIR, "draft")
    if eng.tokenizer is None:
        raise ValueError("the oracle checkpoint needs a tokenizer.json for text prompts")
    prompts = load_prompts(args.prompt_sets, args.limit)
    budget = eng.config.n_positions - args.new_tokens
    encoded = [(p, eng.tokenizer.encode(p["prompt"]).ids) for p in prompts]
    skipped = [p["id"] for p, ids in encoded if len(ids) > budget]
    encoded = [(p, ids) for p, ids in encoded if len(ids) <= budget]
    if skipped:
        progress(f"skipping {len(skipped)} prompts longer than {budget} tokens: {skipped[:5]}")
    hf = HFRunner(oracle_dir, draft_dir) if any(s in HF_SYSTEMS for s in args.systems) else None
    options = json.loads(args.options) if args.options else {}
    result = {"benchmark": "end-to-end decoding", "machine": machine(), "oracle": oracle_dir,
              "draft": draft_dir, "oracle_params": eng.config.num_params,
              "draft_params": eng.draft.config.num_params if eng.draft else None,
              "new_tokens": args.new_tokens, "prompt_sets": args.prompt_sets, "n_prompts": len(encoded),
              "skipped_prompts": skipped, "options": options, "modes": {}}
    result["repeats"] = args.repeats
    result["per_prompt_seconds"] = "median of the repeats"
    orders = balanced_orders(args.systems)
    result["orders"] = "balanced for carryover (bench/common.py balanced_orders), the next each repeat"
    for mode in args.modes:
        sampled = mode != "greedy"
        per_system: dict[str, list[dict]] = {s: [] for s in args.systems}
        # Warm-up: one short run of every system.
        _, ids0 = encoded[0]
        for s in args.systems:
            _run_system(cut_engines.get(s, eng), hf, s, ids0, 16, mode, 0, options)
        bar = progress_bar(len(encoded), f"[{mode}]", "prompts")
        for i, (p, ids) in enumerate(encoded):
            outs, last = {}, {}
            spent: dict[str, list[float]] = {s: [] for s in args.systems}
            for rep in range(args.repeats):  # systems alternate within each repeat: side by side in time
                # Each repeat the next of the balanced orders: every system follows every other
                # equally often (HF's thread pool, a cache another system left warm or cold).
                for s in order_of(orders, i, rep, args.repeats):
                    bar.set_postfix_str(s)  # before the clock starts: the bar is never timed
                    t0 = time.perf_counter()
                    tokens, stats = _run_system(cut_engines.get(s, eng), hf, s, ids, args.new_tokens, mode, i,
                                                options)
                    spent[s].append(time.perf_counter() - t0)
                    outs[s], last[s] = tokens, stats
            for s in args.systems:
                # The median repeat: a burst of another guest's traffic slows one repeat of one
                # system, not the prompt's figure (the mean let one such repeat set it).
                dt = statistics.median(spent[s])
                per_system[s].append({"id": p["id"], "seconds": dt, "tokens_per_s": len(outs[s]) / dt,
                                      "repeat_seconds": spent[s], **last[s]})
            if "plain" in outs:
                per_system["plain"][-1]["loops"] = loops(eng.decode(outs["plain"]))
            if sampled and "plain" in outs:  # drafter invariance: same seed, same tokens
                for s, toks in outs.items():
                    if s not in HF_SYSTEMS:
                        per_system[s][-1]["identical"] = toks == outs["plain"]
            if not sampled and "plain" in outs:
                ref = outs["plain"]
                for s, toks in outs.items():
                    d = first_divergence(toks, ref)
                    rec = per_system[s][-1]
                    rec["identical"] = d is None and len(toks) == len(ref)
                    if d is not None:
                        logits = eng.logits(ids + ref[:d])[-1]
                        top2 = torch.topk(logits, 2).values
                        rec["divergence"] = {"at": d, "top2_gap": (top2[0] - top2[1]).item()}
                        rec["tie"] = (top2[0] - top2[1]).item() < TIE
            bar.update(1)
        bar.close()
        result["modes"][mode] = _summarise(per_system, eng, args.systems)
    return result


def _run_system(eng, hf, system, ids, new_tokens, mode, seed, options):
    if system in HF_SYSTEMS:
        return hf.run(system, ids, new_tokens, mode, seed), {}
    if system == AA:
        system = "plain"
    if system.startswith(CUT):  # staged on the engine whose draft head is cut (run's cut_engines)
        system = "staged"
    strategy, _, k = system.partition("_")
    kw = dict(max_new_tokens=new_tokens, strategy=strategy, stop_at_eos=False)
    if k:  # chain_K: a fixed chain of K drafted tokens
        kw["chain_length"] = int(k)
    if mode in SAMPLED_MODES:
        kw.update(seed=seed, **SAMPLED_MODES[mode][0])
    res = eng.generate(ids, **kw, **options.get(system, {}))
    s = res.stats
    keep = ("oracle_calls", "draft_calls", "tokens_per_oracle_call", "relative_memory_traffic",
            "overhead_share", "forward_seconds", "decode_seconds", "accepted_lengths")
    out = {k: s[k] for k in keep if k in s}
    if "planner" in s:  # which arm played how many rounds, and whether the memory came from disk
        out["planner"] = {k: s["planner"][k] for k in ("favoured", "memory", "drafted_rounds", "fixed_rounds",
                                                        "plain_rounds")}
    return res.token_ids, out


def _summarise(per_system: dict, eng, systems) -> dict:
    out = {}
    base_hf = per_system.get("hf")
    base_plain = per_system.get("plain")
    base_assisted = per_system.get("hf_assisted")
    totals = {s: sum(r["tokens_per_s"] * r["seconds"] for r in per_system[s]) / sum(r["seconds"] for r in per_system[s])
              for s in systems}
    fixed = [s for s in systems if s.startswith("chain_")]
    best_fixed = max(fixed, key=totals.get) if fixed else None
    for s in systems:
        runs = per_system[s]
        row = {"median_tokens_per_s": statistics.median(r["tokens_per_s"] for r in runs),
               "total_tokens_per_s": totals[s]}
        if "plain" in totals:  # over the prompt set: all tokens over all seconds
            row["total_speedup_vs_plain"] = totals[s] / totals["plain"]
        if best_fixed is not None:
            row["best_fixed_chain"] = best_fixed
            row["speedup_vs_best_fixed_chain"] = totals[s] / totals[best_fixed]
        for name, base in (("hf", base_hf), ("hf_assisted", base_assisted), ("plain", base_plain)):
            if base is not None:
                row[f"median_speedup_vs_{name}"] = statistics.median(
                    r["tokens_per_s"] / b["tokens_per_s"] for r, b in zip(runs, base))
        if base_plain is not None:
            row["min_speedup_vs_plain"] = min(r["tokens_per_s"] / b["tokens_per_s"] for r, b in zip(runs, base_plain))
            # On text that does not loop: a loop is easy to draft, so a speedup over repeats alone
            # says little about fresh code.
            fresh = [r["tokens_per_s"] / b["tokens_per_s"] for r, b in zip(runs, base_plain) if "loops" in b
                     and not b["loops"]]
            if fresh:
                row["median_speedup_vs_plain_fresh"] = statistics.median(fresh)
                row["fresh_prompts"] = len(fresh)
        if "oracle_calls" in runs[0]:
            calls = sum(r["oracle_calls"] for r in runs)
            toks = sum(r["tokens_per_oracle_call"] * r["oracle_calls"] for r in runs)
            row.update(tokens_per_oracle_call=toks / calls,
                       draft_calls_per_round=sum(r["draft_calls"] for r in runs) / calls,
                       relative_memory_traffic=statistics.median(r["relative_memory_traffic"] for r in runs),
                       overhead_share=statistics.median(r["overhead_share"] for r in runs))
            hist: dict[int, int] = {}
            for r in runs:
                for a in r["accepted_lengths"]:
                    hist[a] = hist.get(a, 0) + 1
            row["accepted_length_histogram"] = dict(sorted(hist.items()))
        if "loops" in runs[0]:
            row["loop_share"] = sum(r["loops"] for r in runs) / len(runs)
        if "identical" in runs[0]:
            row["identical"] = sum(r["identical"] for r in runs)
            row["ties"] = sum(bool(r.get("tie")) for r in runs)
            row["mismatches"] = [{"id": r["id"], **r.get("divergence", {})} for r in runs
                                 if not r["identical"] and not r.get("tie")]
        if "planner" in runs[0]:
            row["planner_rounds"] = {k: sum(r["planner"][k] for r in runs)
                                     for k in ("drafted_rounds", "fixed_rounds", "plain_rounds")}
            row["planner_memory"] = {m: sum(r["planner"]["memory"] == m for r in runs)
                                     for m in sorted({r["planner"]["memory"] for r in runs})}
        row["runs"] = [{k: v for k, v in r.items() if k != "accepted_lengths"} for r in runs]
        out[s] = row
    return out


def markdown(result: dict) -> str:
    lines = []
    m = result["machine"]
    for mode, rows in result["modes"].items():
        loop = rows.get("plain", {}).get("loop_share")
        lines.append(f"**{mode}** ({result['n_prompts']} prompts x {result['new_tokens']} new tokens; "
                     f"{m['cpu']}, {m['cores']} cores, torch {m['torch']}"
                     + (f"; median of {result['repeats']} repeats a prompt" if result.get("repeats", 1) > 1 else "")
                     + (f"; {100 * loop:.0f}% of plain continuations loop" if loop is not None else "") + ")\n")
        best = next((r["best_fixed_chain"] for r in rows.values() if "best_fixed_chain" in r), None)
        fresh = rows.get("plain", {}).get("fresh_prompts")
        lines.append("| system | tok/s (median) | vs HF generate | vs HF assisted | vs our plain (median) "
                     "| vs our plain (all tokens) | slowest prompt vs plain"
                     + (f" | vs our plain, the {fresh} prompts that do not loop (median)" if fresh else "")
                     + (f" | vs best fixed chain ({best})" if best else "")
                     + " | tokens/oracle call | rel. memory traffic | overhead share | output = our plain |")
        lines.append("|---|---|---|---|---|---|---|" + ("---|" if fresh else "") + ("---|" if best else "")
                     + "---|---|---|---|")
        for s, r in rows.items():
            ident = (f"{r['identical']}/{result['n_prompts']}" + (f" ({r['ties']} ties)" if r.get("ties") else "")
                     if "identical" in r else "n/a (other RNG)")
            lines.append(
                f"| {s} | {r['median_tokens_per_s']:.1f} | {fmt(r.get('median_speedup_vs_hf'), 'x')} | "
                f"{fmt(r.get('median_speedup_vs_hf_assisted'), 'x')} | "
                f"{fmt(r.get('median_speedup_vs_plain'), 'x')} | {fmt(r.get('total_speedup_vs_plain'), 'x')} | "
                f"{fmt(r.get('min_speedup_vs_plain'), 'x')} | "
                + (f"{fmt(r.get('median_speedup_vs_plain_fresh'), 'x')} | " if fresh else "")
                + (f"{fmt(r.get('speedup_vs_best_fixed_chain'), 'x')} | " if best else "")
                + f"{fmt(r.get('tokens_per_oracle_call'))} | "
                f"{fmt(r.get('relative_memory_traffic'))} | {_pct(r.get('overhead_share'))} | {ident} |")
        lines.append("")
    return "\n".join(lines)


def _pct(x):
    return "" if x is None else f"{100 * x:.0f}%"


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_and_prompt_args(ap)
    ap.add_argument("--modes", nargs="+", choices=("greedy", "sampled", "topp"), default=["greedy", "topp", "sampled"],
                    help="greedy; sampled = top-k 50 at T 1; topp = top-p 0.95 at T 0.8")
    ap.add_argument("--systems", nargs="+", choices=HF_SYSTEMS + ENGINE_SYSTEMS,
                    default=list(HF_SYSTEMS + ENGINE_SYSTEMS))
    ap.add_argument("--chains", nargs="*", type=int, default=[1, 2, 3, 4],
                    help="also run fixed chains of these lengths (chain_K); the best is the bar the "
                         "planned default must clear (default 1 2 3 4; none: --chains)")
    ap.add_argument("--no-aa", action="store_true",
                    help=f"skip the A/A control ({AA}: plain decoding run again as a system of its own, "
                         "whose slowest prompt vs plain is the noise floor of that column)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="run each prompt this many times, systems alternating; a prompt's time is "
                         "the median of its repeats (all are recorded), so a burst of noise in one "
                         "repeat does not set it")
    ap.add_argument("--draft-head-rows", nargs="*", type=int, default=[],
                    help=f"also run the default staged strategy with the draft's LM head cut to token ids "
                         f"below each N ({CUT}N: Engine(draft_head_rows=N), an engine of its own)")
    ap.add_argument("--options", help='JSON per-strategy options, e.g. {"staged": {"budget": 12}}')
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--out", default="e2e.json", help="file name under bench/results/")
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if "plain" not in args.systems:
        args.systems = ["plain"] + args.systems  # the reference for identity and speedups
    if args.repeats < 1 or any(k < 1 for k in args.chains):
        raise SystemExit("--repeats and --chains need integers >= 1")
    if any(n < 1 for n in args.draft_head_rows):
        raise SystemExit("--draft-head-rows needs integers >= 1")
    args.systems += [f"chain_{k}" for k in args.chains] + [f"{CUT}{n}" for n in args.draft_head_rows]
    if not args.no_aa:
        args.systems.append(AA)
    result = run(args)
    publish(result, markdown(result), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
