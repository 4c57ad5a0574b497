"""Weight-only int8 and bfloat16: close to float32 matrix by matrix, and SmolLM2 still answers."""

import pytest
import torch
import torch.nn.functional as F

from services.worker.engine.llm_engine import build_llm_engine
from services.worker.engine.quantize import Int8Linear
from services.worker.engine.sampling_params import SamplingParams
from services.worker.engine.settings import EngineSettings
from shared.models.errors import ModelError
from shared.models.spec import resolve_model


@pytest.mark.parametrize("rows", [1, 7, 64])
def test_int8_linear_is_within_a_percent_of_float32(rows: int) -> None:
    gen = torch.Generator().manual_seed(0)
    weight, x = torch.randn(96, 160, generator=gen), torch.randn(rows, 160, generator=gen)
    expected = F.linear(x, weight)
    out = Int8Linear(weight)(x)
    assert out.shape == expected.shape and out.dtype == x.dtype
    assert (out - expected).norm() / expected.norm() < 0.01


def test_int8_keeps_a_zero_row_zero_and_a_batch_shape() -> None:
    weight = torch.randn(8, 16)
    weight[3] = 0
    out = Int8Linear(weight)(torch.randn(2, 5, 16))
    assert out.shape == (2, 5, 8) and torch.equal(out[..., 3], torch.zeros(2, 5))


@pytest.mark.parametrize("dtype, quantization", [("float32", "none"), ("bfloat16", "none"), ("float32", "int8")])
def test_smollm2_answers_in_every_dtype(dtype: str, quantization: str) -> None:
    settings = EngineSettings(num_kv_blocks=32, dtype=dtype, quantization=quantization)
    llm = build_llm_engine(resolve_model("smollm2"), settings, "cpu")
    assert llm.engine.runner.dtype == getattr(torch, dtype)
    ids = llm.tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    request = llm.add_prompt("q", ids, SamplingParams(max_tokens=12, temperature=0.0))
    while llm.has_unfinished_requests():
        llm.step()
    assert "Paris" in llm.tokenizer.decode(request.output_token_ids)


def test_quantization_on_a_gpu_is_refused_before_loading() -> None:
    with pytest.raises(ModelError, match="CPU"):
        build_llm_engine(resolve_model("tiny"), EngineSettings(quantization="int8"), "cuda")
