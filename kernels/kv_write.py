"""Scatter new tokens' K/V into the paged KV cache: a PyTorch reference, a Triton kernel
and a dispatcher that picks the kernel on a GPU and the reference elsewhere."""

import torch
import triton
import triton.language as tl

from kernels.checks import FLOAT_DTYPES, INDEX_DTYPES, check_triton_device


def _check_inputs(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    if k.dim() != 3 or v.shape != k.shape:
        raise ValueError(f"k and v must both be (T, Hkv, D); got k {tuple(k.shape)}, v {tuple(v.shape)}")
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(
            "k_cache and v_cache must both be (num_blocks, block_size, Hkv, D); "
            f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    if k.shape[1:] != k_cache.shape[2:]:
        raise ValueError(
            f"k is (T, Hkv, D) = {tuple(k.shape)} but the cache holds (Hkv, D) = {tuple(k_cache.shape[2:])}"
        )
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] != k.shape[0]:
        raise ValueError(f"slot_mapping must be ({k.shape[0]},); got {tuple(slot_mapping.shape)}")
    if slot_mapping.dtype not in INDEX_DTYPES:
        raise ValueError(f"slot_mapping must be int32 or int64; got {slot_mapping.dtype}")
    if k_cache.dtype != v_cache.dtype:
        raise ValueError(f"k_cache and v_cache dtypes differ: {k_cache.dtype} vs {v_cache.dtype}")


def write_kv_ref(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write k[t], v[t] into slot slot_mapping[t] of the caches; negative slots are padding."""
    _check_inputs(k, v, k_cache, v_cache, slot_mapping)
    block_size = k_cache.shape[1]
    keep = slot_mapping >= 0  # (T,)
    slots = slot_mapping[keep].long()  # (T',)
    block_ids = slots // block_size
    offsets = slots % block_size
    k_cache[block_ids, offsets] = k[keep].to(k_cache.dtype)  # (T', Hkv, D)
    v_cache[block_ids, offsets] = v[keep].to(v_cache.dtype)


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_kh,
    stride_vt, stride_vh,
    stride_kcb, stride_kcs, stride_kch,
    stride_vcb, stride_vcs, stride_vch,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # One program per token moves all of its heads at once: (BLOCK_H, BLOCK_D) tiles.
    # The head dim is unit-stride (the wrapper checks), so rows load as wide vectors.
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:
        return
    block_id = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE

    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    mask = (h[:, None] < NUM_KV_HEADS) & (d[None, :] < HEAD_DIM)

    k = tl.load(k_ptr + t * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask)
    v = tl.load(v_ptr + t * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
    k_dst = k_cache_ptr + block_id * stride_kcb + offset * stride_kcs + h[:, None] * stride_kch + d[None, :]
    v_dst = v_cache_ptr + block_id * stride_vcb + offset * stride_vcs + h[:, None] * stride_vch + d[None, :]
    tl.store(k_dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv_triton(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Triton version of write_kv_ref; same arguments, same in-place effect."""
    _check_inputs(k, v, k_cache, v_cache, slot_mapping)
    check_triton_device(k, v, k_cache, v_cache, slot_mapping)
    if k_cache.dtype not in FLOAT_DTYPES:
        raise ValueError(f"cache dtype must be one of {FLOAT_DTYPES}; got {k_cache.dtype}")
    for name, t in (("k", k), ("v", v), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dim; stride is {t.stride(-1)}")
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    _write_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        *k.stride()[:-1], *v.stride()[:-1], *k_cache.stride()[:-1], *v_cache.stride()[:-1],
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=k_cache.shape[1],
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
    )


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write new K/V into the paged cache: the Triton kernel on a GPU, the reference elsewhere."""
    if k.is_cuda:
        write_kv_triton(k, v, k_cache, v_cache, slot_mapping)
    else:
        write_kv_ref(k, v, k_cache, v_cache, slot_mapping)
