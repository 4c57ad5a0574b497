"""Continuous batching: each step spends a token budget on running decodes, then prompt chunks.

The engine loop is `out = schedule(); sampled = runner.run(out); update_from_output(out,
sampled)`, after which the engine checks stop conditions and calls `finish_request`. A step
counts as computed once scheduled, and the token it draws as pending until it is back, so the
next step can be scheduled while this one still runs on the device (engine.py's overlap): a
decode whose input is that pending token carries PLACEHOLDER, which the runner fills on the device.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from services.worker.engine.chunk_cost import largest_chunk
from services.worker.engine.kv_cache_manager import KVCacheManager, cdiv
from services.worker.engine.request import Request, RequestStatus
from services.worker.engine.sampling_params import SamplingParams
from services.worker.engine.settings import CPU_MAX_BATCH_TOKENS, EngineSettings
from services.worker.engine.tenant_order import FCFS, TenantOrder
from services.worker.engine.types import Failure, FailureCode, RequestRejected
from shared.models.spec import DEFAULT_MAX_MODEL_LEN

DEFAULT_SAMPLING = SamplingParams()
PLACEHOLDER = -1  # a decode's input token that the step before draws: still on the device


_SETTINGS = EngineSettings()


@dataclass(frozen=True)
class SchedulerConfig:
    """The scheduler's part of the engine's settings, every auto resolved (engine.resolve); the
    defaults are the settings' own, with a CPU's budget, for a scheduler used on its own (tests)."""

    max_num_seqs: int = _SETTINGS.max_num_seqs  # requests in one batch
    max_batch_tokens: int = CPU_MAX_BATCH_TOKENS  # tokens computed in one step (the budget)
    max_model_len: int = DEFAULT_MAX_MODEL_LEN  # prompt + output, per request
    long_prefill_token_threshold: int = _SETTINGS.long_prefill_token_threshold  # cap on one chunk; 0 = off
    # Beside decodes, a chunk's attention over the positions before it counts against the budget: the
    # model's chunk_cost.attention_parity. 0 = chunks count their tokens alone.
    attention_parity: int = 0
    enable_chunked_prefill: bool = _SETTINGS.enable_chunked_prefill  # off: a prompt runs whole or waits
    # Baseline for benchmarks: admit a batch, then nothing new until all of it finished.
    static_batching: bool = _SETTINGS.static_batching

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_batch_tokens", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.long_prefill_token_threshold < 0:
            raise ValueError("long_prefill_token_threshold must be >= 0 (0 = off)")
        if self.attention_parity < 0:
            raise ValueError("attention_parity must be >= 0 (0 = off)")


class ScheduledChunk(NamedTuple):
    """One request's part of a step. A tuple, so the runner takes a step's chunks apart column
    by column in one call (zip(*chunks)), not one attribute read per request per field."""

    request_id: str
    token_ids: list[int]  # the tokens whose KV this step computes ([PLACEHOLDER]: drawn by the step before)
    start_position: int  # position of token_ids[0]; KV of earlier positions is cached
    block_row: int  # the request's row of SchedulerOutput.block_tables
    sample: bool  # the chunk reaches the end of the tokens known or pending: sample the next one
    sampling: SamplingParams = DEFAULT_SAMPLING
    history: Sequence[int] = ()  # the request's tokens so far (prompt, then output), for penalties
    num_prompt_tokens: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(slots=True)
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    # Requests that lost their blocks this step, and those finished or aborted since
    # the last step: the runner drops any state it keeps for them.
    preempted_ids: list[str] = field(default_factory=list)
    finished_ids: list[str] = field(default_factory=list)
    num_scheduled_tokens: int = 0
    # (R, W) block ids, a row per request holding blocks (BlockTables.array): the live array,
    # read-only, valid for this step; a row's blocks past its chunk's tokens are not this step's.
    block_tables: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), dtype=np.int32))

    @property
    def is_empty(self) -> bool:
        return not self.chunks

    def block_ids(self, chunk: ScheduledChunk, block_size: int) -> list[int]:
        """The blocks that hold the chunk's request up to the end of this step's tokens."""
        end = chunk.start_position + len(chunk.token_ids)
        return self.block_tables[chunk.block_row, : cdiv(end, block_size)].tolist()


@dataclass(slots=True)
class _StepPlan:
    """What one call of schedule() has decided so far."""

    budget: int
    num_tokens: dict[Request, int] = field(default_factory=dict)  # tokens this step, in scheduling order
    charges: dict[Request, int] = field(default_factory=dict)  # budget a chunk took beyond its tokens
    preempted_ids: list[str] = field(default_factory=list)
    num_new_prefills: int = 0
    num_decodes: int = 0

    def add(self, request: Request, num_tokens: int, charge: int = 0) -> None:
        """charge: the budget the request's tokens take, where that is more than their count."""
        self.num_tokens[request] = num_tokens
        if charge > num_tokens:
            self.charges[request] = charge
        self.budget = max(0, self.budget - max(num_tokens, charge))

    def drop(self, request: Request) -> None:
        tokens, charge = self.num_tokens.pop(request, 0), self.charges.pop(request, None)
        self.budget += tokens if charge is None else charge


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        kv_cache_manager: KVCacheManager,
        tenant_order: TenantOrder | None = None,
    ) -> None:
        self.config = config
        self.kv_cache_manager = kv_cache_manager
        self.waiting = tenant_order if tenant_order is not None else FCFS()
        self.running: list[Request] = []  # in admission order: the last is the newest
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self._finished_ids: list[str] = []
        self._static_batch: set[str] = set()
        self._static_batch_closed = False

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_request(self, request_id: str) -> Request | None:
        return self.requests.get(request_id)

    def check_request(self, request: Request) -> Failure | None:
        """Why this request can never run here (its sampling was checked when it was made), or None."""
        num_prompt = request.num_prompt_tokens
        if num_prompt == 0:
            return Failure(FailureCode.INVALID_REQUEST, "the prompt is empty")
        if num_prompt > self.config.max_model_len:
            limit = self.config.max_model_len
            return Failure(FailureCode.PROMPT_TOO_LONG, f"the prompt has {num_prompt} tokens; the model takes at most {limit}")
        # KV is needed for the whole prompt and for every output token but the last.
        max_num_tokens = min(num_prompt + request.sampling.max_tokens, self.config.max_model_len)
        num_kv_tokens = max(num_prompt, max_num_tokens - 1)
        pool = self.kv_cache_manager.block_pool
        num_blocks = cdiv(num_kv_tokens, pool.block_size)
        if num_blocks > pool.num_usable_blocks:
            return Failure(
                FailureCode.PROMPT_TOO_LONG,
                f"prompt plus max_tokens needs {num_kv_tokens} tokens of KV cache "
                f"({num_blocks} blocks); this worker holds {pool.num_usable_blocks} blocks",
            )
        return None

    def add_request(self, request: Request) -> None:
        """Queue a request; RequestRejected with check_request's reason, or if its id is taken."""
        if request.request_id in self.requests:
            raise RequestRejected(FailureCode.INVALID_REQUEST, f"request id {request.request_id} is already in use")
        if (failure := self.check_request(request)) is not None:
            raise RequestRejected(failure.code, failure.message)
        request.max_num_tokens = min(request.max_num_tokens, self.config.max_model_len)
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.add(request)

    def abort_request(self, request_id: str) -> bool:
        """Cancel a request wherever it is and free its blocks now; False if unknown."""
        return self.finish_request(request_id, RequestStatus.FINISHED_ABORTED)

    def finish_request(self, request_id: str, status: RequestStatus) -> bool:
        """Finish a request with one of the finished statuses; False if unknown."""
        if not status.is_finished:
            raise ValueError(f"{status} is not a finished status")
        request = self.requests.pop(request_id, None)
        if request is None:
            return False
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request_id)
        self.kv_cache_manager.free(request)
        request.status = status
        self._finished_ids.append(request_id)
        self._static_batch.discard(request_id)
        if not self._static_batch:
            self._static_batch_closed = False
        return True

    def park(self, request_id: str) -> Request:
        """Take a running request out of the batch with its blocks still held (a handoff); it is
        no longer this scheduler's, until `add_running` takes it back."""
        request = self.requests.pop(request_id)
        self.running.remove(request)
        return request

    def add_running(self, request: Request) -> None:
        """Run a request whose KV is already in its blocks (taken back, or received from another
        engine): from the next step on it decodes like any other."""
        if request.request_id in self.requests:
            raise RequestRejected(FailureCode.INVALID_REQUEST, f"request id {request.request_id} is already in use")
        request.status = RequestStatus.RUNNING
        self.requests[request.request_id] = request
        self.running.append(request)

    def forget(self, request_id: str) -> None:
        """A request that left without finishing here: the runner drops its state at the next step."""
        self._finished_ids.append(request_id)

    def schedule(self) -> SchedulerOutput:
        plan = _StepPlan(budget=self.config.max_batch_tokens)
        self._schedule_running(plan)
        # A step that had to preempt is short of blocks: admitting more would only
        # preempt again next step.
        if not plan.preempted_ids:
            self._schedule_waiting(plan)
        self.waiting.on_scheduled(plan.num_tokens)
        make_chunk = self._make_chunk
        chunks = [make_chunk(request, num_tokens) for request, num_tokens in plan.num_tokens.items()]
        num_tokens = sum(plan.num_tokens.values())
        output = SchedulerOutput(
            chunks, plan.preempted_ids, self._finished_ids, num_tokens, self.kv_cache_manager.block_tables.array
        )
        self._finished_ids = []
        return output

    def update_from_output(self, output: SchedulerOutput, sampled: dict[str, int]) -> list[tuple[Request, int]]:
        """Record a finished step: append its samples, cache the blocks it filled. Each request
        that got a token, with it, in the step's order."""
        block_size, running = self.kv_cache_manager.block_size, RequestStatus.RUNNING
        get_request, cache_blocks = self.requests.get, self.kv_cache_manager.cache_blocks
        advanced: list[tuple[Request, int]] = []
        for chunk in output.chunks:
            request = get_request(chunk.request_id)
            if request is None or request.status is not running:
                continue  # finished, aborted or preempted while the step ran
            if chunk.sample:
                token = sampled.get(chunk.request_id)
                if token is None:
                    raise KeyError(f"no sampled token for request {chunk.request_id}")
                request.num_pending_tokens -= 1
                request.append_output_token(token)
                advanced.append((request, token))
            start = chunk.start_position
            if (start + len(chunk.token_ids)) // block_size > start // block_size:  # a block filled up
                cache_blocks(request)  # it may enter the prefix cache
        return advanced

    def _schedule_running(self, plan: _StepPlan) -> None:
        # Decodes before prefill chunks, so a long prompt already in flight cannot
        # take the budget that keeps the other streams moving. Once per running request
        # per step: locals and no property calls, at hundreds of requests.
        decodes: list[Request] = []
        prefills: list[Request] = []
        for request in self.running:
            num_tokens = len(request.all_token_ids) + request.num_pending_tokens
            if num_tokens - request.num_computed_tokens > 1:
                prefills.append(request)
            elif not request.num_pending_tokens or num_tokens < request.max_num_tokens:
                decodes.append(request)
            # else its pending token is its last: the engine finishes it once that token is back
        allocate, running = self.kv_cache_manager.allocate_slots, RequestStatus.RUNNING
        for request, fits in zip(decodes, self.kv_cache_manager.fit_one_more(decodes), strict=True):
            if plan.budget <= 0:
                return
            if request.status is not running:
                continue  # preempted earlier in this step
            if fits or allocate(request, 1) is not None or self._preempt_until_fits(request, 1, plan):
                plan.add(request, 1)
                plan.num_decodes += 1
        for request in prefills:
            if plan.budget <= 0:
                return
            if request.status is not running:
                continue
            start = request.num_computed_tokens
            num_new, charge = self._chunk_size(request.num_tokens - start, start, plan)
            if num_new > 0 and (allocate(request, num_new) is not None or self._preempt_until_fits(request, num_new, plan)):
                plan.add(request, num_new, charge)

    def _preempt_until_fits(self, request: Request, num_new: int, plan: _StepPlan) -> bool:
        """Preempt the newest running requests until `request` gets its slots; False if it went itself."""
        while self.kv_cache_manager.allocate_slots(request, num_new) is None:
            victim = self.running[-1]
            self._preempt(victim, plan)
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request, plan: _StepPlan) -> None:
        # Its full blocks stay in the prefix cache, so readmission usually recomputes
        # only the tail; the tokens it generated are part of what it recomputes.
        self.running.remove(request)
        plan.drop(request)
        plan.preempted_ids.append(request.request_id)
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_pending_tokens = 0  # a step in flight that draws it is ignored: update skips it
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.push_front(request)

    def _schedule_waiting(self, plan: _StepPlan) -> None:
        stopped_by_budget = False
        while len(self.running) < self.config.max_num_seqs:
            request = self._next_candidate()
            if request is None:
                break
            if plan.budget <= 0:
                stopped_by_budget = True
                break
            computed_blocks, num_hit = self.kv_cache_manager.get_computed_blocks(request)
            size = self._admission_size(request.num_tokens - num_hit, num_hit, plan)
            if size is None:
                stopped_by_budget = True
                break
            num_new, charge = size
            if self.kv_cache_manager.allocate_slots(request, num_new, computed_blocks) is None:
                break
            self.waiting.remove(request.request_id)
            self._admit(request, num_hit)
            self.waiting.on_admitted(request, num_hit)
            plan.add(request, num_new, charge)
            plan.num_new_prefills += 1
        # A static batch takes whatever waits (up to the caps) and then closes; it
        # stays open only while it is still filling and merely out of budget.
        if self.config.static_batching and self._static_batch and not stopped_by_budget:
            self._static_batch_closed = True

    def _next_candidate(self) -> Request | None:
        """The waiting request to try next; a closed static batch takes back only its own."""
        if not (self.config.static_batching and self._static_batch_closed):
            return self.waiting.peek()
        return next((r for r in self.waiting if r.request_id in self._static_batch), None)

    def _admission_size(self, num_remaining: int, start: int, plan: _StepPlan) -> tuple[int, int] | None:
        """(tokens, charge) of a waiting request to compute this step, or None if it must wait."""
        if self.config.enable_chunked_prefill:
            return self._chunk_size(num_remaining, start, plan)
        if num_remaining <= plan.budget:
            return num_remaining, num_remaining
        # Without chunking, a prompt larger than the whole budget would never fit:
        # it goes in over budget as the step's only new prompt, beside the decodes.
        if num_remaining > self.config.max_batch_tokens and plan.num_new_prefills == 0:
            return num_remaining, num_remaining
        return None

    def _chunk_size(self, num_remaining: int, start: int, plan: _StepPlan) -> tuple[int, int]:
        """(tokens, charge): the prompt tokens after `start` to compute this step and the budget they take.
        Beside decodes, whose next tokens wait for the step, a chunk takes no more work than the budget
        left would on a fresh prompt (chunk_cost.py)."""
        if not self.config.enable_chunked_prefill:
            return num_remaining, num_remaining
        threshold = self.config.long_prefill_token_threshold
        if threshold > 0:
            num_remaining = min(num_remaining, threshold)
        parity = self.config.attention_parity
        if parity and plan.num_decodes and start:
            return largest_chunk(num_remaining, start, plan.budget, parity)
        tokens = min(num_remaining, plan.budget)
        return tokens, tokens

    def _admit(self, request: Request, num_hit: int) -> None:
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = num_hit
        if request.num_preemptions == 0:
            request.num_cached_tokens = num_hit
        self.running.append(request)
        if self.config.static_batching:
            self._static_batch.add(request.request_id)

    def _make_chunk(self, request: Request, num_tokens: int) -> ScheduledChunk:
        """The request's part of this step, which from now on counts as computed."""
        start = request.num_computed_tokens
        request.num_computed_tokens = end = start + num_tokens
        tokens = request.all_token_ids
        known = len(tokens)
        token_ids = tokens[start:end] if end <= known else [PLACEHOLDER]  # a decode of the pending token
        sample = end == known + request.num_pending_tokens
        request.num_pending_tokens += sample
        return ScheduledChunk(
            request.request_id, token_ids, start, self.kv_cache_manager.block_row(request),
            sample, request.sampling, tokens, request.num_prompt_tokens,
        )  # fmt: skip
