"""The one-row benchmark compiles the products the engine's layers compute, and counts the bytes
each reads."""

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
def test_a_token_runs_every_layers_product(bench, scheme: str, one_torch_thread) -> None:
    shapes = {"qkv": (1, 64, 96), "output": (1, 64, 128)}
    run, nbytes = bench.one_token(scheme, 2, shapes)
    outputs = run()
    assert [tuple(out.shape) for out in outputs] == [(1, 96), (1, 96), (1, 128)]
    projection, output = bench.layer_kinds(scheme)
    layers = [projection(torch.randn(96, 64)), output(torch.randn(128, 64))]
    assert nbytes == 2 * bench.weight_bytes(layers[0]) + bench.weight_bytes(layers[1])


def test_the_bytes_read_are_the_codes_and_their_scales(bench) -> None:
    weight = torch.randn(96, 64)
    assert bench.weight_bytes(bench.dense(weight)) == 96 * 64 * 4
    assert bench.weight_bytes(Int8Linear(weight)) == 96 * 64 + 96 * 2  # int8 codes, a bfloat16 scale a row
    # Two codes a byte; per row and group of 32 inputs a bfloat16 scale and offset.
    assert bench.weight_bytes(Int4Linear(weight)) == 96 * 64 // 2 + 96 * (64 // 32) * 2 * 2
