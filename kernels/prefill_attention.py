"""Causal attention for packed prompt chunks over the paged KV cache (chunked prefill and
prefix caching): a PyTorch reference, a flash-attention style Triton kernel, a dispatcher."""

import math

import torch
import triton
import triton.language as tl

from kernels.checks import (
    LOG2E,
    check_index_dtypes,
    check_last_dim_contiguous,
    check_query_and_cache,
    check_triton_device,
)


def _check_inputs(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
) -> None:
    check_query_and_cache(q, k_cache, v_cache, "(T, Hq, D)")
    if context_lens.dim() != 1:
        raise ValueError(f"context_lens must be (N,); got {tuple(context_lens.shape)}")
    num_seqs = context_lens.shape[0]
    if cu_seqlens_q.dim() != 1 or cu_seqlens_q.shape[0] != num_seqs + 1:
        raise ValueError(
            f"cu_seqlens_q must be ({num_seqs + 1},) for {num_seqs} sequences; got {tuple(cu_seqlens_q.shape)}"
        )
    if block_tables.dim() != 2 or block_tables.shape[0] != num_seqs:
        raise ValueError(f"block_tables must be ({num_seqs}, max_blocks_per_seq); got {tuple(block_tables.shape)}")
    check_index_dtypes(block_tables=block_tables, cu_seqlens_q=cu_seqlens_q, context_lens=context_lens)


def paged_prefill_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Query i of a chunk of length L sits at position context_len - L + i and attends to
    every cached position up to and including its own."""
    _check_inputs(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens)
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    group = num_q_heads // num_kv_heads
    out = torch.zeros_like(q)
    bounds = cu_seqlens_q.tolist()
    lengths = context_lens.tolist()

    for n, context_len in enumerate(lengths):
        q_start, q_end = bounds[n], bounds[n + 1]
        chunk_len = q_end - q_start
        if chunk_len == 0:
            continue
        used_blocks = math.ceil(context_len / block_size)
        table = block_tables[n, :used_blocks].long().clamp(0, num_blocks - 1)  # (NB,)
        keys = k_cache[table].flatten(0, 1)[:context_len].float()  # (S, Hkv, D)
        values = v_cache[table].flatten(0, 1)[:context_len].float()  # (S, Hkv, D)

        queries = q[q_start:q_end].float().view(chunk_len, num_kv_heads, group, head_dim)  # (L, Hkv, G, D)
        scores = torch.einsum("lhgd,shd->hgls", queries, keys) * scale  # (Hkv, G, L, S)
        q_pos = torch.arange(context_len - chunk_len, context_len, device=q.device)  # (L,)
        k_pos = torch.arange(context_len, device=q.device)  # (S,)
        scores = scores.masked_fill(k_pos[None, :] > q_pos[:, None], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        chunk_out = torch.einsum("hgls,shd->lhgd", probs, values)  # (L, Hkv, G, D)
        out[q_start:q_end] = chunk_out.reshape(chunk_len, num_q_heads, head_dim).to(q.dtype)
    return out


@triton.jit
def _attend_tile(
    q, acc, row_max, row_sum, q_pos,
    k_cache_ptr, v_cache_ptr, table_row, kv_head, tile_start, context_len,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_tn, scale_log2,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # One online-softmax step over the BLOCK_N cached positions starting at tile_start.
    pos = tile_start + tl.arange(0, BLOCK_N)  # (BLOCK_N,)
    pos_mask = pos < context_len
    d = tl.arange(0, BLOCK_D)
    block_ids = tl.load(table_row + (pos // BLOCK_SIZE) * stride_tn, mask=pos_mask, other=0).to(tl.int64)
    in_block = pos % BLOCK_SIZE
    kv_mask = pos_mask[:, None] & (d[None, :] < HEAD_DIM)
    k = tl.load(
        k_cache_ptr + block_ids[:, None] * stride_kb + in_block[:, None] * stride_ks
        + kv_head * stride_kh + d[None, :],
        mask=kv_mask, other=0.0,
    )  # (BLOCK_N, BLOCK_D)
    v = tl.load(
        v_cache_ptr + block_ids[:, None] * stride_vb + in_block[:, None] * stride_vs
        + kv_head * stride_vh + d[None, :],
        mask=kv_mask, other=0.0,
    )  # (BLOCK_N, BLOCK_D)

    scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2  # (BLOCK_M, BLOCK_N)
    if CAUSAL:
        visible = (pos[None, :] <= q_pos[:, None]) & pos_mask[None, :]
        scores = tl.where(visible, scores, float("-inf"))
    new_max = tl.maximum(row_max, tl.max(scores, axis=1))
    rescale = tl.exp2(row_max - new_max)
    probs = tl.exp2(scores - new_max[:, None])  # (BLOCK_M, BLOCK_N)
    row_sum = row_sum * rescale + tl.sum(probs, axis=1)
    acc = acc * rescale[:, None] + tl.dot(probs.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, new_max, row_sum


@triton.jit
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, cu_seqlens_ptr, context_lens_ptr, out_ptr,
    scale_log2,
    stride_qt, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_tb, stride_tn,
    stride_ot, stride_oh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # One program per (query tile, query head, sequence). The head dim is unit-stride
    # (the wrapper checks), so its offsets need no stride and loads vectorise.
    m_tile = tl.program_id(0)
    head = tl.program_id(1)
    seq = tl.program_id(2)
    kv_head = head // GROUP

    q_start = tl.load(cu_seqlens_ptr + seq).to(tl.int32)
    chunk_len = tl.load(cu_seqlens_ptr + seq + 1).to(tl.int32) - q_start
    first_row = m_tile * BLOCK_M
    if first_row >= chunk_len:
        return
    context_len = tl.load(context_lens_ptr + seq).to(tl.int32)
    prefix_len = context_len - chunk_len

    rows = first_row + tl.arange(0, BLOCK_M)  # (BLOCK_M,)
    d = tl.arange(0, BLOCK_D)
    row_mask = rows < chunk_len
    q_mask = row_mask[:, None] & (d[None, :] < HEAD_DIM)
    tokens = (q_start + rows).to(tl.int64)
    q = tl.load(q_ptr + tokens[:, None] * stride_qt + head * stride_qh + d[None, :], mask=q_mask, other=0.0)
    q_pos = prefix_len + rows  # (BLOCK_M,) absolute positions

    row_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    row_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    table_row = block_tables_ptr + seq.to(tl.int64) * stride_tb

    # Tiles wholly at or before the tile's first query position are visible to every row
    # and need no mask; the rest, up to the last row's position, are masked causally;
    # tiles past that are fully masked and never fetched.
    unmasked_end = ((prefix_len + first_row + 1) // BLOCK_N) * BLOCK_N
    causal_end = tl.minimum(prefix_len + first_row + BLOCK_M, context_len)
    for tile_start in range(0, unmasked_end, BLOCK_N):
        acc, row_max, row_sum = _attend_tile(
            q, acc, row_max, row_sum, q_pos,
            k_cache_ptr, v_cache_ptr, table_row, kv_head, tile_start, context_len,
            stride_kb, stride_ks, stride_kh,
            stride_vb, stride_vs, stride_vh,
            stride_tn, scale_log2,
            HEAD_DIM, BLOCK_SIZE, BLOCK_D, BLOCK_N, False, DOT_PRECISION,
        )
    for tile_start in range(unmasked_end, causal_end, BLOCK_N):
        acc, row_max, row_sum = _attend_tile(
            q, acc, row_max, row_sum, q_pos,
            k_cache_ptr, v_cache_ptr, table_row, kv_head, tile_start, context_len,
            stride_kb, stride_ks, stride_kh,
            stride_vb, stride_vs, stride_vh,
            stride_tn, scale_log2,
            HEAD_DIM, BLOCK_SIZE, BLOCK_D, BLOCK_N, True, DOT_PRECISION,
        )

    safe_sum = tl.where(row_sum > 0, row_sum, 1.0)
    result = acc / safe_sum[:, None]  # (BLOCK_M, BLOCK_D)
    tl.store(
        out_ptr + tokens[:, None] * stride_ot + head * stride_oh + d[None, :],
        result.to(out_ptr.dtype.element_ty), mask=q_mask,
    )


def _tile_config(head_dim: int, dtype: torch.dtype) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps). Sized so that ptxas reports no register spills for
    sm_90 at 16-bit; fp32 (exact "ieee" dots without tensor cores) is a correctness path."""
    if dtype == torch.float32:
        return 64, 32, 8
    if head_dim <= 128:
        return 128, 64, 8
    return 64, 32, 8


def paged_prefill_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    max_seqlen_q: int | None = None,
) -> torch.Tensor:
    """Triton version of paged_prefill_attention_ref.

    max_seqlen_q (the longest chunk) sizes the grid; pass it to avoid reading cu_seqlens_q
    back to the host.
    """
    _check_inputs(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens)
    check_triton_device(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens)
    check_last_dim_contiguous(q=q, k_cache=k_cache, v_cache=v_cache)

    num_tokens, num_q_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    num_seqs = context_lens.shape[0]
    out = torch.empty_like(q)
    if num_tokens == 0 or num_seqs == 0:
        return out
    if max_seqlen_q is None:
        max_seqlen_q = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max().item())
    if max_seqlen_q <= 0:
        return out

    block_m, block_n, num_warps = _tile_config(head_dim, q.dtype)
    _prefill_kernel[(triton.cdiv(max_seqlen_q, block_m), num_q_heads, num_seqs)](
        q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, out,
        scale * LOG2E,
        *q.stride()[:-1], *k_cache.stride()[:-1], *v_cache.stride()[:-1], *block_tables.stride(), *out.stride()[:-1],
        GROUP=num_q_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_M=block_m,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_N=block_n,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=num_warps,
        num_stages=2,
    )
    return out


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    max_seqlen_q: int | None = None,
) -> torch.Tensor:
    """Prefill attention over the paged cache: the Triton kernel on a GPU, the reference elsewhere.

    `max_seqlen_q`, when the caller knows it, spares the GPU path a device-to-host sync."""
    if q.is_cuda:
        return paged_prefill_attention_triton(
            q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale, max_seqlen_q=max_seqlen_q
        )
    return paged_prefill_attention_ref(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale)
