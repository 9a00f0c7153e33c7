"""Differential fuzzing of the n-gram file loader (C++ and pure-Python backends).

Every input goes to both loaders. Each must either raise ValueError or load a model; when both
load, both must re-serialise to exactly the input (the format is canonical) and answer the same
queries. Any other exception, a disagreement, or a crash of the process is a failure.

Inputs are mutations of valid files (bit flips, interesting integers written over header and
body fields, truncation, splicing, insertion, garbage), usually with both CRCs recomputed so
that the structural checks behind the checksums are reached, plus raw garbage.

The pytest test below runs a short, seeded campaign in a subprocess (so a segfault fails it).
Long campaigns run this file as a script:

    python tests/test_ngram_loader_fuzz.py --seconds 180 --out bench/results/ngram_fuzz.json
    # coverage-guided (atheris, guided by the Python loader's branches):
    PYTHONPATH=/path/to/atheris python tests/test_ngram_loader_fuzz.py --atheris --seconds 180
    # against an AddressSanitizer + UBSan build of csrc/ (no torch needed), in /tmp/asan:
    g++ -O1 -g -fsanitize=address,undefined -fno-sanitize-recover=undefined -std=c++17 \
        -shared -fPIC -I<torch/include (pybind11)> -I<python include> csrc/ngram.cpp \
        -o /tmp/asan/_ngram$(python3-config --extension-suffix)
    LD_PRELOAD="$(gcc -print-file-name=libasan.so) $(gcc -print-file-name=libstdc++.so)" \
        ASAN_OPTIONS=detect_leaks=0 python tests/test_ngram_loader_fuzz.py --cpp-module /tmp/asan
    (libstdc++ is preloaded too, or ASan cannot intercept C++ throws from a python binary.)
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import random
import re
import subprocess
import sys
import time
import zlib
from typing import Any, Callable

INTERESTING = [0, 1, 2, 3, 7, 8, 12, 127, 128, 255, 256, 2**16, 2**21 - 1, 2**21, 2**31 - 1,
               2**31, 2**32 - 1, 2**32, 2**61, 2**62, 2**63 - 1, 2**63, 2**64 - 1]


def fix_crcs(b: bytearray) -> bytearray:
    """Recompute the body and header CRCs in place (no-op on a too-short input)."""
    if len(b) >= 128:
        b[104:108] = zlib.crc32(bytes(b[128:])).to_bytes(4, "little")
        b[108:112] = zlib.crc32(bytes(b[:108])).to_bytes(4, "little")
    return b


def make_seeds(rng: random.Random, n: int = 24) -> list[bytes]:
    """Valid files of small random models: orders 1..4, pruned or not, with updates."""
    from staged_engine.ngram import NGramModel

    seeds = []
    for i in range(n):
        vocab = rng.choice([1, 2, 5, 40, 300, 2**21])
        docs = [[rng.randrange(min(vocab, 64)) * (1 if vocab < 2**21 else 32749)
                 for _ in range(rng.randint(0, 60))] for _ in range(rng.randint(1, 4))]
        m = NGramModel.build(docs, order=1 + i % 4, vocab_size=vocab,
                             top_m=rng.choice([None, 1, 3]), min_count=rng.choice([1, 1, 2]),
                             backend="python")
        if rng.random() < 0.5:
            m.update([rng.randrange(min(vocab, 64)) for _ in range(10)])
        seeds.append(m.to_bytes())
    return seeds


def mutate(seed: bytes, rng: random.Random, seeds: list[bytes]) -> bytes:
    """One random mutation of seed; CRCs recomputed with probability 0.8."""
    b = bytearray(seed)
    for _ in range(rng.choice([1, 1, 1, 2, 3])):
        op = rng.randrange(9)
        if op == 0 and b:  # bit flip
            i = rng.randrange(len(b))
            b[i] ^= 1 << rng.randrange(8)
        elif op == 1 and len(b) >= 8:  # interesting integer over a header field or body word
            width = rng.choice([4, 8])
            if rng.random() < 0.5:
                off = rng.choice([8, 12, 16, 20, 24, 32, 40, 48, 56, 64, 72, 80, 88, 96])
            else:
                off = rng.randrange(0, len(b) - width + 1)
            v = rng.choice(INTERESTING) + rng.choice([0, 0, -1, 1])
            v %= 2 ** (8 * width)
            b[off:off + width] = v.to_bytes(width, "little")[: max(0, len(b) - off)]
        elif op == 2:  # truncate
            del b[rng.randrange(len(b) + 1):]
        elif op == 3:  # append garbage
            b += bytes(rng.randrange(256) for _ in range(rng.choice([1, 4, 8, 12, 100])))
        elif op == 4 and b:  # delete a range
            i = rng.randrange(len(b))
            del b[i:i + rng.choice([1, 4, 8, 12])]
        elif op == 5 and b:  # insert bytes
            i = rng.randrange(len(b) + 1)
            b[i:i] = bytes(rng.randrange(256) for _ in range(rng.choice([1, 4, 8])))
        elif op == 6:  # splice with another seed
            other = rng.choice(seeds)
            cut = rng.randrange(min(len(b), len(other)) + 1)
            b = b[:cut] + bytearray(other[cut:])
        elif op == 7 and len(b) > 136:  # copy one 8-byte word of the body over another
            i, j = rng.randrange(128, len(b) - 8), rng.randrange(128, len(b) - 8)
            b[j:j + 8] = b[i:i + 8]
        elif op == 8 and len(b) > 128:  # make the header's body size agree with the file
            b[96:104] = (len(b) - 128).to_bytes(8, "little")
    if rng.random() < 0.8:
        fix_crcs(b)
    return bytes(b)


def random_input(rng: random.Random, seeds: list[bytes]) -> bytes:
    r = rng.random()
    if r < 0.05:  # raw garbage
        return bytes(rng.randrange(256) for _ in range(rng.choice([0, 5, 128, 200, 1000])))
    if r < 0.10:  # a valid header prefix with a garbage body
        s = rng.choice(seeds)
        return bytes(fix_crcs(bytearray(s[:128] + bytes(rng.randrange(256) for _ in range(
            rng.randrange(200))))))
    return mutate(rng.choice(seeds), rng, seeds)


class Mismatch(AssertionError):
    """The two loaders disagreed, or a loader failed in a way other than ValueError."""


def check_one(data: bytes, loaders: dict[str, Callable[[bytes], Any]]) -> str:
    """Load data with every backend; return 'valid' or the (shared) error kind."""
    outcomes: dict[str, Any] = {}
    for name, load in loaders.items():
        try:
            outcomes[name] = ("ok", load(data))
        except ValueError as exc:
            outcomes[name] = ("err", str(exc))
        except Exception as exc:  # noqa: BLE001 - anything but ValueError is a finding
            raise Mismatch(f"{name} raised {type(exc).__name__}: {exc}") from exc
    kinds = {k: v[0] for k, v in outcomes.items()}
    if len(set(kinds.values())) != 1:
        raise Mismatch(f"loaders disagree: { {k: v[1] if v[0] == 'err' else 'loaded' for k, v in outcomes.items()} }")
    first = next(iter(outcomes.values()))
    if first[0] == "err":  # "n-gram file: body size 8 in the header, ..." -> "body size N in ..."
        return re.sub(r"\d+", "N", first[1].split(": ", 1)[-1]).split(" (")[0].split(",")[0]
    models = [v[1] for v in outcomes.values()]
    for m in models:
        if m.to_bytes() != data:
            raise Mismatch("a loaded file does not re-serialise to itself")
    rng = random.Random(len(data))
    vocab = models[0].vocab_size
    for _ in range(20):
        ctx = [rng.randrange(vocab) for _ in range(rng.randint(0, 4))]
        k = rng.choice([1, 3, 12, 40])
        if len({repr(m.topk(ctx, k)) for m in models}) != 1 or \
                len({repr(m.propose(ctx, [12, 7, 4, 1, 1, 1])) for m in models}) != 1:
            raise Mismatch(f"backends answer differently for {ctx}, k={k}")
    return "valid"


def make_loaders(cpp_module: str | None) -> dict[str, Callable[[bytes], Any]]:
    from staged_engine import ngram

    loaders: dict[str, Callable[[bytes], Any]] = {"python": ngram.ReferenceNGram.from_bytes}
    if cpp_module:  # e.g. an AddressSanitizer build of csrc/ named _ngram in that directory
        sys.path.insert(0, cpp_module)
        loaders["cpp"] = importlib.import_module("_ngram").Model.from_bytes
    elif ngram.cpp_available():
        from staged_engine import _ngram  # the C++ loader itself

        loaders["cpp"] = _ngram.Model.from_bytes
    return loaders


def campaign(seconds: float, seed: int, max_inputs: int, cpp_module: str | None) -> dict:
    """Run the mutational campaign; returns a summary (raises Mismatch on a finding)."""
    rng = random.Random(seed)
    seeds = make_seeds(rng)
    loaders = make_loaders(cpp_module)
    outcomes: dict[str, int] = {}
    t0 = time.perf_counter()
    n = 0
    while n < max_inputs and time.perf_counter() - t0 < seconds:
        data = random_input(rng, seeds) if n >= len(seeds) else seeds[n]
        try:
            kind = check_one(data, loaders)
        except Mismatch as exc:
            raise Mismatch(f"input #{n} (seed {seed}, {len(data)} bytes "
                           f"{data[:160].hex()}...): {exc}") from exc
        outcomes[kind] = outcomes.get(kind, 0) + 1
        n += 1
    return {"mode": "mutational", "seed": seed, "inputs": n,
            "seconds": round(time.perf_counter() - t0, 1), "backends": sorted(loaders),
            "outcomes": dict(sorted(outcomes.items(), key=lambda kv: -kv[1]))}


def atheris_campaign(seconds: float, cpp_module: str | None, corpus_dir: str,
                     out: str | None) -> None:
    """Coverage-guided run (atheris/libFuzzer over the Python loader's branches); every input
    is checked as is and with its CRCs fixed. The summary is rewritten every 5 s to `out`."""
    import atheris

    import staged_engine  # noqa: F401  (torch and the rest stay uninstrumented)

    sys.modules.pop("staged_engine.ngram", None)
    with atheris.instrument_imports(include=["staged_engine.ngram"]):
        from staged_engine import ngram  # noqa: F401
    loaders = make_loaders(cpp_module)
    os.makedirs(corpus_dir, exist_ok=True)
    for i, s in enumerate(make_seeds(random.Random(0))):
        with open(os.path.join(corpus_dir, f"seed{i}"), "wb") as f:
            f.write(s)
    stats = {"mode": "atheris (coverage-guided on the Python loader)", "inputs": 0,
             "backends": sorted(loaders), "command": " ".join(sys.argv),
             "python": platform.python_version(), "atheris": getattr(atheris, "__version__", None),
             "outcomes": {}}
    t0 = last = time.perf_counter()

    def one(data: bytes) -> None:
        nonlocal last
        for d in (data, bytes(fix_crcs(bytearray(data)))):  # also past the checksums
            kind = check_one(d, loaders)
            stats["outcomes"][kind] = stats["outcomes"].get(kind, 0) + 1
            stats["inputs"] += 1
        if out and time.perf_counter() - last > 5:
            last = time.perf_counter()
            stats["seconds"] = round(last - t0, 1)
            with open(out, "w") as f:
                json.dump(stats, f, indent=2)

    atheris.Setup([sys.argv[0], corpus_dir, f"-max_total_time={int(seconds)}",
                   "-print_final_stats=1"], one)
    atheris.Fuzz()


# ----------------------------------------------------------------------------------------------
# pytest: a short campaign in a subprocess


def test_loader_short_fuzz_in_subprocess():
    here = os.path.abspath(__file__)
    proc = subprocess.run([sys.executable, here, "--max-inputs", "1500", "--seconds", "25",
                           "--seed", "1234"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (f"fuzz child failed (rc {proc.returncode}; negative = killed "
                                  f"by a signal):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["inputs"] >= 300, summary
    assert summary["outcomes"].get("valid", 0) >= 24, summary  # the seeds at least
    assert sum(v for k, v in summary["outcomes"].items() if k != "valid") >= 200, summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--max-inputs", type=int, default=10**12)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cpp-module", help="directory holding a separately built _ngram module")
    ap.add_argument("--atheris", action="store_true", help="coverage-guided run with atheris")
    ap.add_argument("--corpus", default="/tmp/ngram_fuzz_corpus", help="atheris corpus dir")
    ap.add_argument("--out", help="write the JSON summary here too")
    args = ap.parse_args()
    if args.atheris:
        atheris_campaign(args.seconds, args.cpp_module, args.corpus, args.out)
        return
    summary = campaign(args.seconds, args.seed, args.max_inputs, args.cpp_module)
    summary.update(command=" ".join(sys.argv), python=platform.python_version(),
                   machine=platform.node(), cpp_module=args.cpp_module or "staged_engine._ngram",
                   asan=bool(os.environ.get("LD_PRELOAD", "").count("asan")))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=2)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
