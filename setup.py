"""Build and install staged-engine.

The C++ sources in csrc/ compile with torch's cpp_extension and ninja into two modules:
``staged_engine._ngram`` (csrc/ngram*.cpp, the n-gram draft stage) and ``staged_engine._cpu``
(csrc/cpu_*.cpp, the native decode path and the draft's child scoring; built with -march=native because
the extension is always compiled on the machine that runs it, and skipped on a CPU without AVX2,
FMA and F16C, or with STAGED_ENGINE_NO_CPU_EXT=1: the runtime then falls back to stock torch with
one warning). Install with ``pip install --no-build-isolation -e .`` so the extension builds against the
torch that is already installed (a build-isolated install would fetch another torch).
"""
import glob
import os

from setuptools import find_packages, setup

try:
    from torch.utils.cpp_extension import BuildExtension, CppExtension
except ImportError as exc:  # pragma: no cover - only hit on a misconfigured install
    raise SystemExit(
        "staged-engine builds its C++ extension against an installed torch: run "
        "`pip install -r requirements.txt` first, then `pip install --no-build-isolation -e .`"
    ) from exc

HERE = os.path.dirname(os.path.abspath(__file__))


def _sources(pattern: str) -> list[str]:
    return sorted(os.path.relpath(p, HERE) for p in glob.glob(os.path.join(HERE, "csrc", pattern)))


def _cpu_has_avx2() -> bool:
    """The native kernels need AVX2 + FMA + F16C (or AVX-512); they are compiled with
    -march=native for the machine that builds them. Elsewhere the runtime uses stock torch and
    says so once."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split() for line in f if line.startswith("flags")), [])
    except OSError:
        return False
    return {"avx2", "fma", "f16c"} <= set(flags)


# Python's own build flags carry -g: with it the native decode path's module was 27 MB, 26 of them
# debug sections, and hashing it for the cost profile's key (``spec.cost.native_build``) took
# 27 ms of a process's first speculative request. The code is the same without them (GCC's -g
# does not change what it generates). STAGED_ENGINE_DEBUG_INFO=1 builds with them, for a debugger.
NO_DEBUG_INFO = [] if os.environ.get("STAGED_ENGINE_DEBUG_INFO") == "1" else ["-g0"]

ext_modules = []
if _sources("ngram*.cpp"):
    ext_modules.append(CppExtension(
        name="staged_engine._ngram", sources=_sources("ngram*.cpp"),
        extra_compile_args=["-O3", "-std=c++17", "-fvisibility=hidden", *NO_DEBUG_INFO]))
if _sources("cpu_*.cpp") and os.environ.get("STAGED_ENGINE_NO_CPU_EXT", "0") == "0" and _cpu_has_avx2():
    ext_modules.append(CppExtension(  # csrc/cpu_kernels.cpp, cpu_forward.cpp, cpu_sampling.cpp (cpu_*.h)
        name="staged_engine._cpu", sources=_sources("cpu_*.cpp"),
        extra_compile_args=["-O3", "-std=c++17", "-march=native", "-fopenmp", "-fvisibility=hidden", *NO_DEBUG_INFO],
        extra_link_args=["-fopenmp"]))

setup(
    name="staged-engine",
    version="0.1.0",
    description="Staged speculative decoding and DSBD for GPT-2-family models",
    python_requires=">=3.10",
    # The repository's kernels/ (Triton) installs as staged_engine.kernels: no top-level module.
    packages=find_packages(include=["staged_engine", "staged_engine.*"]) + ["staged_engine.kernels"],
    package_dir={"staged_engine.kernels": "kernels"},
    package_data={"staged_engine": ["assets/demo/*/*", "assets/*.json"]},
    include_package_data=True,
    ext_modules=ext_modules,
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
    install_requires=["torch==2.13.0", "safetensors", "tokenizers"],
    extras_require={"bench": ["transformers", "matplotlib"],  # HF baselines and PNG plots
                    "serve": ["fastapi", "uvicorn"]},  # staged-engine serve
    entry_points={"console_scripts": ["staged-engine=staged_engine.cli.main:main"]},
)
