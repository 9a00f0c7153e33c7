"""Shared benchmark plumbing: machine description, timing, JSON output."""
from __future__ import annotations

import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time

from tqdm import tqdm


def machine() -> dict:
    """What ran the benchmark: CPU model (with its x86 family and model), cores, memory, versions."""
    from staged_engine.spec.cost import cpu_identity  # the one reading of /proc/cpuinfo

    ident = cpu_identity()
    cpu, vector = ident["cpu"], ident["vector_extensions"]
    isa = "avx512" if "avx512f" in vector else ("avx2" if "avx2" in vector else "baseline")
    mem_gb = None
    try:
        mem_gb = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError):
        pass
    import torch

    info = {"cpu": cpu, "cpu_family_model": ident.get("cpu_family_model"),
            "isa": isa, "vector_extensions": vector, "cores": os.cpu_count(), "memory_gib": mem_gb,
            "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
            "torch_threads": torch.get_num_threads(), "python": sys.version.split()[0],
            "torch": torch.__version__, "platform": platform.platform()}
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    from staged_engine.spec.cost import native_build  # the kernels timed: build digest and block form

    info.update(native_build())
    try:
        info["git_commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                            text=True, cwd=os.path.dirname(__file__)).stdout.strip()
    except OSError:
        pass
    return info


def balanced_orders(items: list) -> list[list]:
    """Orders of ``items`` for interleaved runs, balanced for carryover (a Williams design): each
    item takes every place, and runs right after every other item, equally often (once over the n
    orders of an even count n, twice over the 2n of an odd one). A run inherits
    state from the one before it (what the last system left in the caches, its threads' wake-up):
    on the AVX2 Zen 3, plain decoding right after a drafting run took 1.1-1.35% longer than after
    another plain run, so an order where one system never follows a drafting run and another
    does half the time favours the first by about the margin the e2e's lines are judged by.
    Cycle through the orders, one a repeat: ``orders[k % len(orders)]``."""
    n = len(items)
    if n < 2:
        return [list(items)]
    first = [0] + [(j + 1) // 2 if j % 2 else n - j // 2 for j in range(1, n)]  # 0, 1, n-1, 2, n-2, ..
    rows = [[(x + r) % n for x in first] for r in range(n)]
    if n % 2:  # the mirror image: the pairs an odd square repeats come the other way round too
        rows += [row[::-1] for row in rows]
    return [[items[x] for x in row] for row in rows]


def order_of(orders: list[list], prompt: int, rep: int, repeats: int) -> list:
    """The order repeat ``rep`` of prompt ``prompt`` runs its systems in, in a bench that repeats
    each prompt ``repeats`` times in turn (e2e, dsbd): the next of ``orders`` each repeat."""
    return orders[(prompt * repeats + rep) % len(orders)]


PLAIN_SYSTEMS = ("plain", "plain_again")  # e2e's systems that run no draft (HF's are apart)


def carryover(rows: dict[str, dict], repeats: int) -> dict[str, dict[str, dict]]:
    """What each system's runs inherited from the run before them, in an e2e mode whose repeats took
    the orders ``balanced_orders(list(rows))`` gives, the next each repeat (``order_of``; e2e.py
    since 260198d). Each run's time is read against the median repeat of its prompt and system, as a
    log ratio, and grouped by the kind of system that ran right before it: ``plain`` (plain decoding
    or its A/A copy), ``hf`` or ``drafting`` (the rest); the mode's first run follows the warm-up
    and counts in no group. Returns, per system and group: the runs ``n``, the ``mean`` log ratio
    and its standard error ``se`` (None below two runs). With balanced orders every system has each
    predecessor equally often, so this moves no ratio of the e2e's tables: it shows what an
    unbalanced order would have added to one system and not another."""
    systems = list(rows)
    orders = balanced_orders(systems)
    n_prompts = len(rows[systems[0]]["runs"])
    times = {s: [r["repeat_seconds"] for r in rows[s]["runs"]] for s in systems}
    for s in systems:
        if len(times[s]) != n_prompts or any(len(t) != repeats for t in times[s]):
            raise ValueError(f"system {s!r} needs {repeats} repeat seconds for each of {n_prompts} prompts")
    mid = {s: [statistics.median(t) for t in times[s]] for s in systems}
    groups: dict[str, dict[str, list[float]]] = {s: {} for s in systems}
    before = None
    for i in range(n_prompts):
        for rep in range(repeats):
            for s in order_of(orders, i, rep, repeats):
                if before is not None:
                    kind = "plain" if before in PLAIN_SYSTEMS else "hf" if before.startswith("hf") else "drafting"
                    groups[s].setdefault(kind, []).append(math.log(times[s][i][rep] / mid[s][i]))
                before = s
    out: dict[str, dict[str, dict]] = {}
    for s in systems:
        out[s] = {}
        for kind, xs in groups[s].items():
            se = statistics.stdev(xs) / math.sqrt(len(xs)) if len(xs) > 1 else None
            out[s][kind] = {"n": len(xs), "mean": statistics.fmean(xs), "se": se}
    return out


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def timed(fn, repeats: int, warmup: int = 1) -> tuple[list[float], object]:
    """Run ``fn`` warmup + repeats times; return the repeat wall times (s) and the last result."""
    out = None
    for _ in range(warmup):
        out = fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return times, out


def result_path(name: str) -> str:
    """Where a result named ``name`` (a bench's --out) lives: bench/results/<name> for a
    relative name, the path itself for an absolute one."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", name)


def save(result: dict, name: str) -> str:
    path = result_path(name)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
    return path


def plot_path(out: str, default_out: str, default_stem: str) -> str:
    """Where a bench's PNG goes: bench/results/plots/<default_stem>.png for the default result
    file, else named after ``out`` (roofline_avx2.json -> roofline_avx2.png), so a second
    machine's run keeps the first's plot. An ``out`` with a directory of its own (``save``
    writes the JSON there, ``result_path``) takes its plot beside it: a trial run outside the
    checkout leaves nothing in it."""
    stem = default_stem if out == default_out else os.path.splitext(os.path.basename(out))[0]
    if os.path.dirname(out):
        return os.path.join(os.path.dirname(result_path(out)), stem + ".png")
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "plots", stem + ".png")


def publish(result: dict, markdown: str, name: str) -> str:
    """Attach the markdown table to ``result``, save it under bench/results/, print both."""
    result["markdown"] = markdown
    path = save(result, name)
    print(markdown)
    print(f"saved {path}")
    return path


def progress(msg: str) -> None:
    """A one-off message on stderr; loops over prompts or configs use :func:`progress_bar`."""
    print(msg, file=sys.stderr, flush=True)


def progress_bar(total: int, label: str, unit: str):
    """A tqdm bar on stderr for a loop of ``total`` steps: redrawn in place on a terminal; in a
    log (CI, a redirect) refreshed at most every 10 s, so logs stay short. ``set_postfix_str``
    shows what is running; call it and ``update`` outside timed regions."""
    tty = sys.stderr.isatty()
    return tqdm(total=total, desc=label, unit=f" {unit}", file=sys.stderr, dynamic_ncols=True,
                mininterval=0.1 if tty else 10.0, maxinterval=10.0 if tty else 60.0)


def add_model_and_prompt_args(ap) -> None:
    """The options every end-to-end benchmark shares: which checkpoints, which prompts, how long."""
    ap.add_argument("--oracle", help="oracle checkpoint directory (default: the demo pair)")
    ap.add_argument("--draft", help="draft checkpoint directory")
    ap.add_argument("--ngram", help="n-gram table for the staged strategy")
    ap.add_argument("--prompt-sets", nargs="+", default=["heldout", "humaneval"],
                    help="heldout (docstring prompts from packages the demo pair never saw), humaneval, "
                         "or paths to JSONL files with a 'prompt' field")
    ap.add_argument("--limit", type=int, default=None, help="first N prompts of each set")
    ap.add_argument("--new-tokens", type=int, default=128)


def checkpoint_dirs(paths: list[str] | None, defaults) -> dict[str, str]:
    """{name: directory} of the models a per-model bench measures: ``--models DIR ...`` named by
    their directories, else ``defaults()``; each must be a HF GPT-2 checkpoint directory."""
    models = {os.path.basename(os.path.normpath(p)): p for p in paths} if paths else defaults()
    for p in models.values():
        if not os.path.isfile(os.path.join(p, "config.json")):
            raise FileNotFoundError(f"{p}: no config.json (a HF GPT-2 checkpoint directory is expected)")
    return models


def round_to_bfloat16_(model) -> None:
    """Round ``model``'s parameters in place to bfloat16 values, as a checkpoint stored in bf16
    holds, setting element 0 of each matrix to 1e-7 first: below float16's subnormal spacing, as
    a bf16 checkpoint's tiniest weights are, so float16 cannot hold it and each product packs as
    bfloat16 (the engine's or HF's model; the values stay in their float32 tensors)."""
    import torch

    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.view(-1)[0] = 1e-7
            p.copy_(p.bfloat16().float())


def run_main(main) -> int:
    """A bench script's exit code from ``main()``: bad arguments (ValueError, a missing file) end
    in one line naming the script and the problem, exit code 2, as ``staged-engine`` itself
    does, not in a traceback; ^C in 130."""
    name = os.path.basename(sys.argv[0]) or "bench"
    try:
        return main() or 0
    except (ValueError, FileNotFoundError) as exc:
        print(f"{name}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """The first index where the token lists ``a`` and ``b`` differ, the shorter one's length when
    one extends the other, None when they are the same tokens."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def fmt(x, unit: str = "", digits: int = 2) -> str:
    """A table cell: empty for None, else the number with ``digits`` decimals and ``unit``."""
    return "" if x is None else f"{x:.{digits}f}{unit}"


PROMPT_SETS = {"heldout": os.path.join(os.path.dirname(os.path.abspath(__file__)), "prompts", "heldout.jsonl"),
               "humaneval": os.path.join(os.path.dirname(os.path.abspath(__file__)), "prompts", "humaneval.jsonl")}


def load_prompts(sets: list[str], limit: int | None) -> list[dict]:
    """Prompts of the named sets (first ``limit`` of each), exactly as written: a prompt that
    ends in a newline keeps it, as a user's would."""
    out = []
    for name in sets:
        path = PROMPT_SETS.get(name, name)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"prompt set {name!r}: {path} not found")
        with open(path, encoding="utf-8") as f:
            rows = [json.loads(line) for line in f if line.strip()]
        out.extend({"set": os.path.basename(name), "id": r.get("task_id", str(i)), "prompt": r["prompt"]}
                   for i, r in enumerate(rows[:limit]))
    return out


ROUND_COST_CHAINS = (1, 2, 3, 4)  # the fixed chains whose rounds the sweep's round-cost split is shown for


def chain_round_costs(sweep: dict) -> list[dict]:
    """The rows of a sweep (bench/sweep.py) for the fixed chains of ``ROUND_COST_CHAINS`` drafted
    tokens that carry the round-cost split (``round_plain_steps``: sweeps measured before it have
    none), shortest chain first."""
    rows = [x for x in sweep.get("rows", []) if x["strategy"] == "chain" and not x["planned"]
            and "round_plain_steps" in x and x["options"]["chain_length"] in ROUND_COST_CHAINS]
    return sorted(rows, key=lambda x: x["options"]["chain_length"])
