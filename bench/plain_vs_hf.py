"""Plain decoding: staged-engine against HF transformers `generate`, side by side in one run.

Random-weight checkpoints of the GPT-2-small (124M) and GPT-2-large (774M) shapes, greedy,
fp32, the same prompts and 128 new tokens for both; outputs are checked identical. Prints a
table and writes bench/results/plain_vs_hf.json.

    python bench/plain_vs_hf.py [--shapes small large] [--repeats 3] [--new-tokens 128]
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch
from common import machine, median, progress, run_main, save, timed

SHAPES = {
    "small": dict(n_embd=768, n_layer=12, n_head=12),
    "large": dict(n_embd=1280, n_layer=36, n_head=20),
}


def run_shape(name: str, new_tokens: int, repeats: int, prompts: list[list[int]], workdir: str) -> dict:
    from transformers import GPT2Config, GPT2LMHeadModel

    from staged_engine import Engine

    progress(f"[{name}] building random weights ...")
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=50257, n_positions=1024, bos_token_id=None, eos_token_id=None, **SHAPES[name])
    hf = GPT2LMHeadModel(cfg).eval()
    path = os.path.join(workdir, name)
    hf.save_pretrained(path)
    eng = Engine.from_pretrained(path)
    params = sum(p.numel() for p in hf.parameters())
    rows = []
    for i, prompt in enumerate(prompts):
        progress(f"[{name}] prompt {i + 1}/{len(prompts)}: HF generate")
        ids = torch.tensor([prompt])

        def hf_run():
            with torch.inference_mode():
                return hf.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                   do_sample=False, pad_token_id=0)[0, len(prompt):].tolist()

        hf_times, hf_out = timed(hf_run, repeats)
        progress(f"[{name}] prompt {i + 1}/{len(prompts)}: staged-engine plain")
        ours_times, ours = timed(lambda: eng.generate(prompt, max_new_tokens=new_tokens, strategy="plain",
                                                      stop_at_eos=False), repeats)
        rows.append({"prompt_tokens": len(prompt), "hf_seconds": hf_times, "ours_seconds": ours_times,
                     "identical": ours.token_ids == hf_out})
    hf_tps = new_tokens / median([t for r in rows for t in r["hf_seconds"]])
    ours_tps = new_tokens / median([t for r in rows for t in r["ours_seconds"]])
    return {"shape": name, "params": params, **SHAPES[name], "new_tokens": new_tokens, "repeats": repeats,
            "hf_tokens_per_s": hf_tps, "ours_tokens_per_s": ours_tps, "speedup": ours_tps / hf_tps,
            "all_identical": all(r["identical"] for r in rows), "runs": rows}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=["small", "large"])
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per prompt after one warm-up")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prompts", type=int, default=2, help="random prompts of 32 tokens")
    args = ap.parse_args(argv)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 50257, (32,), generator=g).tolist() for _ in range(args.prompts)]
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.shapes:
            results.append(run_shape(name, args.new_tokens, args.repeats, prompts, tmp))
    out = {"benchmark": "plain decoding vs HF generate (greedy, fp32)", "machine": machine(),
           "results": results}
    path = save(out, "plain_vs_hf.json")
    print("\n| shape | params | HF generate tok/s | staged-engine plain tok/s | speedup | outputs identical |")
    print("|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['shape']} | {r['params'] / 1e6:.0f}M | {r['hf_tokens_per_s']:.1f} | "
              f"{r['ours_tokens_per_s']:.1f} | {r['speedup']:.2f}x | {r['all_identical']} |")
    print(f"\nmachine: {out['machine']['cpu']} ({out['machine']['cores']} cores); saved {path}")
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
