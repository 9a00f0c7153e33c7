"""Tokens/s against sampling temperature: plain decoding, the best fixed chain, and the planned
default (staged), side by side on the demo pair.

At each temperature (top-k and top-p off; 0 is greedy) every prompt runs plain, staged (planned
each round) and fixed chains of 1-4 drafted tokens, alternating (in orders balanced for
carryover: each system runs right after every other equally often), ``--repeats`` times; tokens/s
is all tokens over all seconds of the whole call, prompt included (as in e2e: a strategy that
starts its draft lazily pays the draft's prompt inside its rounds, one that prefills it at the
start pays it before them). The best fixed chain is chosen per temperature after the fact
(an oracle choice no user has). Output equals plain decoding in every run (checked). Writes
bench/results/temperature.json; `bench/plots.py` draws temperature.png from it.

    python bench/temperature.py [--limit 8] [--new-tokens 96] [--temperatures 0 0.4 0.8 1.0 1.2]
"""
from __future__ import annotations

import argparse
import sys

from common import balanced_orders, load_prompts, machine, progress_bar, run_main, save

CHAINS = (1, 2, 3, 4)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--limit", type=int, default=8, help="held-out prompts (default 8)")
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--temperatures", nargs="+", type=float, default=[0.0, 0.4, 0.8, 1.0, 1.2])
    ap.add_argument("--out", default="temperature.json")
    args = ap.parse_args(argv)
    if any(t < 0 for t in args.temperatures) or args.repeats < 1:
        raise SystemExit("--temperatures must be >= 0 and --repeats >= 1")
    from staged_engine import Engine

    eng = Engine.demo()
    prompts = [eng.tokenizer.encode(p["prompt"]).ids for p in load_prompts(["heldout"], args.limit)]
    prompts = [p for p in prompts if len(p) + args.new_tokens <= eng.config.n_positions]
    systems = {"plain": {"strategy": "plain"}, "staged": {"strategy": "staged"},
               **{f"chain {k}": {"strategy": "chain", "chain_length": k} for k in CHAINS}}
    orders = balanced_orders(list(systems))
    rows = []
    bar = progress_bar(len(args.temperatures) * len(prompts) * args.repeats, "[temperature]", "prompt runs")
    for t in args.temperatures:
        seconds = dict.fromkeys(systems, 0.0)
        tokens = dict.fromkeys(systems, 0)
        for s, kw in systems.items():  # warm-up
            eng.generate(prompts[0], max_new_tokens=8, temperature=t, seed=0, **kw)
        for rep in range(args.repeats):
            for j, p in enumerate(prompts):
                ref = None
                for s in orders[(rep * len(prompts) + j) % len(orders)]:
                    kw = systems[s]
                    r = eng.generate(p, max_new_tokens=args.new_tokens, temperature=t, seed=j, stop_at_eos=False, **kw)
                    if ref is None:
                        ref = r.token_ids
                    assert r.token_ids == ref, (t, s, j)
                    seconds[s] += r.stats["seconds"]
                    tokens[s] += r.stats["new_tokens"]
                bar.update(1)
        rate = {s: tokens[s] / seconds[s] for s in systems}
        best = max((s for s in systems if s.startswith("chain")), key=rate.get)
        rows.append({"temperature": t, "tokens_per_s": rate, "best_fixed": best,
                     "staged_vs_plain": rate["staged"] / rate["plain"],
                     "best_fixed_vs_plain": rate[best] / rate["plain"],
                     "staged_vs_best_fixed": rate["staged"] / rate[best]})
        bar.set_postfix_str(f"T {t}: staged {rows[-1]['staged_vs_plain']:.2f}x plain")
    bar.close()
    out = {"benchmark": "tokens/s against temperature", "machine": machine(), "n_prompts": len(prompts),
           "new_tokens": args.new_tokens, "repeats": args.repeats, "rows": rows}
    path = save(out, args.out)
    for r in rows:
        print(f"T {r['temperature']:.1f}: plain {r['tokens_per_s']['plain']:.0f} tok/s, staged "
              f"{r['staged_vs_plain']:.2f}x, best fixed ({r['best_fixed']}) {r['best_fixed_vs_plain']:.2f}x")
    print(f"saved {path}")
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
