"""The C++ prompt attention kernel (kernels/cpu_prefill_attention.cpp): each position's causal attention
over its prefix and its chunk equals dense attention in float64, at head groups and sizes the models
use and at head dims that leave parts of a tile, chunks shorter and longer than a task's run of rows,
contexts of one block of keys and of several, over strided views as the model passes them;
eager float32 prompt steps take it, other dtypes and traced graphs keep the fused kernel; what it does
not take is an error, not a crash."""

from __future__ import annotations

import pytest
import torch

from kernels import cpu_prefill_attention
from kernels.cpu_attention import CpuAttentionPlan, paged_attention_cpu


@pytest.fixture(autouse=True, scope="module")
def built() -> None:
    assert cpu_prefill_attention.available()  # make test installs what building it takes


def _dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """(n, L, Hq, D) over (n, C, Hkv, D), position i of L at C - L + i, in float64."""
    length, num_q_heads = q.shape[1:3]
    context, num_kv_heads = k.shape[1:3]
    keys = k.double().repeat_interleave(num_q_heads // num_kv_heads, 2)
    values = v.double().repeat_interleave(num_q_heads // num_kv_heads, 2)
    scores = torch.einsum("nlhd,nchd->nhlc", q.double(), keys) * scale
    seen = torch.arange(context)[None, :] <= torch.arange(length)[:, None] + context - length
    weights = scores.masked_fill(~seen, float("-inf")).softmax(-1)
    return torch.einsum("nhlc,nchd->nlhd", weights, values).float()


def _case(n: int, length: int, context: int, num_q_heads: int, num_kv_heads: int, head_dim: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(n, length, num_q_heads, head_dim, generator=gen)
    k = torch.randn(n, context, num_kv_heads, head_dim, generator=gen)
    v = torch.randn(n, context, num_kv_heads, head_dim, generator=gen)
    return q, k, v


@pytest.mark.parametrize(("n", "length", "context"), [
    (1, 1, 1),  # one position seeing itself
    (1, 7, 7),  # a whole prompt shorter than a vector of keys
    (3, 40, 40),  # whole prompts, padded alike, in one call
    (1, 33, 50),  # a chunk after a prefix, its runs of rows cut mid-chunk
    (2, 100, 612),
    (1, 512, 2000),  # the last chunk of a 2,000-token prompt
    (1, 100, 2100),  # several blocks of keys, the first rows seeing none of the last
    (1, 300, 4500),  # many blocks, each row's running maximum rescaled again and again
    (1, 40, 530),  # the chunk's own keys across a block's end
    (1, 5, 517),  # a last block of 5 keys: tiles of 4 and 1
])
@pytest.mark.parametrize(("num_q_heads", "num_kv_heads", "head_dim"), [
    (9, 3, 64), (4, 4, 16), (8, 2, 128),
    (2, 1, 20), (3, 3, 7),  # head dims in tiles of 8, then of 4, 2 and 1
])
def test_matches_dense_attention(n: int, length: int, context: int, num_q_heads: int, num_kv_heads: int,
                                 head_dim: int) -> None:
    q, k, v = _case(n, length, context, num_q_heads, num_kv_heads, head_dim, seed=length + context)
    out = cpu_prefill_attention.prefill_attention(q, k, v, head_dim ** -0.5)
    torch.testing.assert_close(out, _dense(q, k, v, head_dim ** -0.5), atol=2e-5, rtol=1e-4)


def test_large_scores_stay_finite() -> None:
    # Scores in the thousands: the softmax subtracts each row's largest before its exponentials.
    q, k, v = _case(1, 20, 30, 6, 2, 32, seed=3)
    out = cpu_prefill_attention.prefill_attention(q * 40, k * 40, v, 1.0)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, _dense(q * 40, k * 40, v, 1.0), atol=1e-4, rtol=1e-4)


def test_views_of_a_fused_projection_and_a_gathered_cache() -> None:
    # q a view of a fused q|k|v projection (rows strided), keys and values views of (C, Hkv, D) buffers
    # longer than the context, as the engine passes them; a layout it does not read is copied first.
    q_rows, k, v = _case(1, 30, 45, 6, 2, 16, seed=4)
    fused = torch.cat([q_rows[0].flatten(1), torch.randn(30, 64)], dim=1)  # (L, Hq*D + 2*Hkv*D)
    q = fused[:, :96].view(30, 6, 16)[None]
    buffer_k = torch.cat([k, torch.randn(1, 19, 2, 16)], dim=1)
    buffer_v = torch.cat([v, torch.randn(1, 19, 2, 16)], dim=1)
    expected = _dense(q_rows, k, v, 0.25)
    out = cpu_prefill_attention.prefill_attention(q, buffer_k[:, :45], buffer_v[:, :45], 0.25)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-4)
    heads_apart = q_rows.transpose(2, 3).contiguous().transpose(2, 3)  # each position's heads not one run
    torch.testing.assert_close(cpu_prefill_attention.prefill_attention(heads_apart, k, v, 0.25), expected,
                               atol=2e-5, rtol=1e-4)


def test_an_empty_chunk_gives_an_empty_output() -> None:
    q, k, v = _case(2, 0, 5, 6, 2, 16, seed=5)
    assert cpu_prefill_attention.prefill_attention(q, k, v, 0.25).shape == (2, 0, 6, 16)


@pytest.mark.parametrize(("q", "k", "v", "message"), [
    (torch.ones(1, 4, 6, 16, dtype=torch.float64), torch.ones(1, 4, 2, 16), torch.ones(1, 4, 2, 16), "q:"),
    (torch.ones(1, 4, 6, 16), torch.ones(1, 3, 2, 16), torch.ones(1, 3, 2, 16), "C >= L"),
    (torch.ones(1, 4, 6, 16), torch.ones(1, 4, 4, 16), torch.ones(1, 4, 4, 16), "dividing"),
    (torch.ones(1, 4, 6, 16), torch.ones(1, 4, 2, 16), torch.ones(1, 5, 2, 16), "alike"),
    (torch.ones(1, 4, 6, 16), torch.ones(2, 4, 2, 16), torch.ones(2, 4, 2, 16), "C >= L"),
    (torch.ones(4, 6, 16), torch.ones(4, 2, 16), torch.ones(4, 2, 16), "q:"),
])
def test_arguments_it_does_not_take_are_errors(q, k, v, message: str) -> None:
    with pytest.raises(RuntimeError, match=message):
        torch.ops.drivetrain.cpu_prefill_attention(q, k, v, 0.25)


def _ops_of(run) -> set[str]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        run()
    return {event.name for event in profile.events()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_float32_prompt_steps_take_the_kernel_and_others_the_fused_one(dtype: torch.dtype) -> None:
    # A step of a whole prompt and a chunk after a cached prefix, through the engine's CPU attention.
    block_size, num_blocks = 16, 12
    gen = torch.Generator().manual_seed(6)
    k_cache = torch.randn(num_blocks, block_size, 2, 16, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, 2, 16, generator=gen).to(dtype)
    tables = torch.tensor([[1, 2, 0, 0, 0], [3, 4, 5, 6, 7]], dtype=torch.int32)
    cu = torch.tensor([0, 20, 30], dtype=torch.int32)  # a whole prompt of 20, a chunk of 10 after 60 cached
    lens = torch.tensor([20, 70], dtype=torch.int32)
    q = torch.randn(30, 6, 16, generator=gen).to(dtype)
    plan = CpuAttentionPlan.build(torch.full((30,), -1), tables, cu, lens, block_size)
    assert len(plan.whole_prompts) == 1 and len(plan.prompt_chunks) == 1
    ops = _ops_of(lambda: paged_attention_cpu(q, k_cache, v_cache, plan, 0.25))
    ours = "drivetrain::cpu_prefill_attention" in ops
    fused = "aten::_scaled_dot_product_flash_attention_for_cpu" in ops
    assert (ours, fused) == ((True, False) if dtype == torch.float32 else (False, True))


def test_a_traced_graph_keeps_the_fused_kernel() -> None:
    # inductor has no kernel of ours to fuse: a graph that traces a prompt step keeps PyTorch's op.
    q, k, v = _case(1, 8, 8, 6, 2, 16, seed=7)
    seen: list[bool] = []

    def attend(q, k, v):
        seen.append(cpu_prefill_attention.serves(q, k))
        return q

    torch.compile(attend, backend="eager", fullgraph=True)(q, k, v)
    assert seen == [False]
    assert cpu_prefill_attention.serves(q, k)
