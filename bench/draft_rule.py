"""How often a draft's proposal is the oracle's sampled token, by the rule the draft proposes under.

With sampling, the oracle's token at a position is the best of log p' + g over the tokens its rule
keeps (p' its processed distribution, g the Gumbel noise of that position: ALGORITHMS.md sec. 3);
a draft proposes the same argmax over its own p'. For each sampling rule below, this bench takes
the oracle's plain sampled output on held-out prompts (the engine, seeded), runs the draft over
that text with HF transformers (teacher-forced: its logits at every position, an independent
forward), and counts how often the draft's proposal equals the oracle's token, with the draft's
candidates
- ``64``: its 64 likeliest tokens (fewer under top-k), no top-p cut: drafts' rule before cb12214;
- ``whole``: every token the request's top-k keeps, no top-p cut: the rule at cb12214;
- ``request``: the request's own rule, top-p cut included: the engine's rule since 306012f.
It also counts, for the engine as it is, the tokens a fixed draft chain of 1-3 emits an oracle
pass at each rule (every output checked equal to plain sampling's). Counts only: no clock.

    python bench/draft_rule.py --limit 24
"""
from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace

import torch
from common import load_prompts, machine, progress_bar, publish, run_main

RULES = {"T 0.8, top-p 0.95": dict(temperature=0.8, top_p=0.95), "T 1, top-p 0.9": dict(temperature=1.0, top_p=0.9),
         "T 1, top-k 50": dict(temperature=1.0, top_k=50), "T 1": dict(temperature=1.0)}
CANDIDATES = ("64", "whole", "request")
CHAINS = (1, 2, 3)


def candidate_params(params, which: str):
    """The draft's rule for candidate set ``which`` under the request's ``params``."""
    if which == "64":
        return replace(params, top_k=min(params.top_k or 64, 64), top_p=1.0)
    if which == "whole":
        return replace(params, top_p=1.0)
    return params


def run(args) -> dict:
    from transformers import GPT2LMHeadModel

    from staged_engine import Engine
    from staged_engine.demo_pair import DEMO_DIR
    from staged_engine.sampling import SamplingParams, gumbel_noise, processed_logprobs, vocab_salt

    eng = Engine.demo()
    draft = GPT2LMHeadModel.from_pretrained(os.path.join(DEMO_DIR, "draft"), torch_dtype=torch.float32).eval()
    prompts = [eng.tokenizer.encode(p["prompt"]).ids for p in load_prompts(["heldout"], args.limit)]
    prompts = [p for p in prompts if len(p) + args.new_tokens <= eng.config.n_positions]
    salt = vocab_salt(eng.config.vocab_size)
    out = {"benchmark": "draft proposals against the oracle's sampled tokens, by draft rule", "machine": machine(),
           "n_prompts": len(prompts), "new_tokens": args.new_tokens, "rules": {}}
    bar = progress_bar(len(RULES) * len(prompts) * (1 + len(CHAINS)), "[draft rule]", "runs")
    for name, kw in RULES.items():
        hits = dict.fromkeys(CANDIDATES, 0)
        positions = outside_64 = 0
        chains = {k: [0, 0] for k in CHAINS}  # tokens, oracle passes
        for i, ids in enumerate(prompts):
            seed = 1000 + i
            params = SamplingParams(**kw, seed=seed)
            gen = dict(max_new_tokens=args.new_tokens, seed=seed, stop_at_eos=False, **kw)
            ref = eng.generate(ids, strategy="plain", **gen).token_ids
            bar.update(1)
            seq = ids + ref
            with torch.no_grad():
                logits = draft(torch.tensor([seq[:-1]])).logits[0]  # row j predicts seq[j + 1]
            for j, y in enumerate(ref):
                pos = len(ids) + j  # the emitted token's position: the noise the oracle used there
                row, g = logits[pos - 1:pos], gumbel_noise(seed, pos, salt)
                for which in CANDIDATES:
                    proposal = int((processed_logprobs(row, candidate_params(params, which))[0] + g).argmax())
                    hits[which] += proposal == y
                outside_64 += y not in set(row[0].topk(64).indices.tolist())
                positions += 1
            for k in CHAINS:
                res = eng.generate(ids, strategy="chain", chain_length=k, **gen)
                if res.token_ids != ref:
                    raise AssertionError(f"a chain of {k} at {name} differs from plain sampling on prompt {i}")
                chains[k][0] += res.stats["new_tokens"]
                chains[k][1] += res.stats["oracle_calls"]
                bar.update(1)
        out["rules"][name] = {"rule": kw, "positions": positions,
                              "agreement": {w: hits[w] / positions for w in CANDIDATES},
                              "oracle_token_outside_draft_top64": outside_64 / positions,
                              "chain_tokens_per_oracle_pass": {str(k): t / p for k, (t, p) in chains.items()}}
    bar.close()
    return out


def markdown(r: dict) -> str:
    lines = [f"The draft's proposal against the oracle's sampled token, teacher-forced over the oracle's plain "
             f"output ({r['n_prompts']} held-out prompts x {r['new_tokens']} tokens a rule); the draft's candidates: "
             f"its 64 likeliest tokens with no top-p cut (before cb12214), every token the top-k keeps with no cut "
             f"(cb12214), the request's own rule (306012f, the engine's now); then the engine's fixed chains "
             f"of 1-3 tokens, tokens an oracle pass ({r['machine']['cpu']}, {r['machine'].get('isa', '')}):\n",
             "| rule | oracle's token outside the draft's 64 likeliest | proposal = oracle's token: 64, no cut | "
             "whole row, no cut | the request's rule | chain 1 | chain 2 | chain 3 |",
             "|---|---|---|---|---|---|---|---|"]
    for name, x in r["rules"].items():
        a, c = x["agreement"], x["chain_tokens_per_oracle_pass"]
        lines.append(f"| {name} | {x['oracle_token_outside_draft_top64']:.1%} | {a['64']:.1%} | {a['whole']:.1%} | "
                     f"{a['request']:.1%} | {c['1']:.3f} | {c['2']:.3f} | {c['3']:.3f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--limit", type=int, default=24, help="held-out prompts (default 24)")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--out", default="draft_rule.json", help="file name under bench/results/")
    args = ap.parse_args(argv)
    if args.limit < 1 or args.new_tokens < 1:
        raise SystemExit("--limit and --new-tokens must be >= 1")
    r = run(args)
    publish(r, markdown(r), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
