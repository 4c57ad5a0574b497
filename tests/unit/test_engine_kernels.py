"""The kernel benchmark's checks (loadtest/engine_kernels.py), run small under the Triton interpreter:
every kernel agrees with its reference, and a wrong output shows as a large error."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch


@pytest.fixture
def engine_kernels(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "loadtest"))
    import engine_kernels

    return engine_kernels


def small(engine_kernels, dtype: torch.dtype = torch.float32):
    heads = engine_kernels.Heads(4, 2, 16, dtype, torch.device("cpu"))
    sizes = engine_kernels.KernelSizes(decode_batches=(1, 3), one_sequence_splits=(2, 4), context=40, prefill_seqs=2,
                                       prefix=24, chunk=17)
    return heads, sizes


# float16, not bfloat16: the interpreter computes bfloat16 dots wrongly (the GPU run checks bfloat16).
@pytest.mark.parametrize("dtype, bound", [(torch.float32, 1e-5), (torch.float16, 1e-3)])
def test_every_kernel_agrees_with_its_reference(engine_kernels, dtype, bound):
    heads, sizes = small(engine_kernels, dtype)
    rows = engine_kernels.kernel_checks(heads, sizes)
    elementwise = ["add_rms_norm", "rope", "silu_mul"]
    assert [row["kernel"] for row in rows] == (
        ["decode_attention"] * 4 + ["prefill_attention"] * 2 + ["write_kv"] * 2 + elementwise * 2
    )
    assert all(row["relative_error"] < bound for row in rows), rows
    assert [row["num_splits"] for row in rows[:4]] == [None, None, 2, 4]  # one sequence, split as told too
    assert all(row["kernel_ms"] is None for row in rows)  # no timing off a GPU


def test_a_kernel_that_attends_one_token_short_shows_a_large_error(engine_kernels, monkeypatch):
    heads, sizes = small(engine_kernels)
    triton_decode = engine_kernels.paged_decode_attention_triton
    monkeypatch.setattr(engine_kernels, "paged_decode_attention_triton",
                        lambda q, k, v, tables, lens, scale, **split: triton_decode(q, k, v, tables, lens - 1, scale,
                                                                                    **split))
    rows = engine_kernels.kernel_checks(heads, sizes)
    assert min(row["relative_error"] for row in rows if row["kernel"] == "decode_attention") > 1e-3


def test_relative_error_is_the_ratio_of_norms(engine_kernels):
    ref = torch.tensor([3.0, 4.0])
    assert engine_kernels.relative_error(ref + torch.tensor([0.0, 0.5]), ref) == pytest.approx(0.1)
