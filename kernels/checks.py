"""Argument checks the kernels' host wrappers share: shapes, dtypes, devices, strides.

A wrong argument to a Triton kernel reads or writes the wrong memory instead of
failing; every wrapper runs these first and raises ValueError with what it got.
"""

from __future__ import annotations

import os

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)
LOG2E = 1.4426950408889634  # the kernels use exp2, with this folded into the scale


def check_query_and_cache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, q_shape: str,
                          cache_dtype_of_its_own: bool = False) -> None:
    """q (rows, Hq, D) against paged caches (num_blocks, block_size, Hkv, D), in one float dtype (or, where
    cache_dtype_of_its_own, the two caches in one float dtype and q in one)."""
    if q.dim() != 3:
        raise ValueError(f"q must be {q_shape}; got {tuple(q.shape)}")
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(
            "k_cache and v_cache must both be (num_blocks, block_size, Hkv, D); "
            f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    if k_cache.shape[3] != head_dim:
        raise ValueError(f"head_dim differs: q has {head_dim}, the cache {k_cache.shape[3]}")
    if num_q_heads % num_kv_heads != 0:
        raise ValueError(f"Hq={num_q_heads} is not a multiple of Hkv={num_kv_heads}")
    alike = v_cache.dtype == k_cache.dtype and (cache_dtype_of_its_own or k_cache.dtype == q.dtype)
    if q.dtype not in FLOAT_DTYPES or k_cache.dtype not in FLOAT_DTYPES or not alike:
        shared = "the caches must share one of" if cache_dtype_of_its_own else "q, k_cache, v_cache must share one of"
        raise ValueError(f"{shared} {FLOAT_DTYPES}; got {q.dtype}, {k_cache.dtype}, {v_cache.dtype}")


def check_index_dtypes(**tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if t.dtype not in INDEX_DTYPES:
            raise ValueError(f"{name} must be int32 or int64; got {t.dtype}")


def check_triton_device(*tensors: torch.Tensor) -> None:
    """One device for all, and a GPU unless the interpreter runs the kernel."""
    device = tensors[0].device
    if any(t.device != device for t in tensors):
        raise ValueError(f"all tensors must be on one device; got {[str(t.device) for t in tensors]}")
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"the Triton kernel needs CUDA tensors (or TRITON_INTERPRET=1); got {device}")


def check_last_dim_contiguous(**tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dim; stride is {t.stride(-1)}")
