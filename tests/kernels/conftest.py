"""Kernel tests: compiled Triton on CUDA, the Triton interpreter on CPU.

TRITON_INTERPRET must be set before triton is imported (the @triton.jit decorator reads it), so
this file sets it at import time, before any test module imports ``staged_engine.kernels``. If something
imported the kernels earlier without it, the ``device`` fixture fails with the reason.
"""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"


@pytest.fixture(scope="session")
def device() -> torch.device:
    """CUDA when present, else CPU under the interpreter."""
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        return torch.device("cuda")
    from staged_engine.kernels import interpreting
    from staged_engine.kernels.kv_cache import _kv_append_kernel

    if not interpreting(_kv_append_kernel):
        pytest.fail("kernels/ was imported before TRITON_INTERPRET=1 was set; set it in the "
                    "environment (or the top-level conftest) to run the kernel tests on CPU")
    return torch.device("cpu")


@pytest.fixture(scope="session")
def cuda_device() -> torch.device:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA (large sizes are too slow for the interpreter)")
    return torch.device("cuda")
