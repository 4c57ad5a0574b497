"""The C++ panel projection (kernels/cpu_panel_linear.cpp) against linear: every tile height, a
panel's columns cut short, inputs not a multiple of its step, a bias, batch dimensions and strided
inputs, 1-2 threads; the layout unpacks to the dense weight; the arguments it refuses; and CpuLinear
holding its weight in panels or oneDNN's pack as asked. In bfloat16 (where the CPU has AVX512_BF16),
the same against float32's product of the same values rounded once to bfloat16."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import cpu_panel_linear
from services.worker.engine.cpu_linear import CpuLinear, traced_dense
from services.worker.engine.llm_engine import load_engine_model
from services.worker.engine.settings import EngineSettings
from shared.models.spec import resolve_model

pytestmark = pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() not in cpu_panel_linear.BUILT_FOR,
                                reason="the panel kernel has registers for AVX2 and AVX-512 alone")


@pytest.fixture(autouse=True, scope="module")
def built() -> None:
    assert cpu_panel_linear.available()  # make test installs what building it takes


def width() -> int:
    return cpu_panel_linear.pack(torch.zeros(1, 8)).shape[2]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rows", [0, 1, 3, 4, 5, 7, 8, 9, 16, 17, 64, 130])
def test_panels_match_linear(rows: int, threads: int) -> None:
    generator = torch.Generator().manual_seed(rows)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for n, k in ((3 * width(), 64), (2 * width() + 5, 40), (1, 8), (width() - 1, 131)):
            weight, bias = torch.randn(n, k, generator=generator), torch.randn(n, generator=generator)
            panels = cpu_panel_linear.pack(weight)
            x = torch.randn(rows, k, generator=generator)
            for b in (None, bias):
                out = cpu_panel_linear.project(x, panels, n, b)
                assert out.shape == (rows, n) and out.is_contiguous()
                torch.testing.assert_close(out, F.linear(x, weight, b), rtol=1e-5, atol=1e-4)
    finally:
        torch.set_num_threads(before)


def test_the_layout_unpacks_to_the_dense_weight() -> None:
    weight = torch.randn(2 * width() + 3, 24)
    panels = cpu_panel_linear.pack(weight)
    assert panels.shape == (3, 24, width())
    assert torch.equal(cpu_panel_linear.unpack(panels, *weight.shape), weight)
    assert torch.equal(panels[-1, :, 3:], torch.zeros(24, width() - 3))  # the last panel's missing columns


def test_batch_dims_and_strided_inputs_are_kept() -> None:
    weight = torch.randn(50, 32)
    x = torch.randn(3, 5, 64)[..., ::2]  # (3, 5, 32), not contiguous
    out = cpu_panel_linear.project(x, cpu_panel_linear.pack(weight), 50)
    torch.testing.assert_close(out, F.linear(x, weight), rtol=1e-5, atol=1e-4)


def test_what_it_refuses_is_an_error_not_a_crash() -> None:
    weight = torch.randn(50, 32)
    panels = cpu_panel_linear.pack(weight)
    cases = [
        (torch.randn(4, 31), panels, 50, None),  # inputs of another width
        (torch.randn(4, 32, dtype=torch.float64), panels, 50, None),
        (torch.randn(4, 32), panels, 50 + width(), None),  # more columns than its panels hold
        (torch.randn(4, 32), panels, 50 - width(), None),  # a whole panel too many
        (torch.randn(4, 32), panels, 50, torch.randn(49)),  # a bias of another length
        (torch.randn(4, 32), panels.transpose(1, 2), 50, None),  # not the layout
        (torch.randn(4, 32), panels.double(), 50, None),
        (torch.randn(4, 0), panels[:, :0], 50, None),  # no inputs
    ]
    for x, p, n, b in cases:
        with pytest.raises(RuntimeError):
            cpu_panel_linear.project(x, p, n, b)
    for weight in (torch.randn(50, 32, dtype=torch.float16), torch.randn(50, 0), torch.randn(0, 32), torch.randn(50)):
        with pytest.raises(RuntimeError):
            cpu_panel_linear.pack(weight)


bfloat16_panels = pytest.mark.skipif(not cpu_panel_linear.available(torch.bfloat16),
                                     reason="bfloat16 panels need AVX512_BF16's dot products")


@bfloat16_panels
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rows", [0, 1, 3, 8, 9, 17, 64])
def test_bfloat16_panels_round_float32s_product_once(rows: int, threads: int) -> None:
    """Each pair's products are exact in float32 and summed there: the result is float32's product of the
    same bfloat16 values, up to the order of the sums, rounded to bfloat16 once (oneDNN's rounds so too)."""
    generator = torch.Generator().manual_seed(rows)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for n, k in ((3 * width(), 64), (2 * width() + 5, 40), (1, 9), (width() - 1, 131)):  # odd K: a half pair
            weight = torch.randn(n, k, generator=generator).bfloat16()
            bias = torch.randn(n, generator=generator).bfloat16()
            panels = cpu_panel_linear.pack(weight)
            assert panels.shape == (-(-n // width()), -(-k // 2), 2 * width())
            x = torch.randn(rows, k, generator=generator).bfloat16()
            for b in (None, bias):
                out = cpu_panel_linear.project(x, panels, n, b)
                assert out.shape == (rows, n) and out.dtype == torch.bfloat16 and out.is_contiguous()
                exact = F.linear(x.float(), weight.float(), None if b is None else b.float())
                torch.testing.assert_close(out.float(), exact, rtol=2**-8, atol=1e-4)  # bfloat16's half ulp
    finally:
        torch.set_num_threads(before)


@bfloat16_panels
def test_bfloat16_layout_unpacks_and_what_it_refuses() -> None:
    weight = torch.randn(2 * width() + 3, 25).bfloat16()
    panels = cpu_panel_linear.pack(weight)
    assert torch.equal(cpu_panel_linear.unpack(panels, *weight.shape), weight)
    x = torch.randn(4, 25).bfloat16()
    cases = [
        (x.float(), panels, None),  # inputs of another dtype than the panels'
        (torch.randn(4, 23).bfloat16(), panels, None),  # a whole pair short
        (x, panels, torch.randn(len(weight))),  # a float32 bias to bfloat16 panels
        (x, panels.float(), None),  # bfloat16's layout in float32
    ]
    for inputs, p, b in cases:
        with pytest.raises(RuntimeError):
            cpu_panel_linear.project(inputs, p, len(weight), b)


@bfloat16_panels
def test_cpu_linear_holds_bfloat16_in_panels() -> None:
    weight, x = torch.randn(50, 32).bfloat16(), torch.randn(9, 32).bfloat16()
    layer = CpuLinear(weight)
    assert layer.in_panels and layer.packed.dtype == torch.bfloat16
    torch.testing.assert_close(layer(x).float(), F.linear(x.float(), weight.float()), rtol=2**-8, atol=1e-4)


@bfloat16_panels
@pytest.mark.parametrize("panels", [True, False])
def test_a_bfloat16_engines_projections_are_in_panels_unless_asked_not(panels: bool) -> None:
    """Off, they stay linears, which the compiled graphs freeze into oneDNN's bfloat16 products."""
    settings = EngineSettings(dtype="bfloat16", cpu_panel_products=panels)
    model, _ = load_engine_model(resolve_model("tiny"), settings, torch.device("cpu"))
    projections = [layer.self_attn.qkv_proj for layer in model.layers] + [model.lm_head]
    in_panels = [isinstance(p, CpuLinear) and p.in_panels for p in projections]
    assert in_panels == [panels] * len(projections)
    assert model.embed_tokens.weight.dtype == torch.bfloat16


def test_cpu_linear_holds_panels_or_onednns_pack_as_asked() -> None:
    weight, x = torch.randn(50, 32), torch.randn(9, 32)
    in_panels, onednn = CpuLinear(weight), CpuLinear(weight, panels=False)
    assert in_panels.in_panels and not in_panels.packed.is_mkldnn
    assert not onednn.in_panels and onednn.packed.is_mkldnn
    torch.testing.assert_close(in_panels(x), onednn(x), rtol=1e-5, atol=1e-4)


def test_traced_dense_a_projection_is_a_linear_over_its_dense_weight() -> None:
    """The few-rows graphs trace it so, for autotuning to time inductor's kernels against oneDNN's."""
    layer, x = CpuLinear(torch.randn(50, 32)), torch.randn(9, 32)

    def targets() -> set[str]:
        program = torch.export.export(layer, (x,))
        return {str(node.target) for node in program.graph.nodes if node.op == "call_function"}

    assert "drivetrain.panel_linear.default" in targets()
    with traced_dense():
        dense = targets()
    assert "aten.linear.default" in dense and not any("drivetrain" in target for target in dense)
