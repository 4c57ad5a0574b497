"""The C++ CPU kernels (kernels/cpu_extension.py): each source compiles for every instruction set
PyTorch picks between; the elementwise ones (cpu_elementwise.cpp) match their references at widths
past and short of a vector, over strided views as the model passes them, with and without a residual
to add; the dispatchers send eager float32 CPU calls to them and leave a traced graph the references'
operations."""

from __future__ import annotations

import subprocess
import sysconfig
from pathlib import Path

import pytest
import torch
from torch.utils import cpp_extension

from kernels import (
    cpu_elementwise,
    cpu_extension,
    cpu_inverse_cdf,
    cpu_paged_decode,
    cpu_prefill_attention,
    cpu_screened_output,
)
from kernels.rms_norm import add_rms_norm, add_rms_norm_ref
from kernels.rope import apply_rope, apply_rope_ref
from kernels.silu_mul import silu_mul, silu_mul_ref

OURS = ("drivetrain::cpu_silu_mul", "drivetrain::cpu_add_rms_norm", "drivetrain::cpu_rope")


@pytest.fixture(autouse=True, scope="module")
def built() -> None:
    assert cpu_elementwise.available()  # make test installs what building it takes


@pytest.mark.parametrize("source", [cpu_paged_decode.SOURCE, cpu_elementwise.SOURCE, cpu_prefill_attention.SOURCE,
                                    cpu_screened_output.SOURCE, cpu_inverse_cdf.SOURCE], ids=lambda p: p.stem)
@pytest.mark.parametrize("capability", [*cpu_extension.ISA_FLAGS, "DEFAULT"])
def test_each_kernel_compiles_for_every_instruction_set(source: Path, capability: str, tmp_path: Path) -> None:
    """Each machine builds only its own; compiling (not running) the others here keeps a change that
    needs one more instruction-set flag from passing on the machine it was written on alone."""
    includes = [*cpp_extension.include_paths(), sysconfig.get_paths()["include"]]
    command = ["c++", "-std=c++20", "-fPIC", *(f"-I{path}" for path in includes),
               *cpu_extension.compile_flags(capability), "-c", str(source), "-o", str(tmp_path / "kernel.o")]
    built = subprocess.run(command, check=False, capture_output=True, text=True)
    assert built.returncode == 0, built.stderr[-2000:]


# Widths: a vector and a half, less than a vector, and SmolLM2's.
@pytest.mark.parametrize(("tokens", "inter"), [(0, 24), (1, 24), (3, 7), (5, 1536), (70, 40)])
def test_silu_mul_matches_the_reference(tokens: int, inter: int) -> None:
    gate_up = torch.randn(tokens, 2 * inter) * 4
    ours = silu_mul(gate_up)
    assert ours.shape == (tokens, inter) and ours.is_contiguous()
    torch.testing.assert_close(ours, silu_mul_ref(gate_up), rtol=1e-6, atol=1e-6)
    strided = torch.randn(tokens, 2 * inter + 5)[:, : 2 * inter]  # rows apart from each other
    torch.testing.assert_close(silu_mul(strided), silu_mul_ref(strided), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(("tokens", "cols"), [(0, 576), (1, 576), (4, 9), (33, 24), (130, 576)])
@pytest.mark.parametrize("with_delta", [True, False])
def test_add_rms_norm_matches_the_reference(tokens: int, cols: int, with_delta: bool) -> None:
    x = torch.randn(tokens, cols + 3)[:, :cols] * 3  # rows apart from each other, as a strided view
    delta = torch.randn(tokens, cols) if with_delta else None
    weight = torch.randn(cols)
    total, normed = add_rms_norm(x, delta, weight, 1e-5)
    want_total, want_normed = add_rms_norm_ref(x, delta, weight, 1e-5)
    torch.testing.assert_close(total, want_total, rtol=0, atol=0)
    torch.testing.assert_close(normed, want_normed, rtol=1e-5, atol=1e-5)
    if not with_delta:
        assert total is x  # nothing added: the stream is passed on as it is


@pytest.mark.parametrize(("tokens", "heads", "head_dim"), [(0, 9, 64), (1, 9, 64), (7, 3, 64), (5, 4, 40), (40, 2, 6)])
def test_rope_matches_the_reference_over_views_of_a_fused_projection(tokens: int, heads: int, head_dim: int) -> None:
    width = (heads + 2) * head_dim
    fused = torch.randn(tokens, width)  # q, then k and v, per token: q a strided view of it
    q = fused[:, : heads * head_dim].view(tokens, heads, head_dim)
    table = torch.randn(tokens, head_dim)  # [cos | sin] per token, as RotaryEmbedding's rows
    cos, sin = table.unsqueeze(1).chunk(2, dim=-1)
    ours = apply_rope(q, cos, sin)
    assert ours.shape == q.shape and ours.is_contiguous()
    torch.testing.assert_close(ours, apply_rope_ref(q, cos, sin), rtol=1e-5, atol=1e-5)


def test_eager_float32_calls_take_the_kernels_and_others_the_references() -> None:
    x, weight = torch.randn(4, 32), torch.randn(32)
    cos, sin = torch.randn(4, 1, 8), torch.randn(4, 1, 8)

    def called(dtype: torch.dtype) -> set[str]:
        with torch.profiler.profile() as profile:
            silu_mul(x.to(dtype))
            add_rms_norm(x.to(dtype), x.to(dtype), weight.to(dtype), 1e-5)
            apply_rope(x.view(4, 2, 16).to(dtype), cos, sin)
        return {event.name for event in profile.events()}

    assert set(OURS) <= called(torch.float32)
    assert not set(OURS) & called(torch.bfloat16)


def test_a_traced_graph_holds_the_references_operations_for_inductor_to_fuse() -> None:
    class Layer(torch.nn.Module):
        def forward(self, x: torch.Tensor, delta: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
            total, normed = add_rms_norm(x, delta, torch.ones(32), 1e-5)
            return silu_mul(apply_rope(normed.view(4, 2, 16), cos, sin).view(4, 32)) + total[:, :16]

    args = (torch.randn(4, 32), torch.randn(4, 32), torch.randn(4, 1, 8), torch.randn(4, 1, 8))
    graph = torch.export.export(Layer(), args).graph_module
    targets = {str(node.target) for node in graph.graph.nodes if node.op == "call_function"}
    assert not any("drivetrain" in target for target in targets), targets
    (traced,) = graph(*args)
    torch.testing.assert_close(traced, Layer()(*args), rtol=1e-5, atol=1e-5)


def test_layouts_the_kernels_do_not_take_go_to_the_references() -> None:
    gate_up = torch.randn(12, 6).t()  # columns apart: no row is contiguous
    torch.testing.assert_close(silu_mul(gate_up), silu_mul_ref(gate_up))
    x = torch.randn(2, 5, 8).transpose(0, 1)  # (5, 2, 8): a token's two heads apart
    cos, sin = torch.randn(5, 1, 4), torch.randn(5, 1, 4)
    torch.testing.assert_close(apply_rope(x, cos, sin), apply_rope_ref(x, cos, sin))
