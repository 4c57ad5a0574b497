"""The engine's Triton kernels against their PyTorch references at the model's own shapes: each
output's relative error (float64 norms) and, on a GPU, each side's median time (CUDA events)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass

import torch
from engine_scenarios import Sizes, model_device

from kernels.decode_attention import paged_decode_attention_ref, paged_decode_attention_triton
from kernels.kv_write import write_kv_ref, write_kv_triton
from kernels.prefill_attention import paged_prefill_attention_ref, paged_prefill_attention_triton
from kernels.rms_norm import add_rms_norm_ref, add_rms_norm_triton
from kernels.rope import apply_rope_ref, apply_rope_triton
from kernels.silu_mul import silu_mul_ref, silu_mul_triton
from services.worker.engine.model import LlamaModel

BLOCK_SIZE = 16


@dataclass(frozen=True)
class Heads:
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device
    hidden_size: int = 64
    intermediate_size: int = 160


@dataclass(frozen=True)
class KernelSizes:
    """Decode batches at contexts drawn from [context // 2, context]; prefill chunks of `chunk`
    tokens after `prefix` cached ones; KV writes, and the fused elementwise kernels, of one token
    and of as many as the largest decode batch. One sequence's decode is also run with its context
    cut into each of one_sequence_splits partitions, beside the default's choice: one sequence
    leaves most of a GPU idle, and the default never cuts partitions shorter than 256 tokens."""

    decode_batches: tuple[int, ...] = (1, 64, 256)
    one_sequence_splits: tuple[int, ...] = (16, 32)
    context: int = 2048
    prefill_seqs: int = 4
    prefix: int = 1536
    chunk: int = 512


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def median_ms(run: Callable[[], object], device: torch.device, graph: bool = False) -> float | None:
    """Median of timed runs with CUDA events; None off a GPU (the interpreter's time means nothing).
    graph: replays of a CUDA graph of the run, the device's time alone, as in a serving step (a
    small kernel's Python launch outlasts it); else each run launched from Python."""
    if device.type != "cuda":
        return None
    import triton.testing

    if graph:
        return float(triton.testing.do_bench_cudagraph(run, rep=100, return_mode="median"))
    return float(triton.testing.do_bench(run, warmup=25, rep=100, return_mode="median"))


def random_caches(heads: Heads, num_blocks: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (num_blocks, BLOCK_SIZE, heads.num_kv_heads, heads.head_dim)
    return tuple(torch.randn(shape, generator=gen, device=heads.device).to(heads.dtype) for _ in range(2))


def shuffled_tables(context_lens: torch.Tensor, num_blocks: int, gen: torch.Generator) -> torch.Tensor:
    """Each sequence's blocks, disjoint and shuffled across the pool, as the block pool hands them out."""
    needed = (context_lens + BLOCK_SIZE - 1) // BLOCK_SIZE
    ids = torch.randperm(num_blocks, generator=gen, device=gen.device)
    width = int(needed.max())
    table = torch.zeros(len(context_lens), width, dtype=torch.int32, device=context_lens.device)
    starts = torch.cumsum(needed, 0) - needed
    for row in range(len(context_lens)):  # setup only: a few hundred rows
        count = int(needed[row])
        table[row, :count] = ids[int(starts[row]) : int(starts[row]) + count].to(torch.int32)
    return table


def _compare(name: str, kernel: Callable[[], torch.Tensor], ref: Callable[[], torch.Tensor], device: torch.device,
             timed: tuple[Callable[[], object], Callable[[], object]] | None = None, **shape: int | None) -> dict:
    """timed: what to time of each side, when it is not the whole of what gives the output."""
    out, expected = kernel(), ref()
    timed_kernel, timed_ref = timed or (kernel, ref)
    return {"kernel": name, **shape, "relative_error": relative_error(out, expected),
            "kernel_ms": median_ms(timed_kernel, device, graph=True),
            "kernel_launched_ms": median_ms(timed_kernel, device), "reference_ms": median_ms(timed_ref, device)}


def decode_case(heads: Heads, batch: int, context: int, gen: torch.Generator, num_splits: int | None = None) -> dict:
    """num_splits: context partitions forced on the kernel; None, the default's choice."""
    lens = torch.randint(context // 2, context + 1, (batch,), generator=gen, device=heads.device, dtype=torch.int32)
    num_blocks = int(((lens + BLOCK_SIZE - 1) // BLOCK_SIZE).sum()) + 1
    k_cache, v_cache = random_caches(heads, num_blocks, gen)
    tables = shuffled_tables(lens, num_blocks, gen)
    q = torch.randn(batch, heads.num_q_heads, heads.head_dim, generator=gen, device=heads.device).to(heads.dtype)
    scale = heads.head_dim**-0.5
    args = (q, k_cache, v_cache, tables, lens, scale)
    forced = {} if num_splits is None else {"num_splits": num_splits}
    return _compare("decode_attention", lambda: paged_decode_attention_triton(*args, **forced),
                    lambda: paged_decode_attention_ref(*args), heads.device, batch=batch, max_context=context,
                    num_splits=num_splits)


def prefill_case(heads: Heads, num_seqs: int, prefix: int, chunk: int, gen: torch.Generator) -> dict:
    lens = torch.full((num_seqs,), prefix + chunk, dtype=torch.int32, device=heads.device)
    num_blocks = int(((lens + BLOCK_SIZE - 1) // BLOCK_SIZE).sum()) + 1
    k_cache, v_cache = random_caches(heads, num_blocks, gen)
    tables = shuffled_tables(lens, num_blocks, gen)
    cu = torch.arange(num_seqs + 1, dtype=torch.int32, device=heads.device) * chunk
    q = torch.randn(num_seqs * chunk, heads.num_q_heads, heads.head_dim, generator=gen, device=heads.device)
    q = q.to(heads.dtype)
    scale = heads.head_dim**-0.5
    args = (q, k_cache, v_cache, tables, cu, lens, scale)
    return _compare("prefill_attention", lambda: paged_prefill_attention_triton(*args, max_seqlen_q=chunk),
                    lambda: paged_prefill_attention_ref(*args), heads.device,
                    seqs=num_seqs, prefix=prefix, chunk=chunk)


def kv_write_case(heads: Heads, num_tokens: int, gen: torch.Generator) -> dict:
    num_blocks = num_tokens // BLOCK_SIZE + 2
    k_cache, v_cache = random_caches(heads, num_blocks, gen)
    fused = torch.randn(num_tokens, 2 * heads.num_kv_heads, heads.head_dim, generator=gen, device=heads.device)
    fused = fused.to(heads.dtype)  # k and v as views of one projection, as the model hands them over
    k, v = fused[:, : heads.num_kv_heads], fused[:, heads.num_kv_heads :]
    slots = torch.randperm(num_blocks * BLOCK_SIZE, generator=gen, device=heads.device)[:num_tokens]
    slots[::7] = -1  # padding rows write nothing
    caches = {side: (k_cache.clone(), v_cache.clone()) for side in ("kernel", "ref")}

    def written(write: Callable, side: str) -> torch.Tensor:
        write(k, v, *caches[side], slots)
        return torch.stack(caches[side])

    timed = (lambda: write_kv_triton(k, v, *caches["kernel"], slots), lambda: write_kv_ref(k, v, *caches["ref"], slots))
    return _compare("write_kv", lambda: written(write_kv_triton, "kernel"), lambda: written(write_kv_ref, "ref"),
                    heads.device, timed, tokens=num_tokens)


def elementwise_cases(heads: Heads, num_tokens: int, gen: torch.Generator) -> list[dict]:
    """The fused add + RMSNorm, RoPE and SiLU-and-mul of one step of num_tokens tokens."""
    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=heads.device).to(heads.dtype)

    x, delta = randn(num_tokens, heads.hidden_size), randn(num_tokens, heads.hidden_size)
    weight = randn(heads.hidden_size)
    q = randn(num_tokens, heads.num_q_heads, heads.head_dim)
    angles = torch.randn(num_tokens, 1, heads.head_dim // 2, generator=gen, device=heads.device)
    cos, sin = angles.cos(), angles.sin()
    gate_up = randn(num_tokens, 2 * heads.intermediate_size)
    return [
        _compare("add_rms_norm", lambda: add_rms_norm_triton(x, delta, weight, 1e-5)[1],
                 lambda: add_rms_norm_ref(x, delta, weight, 1e-5)[1], heads.device, tokens=num_tokens),
        _compare("rope", lambda: apply_rope_triton(q, cos, sin), lambda: apply_rope_ref(q, cos, sin), heads.device,
                 tokens=num_tokens),
        _compare("silu_mul", lambda: silu_mul_triton(gate_up), lambda: silu_mul_ref(gate_up), heads.device,
                 tokens=num_tokens),
    ]


def kernel_checks(heads: Heads, sizes: KernelSizes, seed: int = 0) -> list[dict]:
    gen = torch.Generator(device=heads.device).manual_seed(seed)
    rows = [decode_case(heads, batch, sizes.context, gen) for batch in sizes.decode_batches]
    rows += [decode_case(heads, 1, sizes.context, gen, splits) for splits in sizes.one_sequence_splits]
    rows.append(prefill_case(heads, sizes.prefill_seqs, sizes.prefix, sizes.chunk, gen))
    rows.append(prefill_case(heads, 1, 0, sizes.prefix + sizes.chunk, gen))  # one whole prompt
    rows.append(kv_write_case(heads, max(sizes.decode_batches), gen))
    rows.append(kv_write_case(heads, sizes.prefix + sizes.chunk, gen))
    for num_tokens in sorted({1, max(sizes.decode_batches)}):
        rows += elementwise_cases(heads, num_tokens, gen)
    return rows


def kernels(model: LlamaModel, sizes: Sizes, args: argparse.Namespace) -> dict:
    config, device = model.config, model_device(model)
    heads = Heads(config.num_heads, config.num_kv_heads, config.head_dim, next(model.parameters()).dtype, device,
                  config.hidden_size, config.intermediate_size)
    rows = kernel_checks(heads, KernelSizes())
    for row in rows:
        print(f"  {row}", flush=True)
    return {"block_size": BLOCK_SIZE, "dtype": str(heads.dtype), "cases": rows,
            "max_relative_error": max(row["relative_error"] for row in rows)}
