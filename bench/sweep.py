"""Sweep fixed speculative shapes on the demo pair, against the adaptive default.

For each strategy: the default (the depth chosen each round from measured throughput) and each
fixed shape of the grid (chains of 1-10, trees, staged shapes); median tokens/s over a prompt subset (greedy, and top-k 50 at T = 1
with --sampled), tokens per oracle call, draft passes per round, and speedup over plain decoding
measured in the same run. Writes bench/results/sweep.json and prints the best shape per strategy.

    python bench/sweep.py [--limit 12] [--new-tokens 128] [--sampled]
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys

from common import machine, progress_bar, save
from e2e import load_prompts


def grid() -> list[tuple[str, dict]]:
    """Chains of 2-10; trees of 4-16 nodes (narrow and wide); staged shapes from a chain drafted
    with n-gram help (children 1) to trees with n-gram mini-trees of several widths."""
    shapes = [(s, {}) for s in ("chain", "tree", "staged")]  # the adaptive defaults
    shapes += [("chain", {"chain_length": k}) for k in (1, 2, 3, 4, 6, 8, 10)]
    for budget, depth, children in itertools.product((4, 6, 8, 12, 16), (3, 5, 8), (2, 4)):
        if depth < budget:
            shapes.append(("tree", dict(budget=budget, max_depth=depth, children=children,
                                        expand=children)))
    for depth in (4, 6, 8, 10):
        shapes.append(("staged", dict(budget=depth + 1, max_depth=depth, children=1, expand=1,
                                      ngram_widths=(1,) * depth)))
    for budget, depth in itertools.product((6, 8, 12), (5, 8)):
        for widths in ((1, 1, 1, 1, 1), (2, 1, 1, 1, 1), (4, 2, 1, 1), (12, 7, 4, 1, 1, 1)):
            shapes.append(("staged", dict(budget=budget, max_depth=depth, children=2, expand=2,
                                          ngram_widths=widths)))
    return shapes


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--limit", type=int, default=8, help="prompts per set")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--sampled", action="store_true", help="top-k 50, T = 1 instead of greedy")
    ap.add_argument("--strategies", nargs="+", default=["chain", "tree", "staged"])
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    from staged_engine import Engine

    eng = Engine.demo()
    prompts = [eng.tokenizer.encode(p["prompt"]).ids for p in load_prompts(["heldout", "humaneval"], args.limit)]
    prompts = [p for p in prompts if len(p) + args.new_tokens <= eng.config.n_positions]
    kw = dict(max_new_tokens=args.new_tokens, stop_at_eos=False)
    if args.sampled:
        kw.update(temperature=1.0, top_k=50)
    eng.generate(prompts[0], strategy="plain", **{**kw, "max_new_tokens": 16}, seed=0)
    plain = [eng.generate(p, strategy="plain", seed=i, **kw) for i, p in enumerate(prompts)]
    plain_tps = [r.stats["tokens_per_second"] for r in plain]
    rows = []
    shapes = [s for s in grid() if s[0] in args.strategies]
    mode = "sampled" if args.sampled else "greedy"
    bar = progress_bar(len(shapes), f"[sweep {mode}]", "shapes")
    for strategy, opts in shapes:
        bar.set_postfix_str(f"{strategy} {opts}")  # speeds come from the engine's own timers
        res = [eng.generate(p, strategy=strategy, seed=i, **kw, **opts) for i, p in enumerate(prompts)]
        assert all(r.token_ids == q.token_ids for r, q in zip(res, plain)), (strategy, opts)
        tps = [r.stats["tokens_per_second"] for r in res]
        calls = sum(r.stats["oracle_calls"] for r in res)
        rows.append({"strategy": strategy, "options": opts, "median_tokens_per_s": statistics.median(tps),
                     "median_speedup_vs_plain": statistics.median(a / b for a, b in zip(tps, plain_tps)),
                     "tokens_per_oracle_call": sum(r.stats["new_tokens"] for r in res) / calls,
                     "draft_calls_per_round": sum(r.stats["draft_calls"] for r in res) / calls,
                     "overhead_share": statistics.median(r.stats["overhead_share"] for r in res)})
        bar.set_postfix_str(f"{strategy} {opts}: {rows[-1]['median_speedup_vs_plain']:.2f}x")
        bar.update(1)
    bar.close()
    best = {s: max((r for r in rows if r["strategy"] == s), key=lambda r: r["median_speedup_vs_plain"])
            for s in args.strategies}
    from staged_engine.demo_pair import DEMO_DIR

    out = {"benchmark": f"speculation knob sweep ({mode})", "machine": machine(), "mode": mode,
           "oracle": os.path.join(DEMO_DIR, "oracle"), "oracle_params": eng.config.num_params,
           "n_prompts": len(prompts), "new_tokens": args.new_tokens,
           "plain_median_tokens_per_s": statistics.median(plain_tps), "rows": rows, "best": best}
    path = save(out, args.out or f"sweep_{mode}.json")
    print(f"plain: {statistics.median(plain_tps):.1f} tok/s ({len(prompts)} prompts, {mode})")
    for s, r in best.items():
        print(f"best {s}: {json.dumps(r['options'])} -> {r['median_tokens_per_s']:.1f} tok/s, "
              f"{r['median_speedup_vs_plain']:.2f}x plain, {r['tokens_per_oracle_call']:.2f} tokens/call")
    print(f"saved {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
