"""Weight-only int8, int4, W8A8 and bfloat16: close to float32 matrix by matrix, int4 exact on
weights in its own grid (as SmolLM2's Q4_1 weights are), and SmolLM2 still answers."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from services.worker.engine.llm_engine import build_llm_engine
from services.worker.engine.quantize import (
    INT4_GROUP,
    INT7_MAX,
    INT8_MAX,
    WIDENED_FROM_ROWS,
    Int4Linear,
    Int8Linear,
    W8A8Linear,
    activation_levels,
    int4_codes,
    int8_rows,
)
from services.worker.engine.sampling_params import SamplingParams
from services.worker.engine.settings import EngineSettings
from shared.models.errors import ModelError
from shared.models.spec import resolve_model

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("rows", [1, 7, 64, WIDENED_FROM_ROWS])
def test_int8_linear_is_within_a_percent_of_float32(rows: int) -> None:
    gen = torch.Generator().manual_seed(0)
    weight, x = torch.randn(96, 160, generator=gen), torch.randn(rows, 160, generator=gen)
    expected = F.linear(x, weight)
    out = Int8Linear(weight)(x)
    assert out.shape == expected.shape and out.dtype == x.dtype
    assert (out - expected).norm() / expected.norm() < 0.01


@pytest.mark.parametrize("rows", [WIDENED_FROM_ROWS - 1, WIDENED_FROM_ROWS])
def test_a_prompts_rows_multiply_by_widened_weights_not_atens_int8_kernel(rows: int) -> None:
    """ATen's int8 kernel runs at half the float32 product's rate once rows outweigh weights."""
    layer = Int8Linear(torch.randn(96, 160))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        layer(torch.randn(rows, 160))
    int8_calls = sum(event.name == "aten::_weight_int8pack_mm" for event in profile.events())
    assert int8_calls == (1 if rows < WIDENED_FROM_ROWS else 0)


@pytest.mark.parametrize("rows", [5, WIDENED_FROM_ROWS])
def test_int8_keeps_a_zero_row_zero_and_a_batch_shape(rows: int) -> None:
    weight = torch.randn(8, 16)
    weight[3] = 0
    out = Int8Linear(weight)(torch.randn(2, rows, 16))
    assert out.shape == (2, rows, 8) and torch.equal(out[..., 3], torch.zeros(2, rows))


@pytest.mark.parametrize("levels", sorted({activation_levels(), INT7_MAX}))  # this CPU's own, and 7 bits
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_w8a8_linear_multiplies_the_rows_codes_by_the_weights_codes(rows: int, levels: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    weight, x = torch.randn(96, 160, generator=gen), torch.randn(rows, 160, generator=gen)
    x[0] *= 1000  # a row's scale is its own: a loud row leaves the others' precision alone
    out = W8A8Linear(weight, levels)(x)
    assert out.shape == (rows, 96) and out.dtype == x.dtype
    torch.testing.assert_close(out, exact_w8a8(weight, x, levels))
    for row in range(rows):  # and each row is close to its float32 product
        exact = F.linear(x[row], weight)
        assert (out[row] - exact).norm() / exact.norm() < (0.02 if levels == INT8_MAX else 0.04)


def exact_w8a8(weight: torch.Tensor, x: torch.Tensor, levels: int) -> torch.Tensor:
    codes, scale = int8_rows(weight)
    x_codes, x_scale = int8_rows(x, levels)
    return (x_codes.double() @ codes.double().T * x_scale[:, None].double() * scale.double()).float()


def test_w8a8_without_vnni_takes_7_bit_activations_exactly() -> None:
    # oneDNN held to AVX2 multiplies as a CPU without VNNI does, saturating pairs of products
    # at 16 bits: 8-bit activations come out wrong there, the 7 bits chosen for it do not.
    script = """
import torch
from services.worker.engine.quantize import INT7_MAX, INT8_MAX, W8A8Linear
from tests.unit.test_quantize import exact_w8a8
gen = torch.Generator().manual_seed(0)
weight, x = torch.randn(96, 160, generator=gen), torch.randn(64, 160, generator=gen)
for levels in (INT8_MAX, INT7_MAX):
    print(levels, torch.allclose(W8A8Linear(weight, levels)(x), exact_w8a8(weight, x, levels), rtol=1e-5, atol=1e-3))
"""
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2"}
    done = subprocess.run([sys.executable, "-c", script], env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [str(INT8_MAX), "False", str(INT7_MAX), "True"]


def test_w8a8_keeps_zero_rows_zero_and_a_batch_shape() -> None:
    weight = torch.randn(8, 16)
    weight[3] = 0
    x = torch.randn(2, 5, 16)
    x[1, 2] = 0
    out = W8A8Linear(weight)(x)
    assert out.shape == (2, 5, 8) and torch.equal(out[..., 3], torch.zeros(2, 5))
    assert torch.equal(out[1, 2], torch.zeros(8))


def dequantize_int4(codes: torch.Tensor, scale: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    out_features, in_features = codes.shape
    grouped = codes.view(out_features, in_features // INT4_GROUP, INT4_GROUP).float()
    return (grouped * scale[..., None] + low[..., None]).view(out_features, in_features)


@pytest.mark.parametrize("rows", [1, 7, 64])
def test_int4_linear_multiplies_by_its_dequantized_weights(rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    weight, x = torch.randn(96, 192, generator=gen), torch.randn(rows, 192, generator=gen)
    out = Int4Linear(weight)(x)
    expected = F.linear(x.bfloat16().float(), dequantize_int4(*int4_codes(weight)))  # its activations are bfloat16
    assert out.shape == (rows, 96) and out.dtype == x.dtype
    assert (out - expected).norm() / expected.norm() < 0.01  # the bfloat16 scales and output
    assert (out - F.linear(x, weight)).norm() / F.linear(x, weight).norm() < 0.15  # 16 levels per group


def test_int4_codes_give_back_weights_already_on_a_q4_1_grid_exactly() -> None:
    gen = torch.Generator().manual_seed(1)
    scale = torch.rand(8, 3, 1, generator=gen) + 0.1  # (out, groups, 1)
    low = torch.randn(8, 3, 1, generator=gen)
    codes = torch.randint(0, 16, (8, 3, INT4_GROUP), generator=gen)
    codes[..., 0], codes[..., 1] = 0, 15  # every group spans its whole range, as Q4_1's quantizer makes it
    weight = (codes * scale + low).view(8, 3 * INT4_GROUP)
    found = int4_codes(weight)
    assert torch.equal(found[0], codes.view(8, -1).int())  # the very codes back
    torch.testing.assert_close(dequantize_int4(*found), weight, rtol=1e-6, atol=1e-6)  # up to float rounding


def test_int4_refuses_inputs_that_do_not_split_into_groups() -> None:
    with pytest.raises(ValueError, match="divisible by 32"):
        Int4Linear(torch.randn(8, 40))


@pytest.mark.parametrize(
    "dtype, quantization",
    [("float32", "none"), ("bfloat16", "none"), ("float32", "int8"), ("float32", "int4"), ("float32", "w8a8")],
)
def test_smollm2_answers_in_every_dtype(dtype: str, quantization: str) -> None:
    settings = EngineSettings(num_kv_blocks=32, dtype=dtype, quantization=quantization)
    llm = build_llm_engine(resolve_model("smollm2"), settings, "cpu")
    assert llm.engine.runner.dtype == getattr(torch, dtype)
    # int4's and int8's products return bfloat16, so their logits are rounded to 1/8 near 25: asked
    # "What is the capital of France?", int4's first two candidates ("The", "L") tie there, and a
    # difference in the last bit of the attention picks either. This question's tokens lead by 0.6
    # or more in every dtype.
    ids = llm.tokenizer.apply_chat_template([{"role": "user", "content": "Name the capital city of France."}])
    request = llm.add_prompt("q", ids, SamplingParams(max_tokens=12, temperature=0.0))
    while llm.has_unfinished_requests():
        llm.step()
    assert "Paris" in llm.tokenizer.decode(request.output_token_ids)


def test_quantization_on_a_gpu_is_refused_before_loading() -> None:
    with pytest.raises(ModelError, match="CPU"):
        build_llm_engine(resolve_model("tiny"), EngineSettings(quantization="int8"), "cuda")
