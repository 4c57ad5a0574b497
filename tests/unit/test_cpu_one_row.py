"""The one-row benchmark times each format's kernel on the product the engine's layer computes, and
counts the bytes that product reads."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.worker.engine.quantize import Int4Linear, Int8Linear


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "loadtest"))
    import bench_cpu_one_row

    return bench_cpu_one_row


@pytest.mark.parametrize("scheme", ["float32", "int8", "int4"])
def test_the_timed_kernel_computes_the_layers_product(bench, scheme: str) -> None:
    projection, _ = bench.layer_kinds(scheme)
    weight = torch.randn(96, 64, generator=torch.Generator().manual_seed(1)) * 0.02
    layer = projection(weight)
    x = torch.randn(1, 64, generator=torch.Generator().manual_seed(2)).to(bench.ROW_DTYPES[scheme])
    torch.testing.assert_close(bench.kernel_call(layer, x)(), layer(x))


def test_the_bytes_read_are_the_codes_and_their_scales(bench) -> None:
    weight = torch.randn(96, 64)
    assert bench.weight_bytes(bench.Packed(weight)) == 96 * 64 * 4
    assert bench.weight_bytes(Int8Linear(weight)) == 96 * 64 + 96 * 2  # int8 codes, a bfloat16 scale a row
    # Two codes a byte; per row and group of 32 inputs a bfloat16 scale and offset.
    assert bench.weight_bytes(Int4Linear(weight)) == 96 * 64 // 2 + 96 * (64 // 32) * 2 * 2
