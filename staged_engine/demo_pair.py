"""The embedded demo pair: where its models live, its prompts (and whether its text loops), and
its n-gram stage.

The models are ``assets/demo/{oracle,draft}`` (HF GPT-2 directories trained by
``staged_engine.training``). The demo n-gram table (the staged second stage) is built on first use from the standard
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

DEMO_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets", "demo")

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


def loops(text: str) -> bool:
    """Whether a continuation repeats itself: a non-blank line repeated 4 or more times, fewer
    than 8 distinct words (issue 13's definition), or one word 8 or more times in a row, which
    the first two miss in a loop inside one line ("fibi, fibi, fibi, ..."). A small model's greedy
    text often loops, and a loop is easy to draft: the demo and the e2e bench flag it, so that no
    speedup is read off repeats alone."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    if any(lines.count(ln) >= 4 for ln in set(lines)):
        return True
    words = text.split()
    if len(set(words)) < 8:
        return True
    run = 1
    for a, b in zip(words, words[1:]):
        run = run + 1 if a == b else 1
        if run >= 8:
            return True
    return False


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
    from staged_engine.ngram import NGramModel

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
    ng.save(path)  # atomically
    log(f"  {sum(len(d) for d in docs) / 1e6:.1f}M tokens, {time.perf_counter() - t0:.1f}s; cached at {path}")
    return ng
