"""Shared benchmark plumbing: machine description, timing, JSON output."""
from __future__ import annotations

import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time


def machine() -> dict:
    """What ran the benchmark: CPU model, cores, memory, versions."""
    cpu = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((ln for ln in f if ln.startswith("flags")), "")
    except OSError:
        pass
    isa = "avx512" if "avx512f" in flags else ("avx2" if "avx2" in flags else "baseline")
    vector = sorted(f for f in flags.split()[2:] if f.startswith(("avx", "fma", "f16c", "amx")))
    mem_gb = None
    try:
        mem_gb = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError):
        pass
    import torch

    info = {"cpu": cpu, "isa": isa, "vector_extensions": vector, "cores": os.cpu_count(), "memory_gib": mem_gb,
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
    try:
        info["git_commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                            text=True, cwd=os.path.dirname(__file__)).stdout.strip()
    except OSError:
        pass
    return info


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


def save(result: dict, name: str) -> str:
    out_dir = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, name)
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
    return path


def publish(result: dict, markdown: str, name: str) -> str:
    """Attach the markdown table to ``result``, save it under bench/results/, print both."""
    result["markdown"] = markdown
    path = save(result, name)
    print(markdown)
    print(f"saved {path}")
    return path


def progress(msg: str) -> None:
    """A one-off message on stderr; loops over prompts or configs use :class:`ProgressBar`."""
    print(msg, file=sys.stderr, flush=True)


def _duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f}s"
    m, s = divmod(int(round(seconds)), 60)
    return f"{m}m{s:02d}s" if m < 60 else f"{m // 60}h{m % 60:02d}m"


class ProgressBar:
    """Progress of a loop of ``total`` steps on stderr, dependency-free.

    On a terminal (``stream.isatty()``) one line is redrawn in place with ``\\r``::

        [greedy] staged  |#########-----------|  45/64 prompts  12.3s elapsed, ETA 4.1s

    Elsewhere (CI, a redirected log) it prints a plain line without the bar, and only when a step
    completes and either ``every`` of the total (10%) has been done or ``min_interval`` seconds
    (10) have passed since the last line; always a final line. Logs stay short::

        [greedy] 45/64 prompts (70%)  12.3s elapsed, ETA 4.1s

    ``update(advance=1, status=None)`` advances and/or changes the status text shown after the
    label (None keeps it). Call it outside timed regions: it formats and writes. ``close()`` (or
    leaving a ``with`` block) writes the final line. ``stream``, ``tty`` and ``clock`` are for tests.
    """

    def __init__(self, total: int, label: str = "", unit: str = "", *, status_width: int = 0,
                 width: int = 20, every: float = 0.1, min_interval: float = 10.0,
                 stream=None, tty: bool | None = None, clock=time.monotonic) -> None:
        self.total, self.label, self.unit = max(0, int(total)), label, unit
        self.status, self.status_width, self.width = "", status_width, width
        self.every, self.min_interval = every, min_interval
        self.stream = stream if stream is not None else sys.stderr
        if tty is None:
            try:
                tty = self.stream.isatty()
            except (AttributeError, ValueError):
                tty = False
        self.tty, self.clock = tty, clock
        self.n, self.t0 = 0, clock()
        self._last_n, self._last_t, self._drawn, self._closed = 0, self.t0, 0, False

    def __enter__(self) -> "ProgressBar":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def update(self, advance: int = 1, status: str | None = None) -> None:
        if self._closed:
            return
        self.n = min(self.n + advance, self.total) if self.total else self.n + advance
        if status is not None:
            self.status = status
        now = self.clock()
        if self.tty:
            self._draw(now)
        elif advance > 0 and (self.n >= self.total
                              or self.n - self._last_n >= max(1.0, self.every * self.total)
                              or now - self._last_t >= self.min_interval):
            self._line(now)

    def close(self) -> None:
        """Write the final line (once)."""
        if self._closed:
            return
        now = self.clock()
        if self.tty:
            self._draw(now)
            self.stream.write("\n")
            self.stream.flush()
        elif self.n != self._last_n or self.n == 0:
            self._line(now)
        self._closed = True

    def _text(self, now: float, bar: bool, room: int | None = None) -> str:
        elapsed = now - self.t0
        count = f"{self.n}/{self.total} {self.unit}".rstrip() if self.total else f"{self.n} {self.unit}".rstrip()
        if not bar and self.total:
            count += f" ({100 * self.n // self.total}%)"
        if self.total and self.n >= self.total:
            timing = f"{_duration(elapsed)} elapsed, done"
        elif self.n and self.total:
            timing = f"{_duration(elapsed)} elapsed, ETA {_duration(elapsed / self.n * (self.total - self.n))}"
        else:
            timing = f"{_duration(elapsed)} elapsed"
        tail = count
        if bar and self.total:
            filled = self.width * self.n // self.total
            tail = f"|{'#' * filled}{'-' * (self.width - filled)}|  {count}"
        tail += f"  {timing}"
        if not bar:  # a log line: the status (what the last step did) goes last
            return "  ".join(x for x in (f"{self.label} {tail}".strip(), self.status.strip()) if x)
        status = self.status.ljust(self.status_width)
        if room is not None:  # keep the line within the terminal: shorten the status
            status = status[:max(0, room - len(self.label) - len(tail) - 4)]
        head = " ".join(x for x in (self.label, status) if x)
        return f"{head}  {tail}" if head else tail

    def _draw(self, now: float) -> None:
        room = shutil.get_terminal_size((100, 24)).columns - 1
        text = self._text(now, bar=True, room=room)
        self.stream.write("\r" + text + " " * max(0, self._drawn - len(text)))
        self.stream.flush()
        self._drawn = len(text)

    def _line(self, now: float) -> None:
        print(self._text(now, bar=False), file=self.stream, flush=True)
        self._last_n, self._last_t = self.n, now


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


def loops(text: str) -> bool:
    """A continuation loops if a non-blank line repeats 4 or more times, or if it holds fewer
    than 8 distinct words (the definition of issue 13's acceptance line 3)."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    if any(lines.count(ln) >= 4 for ln in set(lines)):
        return True
    return len(set(text.split())) < 8
