"""Triton kernels for staged-engine: tree attention, fused KV-cache append/commit, tree verify.

Each module holds a ``_name_kernel`` (``@triton.jit``), a typed public wrapper ``name()`` that
checks shapes, dtypes, contiguity and device and launches the kernel, and ``name_ref()`` in
plain PyTorch (the reference the tests compare against):

    tree_attention.py   tree_attention()   prefix + tree-masked attention, flash-decoding splits
    kv_cache.py         kv_append()        fused head split of qkv + K/V write into the cache
                        kv_commit()        move accepted tree entries down to their final slots
    verify.py           choice()           position-keyed Gumbel-max (or greedy) at every node
                        verify_tree()      choice + the tree walk, packed into one small tensor

The kernels run on CUDA tensors, or on CPU tensors when ``TRITON_INTERPRET=1`` was set before
triton was imported (the interpreter: slow, for tests only). Importing this package does not
import triton; the submodules do.

The helpers below are the wrappers' shared input checks; every failure is a ``ValueError``
naming the argument (DESIGN.md, "Errors").
"""
from __future__ import annotations

import torch

__all__ = ["interpreting"]


def interpreting(kernel: object) -> bool:
    """True when ``kernel`` (a @triton.jit object) runs under the Triton interpreter."""
    return type(kernel).__name__ == "InterpretedFunction"


def _check_tensor(name: str, t: object, *, ndim: int, dtypes: tuple[torch.dtype, ...],
                  contiguous: bool = True) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise ValueError(f"{name} must have dtype {names}; got {str(t.dtype).replace('torch.', '')}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (call .contiguous()), got strides {t.stride()}")
    return t


def _check_shape(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")


def _check_device(kernel: object, ref_name: str, ref: torch.Tensor, **others: torch.Tensor) -> None:
    """All tensors on ``ref``'s device; CUDA, or CPU under the interpreter."""
    dev = ref.device
    for name, t in others.items():
        if t is not None and t.device != dev:
            raise ValueError(f"{name} is on {t.device} but {ref_name} is on {dev}; "
                             "all tensors must be on one device")
    if dev.type == "cuda":
        if interpreting(kernel):
            raise ValueError(f"{ref_name} is on {dev}, but TRITON_INTERPRET=1 runs kernels on CPU "
                             "tensors only")
        return
    if dev.type == "cpu" and interpreting(kernel):
        return
    raise ValueError(f"{ref_name} is on {dev}: the Triton kernels need CUDA tensors, or CPU tensors "
                     "with TRITON_INTERPRET=1 set before triton is imported (tests only)")
