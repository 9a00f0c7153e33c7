"""Shared fixtures: small random-weight GPT-2 checkpoints written by transformers itself."""
from __future__ import annotations

import atexit
import glob
import os
import shutil
import tempfile

import pytest
import torch

# Triton reads TRITON_INTERPRET when it is imported, and transformers may import it while the
# tests above kernels/ are collected: set it here, before anything, for the kernel tests on CPU.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from ckpt_util import CHECKPOINT_CONFIGS, make_hf_checkpoint, perturbed_copy

from staged_engine.demo_pair import cache_dir

# The suite keeps its own cache directory: the planner's memories and the cost profiles in the
# user's one were learned from timings, and a memory an earlier run kept for the same test models
# (this machine's CI runs share one home) decided which arms a test's adaptive strategy played:
# taken at its word, it had staged play plain steps throughout a test that counts accepted
# proposals. Only the demo n-gram table is shared (linked): a function of the stdlib's sources,
# validated on load, whose build takes tens of seconds.
_user_cache = cache_dir()
_suite_cache = tempfile.mkdtemp(prefix="staged-engine-tests-")
atexit.register(shutil.rmtree, _suite_cache, True)
for _name in glob.glob(os.path.join(_user_cache, "demo-*.ngram")):
    os.symlink(_name, os.path.join(_suite_cache, os.path.basename(_name)))
os.environ["STAGED_ENGINE_CACHE"] = _suite_cache


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
