"""Extract HumanEval-style prompts from the HELD-OUT packages of the demo corpus.

The held-out packages (``staged_engine.training.corpus.HELD_OUT``) never enter the demo pair's
training, so these prompts measure code the models have not seen, as a user's would be. Each
prompt ends in a newline, as HumanEval's do and as users write them.

A prompt is the module's top-level imports, a blank line pair, then one top-level ``def``
(decorators included) up to and including the last line of its docstring, so the model
continues with the body. Files, functions and the order are deterministic (sorted validation
files, functions in source order, at most --per-file per file); a prompt longer than
--max-tokens demo-tokenizer tokens is retried without the imports, then skipped.

    python bench/prompts/extract.py            # writes bench/prompts/heldout.jsonl
    python bench/prompts/extract.py --humaneval /work/shared/data/humaneval_prompts.jsonl
"""
from __future__ import annotations

import argparse
import ast
import hashlib
import json
import os
import re
import statistics

from staged_engine.training import corpus

HERE = os.path.dirname(os.path.abspath(__file__))

DEFAULT_TOKENIZER = os.path.join(os.path.dirname(os.path.dirname(HERE)), "staged_engine", "assets",
                                 "demo", "oracle", "tokenizer.json")


def _segment(lines: list[str], start: int, end: int) -> str:
    """Source lines start..end (1-based, inclusive), newline-terminated."""
    return "".join(lines[start - 1:end]).rstrip("\n") + "\n"


def prompts_from_source(text: str) -> list[tuple[str, str, str]]:
    """(function name, prompt with imports, prompt without imports) for each top-level def
    whose first statement is a docstring."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return []
    lines = re.findall(r"[^\n]*\n|[^\n]+$", text)  # ast counts lines at "\n" only, not "\f"
    imports = "".join(_segment(lines, n.lineno, n.end_lineno) for n in tree.body
                      if isinstance(n, (ast.Import, ast.ImportFrom)))
    out = []
    for node in tree.body:
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or not node.body:
            continue
        first = node.body[0]
        if not (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)):
            continue
        if len(node.body) < 2:  # nothing after the docstring: no body to continue with
            continue
        start = node.decorator_list[0].lineno if node.decorator_list else node.lineno
        # The docstring must end its line (no `"""doc"""; x = 1`); offsets are UTF-8 bytes.
        if lines[first.end_lineno - 1].encode("utf-8")[first.end_col_offset:].strip():
            continue
        body = _segment(lines, start, first.end_lineno)
        full = (imports + "\n\n" + body) if imports else body
        out.append((node.name, full, body))
    return out


def extract(tokenizer_path: str, max_tokens: int, per_file: int) -> tuple[list[dict], dict]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(tokenizer_path)
    docs = corpus.build(log=lambda m: None).held_out
    rows, too_long = [], 0
    for rel, text in sorted(docs):
        n_file = 0
        for name, full, bare in prompts_from_source(text):
            if n_file >= per_file:
                break
            prompt = full if len(tok.encode(full).ids) <= max_tokens else bare
            if len(tok.encode(prompt).ids) > max_tokens:
                too_long += 1
                continue
            rows.append({"task_id": f"HeldOut/{len(rows)}", "prompt": prompt, "source_file": rel,
                         "entry_point": name})
            n_file += 1
    # A fixed pseudo-random order, so that the first N prompts (--limit N) mix every package.
    rows.sort(key=lambda r: hashlib.sha256(f"{r['source_file']}:{r['entry_point']}".encode()).hexdigest())
    for i, r in enumerate(rows):
        r["task_id"] = f"HeldOut/{i}"
    info = {"packages": sorted(corpus.HELD_OUT), "files": len(docs), "too_long": too_long, "prompts": len(rows)}
    return rows, info


def length_stats(lengths: list[int]) -> dict:
    s = sorted(lengths)
    q = lambda p: s[min(len(s) - 1, int(p * len(s)))]  # noqa: E731
    return {"n": len(s), "min": s[0], "p25": q(0.25), "median": statistics.median(s), "mean": round(
        statistics.fmean(s), 1), "p75": q(0.75), "p90": q(0.90), "max": s[-1]}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--tokenizer", default=DEFAULT_TOKENIZER, help="demo tokenizer.json")
    ap.add_argument("--out", default=os.path.join(HERE, "heldout.jsonl"), help="JSONL to write")
    ap.add_argument("--max-tokens", type=int, default=400, help="longest prompt in demo tokens")
    ap.add_argument("--per-file", type=int, default=2, help="most prompts taken from one file")
    ap.add_argument("--humaneval", default=None,
                    help="also print the token-length distribution of this HumanEval prompts JSONL")
    args = ap.parse_args(argv)
    rows, info = extract(args.tokenizer, args.max_tokens, args.per_file)
    with open(args.out, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(args.tokenizer)
    print(json.dumps({**info, "out": args.out,
                      "tokens": length_stats([len(tok.encode(r["prompt"]).ids) for r in rows]),
                      "files_used": len({r["source_file"] for r in rows})}))
    if args.humaneval:
        with open(args.humaneval, encoding="utf-8") as f:
            he = [json.loads(line) for line in f if line.strip()]
        print(json.dumps({"humaneval": args.humaneval,
                          "tokens": length_stats([len(tok.encode(r["prompt"]).ids) for r in he])}))


if __name__ == "__main__":
    main()
