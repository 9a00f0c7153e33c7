"""Sweep fixed speculative shapes on the demo pair, against the planned default and plain decoding.

For each shape of the grid (chains of 1-10 drafted tokens, trees of 4-16 nodes, staged shapes) and
the strategies' planned defaults (``chain``, ``tree``, ``staged`` with no knob: each round drafts
and verifies what pays, see spec/planner.py): tokens/s over a prompt subset, measured side by side
with plain decoding: every generation of a shape is paired with a plain generation of the same
prompt right beside it (before it and after it in turns), so the machine's drift cancels in the
ratio. Reports the speedup over plain (all tokens over all seconds, and the median per prompt),
tokens per oracle call and draft passes per round, and the best fixed shape per strategy. And what a
shape's round costs, in plain steps (a plain step's seconds in the paired plain runs): its draft
passes, its oracle pass and the rest (sampling, verification, the interpreter), from the engine's
forward timers; a shape beats plain decoding when its tokens per round exceed its round's cost.
Output is checked against plain decoding for every generation. Writes
bench/results/sweep_<mode>.json.

    python bench/sweep.py [--mode greedy|topp|sampled] [--limit 8] [--new-tokens 128]
"""
from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys

from common import (
    balanced_orders,
    chain_round_costs,
    load_prompts,
    machine,
    progress_bar,
    run_main,
    save,
)
from e2e import SAMPLED_MODES


def grid() -> list[tuple[str, dict]]:
    """The planned defaults; chains of 1-10; trees of 4-16 nodes (narrow and wide); staged shapes
    from a chain drafted with n-gram help to trees with n-gram mini-trees."""
    shapes = [(s, {}) for s in ("chain", "tree", "staged")]
    shapes += [("chain", {"chain_length": k}) for k in range(1, 11)]
    for budget, depth, children in itertools.product((4, 8, 16), (3, 6), (2, 4)):
        if depth < budget:
            shapes.append(("tree", dict(budget=budget, max_depth=depth, children=children, expand=children)))
    for depth in (2, 4, 8):
        shapes.append(("staged", dict(budget=depth + 1, max_depth=depth, children=1, expand=1)))
    for budget, widths in ((6, (2, 1, 1, 1)), (12, (4, 2, 1, 1))):
        shapes.append(("staged", dict(budget=budget, max_depth=5, children=2, expand=2, ngram_widths=widths)))
    return shapes


def label(strategy: str, opts: dict) -> str:
    if not opts:
        return f"{strategy} (planned)"
    if strategy == "chain":
        return f"chain {opts['chain_length']}"
    return f"{strategy} " + ",".join(f"{k}={v}" for k, v in opts.items() if k != "ngram_widths") + (
        f",ngram={'/'.join(map(str, opts['ngram_widths']))}" if "ngram_widths" in opts else "")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--limit", type=int, default=8, help="prompts per set (held-out code and HumanEval; default 8)")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--mode", choices=("greedy", *SAMPLED_MODES), default="greedy",
                    help="greedy; sampled = top-k 50 at T 1; topp = top-p 0.95 at T 0.8")
    ap.add_argument("--sampled", action="store_true", help="the same as --mode sampled")
    ap.add_argument("--strategies", nargs="+", default=["chain", "tree", "staged"])
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    mode = "sampled" if args.sampled else args.mode
    from staged_engine import Engine

    eng = Engine.demo()
    prompts = [eng.tokenizer.encode(p["prompt"]).ids for p in load_prompts(["heldout", "humaneval"], args.limit)]
    prompts = [p for p in prompts if len(p) + args.new_tokens <= eng.config.n_positions]
    kw = dict(max_new_tokens=args.new_tokens, stop_at_eos=False)
    if mode in SAMPLED_MODES:
        kw.update(SAMPLED_MODES[mode][0])
    shapes = [s for s in grid() if s[0] in args.strategies]
    for strategy, opts in [("plain", {})] + shapes:  # warm-up: every shape once, briefly
        eng.generate(prompts[0], strategy=strategy, seed=0, **{**kw, "max_new_tokens": 16}, **opts)
    seconds = {i: [0.0, 0.0] for i in range(len(shapes))}  # shape -> [plain, shape] seconds
    per_prompt = {i: [] for i in range(len(shapes))}
    calls = {i: [0, 0, 0] for i in range(len(shapes))}  # tokens, oracle calls, draft calls
    # Decode seconds in forward passes: the shape's oracle and draft, and plain's oracle.
    forward = {i: [0.0, 0.0, 0.0] for i in range(len(shapes))}
    pair_orders = balanced_orders(["plain", "shape"])
    bar = progress_bar(len(prompts) * len(shapes), f"[sweep {mode}]", "runs")
    for j, p in enumerate(prompts):
        for i, (strategy, opts) in enumerate(shapes):
            bar.set_postfix_str(label(strategy, opts))  # speeds come from the engine's own timers
            # The pair in turns plain first and the shape first, so that plain does not always run
            # right after the previous pair's shape (balanced_orders of two: each follows the other).
            for which in pair_orders[(j * len(shapes) + i) % 2]:
                if which == "plain":
                    ref = eng.generate(p, strategy="plain", seed=j, **kw)
                else:
                    res = eng.generate(p, strategy=strategy, seed=j, **kw, **opts)
            assert res.token_ids == ref.token_ids, (strategy, opts, j)
            a, b = ref.stats["decode_seconds"], res.stats["decode_seconds"]
            seconds[i][0] += a
            seconds[i][1] += b
            per_prompt[i].append(a / b)
            calls[i][0] += res.stats["new_tokens"]
            calls[i][1] += res.stats["oracle_calls"]
            calls[i][2] += res.stats["draft_calls"]
            forward[i][0] += res.stats["oracle_decode_seconds"]
            forward[i][1] += res.stats["draft_decode_seconds"]
            forward[i][2] += ref.stats["oracle_decode_seconds"]
            bar.update(1)
    bar.close()
    tokens = len(prompts) * args.new_tokens
    rows = []
    for i, (strategy, opts) in enumerate(shapes):
        plain_s, shape_s = seconds[i]
        step = plain_s / tokens  # a plain step's seconds, in the paired plain runs
        rounds = calls[i][1]
        rows.append({"strategy": strategy, "options": opts, "label": label(strategy, opts), "planned": not opts,
                     "tokens_per_s": tokens / shape_s, "plain_tokens_per_s": tokens / plain_s,
                     "speedup_vs_plain": plain_s / shape_s,
                     "median_speedup_vs_plain": statistics.median(per_prompt[i]),
                     "min_speedup_vs_plain": min(per_prompt[i]),
                     "tokens_per_oracle_call": calls[i][0] / calls[i][1],
                     "draft_calls_per_round": calls[i][2] / calls[i][1],
                     # A round's cost in plain steps, and its parts: what a shape pays per round.
                     "round_plain_steps": shape_s / rounds / step,
                     "oracle_pass_plain_steps": forward[i][0] / rounds / step,
                     "draft_plain_steps": forward[i][1] / rounds / step,
                     "plain_pass_share": forward[i][2] / plain_s})
    best = {s: max((r for r in rows if r["strategy"] == s and not r["planned"]), key=lambda r: r["speedup_vs_plain"])
            for s in args.strategies}
    planned = {s: next(r for r in rows if r["strategy"] == s and r["planned"]) for s in args.strategies}
    from staged_engine.demo_pair import DEMO_DIR

    out = {"benchmark": f"speculation shape sweep ({mode})", "machine": machine(), "mode": mode,
           "oracle": os.path.join(DEMO_DIR, "oracle"), "oracle_params": eng.config.num_params,
           "n_prompts": len(prompts), "new_tokens": args.new_tokens,
           "plain_tokens_per_s": tokens * len(shapes) / sum(s[0] for s in seconds.values()),
           "rows": rows, "best": best, "planned": planned}
    path = save(out, args.out or f"sweep_{mode}.json")
    print(f"plain: {out['plain_tokens_per_s']:.1f} tok/s ({len(prompts)} prompts, {mode})")
    for s in args.strategies:
        b, d = best[s], planned[s]
        print(f"{s}: planned {d['speedup_vs_plain']:.2f}x plain; best fixed {b['label']} "
              f"{b['speedup_vs_plain']:.2f}x; planned / best fixed {d['tokens_per_s'] / b['tokens_per_s']:.2f}")
    for r in chain_round_costs(out):
        print(f"{r['label']}: {r['tokens_per_oracle_call']:.2f} tokens a round, a round "
              f"{r['round_plain_steps']:.2f} plain steps (draft {r['draft_plain_steps']:.2f}, oracle pass "
              f"{r['oracle_pass_plain_steps']:.2f}; a plain step's pass {r['plain_pass_share']:.2f})")
    print(f"saved {path}")
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
