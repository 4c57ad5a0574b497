"""The C++ decode attention kernel (kernels/cpu_paged_decode.cpp) against the reference: every head
size it is built for, one to seven query heads per KV head (each count of the four whose sums it holds
at once, and past them), one sequence per task,
a sequence's positions in parts, tasks shared by 1-4 threads, bfloat16 and float16
caches, and the arguments it refuses; an eager engine decoding
through it gives the fused attention's tokens."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from kernels import cpu_paged_decode
from kernels.cpu_attention import decode_group_attention, decode_group_attention_kernel, write_slots
from kernels.decode_attention import paged_decode_attention_ref
from services.worker.engine.engine import Engine
from services.worker.engine.sampling_params import SamplingParams
from services.worker.engine.settings import EngineSettings
from tests.unit.engine_runs import tokens_for

BLOCK = 16


@pytest.fixture(autouse=True, scope="module")
def built() -> None:
    assert cpu_paged_decode.available()  # make test installs what building it takes


def case(context_lens: list[int], head_dim: int, num_kv_heads: int, group: int, seed: int,
         dtype: torch.dtype = torch.float32):
    """Caches with every sequence's blocks shuffled through them; (q, caches, tables, read_slots, lens)."""
    gen = torch.Generator().manual_seed(seed)
    needed = [math.ceil(n / BLOCK) for n in context_lens]
    num_blocks = sum(needed) + 2
    shape = (num_blocks, BLOCK, num_kv_heads, head_dim)
    k_cache, v_cache = (torch.randn(shape, generator=gen).to(dtype) for _ in range(2))
    ids = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()  # block 0 stays the padding block
    width = max(needed)
    tables = torch.zeros((len(context_lens), width), dtype=torch.int64)
    taken = 0
    for row, count in enumerate(needed):
        tables[row, :count] = torch.tensor(ids[taken:taken + count])
        taken += count
    read_slots = (tables[:, :, None] * BLOCK + torch.arange(BLOCK)).flatten(1)  # (n, S)
    q = torch.randn(len(context_lens), num_kv_heads * group, head_dim, generator=gen)
    return q, k_cache, v_cache, tables, read_slots, torch.tensor(context_lens)


@pytest.mark.parametrize("head_dim", cpu_paged_decode.HEAD_DIMS)
@pytest.mark.parametrize(("num_kv_heads", "group"), [(1, 1), (3, 3), (2, 4), (1, 6), (2, 7)])
@pytest.mark.parametrize("context_lens", [[1, 16, 17, 37], [5, 700] + [33] * 10, [700]])  # heads; sequences; one
def test_the_kernel_matches_the_reference(head_dim: int, num_kv_heads: int, group: int,
                                          context_lens: list[int]) -> None:
    q, k_cache, v_cache, tables, read_slots, lens = case(context_lens, head_dim, num_kv_heads, group, seed=head_dim)
    expected = paged_decode_attention_ref(q, k_cache, v_cache, tables.int(), lens.int(), 0.3)
    out = cpu_paged_decode.paged_decode_attention(q, k_cache, v_cache, read_slots, lens, 0.3)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("threads", [1, 2, 3, 4])
@pytest.mark.parametrize("context_lens", [[2000] + [40] * 15, [40] * 7 + [3000] + [40] * 8, [900, 1] + [60] * 3,
                                          [2000], [1], [3], [128, 129, 255, 4096], [4100, 2]])
def test_every_task_is_done_whatever_the_threads_and_skew(threads: int, context_lens: list[int]) -> None:
    """Threads take runs of tasks by their work, and few sequences are cut into parts of their
    positions, merged after: with one context far longer than the rest, or one alone (of a position, or
    fewer than the threads), each of 1-4 threads' shares still covers its tasks once (a skipped task
    would leave its rows unwritten, an empty part its NaN), and the parts merge to the whole's softmax."""
    q, k_cache, v_cache, tables, read_slots, lens = case(context_lens, 64, 3, 3, seed=threads)
    expected = paged_decode_attention_ref(q, k_cache, v_cache, tables.int(), lens.int(), 0.3)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = cpu_paged_decode.paged_decode_attention(q, k_cache, v_cache, read_slots, lens, 0.3)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_half_width_cache_is_read_as_its_float32_values(dtype: torch.dtype) -> None:
    q, k_cache, v_cache, tables, read_slots, lens = case([40, 900, 3], 64, 3, 3, seed=7, dtype=dtype)  # 900: parts
    expected = paged_decode_attention_ref(q, k_cache.float(), v_cache.float(), tables.int(), lens.int(), 0.125)
    out = cpu_paged_decode.paged_decode_attention(q, k_cache, v_cache, read_slots, lens, 0.125)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_decode_group_through_the_kernel_equals_the_tensor_operations(dtype: torch.dtype) -> None:
    q, k_cache, v_cache, _, read_slots, lens = case([37, 20, 33, 40, 64], 16, 2, 3, seed=9, dtype=dtype)
    q = q.to(dtype)
    k, v = (torch.randn(len(lens), 2, 16, generator=torch.Generator().manual_seed(10)).to(dtype) for _ in range(2))
    last = lens - 1
    slots = read_slots.gather(1, last[:, None])[:, 0]
    visible = (torch.arange(read_slots.shape[1])[None] < lens[:, None])[:, None, None, :]
    write_slots(k, v, k_cache, v_cache, slots)
    expected = decode_group_attention(q, k_cache, v_cache, read_slots, visible, 0.25)
    out = decode_group_attention_kernel(q, k_cache, v_cache, read_slots, lens, 0.25)
    assert out.dtype == dtype
    tolerance = {} if dtype == torch.float32 else {"atol": 1e-2, "rtol": 1e-2}
    torch.testing.assert_close(out, expected, **tolerance)


def test_the_kernel_compiles_into_a_graph() -> None:
    q, k_cache, v_cache, _, read_slots, lens = case([30, 18], 32, 2, 2, seed=11)
    compiled = torch.compile(cpu_paged_decode.paged_decode_attention, fullgraph=True)
    expected = cpu_paged_decode.paged_decode_attention(q, k_cache, v_cache, read_slots, lens, 0.5)
    torch.testing.assert_close(compiled(q, k_cache, v_cache, read_slots, lens, 0.5), expected)


@pytest.mark.parametrize(("change", "message"), [
    ({"lens": torch.tensor([0, 5])}, "within 1..S"),
    ({"lens": torch.tensor([5, 33])}, "within 1..S"),  # S is 32: two blocks
    ({"lens": torch.tensor([5.0, 6.0])}, "lengths"),
    ({"read_slots": torch.zeros(2, 32, dtype=torch.int32)}, "read_slots"),
    ({"q": torch.zeros(2, 4, 48)}, "head"),
    ({"q": torch.zeros(2, 4, 16, dtype=torch.float64)}, "q:"),
    ({"k_cache": torch.zeros(3, BLOCK, 2, 16, dtype=torch.float64)}, "float32, bfloat16 or float16 cache"),
])
def test_arguments_it_cannot_serve_are_refused_with_a_reason(change: dict, message: str) -> None:
    q, k_cache, v_cache, _, read_slots, lens = case([20, 30], 16, 2, 2, seed=12)
    args = {"q": q, "k_cache": k_cache, "v_cache": v_cache, "read_slots": read_slots, "lens": lens} | change
    if "k_cache" in change:
        args["v_cache"] = torch.zeros_like(args["k_cache"])
    with pytest.raises(RuntimeError, match=message):
        cpu_paged_decode.paged_decode_attention(args["q"], args["k_cache"], args["v_cache"], args["read_slots"],
                                                args["lens"], 0.5)


def test_it_serves_the_head_sizes_and_cache_dtypes_it_was_built_for() -> None:
    assert cpu_paged_decode.supports(64, torch.float32) and cpu_paged_decode.supports(128, torch.bfloat16)
    assert cpu_paged_decode.supports(32, torch.float16)
    assert not cpu_paged_decode.supports(80, torch.float32)
    assert not cpu_paged_decode.supports(64, torch.float64)


def test_an_eager_engine_decodes_through_the_kernel_with_the_fused_attentions_tokens(tiny, one_torch_thread) -> None:
    greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    prompts = [list(range(3, 40)), list(range(50, 58)), list(range(100, 190))]  # contexts far apart: two groups

    def run(kernel: bool) -> tuple[list[list[int]], list[str]]:
        engine = Engine(copy.deepcopy(tiny), EngineSettings(num_kv_blocks=64, cpu_attention_kernel=kernel), 512,
                        eos_token_ids=())
        assert engine.runner.cpu_attention_kernel == kernel
        with torch.profiler.profile() as profile:
            tokens = tokens_for(engine, prompts, greedy)
        return tokens, [event.name for event in profile.events()]

    (ours, names), (fused, fused_names) = run(True), run(False)
    assert ours == fused
    assert "drivetrain::paged_decode_attention" in names
    assert "drivetrain::paged_decode_attention" not in fused_names


def test_where_it_cannot_be_built_it_says_so_in_one_line_and_is_not_available(monkeypatch, caplog) -> None:
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    monkeypatch.setattr(cpu_paged_decode, "SOURCE", cpu_paged_decode.SOURCE.with_name("missing.cpp"))
    assert not cpu_paged_decode.available.__wrapped__()  # past the process's cached answer
    warnings = [r for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "could not be built" in warnings[0].getMessage()
    assert warnings[0].exc_info is None and "Traceback" not in caplog.text
