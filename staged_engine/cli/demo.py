"""``staged-engine demo``: the embedded pair writes code, plain decoding against speculation.

Each prompt runs ``--repeats`` times with each strategy, the two alternating (and their order
flipped every repeat), and a prompt's speed is the median of its runs: one run of a few tens of
milliseconds moves by 10-30% with whatever else the machine does, enough to print a "speedup"
between two runs of the very same plain steps. Continuations that repeat themselves are flagged
(``demo_pair.loops``): a loop is easy to draft, so the summary also gives the ratio over the
prompts whose text does not loop.
"""
from __future__ import annotations

import os
import statistics
import sys
import time

from staged_engine.demo_pair import DEMO_PROMPTS, SAMPLED, cache_dir, loops
from staged_engine.engine import Engine


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _median_ratio(rows: list[dict]) -> float:
    return statistics.median(r["ratio"] for r in rows)


def run(args) -> int:
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if not 1 <= args.prompts <= len(DEMO_PROMPTS):
        raise ValueError(f"--prompts must be in 1..{len(DEMO_PROMPTS)}, got {args.prompts}")
    if args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
    t0 = time.perf_counter()
    eng = Engine.demo()
    _log(f"loaded the demo pair in {time.perf_counter() - t0:.1f}s: oracle "
         f"{eng.config.num_params / 1e6:.1f}M params, draft {eng.draft.config.num_params / 1e6:.2f}M")
    strategy = args.strategy
    modes = [("greedy", {}), (f"sampled (T {SAMPLED['temperature']}, top-p {SAMPLED['top_p']}, seed {args.seed})",
                              dict(SAMPLED, seed=args.seed))]
    # Warm up both paths once (first calls allocate caches and load kernels).
    eng.generate(DEMO_PROMPTS[0], max_new_tokens=8, strategy="plain")
    eng.generate(DEMO_PROMPTS[0], max_new_tokens=8, strategy=strategy)
    runs = "one run each" if args.repeats == 1 else f"median of {args.repeats} runs each, alternating"
    all_same, summary, new_memory = True, [], False
    for mode, knobs in modes:
        rows = []
        for i, prompt in enumerate(DEMO_PROMPTS[:args.prompts]):
            seconds: dict[str, list[float]] = {"plain": [], strategy: []}
            results: dict[str, list] = {"plain": [], strategy: []}
            for rep in range(args.repeats):
                for name in ("plain", strategy) if (rep + i) % 2 == 0 else (strategy, "plain"):
                    res = eng.generate(prompt, max_new_tokens=args.max_new_tokens, strategy=name, **knobs)
                    seconds[name].append(res.stats["decode_seconds"])
                    results[name].append(res)
            plain, spec = results["plain"][0], results[strategy][-1]
            same = all(r.token_ids == plain.token_ids for rs in results.values() for r in rs)
            looped = loops(plain.text)
            tp = plain.stats["new_tokens"] / statistics.median(seconds["plain"])
            ts = spec.stats["new_tokens"] / statistics.median(seconds[strategy])
            print(f"\n=== {mode}, prompt {i + 1} ({strategy}; output "
                  f"{'identical to' if same else 'DIFFERS from'} plain decoding)")
            print(prompt + spec.text)
            print(f"--- plain {tp:.0f} tok/s | {strategy} {ts:.0f} tok/s ({ts / tp:.2f}x) | "
                  f"{spec.stats['tokens_per_oracle_call']:.2f} tokens per oracle call | {runs}"
                  + ("\n--- this continuation loops (a model this small often repeats itself); repeats are "
                     "easy to draft" if looped else ""))
            plan = [r.stats["planner"] for r in results[strategy] if "planner" in r.stats]
            rows.append(dict(ratio=ts / tp, same=same, loops=looped, plans=plan,
                             tokens=sum(r.stats["new_tokens"] for r in results[strategy]),
                             calls=sum(r.stats["oracle_calls"] for r in results[strategy])))
        same = all(r["same"] for r in rows)
        all_same &= same
        plans = [pl for r in rows for pl in r["plans"]]
        total = sum(pl["drafted_rounds"] + pl["fixed_rounds"] + pl["plain_rounds"] for pl in plans)
        plain_steps = sum(pl["plain_rounds"] for pl in plans)
        new_memory |= any(pl.get("memory") != "cached" for pl in plans)
        fresh = [r for r in rows if not r["loops"]]
        line = (f"{mode}: {strategy} {_median_ratio(rows):.2f}x plain decoding (median over {len(rows)} "
                f"prompt{'s' if len(rows) > 1 else ''}")
        if len(fresh) < len(rows):
            line += (f"; {len(rows) - len(fresh)} of them loop"
                     + (f", {_median_ratio(fresh):.2f}x over the "
                        + ("one that does not" if len(fresh) == 1 else f"{len(fresh)} that do not") if fresh else ""))
        line += (f"), {sum(r['tokens'] for r in rows) / sum(r['calls'] for r in rows):.2f} tokens per oracle "
                 f"call, outputs identical: {same}")
        if total and plain_steps == total:
            line += (f"\n    every round ran as plain steps (drafting did not pay here in this mode), so "
                     f"{strategy} was plain decoding: its ratio is the machine's noise")
        elif total:
            line += (f"\n    {plain_steps / total:.0%} of rounds ran as plain steps (where drafting did not pay, "
                     f"and to time drafting against)")
        summary.append(line)
    print("\nsummary")
    for line in summary:
        print("  " + line)
    if new_memory:
        print("  The planner had no memory of this machine, so these runs also compared its ways of drafting\n"
              "  (blocks of each, timed against plain steps). What it learned is kept in "
              f"{os.path.join(cache_dir(), 'planner')}:\n  the next run starts from it.")
    print(f"  (total {time.perf_counter() - t0:.0f}s)")
    return 0 if all_same else 1
