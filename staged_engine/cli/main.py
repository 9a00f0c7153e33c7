"""The ``staged-engine`` command: demo, generate, bench, and the commands that build models."""
from __future__ import annotations

import argparse
import json
import re
import sys

# Only what building the parser needs is imported here: `staged-engine --help` (and each
# command's) answers without loading torch, the models or the C++ extensions (0.2 s, not 2.4).
from staged_engine.cli import bench, build
from staged_engine.options import OPTIONS, STRATEGIES

_EPILOG = "Run `staged-engine COMMAND --help` for the options of each command."


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("decoding")
    g.add_argument("--strategy", choices=STRATEGIES, default="staged",
                   help="decoding strategy (default: staged; plain is the reference)")
    g.add_argument("--max-new-tokens", type=int, default=128, help="new tokens to generate (default 128)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples")
    g.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = all)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus mass in (0, 1] (default 1)")
    g.add_argument("--seed", type=int, default=None, help="fixes the sampled sequence (any strategy)")
    g.add_argument("--num-beams", type=int, default=1, help="beams for --strategy beam/dsbd")
    g.add_argument("--no-eos", action="store_true", help="do not stop at the end-of-text token")
    g.add_argument("--token-healing", action="store_true",
                   help="back up over the prompt's last token and let the first new token extend it")
    s = p.add_argument_group("speculation knobs: by default each round drafts and verifies what pays on this "
                             "machine (see `staged-engine profile`); giving any shape knob pins the shape")
    s.add_argument("--fixed-shape", action="store_true",
                   help="play the strategy's largest shape every round instead of planning each round")
    s.add_argument("--budget", type=int, help="tree nodes per oracle pass, root included")
    s.add_argument("--max-depth", type=int, help="deepest tree node")
    s.add_argument("--children", type=int, help="children offered per draft-evaluated node")
    s.add_argument("--expand", type=int, help="nodes the draft evaluates per pass")
    s.add_argument("--chain-length", type=int, help="draft tokens per round for --strategy chain")
    s.add_argument("--ngram-widths", type=str, help="n-gram mini-tree widths, e.g. 12,7,4,1,1,1")
    s.add_argument("--draft-window", type=int, metavar="N",
                   help="the most context the draft catches up on at once: a longer backlog restarts its "
                        "cache from the last N tokens (default 64; outputs are unchanged); for dsbd, the most "
                        "of the prompt the draft prefills (it changes the draws; with a fixed width not their "
                        "law)")
    d = p.add_argument_group("beam / DSBD knobs (defaults: the DSBD paper's)")
    d.add_argument("--gamma", type=int, help="DSBD: draft layers per round (default 4)")
    d.add_argument("--draft-width", type=int, help="DSBD: draft beams W_S (default 8)")
    d.add_argument("--threshold", type=float, help="DSBD: dynamic-width threshold t (default 0.7)")
    d.add_argument("--w-min", type=int, help="DSBD: smallest dynamic width (default 1)")
    d.add_argument("--no-dynamic", action="store_true", help="DSBD: keep the width fixed at --num-beams")
    d.add_argument("--memory-mode", action="store_true", help="DSBD: one KV cache row (best beam continues)")
    d.add_argument("--layout", choices=("tree", "rows"), help="beam/DSBD cache layout (default tree)")


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--oracle", help="HF GPT-2 checkpoint directory (default: the embedded demo oracle)")
    p.add_argument("--draft", help="draft checkpoint directory sharing the oracle's vocabulary")
    p.add_argument("--draft2", help="optional third model stage between the draft and the n-gram")
    p.add_argument("--ngram", help="n-gram table file (default for the demo: built and cached)")
    p.add_argument("--draft-head-rows", type=int, metavar="N",
                   help="the draft scores only token ids below N: its LM head, most of a small draft's "
                        "weights, is read over N rows (outputs are unchanged; default: every row)")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:i] (default cpu)")
    p.add_argument("--dtype", default=None, help="float32 / float16 / bfloat16 (default: fp32 on CPU, bf16 on CUDA)")
    p.add_argument("--backend", default="auto", choices=("auto", "torch", "triton"),
                   help="kernels: triton on CUDA, torch on CPU (auto)")
    p.add_argument("--kv-dtype", default=None, choices=("float32", "float16"),
                   help="the oracle's K/V cache: float16 reads half the bytes (faster at long contexts on CPU) "
                        "and rounds each entry, so logits drift from HF's (up to ~1e-3 relative); every strategy "
                        "still equals plain decoding (default: the weights' dtype)")


def _cmd_demo(args) -> int:
    from staged_engine.cli import demo

    return demo.run(args)


def _cmd_profile(args) -> int:
    from staged_engine.cli import profile

    return profile.run(args, _load_engine(args, pool_size=1))


def _cmd_serve(args) -> int:
    import os

    from staged_engine import server

    for name in ("pool_size", "max_queue"):
        if getattr(args, name) < (1 if name == "pool_size" else 0):
            raise ValueError(f"--{name.replace('_', '-')} must be >= {1 if name == 'pool_size' else 0}")
    if not args.timeout > 0:
        raise ValueError(f"--timeout must be > 0, got {args.timeout}")
    eng = _load_engine(args, pool_size=args.pool_size)
    if eng.tokenizer is None:
        raise ValueError("serve needs a tokenizer.json in the oracle directory")
    name = args.model_name or (os.path.basename(os.path.normpath(args.oracle)) if args.oracle else "staged-engine-demo")
    return server.serve(eng, args.host, args.port, name, args.max_queue, args.timeout, args.drain_seconds)


def _load_engine(args, pool_size: int = 4):
    from staged_engine.engine import Engine

    if args.oracle is None:
        if args.draft or args.draft2:
            raise ValueError("--draft/--draft2 need --oracle")
        return Engine.demo(device=args.device, backend=args.backend, pool_size=pool_size,
                           draft_head_rows=args.draft_head_rows, kv_dtype=args.kv_dtype)
    return Engine.from_pretrained(args.oracle, draft=args.draft, ngram=args.ngram, device=args.device,
                                  dtype=args.dtype, backend=args.backend, draft2=args.draft2, pool_size=pool_size,
                                  draft_head_rows=args.draft_head_rows, kv_dtype=args.kv_dtype)


def _options(args) -> dict:
    """The strategy options given on the command line, under the names of ``config.OPTIONS``
    (the engine validates them); flags map to their boolean options."""
    flags = {"no_dynamic": ("dynamic", False), "fixed_shape": ("adaptive", False), "memory_mode": ("memory_mode", True)}
    opts = {}
    for name in sorted({n for names in OPTIONS.values() for n in names}):
        v = getattr(args, name, None)
        if v is not None and not isinstance(v, bool):  # store_true flags are handled below
            opts[name] = v
    for flag, (name, value) in flags.items():
        if getattr(args, flag, False):
            opts[name] = value
    if isinstance(opts.get("ngram_widths"), str):
        try:
            opts["ngram_widths"] = tuple(int(x) for x in opts["ngram_widths"].split(","))
        except ValueError as exc:
            raise ValueError(f"--ngram-widths must be comma-separated integers, got {args.ngram_widths!r}") from exc
    return opts


def _cmd_generate(args) -> int:
    eng = _load_engine(args)
    if args.prompt is not None and args.prompt_file is not None:
        raise ValueError("give either --prompt or --prompt-file, not both")
    if args.prompt_file is not None:
        with open(args.prompt_file, encoding="utf-8") as f:
            prompt = f.read()
    elif args.prompt is not None:
        prompt = args.prompt
    else:
        raise ValueError("--prompt or --prompt-file is required")
    if args.ids:
        words = prompt.replace(",", " ").split()
        bad = [w for w in words if not re.fullmatch(r"[+-]?[0-9]+", w)]
        if bad:
            raise ValueError(f"with --ids the prompt must be token ids separated by spaces or commas, got {bad[0]!r}")
        prompt = [int(x) for x in words]
    kwargs = dict(max_new_tokens=args.max_new_tokens, strategy=args.strategy,
                  temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                  num_beams=args.num_beams, stop_at_eos=not args.no_eos, token_healing=args.token_healing,
                  **_options(args))
    if args.stream and eng.tokenizer is not None:
        stats: dict = {}
        for piece in eng.stream(prompt, stats=stats, **kwargs):
            sys.stdout.write(piece)
            sys.stdout.flush()
        sys.stdout.write("\n")
    else:
        res = eng.generate(prompt, **kwargs)
        print(res.text if res.text is not None else " ".join(map(str, res.token_ids)))
        stats = res.stats
    shown = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in stats.items()
             if k != "accepted_lengths"}
    print(json.dumps(shown) if args.json else
          f"[{stats['new_tokens']} tokens, {stats['tokens_per_second']:.1f} tok/s, "
          f"{stats['tokens_per_oracle_call']:.2f} tokens/oracle call, finish: {stats['finish_reason']}]",
          file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="staged-engine",
        description="Staged speculative decoding (and DSBD) for GPT-2-family models: exact output, "
                    "several times faster small-batch decoding.",
        epilog=_EPILOG)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("demo", help="generate from a few prompts with the embedded demo pair and show the speedup",
                       description="Load the embedded demo oracle/draft pair (trained here on Python "
                                   "source), generate code from a few prompts with plain decoding and "
                                   "with staged speculation, greedy and seeded sampling, and print the "
                                   "text, the speed of both (medians of alternating runs) and whether the "
                                   "outputs are identical.")
    p.add_argument("--max-new-tokens", type=int, default=192,
                   help="new tokens per prompt (default 192: on a machine the planner has not seen, its "
                        "first comparisons of the ways to draft take about 150 rounds)")
    p.add_argument("--prompts", type=int, default=5, help="how many built-in prompts to run (default 5: all)")
    p.add_argument("--repeats", type=int, default=3,
                   help="runs of each prompt with each strategy, alternating; a prompt's speed is their "
                        "median (default 3)")
    p.add_argument("--strategy", choices=("chain", "tree", "staged"), default="staged",
                   help="speculative strategy compared with plain decoding (default staged)")
    p.add_argument("--seed", type=int, default=7, help="seed of the sampled half (default 7)")
    p.set_defaults(func=_cmd_demo)

    p = sub.add_parser("generate", help="generate text from a prompt",
                       description="Generate from a prompt with any strategy; prints the text and, on "
                                   "stderr, the speed and acceptance figures.")
    p.add_argument("--prompt", help="prompt text (or token ids with --ids)")
    p.add_argument("--prompt-file", help="read the prompt from this file")
    p.add_argument("--ids", action="store_true", help="the prompt is whitespace/comma separated token ids")
    p.add_argument("--stream", action="store_true", help="print text as rounds complete")
    p.add_argument("--json", action="store_true", help="print the stats as JSON on stderr")
    _engine_args(p)
    _add_sampling_args(p)
    p.set_defaults(func=_cmd_generate)

    p = sub.add_parser("profile", help="measure (or show the cached) forward cost of each model on this machine",
                       description="Print the seconds of a forward pass over 1-64 new nodes at a short and a "
                                   "long context for the oracle and each draft: the cost model the round "
                                   "planner prices speculation with. It is measured at first use (about a "
                                   "second) and cached per model, machine, thread count and library "
                                   "versions under $STAGED_ENGINE_CACHE/profiles.")
    p.add_argument("--force", action="store_true", help="measure again even if a cached profile exists")
    p.add_argument("--plot", metavar="PNG", help="also draw the profile into this PNG file (needs matplotlib)")
    p.add_argument("--json", action="store_true", help="also print the profile as JSON")
    _engine_args(p)
    p.set_defaults(func=_cmd_profile)

    p = sub.add_parser(
        "serve", help="an OpenAI-compatible completions server (the demo pair by default)",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="Serve POST /v1/completions (stream: true for server-sent events), GET /v1/models "
                    "and GET /health. Extension fields: strategy, token_healing. SIGTERM drains "
                    "in-flight requests and exits 0.")
    p.add_argument("--host", default="127.0.0.1", help="address to bind")
    p.add_argument("--port", type=int, default=8000, help="port to bind")
    p.add_argument("--model-name", default=None, help="the model id /v1/models reports (default: from the oracle)")
    p.add_argument("--pool-size", type=int, default=2, help="generations that run at once (one KV cache set each)")
    p.add_argument("--max-queue", type=int, default=16, help="requests that may wait beyond those (then 429)")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds a request may run")
    p.add_argument("--drain-seconds", type=float, default=30.0, help="on SIGTERM, how long in-flight requests may finish")
    _engine_args(p)
    p.set_defaults(func=_cmd_serve)

    build.register_cli(sub)
    bench.register_cli(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(argv) if argv is not None else sys.argv[1:]  # recorded by train-demo
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return args.func(args) or 0
    except (ValueError, FileNotFoundError) as exc:
        print(f"staged-engine {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
