"""Triton kernels of the inference engine, each beside its PyTorch reference."""

from kernels.decode_attention import paged_decode_attention
from kernels.kv_write import write_kv
from kernels.prefill_attention import paged_prefill_attention
from kernels.rms_norm import add_rms_norm
from kernels.rope import apply_rope
from kernels.silu_mul import silu_mul

__all__ = ["add_rms_norm", "apply_rope", "paged_decode_attention", "paged_prefill_attention", "silu_mul", "write_kv"]
