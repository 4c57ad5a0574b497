"""What overlapping the engine's steps hides (engine.overlap_scheduling): the stub model of
engine_overhead.py on a simulated device whose every step takes a fixed time, as a GPU's stream
does. A launch queues the step and returns; reading its tokens waits until the device has done
it. In turn, a step costs the host's work plus the device's; overlapped, the host schedules and
launches step n+1 while the device runs step n, so a step costs the larger of the two. The last
row has PENALISED of its requests ask for frequency and presence penalties, as OpenAI clients may.

The device time is llama-8b's weight-read bound on an H200 (3.75 ms: 16 GB of bf16 weights at the
4.28 TB/s measured there), the shortest a real step of that model can take, where the host's work
weighs most. The host's work is this machine's. The stub's vocabulary is cut to STUB_VOCAB: the
argmax over (N, V) is a kernel on the device, but on this CPU it would run on the host thread.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from unittest import mock

import numpy as np
import torch
from engine_overhead import (
    BATCHES,
    MAX_TOKENS,
    PROMPT_LENS,
    QUIET_VOCAB,
    STUB_SHAPE,
    StubModel,
    start_decoding,
    stub_config,
)
from engine_scenarios import Sizes, with_engine

from services.worker.engine import model_runner
from services.worker.engine.engine import Engine
from services.worker.engine.kv_cache_manager import cdiv
from services.worker.engine.model import LlamaModel
from services.worker.engine.settings import EngineSettings

DEVICE_MS = 3.75
STUB_VOCAB = QUIET_VOCAB
WARMUP_STEPS, MEASURED_STEPS = 10, 200
PENALISED = 16  # of the largest batch, in a row of its own
SPIN_S = 2e-4  # the last stretch of a wait is spun, not slept: a sleep overshoots by ~0.1 ms


class SimulatedStream:
    """One device stream: steps run one after another, each DEVICE_MS from when the device is free."""

    def __init__(self, step_s: float) -> None:
        self.step_s = step_s
        self.busy_until = 0.0

    def enqueue(self) -> float:
        """Queue a step; when the device will have finished it."""
        self.busy_until = max(time.perf_counter(), self.busy_until) + self.step_s
        return self.busy_until

    def event(self, tokens: torch.Tensor) -> tuple[torch.Tensor, Done]:
        """model_runner.to_host's stand-in: the tokens, ready when the step queued last is done."""
        return tokens, Done(self.busy_until)


class Done:
    """A recorded event: synchronize() waits until the device reaches it."""

    def __init__(self, at: float) -> None:
        self.at = at

    def synchronize(self) -> None:
        left = self.at - time.perf_counter()
        if left > SPIN_S:
            time.sleep(left - SPIN_S)
        while time.perf_counter() < self.at:
            pass


class DeviceStub(StubModel):
    """The stub model whose forward queues a step on the simulated stream."""

    def __init__(self, stream: SimulatedStream, *args) -> None:
        super().__init__(*args)
        self.stream = stream

    def forward(self, input_ids, positions, meta, kv_caches):
        self.stream.enqueue()
        return super().forward(input_ids, positions, meta, kv_caches)


def step_periods(engine: Engine, batch: int, penalised: int) -> list[float]:
    """Wall time between successive launches, with `batch` requests decoding. Per launch, not per
    call: a call that waits for a held-back step launches nothing and returns at once."""
    requests = start_decoding(engine, batch, penalised)
    for _ in range(WARMUP_STEPS):
        engine.step()
    periods, last, launched = [], time.perf_counter(), engine.num_steps
    while len(periods) < MEASURED_STEPS:
        engine.step()
        if engine.num_steps > launched:
            now = time.perf_counter()
            periods.append((now - last) / (engine.num_steps - launched))
            last, launched = now, engine.num_steps
    if engine.scheduler.num_running != batch:
        raise RuntimeError(f"the batch is no longer {batch} decoding requests")
    for request in requests:
        engine.abort_request(request.request_id)
    return periods


def overlap(model: LlamaModel, sizes: Sizes, args: argparse.Namespace) -> dict:
    device = torch.device("cpu")  # the device is simulated, whatever --device says
    config = dataclasses.replace(stub_config(STUB_SHAPE), vocab_size=STUB_VOCAB)
    defaults = EngineSettings()
    blocks_per_request = cdiv(PROMPT_LENS[1] + MAX_TOKENS, defaults.block_size)
    num_kv_blocks = defaults.max_num_seqs * blocks_per_request + 1
    stream = SimulatedStream(DEVICE_MS / 1e3)
    stub = DeviceStub(stream, config, defaults.max_num_seqs, device)
    result: dict = {
        "stub_shape": STUB_SHAPE, "stub_vocab": STUB_VOCAB, "device_ms": DEVICE_MS, "measured_steps": MEASURED_STEPS,
        "definition": "median wall time per launched step with the stub model on a simulated device stream "
        f"that takes {DEVICE_MS} ms a step; in turn (overlap off) against overlapped (on), N requests decoding",
    }  # fmt: skip
    with mock.patch.object(model_runner, "to_host", stream.event):
        for batch, penalised in [(batch, 0) for batch in BATCHES] + [(BATCHES[-1], PENALISED)]:
            row = {}
            for mode in ("off", "on"):
                settings = EngineSettings(max_batch_tokens=8192, num_kv_blocks=num_kv_blocks, overlap_scheduling=mode)
                periods = with_engine(stub, settings, lambda engine, n=batch, p=penalised: step_periods(engine, n, p))
                row[f"step_ms_{mode}"] = 1e3 * statistics.median(periods)
                row[f"step_ms_p99_{mode}"] = 1e3 * float(np.percentile(periods, 99))
            row["host_ms"] = row["step_ms_off"] - DEVICE_MS  # in turn, the device waits this long a step
            row["device_busy_on"] = min(1.0, DEVICE_MS / row["step_ms_on"])
            row["off_over_on"] = row["step_ms_off"] / row["step_ms_on"]
            name = f"batch_{batch}" + (f"_{penalised}_penalised" if penalised else "")
            result[name] = row
            print(f"  overlap {name}: {row['step_ms_off']:.2f} ms in turn, {row['step_ms_on']:.2f} ms overlapped",
                  flush=True)  # fmt: skip
    return result
