"""The engine's own cost per decode step, the model stubbed out: on an H200 a llama-8b decode step
at batch 256 takes a few ms, so the Python around the model (schedule, inputs, sampling, update)
decides throughput. Steps at 1, 64 and 256 running requests, and where each step's time goes.

The breakdown wraps the engine's methods with timers here, in the benchmark (unittest.mock
patches, undone after each pass); no engine code is changed. Timers cost a clock call or two
each (about 2 us for the CPU clock on a shared VM), and the dozen of them ~0.1-0.3 ms a step at 256
requests; so the steps' totals come from an untimed pass, the host's figure from a pass timing only
the device's work, the split from one timing the per-step calls, the per-request calls from a fourth.
What lives before the requests arrive is frozen out of the garbage collector, as in a worker.

On a CPU the stand-in for the device's work (the argmax over (N, V), the gather of (N, C) rows) runs
on the host's own core: left out of the figure, it still evicts the host's data from the caches,
which the next step's Python then reads from memory. A second pass, `quiet_step_ms_at_N`, cuts the
stub's vocabulary and hidden size (QUIET_VOCAB, QUIET_HIDDEN) so that the device's work neither takes
the host's time nor its caches, as on a GPU; the host's work is the same.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from contextlib import ExitStack
from unittest import mock

import numpy as np
import torch
from engine_scenarios import Sizes, model_device, random_tokens, with_engine
from torch import nn

from services.worker.engine import model_runner
from services.worker.engine.engine import Engine
from services.worker.engine.kv_cache_manager import cdiv
from services.worker.engine.model import LlamaModel
from services.worker.engine.request import Request
from services.worker.engine.sampling_params import SamplingParams
from services.worker.engine.settings import EngineSettings
from shared.models.shapes import SHAPES, ModelConfig
from shared.runtime import settle_heap

STUB_SHAPE = "llama-8b"  # its vocabulary (128,256) and hidden size: what the target is about
BATCHES = (1, 64, 256)
PROMPT_LENS = (120, 137)  # ~128, spread so that the requests do not all fill a block in the same step
MAX_TOKENS = 1024  # with ignore_eos and greedy: nobody leaves the batch while it is measured
WARMUP_STEPS, MEASURED_STEPS = 5, 40
STUB_TOKEN = 7  # the stub's logits make greedy pick this token, every row, every step
QUIET_VOCAB, QUIET_HIDDEN = 1024, 64  # the quiet pass's stub: its device work fits the caches beside the host's
# Work that is one kernel of microseconds on a GPU but real arithmetic on a CPU: the gather of the
# sampled rows' hidden states (N, C) and the sampler's argmax over (N, V). The sampler's own Python
# (a check over the rows) goes with it: ~10 us at 256 rows.
DEVICE_WORK = ("run.gather_rows", "run.sampler")


class StubModel(nn.Module):
    """What the runner calls of a LlamaModel (config, parameters, forward, compute_logits), with
    no compute: forward returns zeros (T, C) and compute_logits the rows of a constant (N, V)
    table, as a replayed CUDA graph returns its static output buffer."""

    def __init__(self, config: ModelConfig, max_rows: int, device: torch.device) -> None:
        super().__init__()
        self.config = config
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        # The runner takes its device and dtype from the first parameter.
        self.anchor = nn.Parameter(torch.zeros(1, device=device, dtype=dtype), requires_grad=False)
        self.zero_row = torch.zeros(1, config.hidden_size, device=device, dtype=dtype)  # (1, C)
        self.logits = torch.zeros(max_rows, config.vocab_size, device=device)  # (N, V) float32, as the real head's
        self.logits[:, STUB_TOKEN] = 1.0
        self.timers: StepTimers | None = None  # set: the hidden-row gather between forward and logits is timed
        self._forward_end: float | None = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta, kv_caches) -> torch.Tensor:
        if self.timers is not None:
            self._forward_end = self.timers.clock()
        return self.zero_row.expand(input_ids.shape[0], -1)  # (T, C)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # (N, C) -> (N, V)
        if self.timers is not None and self._forward_end is not None:
            self.timers.add("run.gather_rows", self.timers.clock() - self._forward_end)
            self._forward_end = None
        return self.logits[: hidden.shape[0]]


def stub_config(name: str) -> ModelConfig:
    """The shape's vocabulary, hidden size and context; a one-layer, one-head KV layout, since the
    stub never reads its KV pool and a real-shaped pool of this many blocks is GiBs on a CPU."""
    return dataclasses.replace(SHAPES[name], num_layers=1, num_heads=1, num_kv_heads=1, head_dim=2)


def quiet_config(name: str) -> ModelConfig:
    """The stub's shape with a vocabulary and hidden size whose device work is small beside the host's."""
    return dataclasses.replace(stub_config(name), vocab_size=QUIET_VOCAB, hidden_size=QUIET_HIDDEN)


class StepTimers:
    """Inclusive time per named call, summed within a step; one record per step."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self._now: defaultdict[str, float] = defaultdict(float)
        self._calls: defaultdict[str, int] = defaultdict(int)
        self.steps: list[dict[str, float]] = []
        self.calls: list[dict[str, int]] = []

    def wrap(self, name: str, fn: Callable) -> Callable:
        clock, now, calls = self.clock, self._now, self._calls

        def timed(*args, **kwargs):
            start = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                now[name] += clock() - start
                calls[name] += 1

        return timed

    def add(self, name: str, seconds: float) -> None:
        self._now[name] += seconds
        self._calls[name] += 1

    def end_step(self, step_seconds: float) -> None:
        self.steps.append({**self._now, "step": step_seconds})
        self.calls.append(dict(self._calls))
        self._now.clear()
        self._calls.clear()

    def median_ms(self, name: str) -> float:
        return 1e3 * statistics.median(s.get(name, 0.0) for s in self.steps)


Target = tuple[str, Callable[[Engine], object], str]  # (name, owner of the call, attribute)
PER_STEP: list[Target] = [
    ("schedule", lambda e: e.scheduler, "schedule"),
    ("announce_starts", lambda e: e, "_announce_starts"),
    ("run", lambda e: e.runner, "run"),
    ("run.prepare_inputs", lambda e: model_runner, "prepare_inputs"),
    ("run.to_device", lambda e: e.runner, "_to_device"),
    ("run.forward", lambda e: e.runner, "_forward"),
    ("run.process_logits", lambda e: model_runner, "process_logits"),
    ("run.grammar_bitmask", lambda e: e.grammars, "bitmask"),
    ("run.sampler", lambda e: e.runner, "sampler"),
    ("run.generators", lambda e: e.runner, "_generators_for"),
    ("run.logprobs", lambda e: model_runner, "token_logprobs"),
    ("update", lambda e: e, "_update"),
    ("update.scheduler_update", lambda e: e.scheduler, "update_from_output"),
    ("schedule.tenant_order", lambda e: e.scheduler.waiting, "on_scheduled"),
    ("schedule.fit_one_more", lambda e: e.kv_cache_manager, "fit_one_more"),
]
PER_REQUEST: list[Target] = [
    ("schedule.allocate_slots", lambda e: e.kv_cache_manager, "allocate_slots"),
    ("schedule.make_chunk", lambda e: e.scheduler, "_make_chunk"),
    ("update.cache_blocks", lambda e: e.kv_cache_manager, "cache_blocks"),
    ("update.stop_reason", lambda e: e, "_stop_reason"),
]
# What each inclusive timer holds besides its timed children: the rest is its own code.
CHILDREN = {
    "step": ("schedule", "announce_starts", "run", "update"),
    "schedule": ("schedule.tenant_order", "schedule.fit_one_more"),
    "run": tuple(name for name, _, _ in PER_STEP if name.startswith("run.")) + ("run.gather_rows",),
    "update": ("update.scheduler_update",),
}


def instrument(engine: Engine, timers: StepTimers, targets: list[Target]) -> tuple[ExitStack, list[str]]:
    """Timed stand-ins for the targets (undone when the stack closes); the names not found, if the
    engine's code has moved on."""
    stack, missing = ExitStack(), []
    for name, owner_of, attribute in targets:
        owner = owner_of(engine)
        if not hasattr(owner, attribute):
            missing.append(name)
            continue
        stack.enter_context(mock.patch.object(owner, attribute, timers.wrap(name, getattr(owner, attribute))))
    return stack, missing


def check_full(engine: Engine, batch: int) -> None:
    if engine.scheduler.num_running != batch or engine.scheduler.num_waiting:
        raise RuntimeError(f"the batch is no longer {batch} decoding requests")


def timed_steps(engine: Engine, num_steps: int, timers: StepTimers, batch: int) -> None:
    for _ in range(num_steps):
        check_full(engine, batch)
        start = timers.clock()
        engine.step()
        timers.end_step(timers.clock() - start)


def timed_pass(
    engine: Engine, targets: list[Target], clock: Callable[[], float], batch: int, stub: StubModel | None = None
) -> tuple[StepTimers, list[str]]:
    """MEASURED_STEPS steps with the targets timed, and the stub's row gather where the stub is given;
    the names not found."""
    timers = StepTimers(clock)
    stack, missing = instrument(engine, timers, targets)
    if stub is not None:
        stub.timers = timers
    try:
        with stack:
            timed_steps(engine, MEASURED_STEPS, timers, batch)
    finally:
        if stub is not None:
            stub.timers = None
    return timers, missing


def host_seconds(step: dict[str, float], on_cpu: bool) -> float:
    """The step less its device work, which on a CPU ran on the host's core."""
    return step["step"] - (sum(step.get(name, 0.0) for name in DEVICE_WORK) if on_cpu else 0.0)


def empty_interval(clock: Callable[[], float], n: int = 2000) -> float:
    """What a timer records around a call that does nothing: subtracted from the per-request counts."""
    timers = StepTimers(clock)
    noop = timers.wrap("noop", lambda: None)
    for _ in range(n):
        noop()
    timers.end_step(0.0)
    return timers.steps[0]["noop"] / n


def full_collection_ms() -> float:
    start = time.perf_counter()
    gc.collect()
    return 1e3 * (time.perf_counter() - start)


def start_decoding(engine: Engine, batch: int, penalised: int = 0) -> list[Request]:
    """`batch` greedy requests that do not end while measured, past their prompts: every later step
    is `batch` decodes. The first `penalised` ask for frequency and presence penalties."""
    rng = np.random.default_rng(batch)
    sampling = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    penalties = dataclasses.replace(sampling, frequency_penalty=0.5, presence_penalty=0.5)
    requests = [
        Request(f"o{i}", random_tokens(rng, int(rng.integers(*PROMPT_LENS))), penalties if i < penalised else sampling)
        for i in range(batch)
    ]
    for request in requests:
        engine.add_request(request)
    while any(r.num_output_tokens == 0 for r in requests):
        engine.step()
    return requests


def measure_batch(engine: Engine, stub: StubModel, batch: int, clock: Callable[[], float], on_cpu: bool) -> dict:
    settle_heap()  # as a worker does once its engine is built (services/worker/main.py)
    requests = start_decoding(engine, batch)
    timed_steps(engine, WARMUP_STEPS, StepTimers(clock), batch)

    wall, cpu = [], []
    for _ in range(MEASURED_STEPS):  # untimed inside: both clocks around the whole step
        check_full(engine, batch)
        start_wall, start_cpu = time.perf_counter(), time.process_time()
        engine.step()
        wall.append(time.perf_counter() - start_wall)
        cpu.append(time.process_time() - start_cpu)

    # The host's figure: each step less its own device work, only that timed (a few clock calls).
    device, _ = timed_pass(engine, [target for target in PER_STEP if target[0] in DEVICE_WORK], clock, batch, stub)
    host_ms = 1e3 * statistics.median(host_seconds(step, on_cpu) for step in device.steps)
    coarse, missing = timed_pass(engine, PER_STEP, clock, batch, stub)
    fine, missing_fine = timed_pass(engine, PER_REQUEST, clock, batch)

    for step in coarse.steps:  # each inclusive timer's own code, and the step less its device work
        for parent, children in CHILDREN.items():
            step[f"{parent}.rest"] = step.get(parent, 0.0) - sum(step.get(c, 0.0) for c in children)
        step["device_work"] = sum(step.get(name, 0.0) for name in DEVICE_WORK)
        step["host"] = host_seconds(step, on_cpu)
    breakdown = {name: coarse.median_ms(name) for name in sorted({k for s in coarse.steps for k in s})}
    noop = empty_interval(clock)
    per_request = {}
    for name, _, _ in PER_REQUEST:
        calls = statistics.median(c.get(name, 0) for c in fine.calls)
        per_request[name] = {"ms": max(0.0, fine.median_ms(name) - 1e3 * calls * noop), "calls": calls}
    # What a full collection pauses the engine for, with the process's objects from before the
    # requests frozen as a worker freezes them, and with nothing frozen.
    pause_frozen = full_collection_ms()
    gc.unfreeze()
    pause_unfrozen = full_collection_ms()
    for request in requests:
        engine.abort_request(request.request_id)
    return {
        "full_collection_ms": {"frozen_at_start": pause_frozen, "nothing_frozen": pause_unfrozen},
        "host_ms": host_ms, "host_ms_instrumented": breakdown["host"], "step_ms_wall": 1e3 * statistics.median(wall),
        "step_ms_cpu": 1e3 * statistics.median(cpu), "step_ms_wall_mean": 1e3 * statistics.mean(wall),
        "step_ms_instrumented": breakdown["step"], "device_work_ms": breakdown["device_work"],
        "breakdown_ms": breakdown, "per_request_calls": per_request, "timer_empty_interval_us": 1e6 * noop,
        "not_found": missing + missing_fine,
    }  # fmt: skip


def top_items(breakdown: dict[str, float], on_cpu: bool, n: int = 6) -> list[tuple[str, float]]:
    """The leaf timers of the host's part (own code, children excluded), largest first."""
    left_out = set(CHILDREN) | {"host", "device_work"} | (set(DEVICE_WORK) if on_cpu else set())
    leaves = {k: v for k, v in breakdown.items() if k not in left_out}
    return sorted(leaves.items(), key=lambda kv: -kv[1])[:n]


def overhead(model: LlamaModel, sizes: Sizes, args: argparse.Namespace) -> dict:
    device = model_device(model)
    on_cpu = device.type == "cpu"
    config = stub_config(STUB_SHAPE)
    # The serving defaults (256 sequences, 16-token blocks), a GPU's token budget, a pool for 256 full requests.
    defaults = EngineSettings()
    blocks_per_request = cdiv(PROMPT_LENS[1] + MAX_TOKENS, defaults.block_size)
    # In turn: the host's whole work per step is what is measured (engine_overlap.py hides it).
    settings = EngineSettings(
        max_batch_tokens=8192, num_kv_blocks=defaults.max_num_seqs * blocks_per_request + 1, overlap_scheduling="off"
    )
    stub = StubModel(config, settings.max_num_seqs, device)
    result: dict = {
        "stub_shape": STUB_SHAPE, "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
        "prompt_tokens": f"{PROMPT_LENS[0]}..{PROMPT_LENS[1] - 1}", "measured_steps": MEASURED_STEPS,
        "clock": args.clock_name, "torch_threads": torch.get_num_threads(),
        "definition": "step_ms_at_N: median Engine.step() with a stub model, N requests decoding (greedy, "
        "ignore_eos), on the benchmark's clock; on a CPU less the device work (the gather of the sampled rows' "
        "hidden states, the sampler's argmax over (N, V)), one kernel each on a GPU",
    }  # fmt: skip
    # On a GPU the device's work is on the device already: no quiet pass.
    quiet = StubModel(quiet_config(STUB_SHAPE), settings.max_num_seqs, device) if on_cpu else None

    def measure(model: StubModel, batch: int) -> dict:
        return with_engine(model, settings, lambda engine: measure_batch(engine, model, batch, args.clock, on_cpu))

    for batch in BATCHES:
        measured = measure(stub, batch)
        result[f"batch_{batch}"] = measured
        result[f"step_ms_at_{batch}"] = measured["host_ms"]
        result[f"top_items_at_{batch}"] = top_items(measured["breakdown_ms"], on_cpu)
        line = f"  overhead {batch}: {measured['host_ms']:.3f} ms host, {measured['step_ms_cpu']:.2f} ms cpu step"
        if quiet is not None:
            quieted = measure(quiet, batch)
            result[f"quiet_batch_{batch}"] = {key: quieted[key] for key in ("host_ms", "step_ms_cpu", "breakdown_ms")}
            result[f"quiet_step_ms_at_{batch}"] = quieted["host_ms"]
            line += f"; quiet {quieted['host_ms']:.3f} ms host"
        print(line, flush=True)
    return result
