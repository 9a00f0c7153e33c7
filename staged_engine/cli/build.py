"""``staged-engine ngram-build``, ``train-demo`` and ``train-pilot``: the commands that build models.

The n-gram table is built here from a corpus; the demo pair's training lives in
``staged_engine.training`` (never imported by the runtime), which registers its own commands.
"""
from __future__ import annotations

import argparse
import errno
import os
import sys
import time
from typing import Any, Iterator, Sequence

from staged_engine.training import cli as training_cli

_ID_SUFFIXES = (".ids", ".tokens")


def _register_ngram_build(subparsers: Any) -> None:
    """Add the ``ngram-build`` subcommand to an argparse subparsers object.

    The parser's default ``func`` is ``run_ngram_build(args) -> int`` (exit status).
    """
    p = subparsers.add_parser(
        "ngram-build",
        help="build an n-gram draft table (.ngram) from a corpus",
        description=(
            "Count the n-grams of a corpus and write a staged-engine n-gram file.\n\n"
            "Inputs are directories (every file matching --glob below them, one document per\n"
            "file), source/text files (tokenized with --tokenizer, one document per file),\n"
            "token-id files (*.ids / *.tokens: whitespace-separated integers, one document\n"
            "per line) or *.npy integer arrays (1-D: one document; 2-D: one per row)."
        ),
        epilog=(
            "examples:\n"
            "  staged-engine ngram-build --tokenizer tokenizer.json src/ -o code.ngram\n"
            "  staged-engine ngram-build corpus.ids --order 4 --top-m 32 --min-count 2 -o c.ngram"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("inputs", nargs="+", metavar="INPUT",
                   help="directories, text/source files, token-id files (*.ids, *.tokens, *.npy)")
    p.add_argument("--tokenizer", metavar="TOKENIZER_JSON",
                   help="HuggingFace tokenizers file used for text inputs (any tokenizer.json)")
    p.add_argument("--glob", default="*.py", help="file pattern inside directories (default: *.py)")
    p.add_argument("--order", type=int, default=3, help="n, 1..4 (default: 3)")
    p.add_argument("--top-m", type=int, default=None,
                   help="keep at most M continuations per context (default: all)")
    p.add_argument("--min-count", type=int, default=1,
                   help="drop n-grams seen fewer times than this (default: 1)")
    p.add_argument("--vocab-size", type=int, default=None,
                   help="default: the tokenizer's vocabulary size, else max id + 1")
    p.add_argument("--backend", choices=("auto", "cpp", "python"), default=None,
                   help="n-gram backend (default: auto)")
    p.add_argument("--output", "-o", required=True, help="path of the .ngram file to write")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress output")
    p.set_defaults(func=run_ngram_build)


def _expand_inputs(inputs: Sequence[str], pattern: str) -> list[str]:
    from pathlib import Path

    files: list[str] = []
    for item in inputs:
        path = Path(item)
        if path.is_dir():
            files.extend(str(f) for f in sorted(path.rglob(pattern)) if f.is_file())
        elif path.is_file():
            files.append(str(path))
        else:
            raise FileNotFoundError(errno.ENOENT, "input not found", item)
    return files


def _read_documents(files: Sequence[str], tokenizer: Any, log: Any) -> Iterator[Any]:
    """Yield one int sequence per document (text files are tokenized 64 at a time); `log`
    (or None) gets a progress line about every 2 seconds and at the end."""
    batch: list[str] = []
    n_tokens = 0
    t0 = last = time.perf_counter()

    def flush() -> Iterator[list[int]]:
        nonlocal n_tokens
        for enc in tokenizer.encode_batch(batch, add_special_tokens=False) if batch else ():
            n_tokens += len(enc.ids)
            yield enc.ids
        batch.clear()

    for i, f in enumerate(files):
        if f.endswith(".npy"):
            import numpy as np

            arr = np.load(f, allow_pickle=False)
            for row in arr if arr.ndim == 2 else [arr]:
                n_tokens += len(row)
                yield row
        elif f.endswith(_ID_SUFFIXES):
            with open(f, encoding="ascii") as fh:
                for lineno, line in enumerate(fh, 1):
                    if line.strip():
                        try:
                            ids = [int(x) for x in line.split()]
                        except ValueError:
                            raise ValueError(f"{f}:{lineno}: expected integers") from None
                        n_tokens += len(ids)
                        yield ids
        else:
            if tokenizer is None:
                raise ValueError(f"--tokenizer: needed to tokenize the text file {f}")
            with open(f, encoding="utf-8", errors="replace") as fh:
                batch.append(fh.read())
            if len(batch) >= 64:
                yield from flush()
        if log and time.perf_counter() - last > 2.0:
            last = time.perf_counter()
            log(f"read {i + 1 - len(batch)}/{len(files)} files, {n_tokens / 1e6:.2f}M tokens "
                f"({last - t0:.1f} s)")
    yield from flush()
    if log:
        log(f"read {len(files)} files, {n_tokens / 1e6:.2f}M tokens "
            f"({time.perf_counter() - t0:.1f} s)")


def run_ngram_build(args: argparse.Namespace) -> int:
    """Run ``ngram-build`` from parsed arguments; returns the exit status."""
    from staged_engine.ngram import NGramModel  # here, not at import: it loads torch (the parser does not)

    def log(msg: str) -> None:
        if not args.quiet:
            print(f"ngram-build: {msg}", file=sys.stderr, flush=True)

    tokenizer = None
    vocab_size = args.vocab_size
    if args.tokenizer:
        if not os.path.isfile(args.tokenizer):
            raise FileNotFoundError(errno.ENOENT, "tokenizer file not found", args.tokenizer)
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(args.tokenizer)
        if vocab_size is None:
            vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        log(f"tokenizer {args.tokenizer}: vocabulary {vocab_size}")
    files = _expand_inputs(args.inputs, args.glob)
    if not files:
        raise ValueError(f"inputs: no files found (pattern {args.glob!r})")
    log(f"{len(files)} input files")
    docs = list(_read_documents(files, tokenizer, log))
    n_tokens = sum(len(d) for d in docs)
    t0 = time.perf_counter()
    model = NGramModel.build(docs, order=args.order, vocab_size=vocab_size, top_m=args.top_m,
                             min_count=args.min_count, backend=args.backend)
    del docs
    dt = time.perf_counter() - t0
    log(f"built order-{model.order} model over {n_tokens / 1e6:.2f}M tokens in {dt:.2f} s: "
        f"{model.num_contexts} contexts, {model.num_entries} entries")
    model.save(args.output)
    log(f"wrote {args.output} ({os.path.getsize(args.output) / 1e6:.1f} MB)")
    return 0


def register_cli(subparsers: Any) -> None:
    _register_ngram_build(subparsers)
    training_cli.register_cli(subparsers)
