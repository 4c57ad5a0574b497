"""The engine's settings: one frozen section, which the worker's settings embed as `engine`.

A pydantic dataclass, so the worker's flags, environment and docs come from these very
fields. Torch-free: the `drivetrain` command reads it in every process, edges included.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import ConfigDict, Field
from pydantic.dataclasses import dataclass

from shared.models.cache_salt import CacheSharing

# What max_batch_tokens = 0 means: a step's token budget on each kind of device.
CPU_MAX_BATCH_TOKENS = 512
GPU_MAX_BATCH_TOKENS = 8192

Positive = Annotated[int, Field(ge=1)]
Auto = Annotated[int, Field(ge=0)]
CpuCompile = Literal["off", "on", "background"]


@dataclass(frozen=True, config=ConfigDict(use_attribute_docstrings=True, extra="ignore"))
class EngineSettings(CacheSharing):
    """How the engine batches and how much memory it takes; its prefix-cache isolation (cache_isolation,
    cache_groups, cache_salt) is CacheSharing's, which edges read too."""

    max_num_seqs: Positive = 256
    """most requests in one engine step; also the largest captured CUDA graph"""
    max_batch_tokens: Auto = 0
    """token budget of one step (decodes first, then prompt chunks); 0 = 512 on a CPU, 8192 on a GPU"""
    block_size: Positive = 16
    """tokens per KV cache block"""
    num_kv_blocks: Auto = 0
    """KV cache pool in blocks, one reserved null block included; 0 = size the pool from memory"""
    kv_memory_fraction: Annotated[float, Field(gt=0.0, le=1.0)] = 0.9
    """GPU: share of device memory for weights, activations and KV cache together"""
    enable_prefix_caching: bool = True
    """reuse the KV blocks of prompt prefixes seen before"""
    enable_chunked_prefill: bool = True
    """split long prompts across steps so running decodes keep their pace"""
    long_prefill_token_threshold: Auto = 0
    """cap on one prompt's chunk per step; 0 = off"""
    count_chunk_attention: bool = True
    """while other requests decode, a prompt chunk's attention over the positions before it counts against the step's budget (as the tokens of a fresh prompt that take as long), so a long prompt's last chunks keep the decodes' pace as its first did (SmolLM2 on a CPU, a 4,000-token prompt among 16 chats: their longest wait for a token 0.79 s against 1.44 s, its first token 7 % later); off: chunks count their tokens alone"""
    static_batching: bool = False
    """benchmark baseline only: admit a batch, then nothing new until all of it finished"""
    cuda_graphs: bool = True
    """GPU: replay decode steps as captured CUDA graphs"""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """weights and KV cache; auto: bfloat16 on a GPU, float32 on a CPU"""
    kv_cache_dtype: Literal["auto", "float16", "bfloat16"] = "auto"
    """keys and values in the KV cache: auto, the weights' dtype; float16 or bfloat16 under float32 weights on a CPU halves the cache's memory and the bytes each decode step reads, at the cost of greedy output matching float32's exactly: float16 (llama.cpp's default under f32 weights) keeps three more bits of each value (past ±65,504 it saturates), bfloat16 float32's range"""
    quantization: Literal["none", "int8", "int4", "w8a8"] = "none"
    """CPU: weight-only quantization, for fewer bytes read per token: int8 (a quarter of float32's), or int4 projections in llama.cpp's Q4_1 layout with an int8 output layer (about a seventh; with AVX2 alone, PyTorch's int4 kernel is bound by its arithmetic and compiled int8 decodes one stream faster); or w8a8, int8 weights and activations multiplied in integers, for many streams and long prompts, which are bound by arithmetic"""
    overlap_scheduling: Literal["auto", "on", "off"] = "auto"
    """schedule each step while the step before still runs on the device, so the host's work per step (scheduling, inputs, the tokens' update) hides behind the device's; auto: on a GPU (a CPU computes as it is asked: nothing to hide behind)"""
    cpu_compile: CpuCompile = "off"
    """CPU: decode steps through graphs compiled by inductor with the weights frozen in (fused small operations, inductor's own GEMM kernels): about 2.7x one stream's decode speed, for minutes of compiling at the first start of a model (then loaded from cpu_graph_store; w8a8 weights compile at every start). on: before the engine serves; background: steps run eagerly until it is done, slowly on a few cores"""
    cpu_graph_store: bool = True
    """CPU: keep the compiled decode graphs between starts (AOTInductor libraries, with such weights as the model does not hold: SmolLM2 float32's three take 0.55-1.1 GB; the most recently used up to 8 GiB in all, every one a running worker uses kept, in $DRIVETRAIN_CACHE/cpu-graphs, else ~/.cache/drivetrain/cpu-graphs): the next start of the same model loads them in seconds; off: compiled at every start"""
    cpu_attention_kernel: bool = True
    """CPU: decode attention through a C++ kernel (kernels/cpu_paged_decode.cpp, built with the compiler torch.compile uses, seconds once per machine) that reads the KV cache where it lies, 2-2.6x as fast as the compiled tensor operations where many sequences decode; off, or where it cannot be built: those operations in compiled steps, PyTorch's fused attention over gathered copies in eager ones"""
    cpu_output_screen: bool = True
    """CPU, float32 weights: rows whose logits nothing touches (no penalty, bias, grammar, top-k, top-p, seed or log-probabilities), greedy or sampled at a temperature, take the output layer in bfloat16 (where this CPU multiplies it: the panel kernel with AVX512_BF16, else oneDNN), and only the tokens the bfloat16 logits cannot settle are rescored in float32 (kernels/cpu_screened_output.cpp): a greedy row's token is the one every float32 logit gives, a sampled row's is drawn from their same softmax (by rejection); the step's other rows take every float32 logit (where the screened rows are fewer than 16, all of them do), for about half the output layer's time (a fifth of a SmolLM2 step's arithmetic at 64 rows, of its bytes at one); off: every logit in float32"""
    cpu_panel_products: bool = True
    """CPU, float32 or bfloat16 weights: projections through a C++ kernel over weights laid out in panels of columns (kernels/cpu_panel_linear.cpp; float32 on CPUs with AVX2 or AVX-512, bfloat16 on those with AVX512_BF16), which asks for the next panel's weights while it multiplies the one before: a SmolLM2 layer's four products in 0.70-0.98 of oneDNN's time from one row to 512, 0.82 at 64, in bfloat16 0.70 at one row, 0.59 at 16 and 0.86 at 64 (2-core Zen 4, loadtest/bench_cpu_panel_linear.py); off, and elsewhere: oneDNN's packed products (the float32 few-rows compiled graphs pick their kernels by timing either way)"""
    cpu_threads: int = Field(default=0, ge=0)
    """CPU: threads for the model's math; 0: torch's default, one per core. Workers sharing a machine should split its cores (drivetrain up does): more threads than cores make every small operation wait"""
    fair_share: Literal["vtc", "fcfs"] = "vtc"
    """order of waiting requests: weighted virtual token counters between tenants (vtc), or arrival order (fcfs)"""
    vtc_output_weight: Annotated[float, Field(ge=0.0)] = 2.0
    """vtc: cost of a generated token, against 1 for a prompt token computed"""
    vtc_cached_weight: Annotated[float, Field(ge=0.0)] = 0.1
    """vtc: cost of a prompt token read from the prefix cache, against 1 for one computed; the default is the billing policy's cached_fraction, so fair share charges what billing does (docs/billing.md)"""
    tenant_weights: Annotated[str, Field(pattern=r"^(\s*[^:,\s]+\s*:\s*\d+(\.\d+)?\s*(,|$))*$")] = ""
    """vtc: share weights, tenant:weight[,tenant:weight]; a tenant not listed weighs 1"""

    def weights(self) -> dict[str, float]:
        pairs = (item.split(":") for item in self.tenant_weights.split(",") if item.strip())
        return {tenant.strip(): float(weight) for tenant, weight in pairs}
