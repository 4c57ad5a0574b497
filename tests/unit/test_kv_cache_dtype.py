"""engine.kv_cache_dtype float16 or bfloat16 under float32 weights on a CPU: the cache holds that
dtype, every path that reads it (eager prefill and decode, the compiled graphs with and without the
C++ kernel) gives logits within its rounding of the float32 cache's, float16's closer than
bfloat16's, and the compiled graphs the eager path's logits over the same cache."""

from __future__ import annotations

import copy

import pytest
import torch

from kernels import cpu_paged_decode
from kernels.cpu_attention import (
    CpuAttentionPlan,
    decode_group_attention,
    decode_group_attention_kernel,
    paged_attention_cpu,
    write_kv_cpu,
    write_slots,
)
from services.worker.engine.cpu_linear import use_cpu_linear_
from services.worker.engine.engine import Engine
from services.worker.engine.model import LlamaModel
from services.worker.engine.model_runner import ModelRunner, StepInputs, kv_cache_dtype
from services.worker.engine.sampling_params import SamplingParams
from services.worker.engine.settings import EngineSettings
from tests.unit.engine_runs import tokens_for

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPTS = [list(range(3, 40)), list(range(50, 70)), list(range(100, 131))]


class LogitsKept(ModelRunner):
    """Keeps every step's logits; with `beside`, also the eager path's on the same inputs of each step a
    compiled graph took (run first: the graph then writes the same K/V again)."""

    beside = False

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.kept: list[torch.Tensor] = []
        self.pairs: list[tuple[torch.Tensor, torch.Tensor]] = []

    def _logits(self, inputs: StepInputs) -> torch.Tensor | None:
        graphs = self.decode_graphs
        eager = None
        if self.beside and graphs is not None and graphs.ready.is_set() and len(inputs.sample_ids) == inputs.num_seqs:
            eager = self.model.compute_logits(self._forward(inputs)[inputs.sample_rows])
        graph_steps = self.num_graph_steps
        logits = super()._logits(inputs)
        self.kept.append(logits)
        if eager is not None and self.num_graph_steps > graph_steps:
            self.pairs.append((logits, eager))
        return logits


class EagerBeside(LogitsKept):
    beside = True


def engine(model: LlamaModel, runner_cls: type[ModelRunner] = LogitsKept, **settings) -> Engine:
    """An engine of its own over `model` (not copied)."""
    return Engine(model, EngineSettings(num_kv_blocks=64, **settings), 512, eos_token_ids=(),
                  runner_cls=runner_cls)


# Of the largest logit: bfloat16 keeps 8 bits of each cached value, float16 11.
ROUNDING = {"bfloat16": 0.02, "float16": 0.004}


def first_logits_error(cache_dtype: str, tiny: LlamaModel) -> float:
    """The largest difference of the prefill's and first decode's logits from the float32 cache's (both
    read the same contexts), over the largest logit; checks the cache's dtype and output as it goes."""
    exact, halved = engine(copy.deepcopy(tiny)), engine(copy.deepcopy(tiny), kv_cache_dtype=cache_dtype)
    assert all(k.dtype == v.dtype == getattr(torch, cache_dtype) for k, v in halved.runner.kv_caches)
    assert next(halved.runner.model.parameters()).dtype == torch.float32
    ours, theirs = tokens_for(halved, PROMPTS, GREEDY), tokens_for(exact, PROMPTS, GREEDY)
    agreed = sum(a == b for mine, ref in zip(ours, theirs) for a, b in zip(mine, ref))
    assert agreed >= 0.8 * sum(map(len, theirs))
    errors = []
    for step in range(2):
        logits, reference = halved.runner.kept[step], exact.runner.kept[step]
        assert not torch.equal(logits, reference)  # the cache's dtype took effect
        errors.append(((logits - reference).abs().amax() / reference.abs().amax()).item())
    return max(errors)


def test_a_half_width_cache_under_float32_weights_stays_within_its_rounding(tiny: LlamaModel,
                                                                            one_torch_thread) -> None:
    errors = {dtype: first_logits_error(dtype, tiny) for dtype in ROUNDING}
    assert all(errors[dtype] <= bound for dtype, bound in ROUNDING.items()), errors
    assert errors["float16"] < errors["bfloat16"], errors


@pytest.mark.parametrize(("cache_dtype", "kernel"), [("bfloat16", True), ("bfloat16", False), ("float16", True)])
def test_compiled_graphs_over_a_half_width_cache_give_the_eager_logits(tiny: LlamaModel, one_torch_thread,
                                                                       cache_dtype: str, kernel: bool) -> None:
    model = use_cpu_linear_(copy.deepcopy(tiny))
    compiled = engine(model, EagerBeside, kv_cache_dtype=cache_dtype, cpu_compile="on", cpu_attention_kernel=kernel)
    graphs = compiled.runner.decode_graphs
    assert not graphs.failed and graphs.attention_kernel == kernel
    tokens_for(compiled, PROMPTS, GREEDY)
    assert len(compiled.runner.pairs) == GREEDY.max_tokens - 1  # every decode step took a graph
    for logits, eager in compiled.runner.pairs:
        torch.testing.assert_close(logits, eager, rtol=1e-4, atol=1e-4 * eager.abs().amax().item())


def write_then_attend_eagerly(q, k, v, k_cache, v_cache, slots, read_slots, visible, lens):
    plan = CpuAttentionPlan.build(slots, read_slots[:, ::16] // 16, torch.tensor([0, 1]), lens, 16, kernel=True)
    write_kv_cpu(k, v, k_cache, v_cache, plan)
    return paged_attention_cpu(q, k_cache, v_cache, plan, 0.25)


def write_then_attend_by_tensor_operations(q, k, v, k_cache, v_cache, slots, read_slots, visible, lens):
    write_slots(k, v, k_cache, v_cache, slots)
    return decode_group_attention(q, k_cache, v_cache, read_slots, visible, 0.25)


def write_then_attend_with_lengths(q, k, v, k_cache, v_cache, slots, read_slots, visible, lens):
    write_slots(k, v, k_cache, v_cache, slots)
    return decode_group_attention_kernel(q, k_cache, v_cache, read_slots, lens, 0.25)


@pytest.mark.parametrize("write_and_attend", [
    write_then_attend_eagerly,
    write_then_attend_by_tensor_operations,
    torch.compile(write_then_attend_by_tensor_operations, fullgraph=True),
    write_then_attend_with_lengths,
], ids=["eager", "tensor_operations", "compiled", "kernel"])
def test_a_float16_cache_saturates_rather_than_holding_infinities(write_and_attend) -> None:
    """A key or value past float16's range is kept as its largest finite value: an infinite one would
    turn its sequence's attention into NaNs from then on."""
    assert cpu_paged_decode.available()  # the kernel's op registered: make test installs what building it takes
    gen = torch.Generator().manual_seed(3)
    k_cache, v_cache = (torch.randn(3, 16, 2, 16, generator=gen).half() for _ in range(2))
    big = torch.tensor([1e6, -1e6]).repeat(8)  # (16,): beyond 65,504 either way
    k, v = big.expand(1, 2, 16).clone(), (-big).expand(1, 2, 16).clone()
    slots, lens = torch.tensor([16 + 5]), torch.tensor([6])  # block 1's sixth slot: the sixth position
    read_slots = torch.arange(16, 32)[None]
    visible = (torch.arange(16) < 6)[None, None, None, :]
    q = torch.randn(1, 4, 16, generator=gen) * 1e-3
    out = write_and_attend(q, k, v, k_cache, v_cache, slots, read_slots, visible, lens)
    limit = torch.finfo(torch.float16).max
    assert torch.equal(k_cache[1, 5].float(), big.clamp(-limit, limit).expand(2, 16))
    assert torch.equal(v_cache[1, 5].float(), (-big).clamp(-limit, limit).expand(2, 16))
    assert torch.isfinite(out).all()


def test_a_gpu_keeps_the_weights_dtype_in_its_cache() -> None:
    with pytest.raises(ValueError, match="CPU option"):
        kv_cache_dtype(torch.float32, torch.bfloat16, torch.device("cuda"))
    assert kv_cache_dtype(torch.float32, torch.bfloat16, torch.device("cpu")) == torch.bfloat16
    assert kv_cache_dtype(torch.bfloat16, None, torch.device("cuda")) == torch.bfloat16
