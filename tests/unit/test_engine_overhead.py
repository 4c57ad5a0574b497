"""The engine-overhead benchmark's stub model and step timers: the stub drives a real Engine, greedy
picks its token, a measured batch is split into its calls, and every timer is undone afterwards."""

from __future__ import annotations

import gc
import time
from pathlib import Path

import pytest
import torch

from services.worker.engine import model_runner
from services.worker.engine.engine import Engine
from services.worker.engine.kv_cache_manager import cdiv
from services.worker.engine.request import Request
from services.worker.engine.sampling_params import SamplingParams
from services.worker.engine.settings import EngineSettings
from shared.runtime import YOUNG_COLLECTION_AFTER


@pytest.fixture
def overhead(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "loadtest"))
    import engine_overhead

    monkeypatch.setattr(engine_overhead, "WARMUP_STEPS", 1)
    monkeypatch.setattr(engine_overhead, "MEASURED_STEPS", 3)
    return engine_overhead


def stub_engine(overhead, max_num_seqs: int = 8):
    stub = overhead.StubModel(overhead.stub_config("tiny"), max_num_seqs, torch.device("cpu"))
    blocks = max_num_seqs * cdiv(overhead.PROMPT_LENS[1] + overhead.MAX_TOKENS, 16) + 1
    return stub, Engine(stub, EngineSettings(max_num_seqs=max_num_seqs, num_kv_blocks=blocks), eos_token_ids=())


def test_greedy_picks_the_stub_token(overhead):
    _, engine = stub_engine(overhead)
    request = Request("a", list(range(3, 40)), SamplingParams(max_tokens=3, temperature=0.0))
    engine.add_request(request)
    while engine.has_unfinished_requests():
        engine.step()
    assert request.output_token_ids == [overhead.STUB_TOKEN] * 3


def test_a_measured_batch_is_split_into_its_calls_and_the_timers_are_undone(overhead):
    stub, engine = stub_engine(overhead)
    prepare_inputs = model_runner.prepare_inputs
    threshold = gc.get_threshold()
    try:
        result = overhead.measure_batch(engine, stub, 4, time.perf_counter, on_cpu=True)
        assert gc.get_threshold()[0] == YOUNG_COLLECTION_AFTER  # as a worker's engine steps
    finally:
        gc.set_threshold(*threshold)
    assert result["not_found"] == []
    breakdown = result["breakdown_ms"]
    assert breakdown["run.sampler"] > 0 and breakdown["run.prepare_inputs"] > 0 and breakdown["schedule"] > 0
    # The host's figure comes from a pass that times the device's work alone, the split from another.
    assert breakdown["host"] == pytest.approx(result["host_ms_instrumented"])
    assert result["host_ms"] > 0 and 0 < breakdown["host"] < breakdown["step"]
    assert result["per_request_calls"]["schedule.make_chunk"]["calls"] == 4
    assert model_runner.prepare_inputs is prepare_inputs
    assert "schedule" not in vars(engine.scheduler) and "run" not in vars(engine.runner) and stub.timers is None
    assert not engine.has_unfinished_requests()
    names = [name for name, _ in overhead.top_items(breakdown, on_cpu=True)]
    assert "run.sampler" not in names and "host" not in names and "schedule.rest" in names
    assert set(result["full_collection_ms"]) == {"frozen_at_start", "nothing_frozen"} and gc.get_freeze_count() == 0


def test_overlapped_steps_hide_the_host_behind_a_simulated_device(overhead, monkeypatch):
    """engine_overlap.py: with a device step far longer than the host's work, a step in turn costs
    both and an overlapped one the device's alone, penalised requests in the batch or not."""
    import engine_overlap

    monkeypatch.setattr(engine_overlap, "DEVICE_MS", 20.0)
    monkeypatch.setattr(engine_overlap, "BATCHES", (4,))
    monkeypatch.setattr(engine_overlap, "PENALISED", 2)
    monkeypatch.setattr(engine_overlap, "WARMUP_STEPS", 2)
    monkeypatch.setattr(engine_overlap, "MEASURED_STEPS", 8)
    # A host's work of 10 ms a step, whichever way the engine steps.
    prepare_inputs = model_runner.prepare_inputs

    def slow_prepare(*args, **kwargs):
        time.sleep(0.010)
        return prepare_inputs(*args, **kwargs)

    monkeypatch.setattr(model_runner, "prepare_inputs", slow_prepare)
    results = engine_overlap.overlap(None, None, None)
    for result in (results["batch_4"], results["batch_4_2_penalised"]):
        assert result["step_ms_off"] == pytest.approx(30.0, abs=4.0)  # device, then host
        assert result["step_ms_on"] == pytest.approx(20.0, abs=2.0)  # the host's 10 ms hidden
    assert model_runner.to_host is not engine_overlap.SimulatedStream.event
