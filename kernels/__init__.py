"""Triton kernels of the inference engine, each beside its PyTorch reference."""

from kernels.decode_attention import paged_decode_attention
from kernels.kv_write import write_kv
from kernels.prefill_attention import paged_prefill_attention

__all__ = ["paged_decode_attention", "paged_prefill_attention", "write_kv"]
