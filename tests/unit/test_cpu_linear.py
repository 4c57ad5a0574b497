"""CpuLinear computes what linear does through oneDNN's packed weight, for one row, a decode step's
few and a prompt's many; swapping it in keeps a model's outputs and none of its dense projection
weights (the embedding stays, shared or not); a graph traced with the packed weights multiplies with
them and packs no copy of its own."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch._inductor.config as inductor_config
import torch.nn.functional as F
from torch._dynamo.utils import counters

from services.worker.engine.cpu_linear import CpuLinear, use_cpu_linear_
from services.worker.engine.model import LlamaModel
from shared.models.shapes import SHAPES


@pytest.mark.parametrize("rows", [0, 1, 2, 7, 64, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_cpu_linear_matches_linear(rows: int, bias: bool) -> None:
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(48, 32, generator=generator)
    b = torch.randn(48, generator=generator) if bias else None
    x = torch.randn(rows, 32, generator=generator)
    out = CpuLinear(weight, b)(x)
    assert out.shape == (rows, 48) and out.is_contiguous()
    torch.testing.assert_close(out, F.linear(x, weight, b), rtol=1e-5, atol=1e-5)


def test_batch_dims_and_strided_inputs_are_kept() -> None:
    weight = torch.randn(48, 32)
    x = torch.randn(3, 5, 64)[..., ::2]  # (3, 5, 32), not contiguous
    torch.testing.assert_close(CpuLinear(weight)(x), F.linear(x, weight), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tied", [False, True])
def test_swapping_keeps_the_models_outputs_and_no_dense_projection(tiny: LlamaModel, tied: bool) -> None:
    model = LlamaModel(dataclasses.replace(SHAPES["tiny"], tie_word_embeddings=tied))
    model.load_state_dict(tiny.state_dict(), strict=False)
    model.eval()
    ids = torch.arange(5, 45)
    before = model.dense_forward(ids)
    embedding = model.embed_tokens.weight
    use_cpu_linear_(model)
    torch.testing.assert_close(model.dense_forward(ids), before, rtol=1e-5, atol=1e-5)
    assert model.embed_tokens.weight is embedding
    dense = [name for name, tensor in model.named_parameters() if tensor.dim() == 2]
    assert dense == ["embed_tokens.weight"], dense


def test_the_digest_stands_for_the_dense_weight() -> None:
    weight = torch.randn(48, 32)
    nudged = weight.clone()
    nudged[7, 3] += 1e-3
    assert CpuLinear(weight).dense_digest == CpuLinear(weight.clone()).dense_digest != CpuLinear(nudged).dense_digest


def test_a_graph_traced_with_the_packed_weights_packs_none_of_its_own(one_torch_thread) -> None:
    weight = torch.randn(48, 32)
    layer = CpuLinear(weight)
    x = torch.randn(7, 32)
    counters.clear()
    with torch.no_grad(), inductor_config.patch({"freezing": True}):
        out = torch.compile(layer)(x)
    torch.testing.assert_close(out, F.linear(x, weight), rtol=1e-5, atol=1e-5)
    # Freezing would pack a dense float32 weight for oneDNN itself, a copy the graph then holds.
    assert counters["inductor"]["mkldnn_linear_weight_pack_matcher_count"] == 0
