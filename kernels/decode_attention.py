"""Attention for one new query token per sequence over the paged KV cache: a PyTorch
reference, a split-K (flash-decoding) Triton kernel, and a dispatcher."""

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
    context_lens: torch.Tensor,
) -> None:
    check_query_and_cache(q, k_cache, v_cache, "(B, Hq, D)")
    batch = q.shape[0]
    if block_tables.dim() != 2 or block_tables.shape[0] != batch:
        raise ValueError(f"block_tables must be ({batch}, max_blocks_per_seq); got {tuple(block_tables.shape)}")
    if context_lens.dim() != 1 or context_lens.shape[0] != batch:
        raise ValueError(f"context_lens must be ({batch},); got {tuple(context_lens.shape)}")
    check_index_dtypes(block_tables=block_tables, context_lens=context_lens)


def paged_decode_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Each sequence's single query attends to its first context_lens[b] cached tokens.

    A sequence with context length 0 (batch padding) gets a zero output.
    """
    _check_inputs(q, k_cache, v_cache, block_tables, context_lens)
    batch, num_q_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    group = num_q_heads // num_kv_heads
    if batch == 0:
        return torch.empty_like(q)

    # Gather every sequence's blocks up to the longest context in one indexing op;
    # table entries past a sequence's end may be junk, so clamp them to a real block.
    max_len = int(context_lens.max().item())
    used_blocks = max(1, math.ceil(max_len / block_size))
    table = block_tables[:, :used_blocks].long().clamp(0, num_blocks - 1)  # (B, NB)
    keys = k_cache[table].flatten(1, 2).float()  # (B, S, Hkv, D), S = NB * block_size
    values = v_cache[table].flatten(1, 2).float()  # (B, S, Hkv, D)

    queries = q.float().view(batch, num_kv_heads, group, head_dim)  # (B, Hkv, G, D)
    scores = torch.einsum("bhgd,bshd->bhgs", queries, keys) * scale  # (B, Hkv, G, S)
    positions = torch.arange(keys.shape[1], device=q.device)  # (S,)
    visible = positions[None, :] < context_lens[:, None].to(q.device)  # (B, S)
    scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    probs = torch.nan_to_num(probs, nan=0.0)  # rows with nothing visible
    out = torch.einsum("bhgs,bshd->bhgd", probs, values)  # (B, Hkv, G, D)
    return out.reshape(batch, num_q_heads, head_dim).to(q.dtype)


@triton.jit
def _decode_split_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr,
    out_ptr, part_out_ptr, part_max_ptr, part_sum_ptr,
    scale_log2,
    stride_qb, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_tb, stride_tn,
    stride_ob, stride_oh,
    stride_pb, stride_ph, stride_ps,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # One program per (sequence, kv head, context partition); the GROUP query heads that
    # share a kv head ride together as rows of one matrix, so each K/V tile is read once.
    # The head dim is unit-stride (the wrapper checks), so its offsets need no stride.
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    context_len = tl.load(context_lens_ptr + seq).to(tl.int32)
    # Partitions are whole BLOCK_N tiles; trailing partitions of short contexts are empty.
    split_len = tl.cdiv(tl.cdiv(context_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, context_len)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + g  # (BLOCK_G,)
    g_mask = g < GROUP
    d_mask = d < HEAD_DIM
    q = tl.load(
        q_ptr + seq.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + d[None, :],
        mask=g_mask[:, None] & d_mask[None, :],
        other=0.0,
    )  # (BLOCK_G, BLOCK_D)

    row_max = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    row_sum = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    table_row = block_tables_ptr + seq.to(tl.int64) * stride_tb

    for tile_start in range(start, end, BLOCK_N):
        pos = tile_start + tl.arange(0, BLOCK_N)  # (BLOCK_N,)
        pos_mask = pos < end
        block_ids = tl.load(table_row + (pos // BLOCK_SIZE) * stride_tn, mask=pos_mask, other=0).to(tl.int64)
        in_block = pos % BLOCK_SIZE
        kv_mask = pos_mask[:, None] & d_mask[None, :]
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

        # Scores live in log2 units so the softmax can use exp2.
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2  # (BLOCK_G, BLOCK_N)
        scores = tl.where(pos_mask[None, :], scores, float("-inf"))
        new_max = tl.maximum(row_max, tl.max(scores, axis=1))
        rescale = tl.exp2(row_max - new_max)
        probs = tl.exp2(scores - new_max[:, None])  # (BLOCK_G, BLOCK_N)
        row_sum = row_sum * rescale + tl.sum(probs, axis=1)
        acc = acc * rescale[:, None] + tl.dot(probs.to(v.dtype), v, input_precision=DOT_PRECISION)
        row_max = new_max

    safe_sum = tl.where(row_sum > 0, row_sum, 1.0)
    result = acc / safe_sum[:, None]  # (BLOCK_G, BLOCK_D)
    out_mask = g_mask[:, None] & d_mask[None, :]
    if NUM_SPLITS == 1:
        tl.store(
            out_ptr + seq.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + d[None, :],
            result.to(out_ptr.dtype.element_ty), mask=out_mask,
        )
    else:
        part = seq.to(tl.int64) * stride_pb + heads * stride_ph + split * stride_ps  # (BLOCK_G,)
        tl.store(part_out_ptr + part[:, None] * HEAD_DIM + d[None, :], result, mask=out_mask)
        tl.store(part_max_ptr + part, row_max, mask=g_mask)
        tl.store(part_sum_ptr + part, row_sum, mask=g_mask)


@triton.jit
def _decode_reduce_kernel(
    out_ptr, part_out_ptr, part_max_ptr, part_sum_ptr,
    stride_ob, stride_oh,
    stride_pb, stride_ph, stride_ps,
    HEAD_DIM: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # Merges the partitions of one (sequence, query head): each partition's normalised
    # output is weighted by its share of the softmax denominator.
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_mask = s < NUM_SPLITS
    d_mask = d < HEAD_DIM
    part = seq * stride_pb + head * stride_ph + s * stride_ps  # (BLOCK_S,)

    part_max = tl.load(part_max_ptr + part, mask=s_mask, other=float("-inf"))  # (BLOCK_S,)
    part_sum = tl.load(part_sum_ptr + part, mask=s_mask, other=0.0)
    part_out = tl.load(
        part_out_ptr + part[:, None] * HEAD_DIM + d[None, :], mask=s_mask[:, None] & d_mask[None, :], other=0.0
    )  # (BLOCK_S, BLOCK_D)

    global_max = tl.max(part_max, axis=0)
    # Empty partitions carry -inf and weigh exp2(-inf) = 0; a sequence with no tokens at
    # all has no finite max, so a stand-in keeps -inf - -inf (NaN) out of the exp.
    global_max = tl.where(global_max > float("-inf"), global_max, 0.0)
    weight = part_sum * tl.exp2(part_max - global_max)  # (BLOCK_S,)
    total = tl.sum(weight, axis=0)
    total = tl.where(total > 0, total, 1.0)
    result = tl.sum(part_out * weight[:, None], axis=0) / total  # (BLOCK_D,)
    tl.store(out_ptr + seq * stride_ob + head * stride_oh + d, result.to(out_ptr.dtype.element_ty), mask=d_mask)


def _num_splits(batch: int, num_kv_heads: int, max_context: int, device: torch.device) -> int:
    """Enough partitions that (sequences x kv heads x partitions) covers the GPU about twice,
    but never partitions shorter than 256 tokens, whose reduce would cost more than it saves."""
    if device.type == "cuda":
        num_sms = torch.cuda.get_device_properties(device).multi_processor_count
    else:
        num_sms = 4
    wanted = triton.cdiv(2 * num_sms, max(1, batch * num_kv_heads))
    useful = triton.cdiv(max_context, 256)
    return max(1, min(wanted, useful, 64))


def paged_decode_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Triton version of paged_decode_attention_ref.

    num_splits partitions each context (flash-decoding); by default it is chosen from the
    batch size and the block table's width, without reading context_lens on the host.
    """
    _check_inputs(q, k_cache, v_cache, block_tables, context_lens)
    check_triton_device(q, k_cache, v_cache, block_tables, context_lens)
    check_last_dim_contiguous(q=q, k_cache=k_cache, v_cache=v_cache)
    if num_splits is not None and num_splits < 1:
        raise ValueError(f"num_splits must be >= 1; got {num_splits}")

    batch, num_q_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    out = torch.empty_like(q)
    if batch == 0:
        return out
    if num_splits is None:
        num_splits = _num_splits(batch, num_kv_heads, block_tables.shape[1] * block_size, q.device)

    block_d = max(16, triton.next_power_of_2(head_dim))
    if num_splits > 1:
        part_out = torch.empty(batch, num_q_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
        part_max = torch.empty(batch, num_q_heads, num_splits, dtype=torch.float32, device=q.device)
        part_sum = torch.empty_like(part_max)
    else:  # never touched: the kernel writes straight to out
        part_out = part_max = part_sum = out
    part_strides = (num_q_heads * num_splits, num_splits, 1)

    _decode_split_kernel[(batch, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, context_lens,
        out, part_out, part_max, part_sum,
        scale * LOG2E,
        *q.stride()[:-1], *k_cache.stride()[:-1], *v_cache.stride()[:-1], *block_tables.stride(), *out.stride()[:-1],
        *part_strides,
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        # tl.dot needs every side >= 16, so small groups are padded with masked rows.
        BLOCK_G=max(16, triton.next_power_of_2(group)),
        BLOCK_D=block_d,
        BLOCK_N=64 if head_dim <= 128 else 32,
        NUM_SPLITS=num_splits,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=4,
    )
    if num_splits > 1:
        _decode_reduce_kernel[(batch, num_q_heads)](
            out, part_out, part_max, part_sum,
            *out.stride()[:-1], *part_strides,
            HEAD_DIM=head_dim,
            NUM_SPLITS=num_splits,
            BLOCK_S=triton.next_power_of_2(num_splits),
            BLOCK_D=block_d,
        )
    return out


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Decode attention over the paged cache: the Triton kernel on a GPU, the reference elsewhere."""
    if q.is_cuda:
        return paged_decode_attention_triton(q, k_cache, v_cache, block_tables, context_lens, scale)
    return paged_decode_attention_ref(q, k_cache, v_cache, block_tables, context_lens, scale)
