"""``staged-engine profile``: the measured forward cost of each model on this machine.

Prints, per model, the seconds of a forward pass over 1-64 new nodes at a short and a long
context (what the round planner prices drafting and verification with), where the profile is
cached and whether it was measured now; ``--plot`` draws it (needs matplotlib).
"""
from __future__ import annotations

import json
import os
import sys

from staged_engine.spec.cost import cpu_identity, profile_key, profile_path


def run(args, engine) -> int:
    models = [w for w in ("oracle", "draft", "draft2") if getattr(engine, w) is not None]
    ident = cpu_identity()
    where = f"{ident['cpu']}, {ident['cpu_family_model']}" if ident.get("cpu_family_model") else ident["cpu"]
    print(f"machine: {where} ({', '.join(ident['vector_extensions']) or 'no vector extensions'}), "
          f"{ident['cores']} cores")
    out = {}
    for which in models:
        prof = engine.cost_profile(which, force=args.force)
        how = engine.profile_sources.get(which, "cached")
        key = profile_key(getattr(engine, which), engine.backend)
        path = profile_path(key)
        # What the figures were measured over: the weights' packing on the native path (float16,
        # bfloat16 or float32: their speeds differ) and a float16 K/V cache.
        notes = ([f"weights packed {key['packed']}"] if "packed" in key else []) + \
            ([f"{key['kv_dtype']} K/V cache"] if "kv_dtype" in key else [])
        label = which + (f" ({', '.join(notes)})" if notes else "")
        print(f"\n{label}: {how}" + (f" in {prof.measured_in:.2f} s" if how != "cached" else "") + f"  [{path}]")
        print("  nodes " + " ".join(f"{n:>7d}" for n in prof.nodes))
        for ctx, row in zip(prof.contexts, prof.seconds):
            print(f"  ctx {ctx:<4d}" + " ".join(f"{1e3 * s:7.3f}" for s in row) + "  ms")
        out[which] = {"contexts": list(prof.contexts), "nodes": list(prof.nodes), "seconds": prof.seconds,
                      "source": how, "path": path, "kv_dtype": key.get("kv_dtype"),
                      "packed": key.get("packed")}
    if args.json:
        json.dump({"machine": ident, "models": out}, sys.stdout, indent=1)
        print()
    if args.plot:
        _plot(out, ident, args.plot)
        print(f"\nplot: {args.plot}", file=sys.stderr)
    return 0


def _plot(out: dict, ident: dict, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ValueError(f"--plot needs matplotlib ({exc}); pip install matplotlib") from exc
    fig, axes = plt.subplots(1, len(out), figsize=(5 * len(out), 3.8), squeeze=False)
    for ax, (which, prof) in zip(axes[0], out.items()):
        for ctx, row in zip(prof["contexts"], prof["seconds"]):
            ax.plot(prof["nodes"], [1e3 * s for s in row], marker="o", label=f"context {ctx}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("new nodes in the pass")
        ax.set_ylabel("ms per forward pass")
        ax.set_title(which + (f" ({prof['kv_dtype']} K/V cache)" if prof.get("kv_dtype") else ""))
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"forward cost on {ident['cpu']}, {ident['cores']} cores", fontsize=9)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
