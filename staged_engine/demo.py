"""``staged-engine demo``: the embedded pair writes code, plain decoding against speculation.

The demo n-gram table (the staged second stage) is built on first use from the training split
of the corpus the pair was trained on, with the pair's tokenizer, and cached under
``$STAGED_ENGINE_CACHE`` (default ``~/.cache/staged-engine``), keyed by the tokenizer and
the corpus file list, so a later run loads it in a fraction of a second.
"""
from __future__ import annotations

import hashlib
import os
import sys
import time

# No prompt ends in a newline: the byte-level pre-tokenizer merges a newline with the next line's
# indentation, so a bare trailing newline is a token the models almost never saw end a line.
DEMO_PROMPTS = [
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""',
    'import os\n\n\ndef find_python_files(root):\n    """Yield the paths of all .py files below root."""',
    'class Stack:\n    """A last-in, first-out stack of items."""\n\n    def __init__(self):',
    'def parse_args(argv=None):\n    """Parse the command line and return the namespace."""\n    import argparse',
    'def read_config(path):\n    """Read a key = value configuration file into a dict."""\n    result = {}',
]
NGRAM_ORDER = 3
NGRAM_TOP_M = 16  # continuations kept per context: bounds memory, the drafter asks for <= 12


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def cache_dir() -> str:
    return os.environ.get("STAGED_ENGINE_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "staged-engine"))


def demo_ngram(tokenizer_path: str, log=_log):
    """The demo n-gram model: loaded from the cache, or built from the stdlib training split."""
    from . import train
    from .ngram import NGramModel

    root = train.stdlib_root()
    files = train.list_corpus(root)
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
    train_files, _ = train.split_corpus(files)
    log(f"building the demo n-gram table from {len(train_files)} stdlib files (first run only) ...")
    _, texts, _ = train.read_texts(root, train_files)
    docs = []
    for i in range(0, len(texts), 256):
        docs.extend(e.ids for e in tok.encode_batch(texts[i:i + 256], add_special_tokens=False))
        log(f"  tokenized {min(i + 256, len(texts))}/{len(texts)} files")
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
    # Warm up both paths once (first calls allocate caches and load kernels).
    eng.generate(DEMO_PROMPTS[0], max_new_tokens=8, strategy="plain")
    eng.generate(DEMO_PROMPTS[0], max_new_tokens=8, strategy=strategy)
    rows = []
    for i, prompt in enumerate(DEMO_PROMPTS[:args.prompts]):
        plain = eng.generate(prompt, max_new_tokens=args.max_new_tokens, strategy="plain")
        spec = eng.generate(prompt, max_new_tokens=args.max_new_tokens, strategy=strategy)
        same = plain.token_ids == spec.token_ids
        print(f"\n=== prompt {i + 1} ({strategy}; output {'identical to' if same else 'DIFFERS from'} plain decoding)")
        print(prompt + spec.text)
        s, p = spec.stats, plain.stats
        print(f"--- plain {p['tokens_per_second']:.0f} tok/s | {strategy} {s['tokens_per_second']:.0f} tok/s "
              f"({s['tokens_per_second'] / p['tokens_per_second']:.2f}x) | "
              f"{s['tokens_per_oracle_call']:.2f} tokens per oracle call | "
              f"{s['draft_calls'] / max(1, s['oracle_calls']):.1f} draft passes per round")
        rows.append((p, s, same))
    tp = sum(p["new_tokens"] for p, _, _ in rows) / sum(p["decode_seconds"] for p, _, _ in rows)
    ts = sum(s["new_tokens"] for _, s, _ in rows) / sum(s["decode_seconds"] for _, s, _ in rows)
    calls = sum(s["oracle_calls"] for _, s, _ in rows)
    print(f"\nsummary: plain {tp:.0f} tok/s, {strategy} {ts:.0f} tok/s, speedup {ts / tp:.2f}x, "
          f"{sum(s['new_tokens'] for _, s, _ in rows) / calls:.2f} tokens per oracle call, "
          f"outputs identical: {all(same for _, _, same in rows)} "
          f"(total {time.perf_counter() - t0:.0f}s)")
    return 0 if all(same for _, _, same in rows) else 1
