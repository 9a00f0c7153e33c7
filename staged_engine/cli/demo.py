"""``staged-engine demo``: the embedded pair writes code, plain decoding against speculation."""
from __future__ import annotations

import os
import sys
import time

from staged_engine.demo_pair import DEMO_PROMPTS, SAMPLED, cache_dir
from staged_engine.engine import Engine


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run(args) -> int:
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if not 1 <= args.prompts <= len(DEMO_PROMPTS):
        raise ValueError(f"--prompts must be in 1..{len(DEMO_PROMPTS)}, got {args.prompts}")
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
    all_same, summary, new_memory = True, [], False
    for mode, knobs in modes:
        rows = []
        for i, prompt in enumerate(DEMO_PROMPTS[:args.prompts]):
            plain = eng.generate(prompt, max_new_tokens=args.max_new_tokens, strategy="plain", **knobs)
            spec = eng.generate(prompt, max_new_tokens=args.max_new_tokens, strategy=strategy, **knobs)
            same = plain.token_ids == spec.token_ids
            print(f"\n=== {mode}, prompt {i + 1} ({strategy}; output "
                  f"{'identical to' if same else 'DIFFERS from'} plain decoding)")
            print(prompt + spec.text)
            s, p = spec.stats, plain.stats
            print(f"--- plain {p['tokens_per_second']:.0f} tok/s | {strategy} {s['tokens_per_second']:.0f} tok/s "
                  f"({s['tokens_per_second'] / p['tokens_per_second']:.2f}x) | "
                  f"{s['tokens_per_oracle_call']:.2f} tokens per oracle call")
            rows.append((p, s, same))
        tp = sum(p["new_tokens"] for p, _, _ in rows) / sum(p["decode_seconds"] for p, _, _ in rows)
        ts = sum(s["new_tokens"] for _, s, _ in rows) / sum(s["decode_seconds"] for _, s, _ in rows)
        calls = sum(s["oracle_calls"] for _, s, _ in rows)
        same = all(x for _, _, x in rows)
        all_same &= same
        plans = [s["planner"] for _, s, _ in rows if "planner" in s]
        total = sum(pl["drafted_rounds"] + pl["fixed_rounds"] + pl["plain_rounds"] for pl in plans)
        plain_steps = sum(pl["plain_rounds"] for pl in plans)
        chosen = (f", {plain_steps / total:.0%} of rounds ran as plain steps (where drafting did not pay, "
                  f"and to time drafting against)" if total else "")
        new_memory |= any(pl.get("memory") != "cached" for pl in plans)
        summary.append(f"{mode}: plain {tp:.0f} tok/s, {strategy} {ts:.0f} tok/s, speedup {ts / tp:.2f}x, "
                       f"{sum(s['new_tokens'] for _, s, _ in rows) / calls:.2f} tokens per oracle call{chosen}, "
                       f"outputs identical: {same}")
    print("\nsummary")
    for line in summary:
        print("  " + line)
    if new_memory:
        print("  The planner had no memory of this machine, so these runs also compared its ways of drafting\n"
              "  (blocks of each, timed against plain steps). What it learned is kept in "
              f"{os.path.join(cache_dir(), 'planner')}:\n  the next run starts from it.")
    print(f"  (total {time.perf_counter() - t0:.0f}s)")
    return 0 if all_same else 1
