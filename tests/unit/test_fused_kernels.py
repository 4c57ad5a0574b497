"""The fused elementwise kernels (residual add + RMSNorm, RoPE, SiLU-and-mul): each Triton kernel
(on a GPU, or interpreted on a CPU) against its PyTorch reference, the references against the
unfused PyTorch they replace, and the wrappers' argument checks."""

import os

import pytest
import torch
import torch.nn.functional as F

from kernels.rms_norm import add_rms_norm, add_rms_norm_ref, add_rms_norm_triton
from kernels.rope import apply_rope, apply_rope_ref, apply_rope_triton
from kernels.silu_mul import silu_mul, silu_mul_ref, silu_mul_triton

KERNEL_DEVICE = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
# bfloat16 only on a GPU: the interpreter computes bfloat16 wrongly.
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if KERNEL_DEVICE == "cuda" else [])
# Within one rounding of the output dtype: the kernels sum in another order.
TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.float16: (1e-3, 1e-3), torch.bfloat16: (1e-2, 1e-2)}


def _randn(*shape: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype).to(KERNEL_DEVICE)


def _angles(num_tokens: int, half: int) -> tuple[torch.Tensor, torch.Tensor]:
    angles = _randn(num_tokens, 1, half, seed=9) * 3
    return angles.cos(), angles.sin()


# --- add + RMSNorm -----------------------------------------------------------------------

def test_add_rms_norm_ref_is_the_add_then_the_unfused_norm() -> None:
    x, delta, weight = _randn(5, 24, seed=1), _randn(5, 24, seed=2), _randn(24, seed=3)
    summed, normed = add_rms_norm_ref(x, delta, weight, 1e-5)
    s = x + delta
    assert torch.equal(summed, s)
    torch.testing.assert_close(normed, weight * s / torch.sqrt((s * s).mean(-1, keepdim=True) + 1e-5))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_cols", [24, 64, 576])  # 576: SmolLM2's width, not a power of two
@pytest.mark.parametrize("with_delta", [True, False])
def test_add_rms_norm_triton_matches_ref(dtype: torch.dtype, num_cols: int, with_delta: bool) -> None:
    x, weight = _randn(7, num_cols, dtype=dtype, seed=4), _randn(num_cols, dtype=dtype, seed=5)
    delta = _randn(7, num_cols, dtype=dtype, seed=6) if with_delta else None
    expected_sum, expected = add_rms_norm_ref(x, delta, weight, 1e-6)
    summed, out = add_rms_norm_triton(x, delta, weight, 1e-6)
    assert torch.equal(summed, expected_sum)  # one rounding of one add: exactly the reference's
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(out, expected, atol=atol, rtol=rtol)


def test_add_rms_norm_takes_rows_of_a_wider_buffer() -> None:
    wide = _randn(4, 96, seed=7)
    x, weight = wide[:, :32], _randn(32, seed=8)
    torch.testing.assert_close(add_rms_norm_triton(x, x, weight, 1e-6)[1], add_rms_norm_ref(x, x, weight, 1e-6)[1])


def test_add_rms_norm_rejects_bad_arguments() -> None:
    x = torch.randn(3, 8)
    with pytest.raises(ValueError, match="weight"):
        add_rms_norm(x, None, torch.ones(7), 1e-6)
    with pytest.raises(ValueError, match="delta"):
        add_rms_norm(x, torch.randn(3, 4), torch.ones(8), 1e-6)
    with pytest.raises(ValueError, match="share"):
        add_rms_norm_triton(x, None, torch.ones(8, dtype=torch.float16), 1e-6)


# --- RoPE --------------------------------------------------------------------------------

def test_rope_ref_rotates_each_pair_of_halves() -> None:
    x = _randn(3, 2, 8, seed=10)
    cos, sin = _angles(3, 4)
    out = apply_rope_ref(x, cos, sin)
    torch.testing.assert_close(out[..., :4], x[..., :4] * cos - x[..., 4:] * sin)
    torch.testing.assert_close(out[..., 4:], x[..., 4:] * cos + x[..., :4] * sin)
    torch.testing.assert_close(out.norm(dim=-1), x.norm(dim=-1))  # a rotation keeps lengths


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_heads, head_dim", [(1, 16), (3, 24), (9, 64)])
def test_rope_triton_matches_ref(dtype: torch.dtype, num_heads: int, head_dim: int) -> None:
    x = _randn(6, num_heads, head_dim, dtype=dtype, seed=11)
    cos, sin = _angles(6, head_dim // 2)
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(apply_rope_triton(x, cos, sin), apply_rope_ref(x, cos, sin), atol=atol, rtol=rtol)


def test_rope_triton_takes_q_and_k_as_views_of_one_projection() -> None:
    qkv = _randn(5, 3 * 4 * 16, seed=12)  # (T, (Hq + 2 Hkv) D) with Hq = 8, Hkv = 2
    q, k, _ = qkv.split([8 * 16, 2 * 16, 2 * 16], dim=-1)
    q, k = q.view(5, 8, 16), k.view(5, 2, 16)
    table = _randn(40, 16, seed=13)  # a [cos | sin] table looked up by position, as the model does
    cos, sin = table[torch.tensor([0, 3, 9, 2, 39], device=KERNEL_DEVICE)].unsqueeze(1).chunk(2, dim=-1)
    for x in (q, k):
        torch.testing.assert_close(apply_rope_triton(x, cos, sin), apply_rope_ref(x, cos, sin))


def test_rope_rejects_bad_arguments() -> None:
    cos = sin = torch.ones(2, 1, 4)
    with pytest.raises(ValueError, match="even"):
        apply_rope(torch.randn(2, 1, 7), cos, sin)
    with pytest.raises(ValueError, match="cos and sin"):
        apply_rope(torch.randn(3, 1, 8), cos, sin)


# --- SiLU and mul ------------------------------------------------------------------------

def test_silu_mul_ref_is_the_gate_times_the_up_half() -> None:
    gate_up = _randn(3, 10, seed=14)
    torch.testing.assert_close(silu_mul_ref(gate_up), F.silu(gate_up[:, :5]) * gate_up[:, 5:])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [5, 1024, 1536])  # 1536: SmolLM2's, past one block of columns
def test_silu_mul_triton_matches_ref(dtype: torch.dtype, inter: int) -> None:
    gate_up = _randn(4, 2 * inter, dtype=dtype, seed=15) * 4
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(silu_mul_triton(gate_up), silu_mul_ref(gate_up), atol=atol, rtol=rtol)


def test_silu_mul_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="2I"):
        silu_mul(torch.randn(3, 7))
    with pytest.raises(ValueError, match="contiguous"):
        silu_mul_triton(torch.randn(8, 3).t())
