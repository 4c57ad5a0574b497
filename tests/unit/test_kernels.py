"""Paged-KV kernels: references against dense attention, Triton kernels (on a GPU, or interpreted
on a CPU) against the references, and the host wrappers' argument checks."""

import math
import os

import pytest
import torch
import torch.nn.functional as F

from kernels import cpu_prefill_attention
from kernels.cpu_attention import (
    PAD_BLOCK,
    CpuAttentionPlan,
    decode_group_attention,
    paged_attention_cpu,
    write_kv_cpu,
    write_slots,
)
from kernels.decode_attention import (
    paged_decode_attention,
    paged_decode_attention_ref,
    paged_decode_attention_triton,
)
from kernels.kv_write import write_kv, write_kv_ref, write_kv_triton
from kernels.prefill_attention import (
    paged_prefill_attention,
    paged_prefill_attention_ref,
    paged_prefill_attention_triton,
)

ATOL, RTOL = 1e-4, 1e-3
TABLE_PAD = -1  # table entries past a sequence's blocks; kernels must never read them
# Where the Triton-against-reference tests run: the GPU when there is one, else the interpreter.
KERNEL_DEVICE = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"


def _on_kernel_device(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return tuple(t.to(KERNEL_DEVICE) for t in tensors)


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _random_cache(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, gen: torch.Generator,
                  dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return torch.randn(shape, generator=gen).to(dtype), torch.randn(shape, generator=gen).to(dtype)


def _block_tables(context_lens: list[int], block_size: int, num_blocks: int, gen: torch.Generator) -> torch.Tensor:
    """Disjoint, shuffled block ids per sequence; unused entries hold TABLE_PAD."""
    needed = [math.ceil(n / block_size) for n in context_lens]
    assert sum(needed) <= num_blocks
    ids = torch.randperm(num_blocks, generator=gen).tolist()
    table = torch.full((len(context_lens), max(needed) + 2), TABLE_PAD, dtype=torch.int32)
    taken = 0
    for row, count in enumerate(needed):
        table[row, :count] = torch.tensor(ids[taken:taken + count], dtype=torch.int32)
        taken += count
    return table


def _dense(cache: torch.Tensor, table_row: torch.Tensor, length: int) -> torch.Tensor:
    """Token-by-token gather of one sequence's cache: (length, Hkv, D)."""
    block_size = cache.shape[1]
    rows = [cache[int(table_row[p // block_size]), p % block_size] for p in range(length)]
    return torch.stack(rows) if rows else cache.new_zeros((0,) + cache.shape[2:])


def _dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q (L, Hq, D) at the last L of S positions, causal; k, v (S, Hkv, D) -> (L, Hq, D)."""
    chunk_len, num_q_heads, _ = q.shape
    length = k.shape[0]
    group = num_q_heads // k.shape[1]
    k = k.repeat_interleave(group, dim=1).transpose(0, 1).double()  # (Hq, S, D)
    v = v.repeat_interleave(group, dim=1).transpose(0, 1).double()
    q_pos = torch.arange(length - chunk_len, length)
    mask = torch.arange(length)[None, :] <= q_pos[:, None]  # (L, S)
    out = F.scaled_dot_product_attention(q.transpose(0, 1).double(), k, v, attn_mask=mask, scale=scale)
    return out.transpose(0, 1).to(q.dtype)  # (L, Hq, D)


def _decode_case(context_lens: list[int], group: int, head_dim: int, block_size: int, seed: int,
                 num_kv_heads: int = 2, dtype: torch.dtype = torch.float32):
    gen = _generator(seed)
    num_blocks = sum(math.ceil(n / block_size) for n in context_lens) + 3
    k_cache, v_cache = _random_cache(num_blocks, block_size, num_kv_heads, head_dim, gen, dtype)
    tables = _block_tables(context_lens, block_size, num_blocks, gen)
    q = torch.randn(len(context_lens), num_kv_heads * group, head_dim, generator=gen).to(dtype)
    lens = torch.tensor(context_lens, dtype=torch.int32)
    return q, k_cache, v_cache, tables, lens


def _prefill_case(chunks: list[tuple[int, int]], group: int, head_dim: int, block_size: int, seed: int,
                  num_kv_heads: int = 2):
    """chunks: (cached prefix length, chunk length) per sequence."""
    gen = _generator(seed)
    context_lens = [prefix + chunk for prefix, chunk in chunks]
    num_blocks = sum(math.ceil(n / block_size) for n in context_lens) + 3
    k_cache, v_cache = _random_cache(num_blocks, block_size, num_kv_heads, head_dim, gen)
    tables = _block_tables(context_lens, block_size, num_blocks, gen)
    cu = torch.tensor([0] + [chunk for _, chunk in chunks], dtype=torch.int32).cumsum(0).to(torch.int32)
    q = torch.randn(int(cu[-1]), num_kv_heads * group, head_dim, generator=gen)
    return q, k_cache, v_cache, tables, cu, torch.tensor(context_lens, dtype=torch.int32)


# --- write_kv ---------------------------------------------------------------------------

@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_write_kv_ref_matches_token_loop_and_skips_padding(index_dtype: torch.dtype) -> None:
    gen = _generator(0)
    k_cache, v_cache = _random_cache(6, 8, 2, 16, gen)
    k, v = torch.randn(5, 2, 16, generator=gen), torch.randn(5, 2, 16, generator=gen)
    slots = torch.tensor([17, -1, 3, 46, -1], dtype=index_dtype)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            expected_k[slot // 8, slot % 8] = k[t]
            expected_v[slot // 8, slot % 8] = v[t]

    write_kv_ref(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, expected_k)
    assert torch.equal(v_cache, expected_v)
    assert torch.equal(k_cache[2, 1], k[0])  # slot 17 = block 2, offset 1


@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_write_kv_triton_matches_ref(block_size: int, index_dtype: torch.dtype) -> None:
    gen = _generator(block_size)
    num_kv_heads, head_dim, num_tokens = 3, 24, 9  # neither a power of two: masks are exercised
    k_cache, v_cache = _random_cache(5, block_size, num_kv_heads, head_dim, gen)
    # k and v as views into one fused projection: last dim contiguous, token stride wider.
    fused = torch.randn(num_tokens, 2 * num_kv_heads, head_dim, generator=gen)
    k, v = fused[:, :num_kv_heads], fused[:, num_kv_heads:]
    slots = torch.randperm(5 * block_size, generator=gen)[:num_tokens].to(index_dtype)
    slots[[1, 6]] = -1
    k_cache, v_cache, fused, slots = _on_kernel_device(k_cache, v_cache, fused, slots)
    k, v = fused[:, :num_kv_heads], fused[:, num_kv_heads:]
    ref_k, ref_v = k_cache.clone(), v_cache.clone()

    write_kv_ref(k, v, ref_k, ref_v, slots)
    write_kv_triton(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, ref_k)
    assert torch.equal(v_cache, ref_v)
    slot = int(slots[0])
    assert torch.equal(v_cache[slot // block_size, slot % block_size], v[0])


# --- decode -----------------------------------------------------------------------------

@pytest.mark.parametrize("group", [1, 4])
def test_decode_ref_matches_dense(group: int) -> None:
    q, k_cache, v_cache, tables, lens = _decode_case([1, 37, 16, 70], group, 16, 16, seed=1)
    out = paged_decode_attention_ref(q, k_cache, v_cache, tables, lens, 0.25)
    for b, length in enumerate(lens.tolist()):
        k, v = _dense(k_cache, tables[b], length), _dense(v_cache, tables[b], length)
        expected = _dense_attention(q[b:b + 1], k, v, 0.25)[0]
        torch.testing.assert_close(out[b], expected, atol=1e-5, rtol=1e-5)


def test_decode_ref_agrees_with_prefill_ref_for_one_token_chunks() -> None:
    q, k_cache, v_cache, tables, lens = _decode_case([9, 33, 50], 4, 16, 8, seed=2)
    cu = torch.arange(len(lens) + 1, dtype=torch.int32)
    decode = paged_decode_attention_ref(q, k_cache, v_cache, tables, lens, 0.3)
    prefill = paged_prefill_attention_ref(q, k_cache, v_cache, tables, cu, lens, 0.3)
    torch.testing.assert_close(decode, prefill, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize(
    "group, head_dim, block_size",
    [(1, 16, 16), (4, 16, 8), (4, 64, 32), (2, 24, 1)],
)
def test_decode_triton_matches_ref(group: int, head_dim: int, block_size: int) -> None:
    q, k_cache, v_cache, tables, lens = _on_kernel_device(
        *_decode_case([1, 37, 16, 83], group, head_dim, block_size, seed=3)
    )
    expected = paged_decode_attention_ref(q, k_cache, v_cache, tables, lens, 0.2)
    out = paged_decode_attention_triton(q, k_cache, v_cache, tables, lens, 0.2, num_splits=1)
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("num_splits", [2, 5, None])
def test_decode_triton_split_k_matches_ref(num_splits: int | None) -> None:
    # 300 tokens over 5 partitions of whole 64-token tiles: one partition runs short and,
    # for the 20-token sequence, most are empty.
    q, k_cache, v_cache, tables, lens = _on_kernel_device(*_decode_case([300, 20], 4, 16, 16, seed=4))
    expected = paged_decode_attention_ref(q, k_cache, v_cache, tables, lens, 0.2)
    out = paged_decode_attention_triton(q, k_cache, v_cache, tables, lens, 0.2, num_splits=num_splits)
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_zero_length_sequence_gives_zeros(num_splits: int) -> None:
    q, k_cache, v_cache, tables, lens = _on_kernel_device(*_decode_case([40, 1], 2, 16, 16, seed=5))
    lens[1] = 0  # a padding row of a fixed-size batch
    ref = paged_decode_attention_ref(q, k_cache, v_cache, tables, lens, 0.2)
    out = paged_decode_attention_triton(q, k_cache, v_cache, tables, lens, 0.2, num_splits=num_splits)
    assert torch.equal(ref[1], torch.zeros_like(ref[1]))
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=RTOL)


def test_decode_triton_half_precision_close_to_ref() -> None:
    q, k_cache, v_cache, tables, lens = _on_kernel_device(
        *_decode_case([45, 130], 4, 16, 16, seed=6, dtype=torch.float16)
    )
    expected = paged_decode_attention_ref(q, k_cache, v_cache, tables, lens, 0.25)
    out = paged_decode_attention_triton(q, k_cache, v_cache, tables, lens, 0.25, num_splits=2)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out, expected, atol=2e-3, rtol=2e-3)


# --- prefill ----------------------------------------------------------------------------

@pytest.mark.parametrize("group", [1, 4])
def test_prefill_ref_matches_dense(group: int) -> None:
    chunks = [(0, 23), (40, 17), (5, 1), (16, 0), (0, 1)]
    q, k_cache, v_cache, tables, cu, lens = _prefill_case(chunks, group, 16, 16, seed=7)
    out = paged_prefill_attention_ref(q, k_cache, v_cache, tables, cu, lens, 0.25)
    for n, length in enumerate(lens.tolist()):
        start, end = int(cu[n]), int(cu[n + 1])
        if start == end:
            continue
        k, v = _dense(k_cache, tables[n], length), _dense(v_cache, tables[n], length)
        torch.testing.assert_close(out[start:end], _dense_attention(q[start:end], k, v, 0.25), atol=1e-5, rtol=1e-5)


def test_prefill_ref_chunked_equals_whole_prompt() -> None:
    # The same 50-token prompt attended in one chunk and as a 30-token chunk after a
    # 20-token cached prefix must give identical outputs for the last 30 tokens.
    q, k_cache, v_cache, tables, cu, lens = _prefill_case([(0, 50)], 4, 16, 8, seed=8)
    whole = paged_prefill_attention_ref(q, k_cache, v_cache, tables, cu, lens, 0.3)
    tail_cu = torch.tensor([0, 30], dtype=torch.int32)
    tail = paged_prefill_attention_ref(q[20:], k_cache, v_cache, tables, tail_cu, lens, 0.3)
    torch.testing.assert_close(tail, whole[20:], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize(
    "group, head_dim, block_size",
    [(1, 16, 16), (4, 16, 8), (4, 64, 32)],
)
def test_prefill_triton_matches_ref(group: int, head_dim: int, block_size: int) -> None:
    # Covers: no prefix, a cached prefix, a one-token chunk, an empty chunk, and a chunk
    # spanning several query tiles, each seeing both unmasked and diagonal KV tiles.
    chunks = [(0, 23), (40, 17), (5, 1), (16, 0), (70, 140)]
    q, k_cache, v_cache, tables, cu, lens = _on_kernel_device(
        *_prefill_case(chunks, group, head_dim, block_size, seed=9)
    )
    expected = paged_prefill_attention_ref(q, k_cache, v_cache, tables, cu, lens, 0.2)
    out = paged_prefill_attention_triton(q, k_cache, v_cache, tables, cu, lens, 0.2)
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=RTOL)


def test_prefill_triton_strided_query_view() -> None:
    # q as a view into a fused QKV projection: only its last dim is contiguous.
    q, k_cache, v_cache, tables, cu, lens = _on_kernel_device(*_prefill_case([(3, 9), (0, 12)], 2, 16, 16, seed=10))
    fused = torch.cat([q, torch.randn_like(q)], dim=1)
    q_view = fused[:, : q.shape[1]]
    expected = paged_prefill_attention_ref(q, k_cache, v_cache, tables, cu, lens, 0.2)
    out = paged_prefill_attention_triton(q_view, k_cache, v_cache, tables, cu, lens, 0.2, max_seqlen_q=12)
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=RTOL)


# --- dispatchers and argument checks ----------------------------------------------------

def test_dispatchers_use_reference_on_cpu() -> None:
    q, k_cache, v_cache, tables, lens = _decode_case([10, 20], 2, 16, 16, seed=11)
    assert torch.equal(
        paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.2),
        paged_decode_attention_ref(q, k_cache, v_cache, tables, lens, 0.2),
    )
    cu = torch.arange(3, dtype=torch.int32)
    assert torch.equal(
        paged_prefill_attention(q, k_cache, v_cache, tables, cu, lens, 0.2),
        paged_prefill_attention_ref(q, k_cache, v_cache, tables, cu, lens, 0.2),
    )
    k = torch.randn(2, 2, 16)
    write_kv(k, k, k_cache, v_cache, torch.tensor([0, 1]))
    assert torch.equal(k_cache[0, :2], k)


def test_write_kv_rejects_bad_arguments() -> None:
    k_cache, v_cache = _random_cache(4, 16, 2, 16, _generator(12))
    k = torch.randn(3, 2, 16)
    slots = torch.tensor([0, 1, 2])
    with pytest.raises(ValueError, match="cache holds"):
        write_kv_triton(torch.randn(3, 2, 8), torch.randn(3, 2, 8), k_cache, v_cache, slots)
    with pytest.raises(ValueError, match="slot_mapping"):
        write_kv_triton(k, k, k_cache, v_cache, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="slot_mapping"):
        write_kv(k, k, k_cache, v_cache, slots.float())
    with pytest.raises(ValueError, match="contiguous"):
        write_kv_triton(torch.randn(3, 16, 2).transpose(1, 2), k, k_cache, v_cache, slots)


def test_decode_rejects_bad_arguments() -> None:
    q, k_cache, v_cache, tables, lens = _decode_case([10, 20], 2, 16, 16, seed=13)
    with pytest.raises(ValueError, match="multiple"):
        paged_decode_attention_triton(q[:, :3], k_cache, v_cache, tables, lens, 0.2)
    with pytest.raises(ValueError, match="block_tables"):
        paged_decode_attention_triton(q, k_cache, v_cache, tables[:1], lens, 0.2)
    with pytest.raises(ValueError, match="context_lens"):
        paged_decode_attention(q, k_cache, v_cache, tables, lens[:1], 0.2)
    with pytest.raises(ValueError, match="head_dim"):
        paged_decode_attention_triton(q[..., :8], k_cache, v_cache, tables, lens, 0.2)
    with pytest.raises(ValueError, match="share"):
        paged_decode_attention_triton(q.half(), k_cache, v_cache, tables, lens, 0.2)
    with pytest.raises(ValueError, match="contiguous"):
        strided_q = torch.randn(2, 16, 4).transpose(1, 2)
        paged_decode_attention_triton(strided_q, k_cache, v_cache, tables, lens, 0.2)


def test_prefill_rejects_bad_arguments() -> None:
    q, k_cache, v_cache, tables, cu, lens = _prefill_case([(0, 5), (3, 4)], 2, 16, 16, seed=14)
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        paged_prefill_attention_triton(q, k_cache, v_cache, tables, cu[:2], lens, 0.2)
    with pytest.raises(ValueError, match="block_tables"):
        paged_prefill_attention(q, k_cache, v_cache, tables[:1], cu, lens, 0.2)
    with pytest.raises(ValueError, match="q must be"):
        paged_prefill_attention_triton(q[0], k_cache, v_cache, tables, cu, lens, 0.2)
    with pytest.raises(ValueError, match="k_cache and v_cache"):
        paged_prefill_attention_triton(q, k_cache, v_cache[:, :8], tables, cu, lens, 0.2)


# --- the CPU path: PyTorch's fused attention and our C++ kernels over a per-step plan ------

@pytest.fixture(params=["cpp_kernel", "fused"])
def prompt_attention(request, monkeypatch) -> str:
    """Each float32 prompt test twice: through the C++ kernel, and through PyTorch's fused attention,
    which serves where the kernel cannot be built."""
    if request.param == "cpp_kernel":
        assert cpu_prefill_attention.available()  # make test installs what building it takes
    else:
        monkeypatch.setattr(cpu_prefill_attention, "serves", lambda *tensors: False)
    return request.param


def _cpu_attention(q, k_cache, v_cache, tables, cu, lens, scale, slots=None):
    slots = torch.full((q.shape[0],), -1) if slots is None else slots
    plan = CpuAttentionPlan.build(slots, tables, cu, lens, k_cache.shape[1])
    return paged_attention_cpu(q, k_cache, v_cache, plan, scale)


@pytest.mark.parametrize("context_lens", [[37], [16, 16, 16], [1, 37, 16, 83], [700] + [20] * 9, [79, 134]])
@pytest.mark.parametrize("group", [1, 3])
def test_cpu_decode_matches_ref(context_lens: list[int], group: int) -> None:
    q, k_cache, v_cache, tables, lens = _decode_case(context_lens, group, 16, 16, seed=21)
    cu = torch.arange(len(context_lens) + 1, dtype=torch.int32)
    expected = paged_decode_attention_ref(q, k_cache, v_cache, tables, lens, 0.2)
    torch.testing.assert_close(_cpu_attention(q, k_cache, v_cache, tables, cu, lens, 0.2), expected,
                               atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_decode_group_writes_then_attends_like_the_ref(dtype: torch.dtype) -> None:
    # The compiled graphs' form: whole blocks read where they lie, positions past each context masked.
    context_lens, block_size = [37, 20, 33, 40], 16
    q, k_cache, v_cache, tables, lens = _decode_case(context_lens, 3, 16, block_size, seed=26, dtype=dtype)
    k, v = torch.randn(2, len(context_lens), 2, 16, generator=_generator(27)).to(dtype)
    last = lens.long() - 1
    slots = tables.long().gather(1, (last // block_size)[:, None])[:, 0] * block_size + last % block_size
    blocks = tables.long().masked_fill(tables == TABLE_PAD, PAD_BLOCK)
    read_slots = (blocks[:, :, None] * block_size + torch.arange(block_size)).flatten(1)  # (n, S)
    visible = (torch.arange(read_slots.shape[1])[None] < lens[:, None])[:, None, None, :]
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    write_kv_ref(k, v, expected_k, expected_v, slots)
    expected = paged_decode_attention_ref(q.float(), expected_k.float(), expected_v.float(), tables, lens, 0.2)
    write_slots(k, v, k_cache, v_cache, slots)
    out = decode_group_attention(q, k_cache, v_cache, read_slots, visible, 0.2)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)
    atol, rtol = (ATOL, RTOL) if dtype == torch.float32 else (1e-2, 1e-2)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), expected, atol=atol, rtol=rtol)


def test_cpu_decode_groups_contexts_within_a_factor_of_two() -> None:
    lens = torch.tensor([700, 20, 20, 33, 400, 16], dtype=torch.int32)
    tables = torch.arange(6 * 44, dtype=torch.int32).view(6, 44)
    plan = CpuAttentionPlan.build(torch.zeros(6, dtype=torch.long), tables, torch.arange(7), lens, 16)
    groups = sorted((g.length, sorted(g.rows.tolist())) for g in plan.decode_groups)
    assert groups == [(16, [5]), (48, [1, 2, 3]), (704, [0, 4])]  # 400 padded to 700, 20 to 33; 16 alone


@pytest.mark.parametrize("group", [1, 4])
def test_cpu_mixed_step_matches_prefill_ref(group: int, prompt_attention: str) -> None:
    # Fresh prompts, chunks after a cached prefix, decodes and an empty padding sequence in one step.
    chunks = [(0, 23), (40, 17), (5, 1), (16, 0), (0, 1), (90, 1), (33, 64)]
    q, k_cache, v_cache, tables, cu, lens = _prefill_case(chunks, group, 16, 16, seed=22)
    expected = paged_prefill_attention_ref(q, k_cache, v_cache, tables, cu, lens, 0.25)
    torch.testing.assert_close(_cpu_attention(q, k_cache, v_cache, tables, cu, lens, 0.25), expected,
                               atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 3])
def test_cpu_whole_prompts_attend_in_groups_like_the_ref(dtype: torch.dtype, group: int,
                                                          prompt_attention: str) -> None:
    # Prompts with nothing cached before them, of lengths that make three groups (64 and 40; 23 and
    # 17; 5 and 3), beside a chunk after a prefix and two decodes, each group one padded call.
    chunks = [(0, 23), (0, 64), (12, 30), (0, 5), (0, 40), (7, 1), (0, 17), (0, 3), (0, 1)]
    q, k_cache, v_cache, tables, cu, lens = _prefill_case(chunks, group, 16, 16, seed=28)
    plan = CpuAttentionPlan.build(torch.full((q.shape[0],), -1), tables, cu, lens, 16)
    assert sorted(p.rows.shape for p in plan.whole_prompts) == [(2, 5), (2, 23), (2, 64)]
    assert len(plan.prompt_chunks) == 1 and sum(g.rows.numel() for g in plan.decode_groups) == 2
    expected = paged_prefill_attention_ref(q, k_cache.to(dtype).float(), v_cache.to(dtype).float(), tables, cu,
                                           lens, 0.25)
    out = paged_attention_cpu(q.to(dtype), k_cache.to(dtype), v_cache.to(dtype), plan, 0.25)
    atol, rtol = (ATOL, RTOL) if dtype == torch.float32 else (2e-2, 2e-2)
    torch.testing.assert_close(out.float(), expected, atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_chunk_after_a_long_prefix_matches_prefill_ref(dtype: torch.dtype, prompt_attention: str) -> None:
    # A prefix longer than the fused kernel's key splits, a chunk longer than its query splits (the
    # fused kernel attends the cached and own parts apart and merges them by their log-sum-exps), and
    # longer than the C++ kernel's runs of rows.
    q, k_cache, v_cache, tables, cu, lens = _prefill_case([(1100, 300), (17, 530)], 3, 64, 16, seed=25)
    expected = paged_prefill_attention_ref(q, k_cache, v_cache, tables, cu, lens, 0.125)
    out = _cpu_attention(q.to(dtype), k_cache.to(dtype), v_cache.to(dtype), tables, cu, lens, 0.125)
    atol, rtol = (ATOL, RTOL) if dtype == torch.float32 else (2e-2, 2e-2)
    torch.testing.assert_close(out.float(), expected, atol=atol, rtol=rtol)


def test_cpu_zero_context_rows_give_zeros() -> None:
    q, k_cache, v_cache, tables, lens = _decode_case([0, 12, 0], 2, 16, 16, seed=23)
    out = _cpu_attention(q, k_cache, v_cache, tables, torch.arange(4, dtype=torch.int32), lens, 0.2)
    assert torch.equal(out[0], torch.zeros_like(out[0])) and torch.equal(out[2], torch.zeros_like(out[2]))
    torch.testing.assert_close(out, paged_decode_attention_ref(q, k_cache, v_cache, tables, lens, 0.2))


def test_cpu_write_matches_ref_and_skips_padding() -> None:
    gen = _generator(24)
    k_cache, v_cache = _random_cache(6, 8, 2, 16, gen)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    k, v = torch.randn(5, 2, 16, generator=gen), torch.randn(5, 2, 16, generator=gen)
    slots = torch.tensor([17, -1, 3, 46, -1])
    write_kv_ref(k, v, expected_k, expected_v, slots)
    plan = CpuAttentionPlan.build(slots, torch.zeros(1, 1, dtype=torch.int32), torch.tensor([0, 5]),
                                  torch.tensor([5]), 8)
    write_kv_cpu(k, v, k_cache, v_cache, plan)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)
