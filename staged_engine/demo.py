"""``staged-engine demo``: the embedded pair writes code, plain decoding against speculation.

The demo n-gram table (the staged second stage) is built on first use from the standard
library's sources (which every machine has; the pair's training corpus also holds packages
that differ between machines) with the pair's tokenizer, and cached under
``$STAGED_ENGINE_CACHE`` (default ``~/.cache/staged-engine``), keyed by the tokenizer and the
file list, so a later run loads it in a fraction of a second.
"""
from __future__ import annotations

import hashlib
import os
import sys
import sysconfig
import time

# Prompts as users write them: a signature and a docstring, ending in a newline.
DEMO_PROMPTS = [
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    'import os\n\n\ndef find_python_files(root):\n    """Yield the paths of all .py files below root."""\n',
    'class Stack:\n    """A last-in, first-out stack of items."""\n\n    def __init__(self):\n',
    'def read_config(path):\n    """Read a key = value configuration file into a dict."""\n',
    'def is_palindrome(text):\n    """Return True if text reads the same backwards, ignoring case."""\n',
]
SAMPLED = dict(temperature=0.8, top_p=0.95)  # the sampled half of the demo, with a fixed seed
NGRAM_ORDER = 3
NGRAM_TOP_M = 16  # continuations kept per context: bounds memory, the drafter asks for <= 12


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def stdlib_sources() -> tuple[str, list[str]]:
    """(root, sorted relative paths of the standard library's .py files, site-packages excluded)."""
    root = sysconfig.get_path("stdlib")
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in ("site-packages", "dist-packages", "__pycache__")]
        out.extend(os.path.relpath(os.path.join(dirpath, n), root).replace(os.sep, "/")
                   for n in filenames if n.endswith(".py"))
    return root, sorted(out)


def cache_dir() -> str:
    return os.environ.get("STAGED_ENGINE_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "staged-engine"))


def demo_ngram(tokenizer_path: str, log=_log):
    """The demo n-gram model: loaded from the cache, or built from the stdlib sources."""
    from .ngram import NGramModel

    root, files = stdlib_sources()
    key = hashlib.sha256()
    with open(tokenizer_path, "rb") as f:
        key.update(f.read())
    key.update("\n".join(files).encode())
    key.update(f"order={NGRAM_ORDER} top_m={NGRAM_TOP_M}".encode())
    path = os.path.join(cache_dir(), f"demo-{key.hexdigest()[:16]}.ngram")
    if os.path.isfile(path):
        try:
            return NGramModel.load(path)
        except ValueError as exc:  # a corrupt cache file is rebuilt, not trusted
            log(f"rebuilding the n-gram cache ({exc})")
    from tokenizers import Tokenizer

    t0 = time.perf_counter()
    tok = Tokenizer.from_file(tokenizer_path)
    texts = []
    for rel in files:
        with open(os.path.join(root, rel), "rb") as f:
            raw = f.read()
        try:
            texts.append(raw.decode("utf-8"))
        except UnicodeDecodeError:
            continue
    log(f"building the demo n-gram table from {len(texts)} stdlib files (first run only) ...")
    docs = []
    for i in range(0, len(texts), 512):
        docs.extend(e.ids for e in tok.encode_batch(texts[i:i + 512], add_special_tokens=False))
    ng = NGramModel.build(docs, order=NGRAM_ORDER, vocab_size=tok.get_vocab_size(), top_m=NGRAM_TOP_M)
    os.makedirs(cache_dir(), exist_ok=True)
    tmp = path + f".{os.getpid()}.tmp"
    ng.save(tmp)
    os.replace(tmp, path)
    log(f"  {sum(len(d) for d in docs) / 1e6:.1f}M tokens, {time.perf_counter() - t0:.1f}s; cached at {path}")
    return ng


def run(args) -> int:
    from .engine import Engine

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
    all_same, summary = True, []
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
        arms = [s.get("adaptive", {}) for _, s, _ in rows]
        total = sum(a["rounds"] for arm in arms for a in arm.values())
        plain_steps = sum(arm.get("0", {}).get("rounds", 0) for arm in arms)
        chosen = (f", {plain_steps / total:.0%} of rounds chosen as plain steps (drafting did not pay there)"
                  if total else "")
        summary.append(f"{mode}: plain {tp:.0f} tok/s, {strategy} {ts:.0f} tok/s, speedup {ts / tp:.2f}x, "
                       f"{sum(s['new_tokens'] for _, s, _ in rows) / calls:.2f} tokens per oracle call{chosen}, "
                       f"outputs identical: {same}")
    print("\nsummary")
    for line in summary:
        print("  " + line)
    print(f"  (total {time.perf_counter() - t0:.0f}s)")
    return 0 if all_same else 1
