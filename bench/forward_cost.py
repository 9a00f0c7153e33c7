"""Oracle forward cost against the number of tree nodes N (ALGORITHMS.md sec. 5, DESIGN.md
"Performance model"): the right tree budget is where this curve starts to climb.

For N = 1..64 nodes (a random tree below a committed prefix), the median wall time of one
forward pass relative to the 1-node pass, two ways, in one run: the native decode path (the
whole pass in one call, the default) and stock torch (MKL + SDPA). Writes bench/results/forward_cost.json.

    python bench/forward_cost.py [--oracle DIR] [--prefix 256] [--repeats 30]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
from common import machine, progress, run_main, save

NODES = [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64]


def random_tree_mask(n: int, g: torch.Generator) -> torch.Tensor:
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)]
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i, p in enumerate(parents):
        if p >= 0:
            mask[i] = mask[p]
        mask[i, i] = True
    return mask


def curve(model, backend, prefix: int, repeats: int, nodes: list[int]) -> dict[int, float]:
    cache = model.new_cache()
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (1, prefix), generator=g)
    with torch.inference_mode():
        model(ids, torch.arange(prefix)[None], cache, backend=backend)
        cache.advance()
        out = {}
        for n in nodes:
            mask = random_tree_mask(n, g)
            depth = mask.sum(1) - 1
            toks = torch.randint(0, vocab, (1, n), generator=g)
            pos = (prefix + depth)[None]
            times = []
            for r in range(repeats + 3):
                t0 = time.perf_counter()
                model(toks, pos, cache, mask, backend=backend)
                dt = time.perf_counter() - t0
                cache.discard()
                if r >= 3:
                    times.append(dt)
            out[n] = statistics.median(times)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--oracle", help="checkpoint directory (default: the demo oracle; give the draft's to "
                                     "measure the draft)")
    ap.add_argument("--prefix", type=int, default=256, help="committed tokens before the tree")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--out", default="forward_cost.json")
    args = ap.parse_args(argv)
    from staged_engine.demo_pair import DEMO_DIR
    from staged_engine.model.backend import TorchBackend, _cpu
    from staged_engine.model.checkpoint import load_model

    path = args.oracle or os.path.join(DEMO_DIR, "oracle")
    model = load_model(path)
    result = {"benchmark": "oracle forward cost vs tree nodes", "machine": machine(), "oracle": path,
              "params": model.config.num_params, "prefix": args.prefix, "repeats": args.repeats, "curves": {}}
    backends = {"stock torch": TorchBackend(native=False)}
    if _cpu is not None:
        backends = {"native, one call per pass": TorchBackend(native=True), **backends}
    for name, be in backends.items():
        progress(f"measuring {name} ...")
        c = curve(model, be, args.prefix, args.repeats, NODES)
        result["curves"][name] = {str(n): {"seconds": t, "relative_to_1": t / c[1]} for n, t in c.items()}
    print(f"oracle {model.config.num_params / 1e6:.1f}M params, prefix {args.prefix}; "
          f"{result['machine']['cpu']}, {torch.get_num_threads()} threads")
    names = list(result["curves"])
    print("| nodes | " + " | ".join(f"{n} ms | {n} rel." for n in names) + " |")
    print("|---|" + "---|---|" * len(names))
    for n in NODES:
        cells = [f"{result['curves'][b][str(n)]['seconds'] * 1e3:.2f} | {result['curves'][b][str(n)]['relative_to_1']:.2f}"
                 for b in names]
        print(f"| {n} | " + " | ".join(cells) + " |")
    print(f"saved {save(result, args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
