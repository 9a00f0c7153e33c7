"""Shared fixtures: small random-weight GPT-2 checkpoints written by transformers itself."""
from __future__ import annotations

import os

import pytest
import torch

# Triton reads TRITON_INTERPRET when it is imported, and transformers may import it while the
# tests above kernels/ are collected: set it here, before anything, for the kernel tests on CPU.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from ckpt_util import CHECKPOINT_CONFIGS, make_hf_checkpoint, perturbed_copy


def pytest_xdist_auto_num_workers(config) -> int:
    """``-n auto`` (pytest.ini): one worker per CPU this process may run on (its affinity, which
    a container or ``taskset`` narrows), not per CPU the machine has. Each test runs torch on one
    thread (below), so the workers never oversubscribe the cores."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("ckpt")
    return {name: make_hf_checkpoint(str(root / name), seed=i, **cfg)
            for i, (name, cfg) in enumerate(CHECKPOINT_CONFIGS.items())}


@pytest.fixture(scope="session")
def pair(checkpoints, tmp_path_factory) -> tuple[str, str]:
    """(oracle, draft) directories: odd96 and a perturbed copy of it."""
    root = tmp_path_factory.mktemp("draft")
    return checkpoints["odd96"], perturbed_copy(checkpoints["odd96"], str(root / "draft"), 0.05, seed=11)


os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The test models are tiny: one thread is fastest and immune to oversubscription.
torch.set_num_threads(1)
