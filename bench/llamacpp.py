"""llama.cpp as a baseline: built from the llama-cpp-python source package (CPU only), cached.

``llama_bench(checkpoint, threads)`` converts a HF GPT-2 directory to GGUF with llama.cpp's own
``convert_hf_to_gguf.py`` (at the checkpoint's precision: f16 when every weight is fp16-exact,
else f32) and runs ``llama-bench -p 0 -n 128`` on it. Everything is cached under
``$STAGED_ENGINE_CACHE/llama.cpp`` (default ~/.cache/staged-engine): the source package, the
build and the converted files, so only the first call pays for the build (minutes on 2 cores).

Nothing here is fatal: when a step cannot run on this machine (no compiler, no cmake, the
package index unreachable, a conversion llama.cpp refuses), ``LlamaCppUnavailable`` says which
step failed and why, and the bench reports that instead of a figure.
"""
from __future__ import annotations

import glob
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile

from staged_engine.checks import atomic_path

VERSION = "0.3.36"  # llama-cpp-python; its vendor/llama.cpp is what gets built


class LlamaCppUnavailable(RuntimeError):
    """A step of building or running llama.cpp failed; the message names it."""


def cache_dir() -> str:
    from staged_engine.demo_pair import (
        cache_dir as engine_cache,  # $STAGED_ENGINE_CACHE, ~/.cache/staged-engine
    )

    root = engine_cache()
    path = os.path.join(root, "llama.cpp")
    os.makedirs(path, exist_ok=True)
    return path


def run_step(cmd: list[str], step: str, log: str, cwd: str | None = None, env: dict | None = None) -> str:
    try:
        out = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=3600)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise LlamaCppUnavailable(f"{step}: {exc}") from exc
    with open(log, "a") as f:
        f.write(f"$ {' '.join(cmd)}\n{out.stdout}\n{out.stderr}\n")
    if out.returncode != 0:
        tail = (out.stderr or out.stdout).strip().splitlines()[-3:]
        raise LlamaCppUnavailable(f"{step} failed (exit {out.returncode}): {' | '.join(tail)} (log: {log})")
    return out.stdout


def source_dir() -> str:
    """vendor/llama.cpp of the llama-cpp-python source package, downloaded and unpacked once."""
    root = cache_dir()
    src = os.path.join(root, f"llama_cpp_python-{VERSION}", "vendor", "llama.cpp")
    if os.path.isfile(os.path.join(src, "CMakeLists.txt")):
        return src
    log = os.path.join(root, "build.log")
    archive = os.path.join(root, f"llama_cpp_python-{VERSION}.tar.gz")
    if not os.path.isfile(archive):
        run_step([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
              f"llama-cpp-python=={VERSION}", "-d", root], "downloading llama-cpp-python's source package", log)
    with tarfile.open(archive) as tar:
        tar.extractall(root, filter="data")
    if not os.path.isfile(os.path.join(src, "CMakeLists.txt")):
        raise LlamaCppUnavailable(f"{archive} holds no vendor/llama.cpp")
    return src


def llama_bench_binary() -> str:
    """Path of llama-bench, configured for this CPU (GGML_NATIVE) and built once."""
    src = source_dir()
    binary = os.path.join(src, "build", "bin", "llama-bench")
    if os.path.isfile(binary):
        return binary
    if shutil.which("cmake") is None:
        raise LlamaCppUnavailable("building llama.cpp needs cmake, which is not installed")
    log = os.path.join(cache_dir(), "build.log")
    print(f"building llama.cpp {VERSION} (llama-bench, CPU only; once, a few minutes) ...", file=sys.stderr, flush=True)
    run_step(["cmake", "-S", src, "-B", os.path.join(src, "build"), "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON",
          "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=OFF",
          "-DLLAMA_BUILD_TOOLS=ON"], "configuring llama.cpp", log)
    run_step(["cmake", "--build", os.path.join(src, "build"), "--target", "llama-bench", "-j", str(os.cpu_count() or 2)],
         "building llama-bench", log)
    if not os.path.isfile(binary):
        raise LlamaCppUnavailable(f"the build finished without {binary}")
    return binary


# convert_hf_to_gguf.py identifies a BPE tokenizer by hashing how it splits a test text and
# refuses ones it does not know. The demo tokenizer splits like GPT-2's newer patterns, which
# llama.cpp does not list; the split only matters for llama.cpp's own tokenizer, not for
# llama-bench (it decodes random token ids), so the conversion declares it GPT-2's ("gpt-2").
# Configs written by transformers 5 no longer carry GPT-2's n_ctx, which the converter reads:
# it is n_positions.
_CONVERT = r'''
import sys
sys.argv = ["convert_hf_to_gguf.py", {model!r}, "--outfile", {out!r}, "--outtype", {outtype!r}]
import convert_hf_to_gguf as conv
_load = conv.ModelBase.load_hparams
def _hparams(*a, **k):
    h = _load(*a, **k)
    if "n_ctx" not in h and "n_positions" in h:
        h["n_ctx"] = h["n_positions"]
    return h
conv.ModelBase.load_hparams = staticmethod(_hparams)
try:
    from conversion.base import TextModel as base  # llama.cpp's layout since the conversion/ split
except ImportError:
    base = getattr(conv, "TextModel", None) or conv.Model
base.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
conv.main()
'''


def convert(checkpoint: str, outtype: str) -> str:
    """GGUF of a HF GPT-2 directory (cached by the weights' hash and the output type)."""
    src = source_dir()
    weights = os.path.join(checkpoint, "model.safetensors")
    h = hashlib.sha256()
    with open(weights, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    out = os.path.join(cache_dir(), f"{h.hexdigest()[:16]}-{outtype}-v2.gguf")  # v2: the "gpt-2" pre-tokenizer
    if os.path.isfile(out):
        return out
    if not os.path.isfile(os.path.join(checkpoint, "tokenizer.json")):
        raise LlamaCppUnavailable(f"{checkpoint} has no tokenizer.json, which the GGUF converter needs")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([src, os.path.join(src, "gguf-py")]))  # llama.cpp's converter
    with atomic_path(out) as tmp:
        code = _CONVERT.format(model=checkpoint, out=tmp, outtype=outtype)
        run_step([sys.executable, "-c", code], f"converting {checkpoint} to GGUF",
             os.path.join(cache_dir(), "convert.log"), env=env)
    return out


def llama_bench(checkpoint: str, outtype: str, threads: int, n_gen: int = 128, repetitions: int = 5) -> dict:
    """llama-bench's text-generation figure for the checkpoint: tokens/s (mean and std over
    ``repetitions`` runs of ``n_gen`` tokens), the build and the file it ran."""
    binary = llama_bench_binary()
    gguf = convert(checkpoint, outtype)
    out = run_step([binary, "-m", gguf, "-p", "0", "-n", str(n_gen), "-t", str(threads), "-r", str(repetitions),
                "-o", "json"], "running llama-bench", os.path.join(cache_dir(), "bench.log"))
    rows = json.loads(out)
    row = next(r for r in rows if r.get("n_gen") == n_gen)
    return {"tokens_per_s": row["avg_ts"], "tokens_per_s_std": row.get("stddev_ts"), "ms_per_token": 1e3 / row["avg_ts"],
            "threads": threads, "type": outtype, "gguf": os.path.basename(gguf),
            "build": f"llama-cpp-python {VERSION} vendor/llama.cpp (commit {row.get('build_commit', '?')}), GGML_NATIVE",
            "cpu_info": row.get("cpu_info")}


def clean() -> None:
    """Forget the converted files (the build stays)."""
    for path in glob.glob(os.path.join(cache_dir(), "*.gguf")):
        os.remove(path)
