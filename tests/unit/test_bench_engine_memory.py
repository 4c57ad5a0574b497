"""The memory benchmark counts a tensor's memory once however many tensors share it, a oneDNN pack
by the buffer oneDNN allocated."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.worker.engine.cpu_linear import pack


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "loadtest"))
    import bench_engine_memory

    return bench_engine_memory


def test_views_of_one_tensor_are_one_storage_and_copies_are_not(bench) -> None:
    weight = torch.randn(48, 32)
    assert bench.storage(weight) == bench.storage(weight[8:].t()) == (weight.data_ptr(), 48 * 32 * 4)
    assert bench.storage(weight.clone()) != bench.storage(weight)


def test_a_pack_counts_the_buffer_onednn_holds(bench) -> None:
    packed = pack(torch.randn(48, 32))
    address, size = bench.storage(packed)
    assert size >= 48 * 32 * 4 and address == torch.ops.mkldnn.data_ptr(packed)
