"""CpuLinear computes what linear does, for one row, a decode step's few and a prompt's many, and
swapping it in changes neither a model's outputs nor its memory (the weights are shared)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from services.worker.engine.cpu_linear import MAX_ROWS, CpuLinear, use_cpu_linear_
from services.worker.engine.model import LlamaModel
from shared.models.shapes import SHAPES


@pytest.mark.parametrize("rows", [1, 2, 7, MAX_ROWS, MAX_ROWS + 1, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_cpu_linear_matches_linear(rows: int, bias: bool) -> None:
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(48, 32, generator=generator)
    b = torch.randn(48, generator=generator) if bias else None
    x = torch.randn(rows, 32, generator=generator)
    out = CpuLinear(weight, b)(x)
    assert out.shape == (rows, 48) and out.is_contiguous()
    torch.testing.assert_close(out, F.linear(x, weight, b), rtol=1e-5, atol=1e-5)


def test_swapping_keeps_the_models_outputs_and_shares_its_weights(tiny: LlamaModel) -> None:
    model = LlamaModel(dataclasses.replace(SHAPES["tiny"], tie_word_embeddings=True))
    model.load_state_dict(tiny.state_dict(), strict=False)
    model.eval()
    ids = torch.arange(5, 45)
    before = model.dense_forward(ids)
    pointers = {p.data_ptr() for p in model.parameters()}
    use_cpu_linear_(model)
    torch.testing.assert_close(model.dense_forward(ids), before, rtol=1e-5, atol=1e-5)
    assert model.lm_head.weight.data_ptr() == model.embed_tokens.weight.data_ptr()  # tied: one tensor
    assert {p.data_ptr() for p in model.parameters()} == pointers
