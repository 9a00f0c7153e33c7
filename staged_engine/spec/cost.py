"""What a forward pass costs on this machine: measured once, cached, corrected online.

A ``CostProfile`` holds, for one model on one machine, the median time of a forward pass over
N new nodes (N in ``NODES``, 1-64) at two context lengths, and interpolates between them. It is
measured at first use in well under 2 seconds (``measure``) and cached as JSON under
``$STAGED_ENGINE_CACHE/profiles/``, keyed by everything that changes the figures: the model's
shape, dtype and a fingerprint of its weights, the backend, the CPU model and vector
extensions, the thread count, the library versions and the native kernels' build. A file that does not parse, carries
another key or holds a non-finite or non-positive figure is measured afresh, never trusted.

The planner (``spec.planner``) reads these tables; a running ratio of measured to predicted
time per model corrects them for what a profile cannot see (caches shared with the other
model, a busy neighbour), so the profile sets the shape of the curve and the run its level.
"""
from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import math
import os
import platform
import time
import warnings
from dataclasses import dataclass

import torch

from staged_engine.checks import atomic_path

SCHEMA = 2
NODES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
_VECTOR_PREFIXES = ("avx", "fma", "f16c", "amx", "neon", "asimd", "sve")


def cpu_identity() -> dict:
    """The CPU model, its x86 family and model numbers (a guest's model name may say only "AMD
    EPYC", which covers several core generations), its vector extensions and core count (from
    /proc/cpuinfo where present)."""
    name, flags, family, model = None, set(), None, None
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and name is None:
                    name = value.strip()
                elif key == "cpu family" and family is None:
                    family = value.strip()
                elif key == "model" and model is None:
                    model = value.strip()
                elif key in ("flags", "Features") and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    name = name or platform.processor() or platform.machine() or "unknown"
    ident = {"cpu": name, "vector_extensions": sorted(f for f in flags if f.startswith(_VECTOR_PREFIXES)),
             "cores": os.cpu_count() or 1}
    if family is not None and model is not None:
        ident["cpu_family_model"] = f"family {family} model {model}"
    return ident


def model_fingerprint(model) -> str:
    """A short hash of a model's shape, dtype, device, LM head rows (``GPT2.head_rows``) and a
    sample of its weights (every tensor's first and last 64 values): two checkpoints of one shape
    do not share a profile, nor does a draft with a cut head share the whole head's."""
    h = hashlib.sha256()
    c = model.config
    h.update(json.dumps([c.vocab_size, c.n_positions, c.n_embd, c.n_layer, c.n_head, c.mlp_dim,
                         c.activation_function, str(model.wte.weight.dtype), str(model.wte.weight.device),
                         getattr(model, "head_rows", None)]).encode())
    with torch.no_grad():
        for p in model.parameters():
            flat = p.detach().reshape(-1)
            sample = torch.cat([flat[:64], flat[-64:]]).float().cpu()
            h.update(sample.numpy().tobytes())
    return h.hexdigest()[:16]


def _version() -> str:
    try:
        return importlib.metadata.version("staged-engine")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


@functools.lru_cache(maxsize=None)
def _file_digest(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()[:16]


def native_build() -> dict:
    """The native kernels the figures were measured with: a digest of the built extension (a
    rebuild with other kernels changes the speed the package version does not show) and the
    register-block forms in force (``_cpu.narrow_rows``, ``_cpu.group_runs``). Empty where it is
    not built."""
    from staged_engine.model.backend import _cpu

    if _cpu is None or not getattr(_cpu, "__file__", None):
        return {}
    build = {"native_build": _file_digest(_cpu.__file__)}
    if hasattr(_cpu, "narrow_rows"):
        build["narrow_rows"] = _cpu.narrow_rows()
    if hasattr(_cpu, "group_runs"):
        build["group_runs"] = _cpu.group_runs()
    return build


def profile_key(model, backend) -> dict:
    """Everything the figures depend on; a cached profile is used only when all of it matches."""
    native = bool(getattr(backend, "native", False))
    packed = backend.native_rows(model) if native else None  # float16, bfloat16 or float32 weights: their speeds differ
    return {"schema": SCHEMA, "model": model_fingerprint(model), "backend": backend.name,
            "native": native, **(native_build() if native else {}),
            **({"packed": packed.weight_format, "streaming": packed.streaming} if packed is not None else {}),
            # whether passes of many rows may take a float32 packing (TorchBackend.wide_rows); not
            # the row count they take it from, which is measured at load and moves a little from
            # load to load (a second load must find its profile)
            **({"wide_rows": backend.wide_rows} if packed is not None and hasattr(backend, "wide_rows") else {}),
            # a float16 K/V cache (``GPT2.kv_dtype``) reads half the bytes at each context
            **({"kv_dtype": str(model.kv_dtype).replace("torch.", "")} if getattr(model, "kv_dtype", None) else {}),
            **cpu_identity(),
            "threads": torch.get_num_threads(), "torch": torch.__version__, "staged_engine": _version(),
            "python": platform.python_version()}


@dataclass
class CostProfile:
    """Median seconds of one forward pass over ``nodes[i]`` new nodes at each of ``contexts``."""

    key: dict
    nodes: tuple[int, ...]
    contexts: tuple[int, ...]
    seconds: list[list[float]]  # [context][node index]
    measured_in: float = 0.0  # seconds the measurement took

    def time(self, n: int, context: int) -> float:
        """Interpolated seconds of a pass over ``n`` nodes after ``context`` cached tokens."""
        n = max(1, n)
        row = [self._at(i, n) for i in range(len(self.contexts))]
        c0, c1 = self.contexts[0], self.contexts[-1]
        if c1 == c0:
            return row[0]
        w = min(max((context - c0) / (c1 - c0), 0.0), 1.5)  # a little extrapolation, no more
        return max(row[0] + w * (row[-1] - row[0]), 1e-7)

    def _at(self, ci: int, n: int) -> float:
        xs, ys = self.nodes, self.seconds[ci]
        if n <= xs[0]:
            return ys[0]
        for i in range(1, len(xs)):
            if n <= xs[i]:
                f = (n - xs[i - 1]) / (xs[i] - xs[i - 1])
                return ys[i - 1] + f * (ys[i] - ys[i - 1])
        return ys[-1] * n / xs[-1]  # beyond the table: linear in nodes

    def to_json(self) -> dict:
        return {"key": self.key, "nodes": list(self.nodes), "contexts": list(self.contexts),
                "seconds": self.seconds, "measured_in": self.measured_in}

    @classmethod
    def from_json(cls, raw: dict, key: dict) -> "CostProfile":
        """The profile in ``raw`` if it is well formed and measured under ``key``; else ValueError."""
        if not isinstance(raw, dict) or raw.get("key") != key:
            raise ValueError("profile was measured for another model, machine or library version")
        nodes, contexts, secs = raw.get("nodes"), raw.get("contexts"), raw.get("seconds")
        if nodes != list(NODES):
            raise ValueError(f"profile node counts {nodes!r} are not {list(NODES)}")
        if (not isinstance(contexts, list) or not contexts or any(not isinstance(c, int) or c < 0 for c in contexts)
                or contexts != sorted(contexts)):
            raise ValueError(f"profile contexts must be increasing integers >= 0, got {contexts!r}")
        if (not isinstance(secs, list) or len(secs) != len(contexts)
                or any(not isinstance(r, list) or len(r) != len(NODES) for r in secs)
                or any(not isinstance(s, (int, float)) or isinstance(s, bool) or not math.isfinite(s) or s <= 0
                       for r in secs for s in r)):
            raise ValueError("profile seconds must be one row of positive finite numbers per context")
        return cls(key, tuple(nodes), tuple(contexts), [list(map(float, r)) for r in secs],
                   float(raw.get("measured_in", 0.0)))


def measure(runner_factory, key: dict, budget_seconds: float = 1.0) -> CostProfile:
    """Time passes of 1-64 nodes at a short and a long context with a fresh runner.

    ``runner_factory()`` returns a ``ModelRunner`` of the model (its own cache). Every point is
    the lower quartile of 15 passes (1-8 nodes) or 7 (more) after 2 warm-ups, 3 when the budget runs
    short.
    """
    t_start = time.perf_counter()
    runner = runner_factory()
    n_ctx = min(runner.max_len, runner.model.config.n_positions)
    top = min(NODES[-1], n_ctx // 2)
    contexts = sorted({min(16, n_ctx - top), max(16, min(n_ctx - top, n_ctx // 2))})
    vocab = runner.model.config.vocab_size
    seconds: list[list[float]] = []
    with torch.inference_mode():
        for ci, ctx in enumerate(contexts):
            runner.reset()
            if ctx > 0:
                runner.prefill([(7 * i + 3) % vocab for i in range(ctx)])
            row = []
            for n in NODES:
                if n > top:  # a tiny context window: extend the row linearly
                    row.append(row[-1] * n / NODES[len(row) - 1])
                    continue
                tokens = [(11 * i + 5) % vocab for i in range(n)]
                positions = list(range(ctx, ctx + n))
                for _ in range(2):  # warm-up: first calls at a new shape pay for allocation
                    runner.forward_nodes(tokens, positions, None)
                    runner.discard()
                times = []
                elapsed = time.perf_counter() - t_start
                reps = (15 if n <= 8 else 7) if elapsed < budget_seconds * (ci + 0.5) / len(contexts) else 3
                for _ in range(reps):
                    t0 = time.perf_counter()
                    runner.forward_nodes(tokens, positions, None)
                    times.append(time.perf_counter() - t0)
                    runner.discard()
                # Timer noise only ever adds time: the lower quartile is the pass's own cost.
                row.append(sorted(times)[len(times) // 4])
            seconds.append(row)
    # A pass over more nodes never costs less than over fewer (timer noise can say otherwise).
    for row in seconds:
        for i in range(1, len(row)):
            row[i] = max(row[i], row[i - 1])
    return CostProfile(key, NODES, tuple(contexts), seconds, time.perf_counter() - t_start)


def keyed_path(kind: str, key: dict, directory: str | None = None) -> str:
    """The cache file of ``key`` under ``$STAGED_ENGINE_CACHE/<kind>/`` (or ``directory``)."""
    from staged_engine.demo_pair import cache_dir  # noqa: PLC0415

    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    return os.path.join(directory or os.path.join(cache_dir(), kind), f"{digest}.json")


def profile_path(key: dict, directory: str | None = None) -> str:
    return keyed_path("profiles", key, directory)


def load_or_measure(model, backend, runner_factory, directory: str | None = None,
                    force: bool = False) -> tuple[CostProfile, str]:
    """The cached profile of ``model`` on this machine, or a fresh measurement (then cached).

    Returns (profile, how): how is "cached", "measured" (none was cached) or "re-measured" (the
    cached file was unreadable or foreign, with a warning saying why)."""
    key = profile_key(model, backend)
    path = profile_path(key, directory)
    how = "measured"
    if not force and os.path.exists(path):
        try:
            with open(path, encoding="utf-8") as f:
                return CostProfile.from_json(json.load(f), key), "cached"
        except (OSError, ValueError, TypeError, json.JSONDecodeError) as exc:
            warnings.warn(f"ignoring the cost profile {path} ({exc}); measuring it again", stacklevel=3)
            how = "re-measured"
    elif force:
        how = "re-measured"
    prof = measure(runner_factory, key)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
            json.dump(prof.to_json(), f, indent=1)
    except OSError as exc:  # a read-only home: use the measurement, say why it is not kept
        warnings.warn(f"could not cache the cost profile at {path}: {exc}", stacklevel=3)
    return prof, how
