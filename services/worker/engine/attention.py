"""Attention of one layer over flat packed tokens: paged (through the KV cache, for serving:
Triton kernels on a GPU, PyTorch's fused attention on a CPU) or dense causal (one sequence,
no cache: the ground truth in tests)."""

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kernels.cpu_attention import (
    CpuAttentionPlan,
    decode_group_attention,
    decode_group_attention_kernel,
    paged_attention_cpu,
    write_kv_cpu,
    write_slots,
)
from kernels.decode_attention import paged_decode_attention
from kernels.kv_write import write_kv
from kernels.prefill_attention import paged_prefill_attention


@dataclass
class AttentionMetadata:
    """Where one step's T tokens of N sequences live in the paged KV cache.

    Sequence i owns query tokens cu_seqlens_q[i]:cu_seqlens_q[i+1]; its cache holds
    context_lens[i] tokens once this step's K/V are written (this step's included).
    """

    slot_mapping: torch.Tensor  # (T,) int64: block_id * block_size + offset; < 0 = padding, not written
    block_tables: torch.Tensor  # (N, M) int32: the blocks of each sequence, in order
    cu_seqlens_q: torch.Tensor  # (N+1,) int32
    context_lens: torch.Tensor  # (N,) int32
    max_query_len: int  # 1 means every sequence decodes one token: T == N
    cpu_attention_kernel: bool = False  # CPU decode groups through the C++ kernel (the runner sets it)
    _cpu_plan: CpuAttentionPlan | None = field(default=None, repr=False, compare=False)

    @property
    def decode_only(self) -> bool:
        return self.max_query_len == 1

    def cpu_plan(self, block_size: int) -> CpuAttentionPlan:
        """What each sequence reads from the cache, worked out by the first layer for all of them."""
        if self._cpu_plan is None:
            self._cpu_plan = CpuAttentionPlan.build(
                self.slot_mapping, self.block_tables, self.cu_seqlens_q, self.context_lens, block_size,
                kernel=self.cpu_attention_kernel,
            )
        return self._cpu_plan


@dataclass(frozen=True)
class DecodeGroupMetadata:
    """A CPU step in which every sequence decodes one token, all contexts read as the same number of
    whole blocks, the positions past each one masked: tensors only, what a compiled graph takes."""

    slot_mapping: torch.Tensor  # (N,) int64: where each new token's K/V goes
    read_slots: torch.Tensor  # (N, S) int64: the slot of each position read; past its table, the null block's
    visible: torch.Tensor  # (N, 1, 1, S) bool: True within the sequence's context
    lengths: torch.Tensor | None = None  # (N,) int64 contexts when the C++ kernel reads the cache; else tensor ops


def paged_attention(
    q: torch.Tensor,  # (T, Hq, D)
    k: torch.Tensor,  # (T, Hkv, D)
    v: torch.Tensor,  # (T, Hkv, D)
    k_cache: torch.Tensor,  # (num_blocks, block_size, Hkv, D)
    v_cache: torch.Tensor,  # (num_blocks, block_size, Hkv, D)
    meta: AttentionMetadata | DecodeGroupMetadata,
    scale: float,
) -> torch.Tensor:  # (T, Hq, D)
    """Store this step's K/V in the cache, then attend over each sequence's whole cached context."""
    if isinstance(meta, DecodeGroupMetadata):
        write_slots(k, v, k_cache, v_cache, meta.slot_mapping)
        if meta.lengths is not None:
            return decode_group_attention_kernel(q, k_cache, v_cache, meta.read_slots, meta.lengths, scale)
        return decode_group_attention(q, k_cache, v_cache, meta.read_slots, meta.visible, scale)
    if not q.is_cuda:
        plan = meta.cpu_plan(k_cache.shape[1])
        write_kv_cpu(k, v, k_cache, v_cache, plan)
        return paged_attention_cpu(q, k_cache, v_cache, plan, scale)
    write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    if meta.decode_only:
        return paged_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.context_lens, scale)
    return paged_prefill_attention(
        q, k_cache, v_cache, meta.block_tables, meta.cu_seqlens_q, meta.context_lens, scale,
        max_seqlen_q=meta.max_query_len,
    )


def causal_attention(
    q: torch.Tensor,  # (T, Hq, D)
    k: torch.Tensor,  # (T, Hkv, D)
    v: torch.Tensor,  # (T, Hkv, D)
    scale: float,
) -> torch.Tensor:  # (T, Hq, D)
    """Plain causal attention over one whole sequence; query head h reads KV head h // (Hq // Hkv)."""
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1),  # (Hq, T, D)
        k.transpose(0, 1),  # (Hkv, T, D)
        v.transpose(0, 1),
        is_causal=True,
        scale=scale,
        enable_gqa=True,
    )  # (Hq, T, D)
    return out.transpose(0, 1)
