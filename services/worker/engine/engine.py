"""The core loop over token ids: requests in, one scheduled step at a time (schedule, run, update),
new tokens and finish reasons out. Text, chat templates and stop strings live in llm_engine.py.

Overlapped (`overlap_scheduling`, on a GPU): each call schedules and launches step n+1 while step n
still runs on the device, then waits for step n's tokens and returns step n's updates, as vLLM's
async scheduling and SGLang's overlap scheduler do. Step n+1's decodes read step n's tokens on the
device. A request that step n finishes (its end token, a stop string, an abort) has one row in step
n+1 that is computed and dropped. Penalties count a token still on the device where it lies
(logits_processors.py). Requests that need their last token here before the next step (a grammar
advances on it, a handoff parks after it) make the engine wait for it first, for that step."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field

import torch
from llguidance import LLMatcher

from services.worker.engine import cpu_graph_store
from services.worker.engine.block_pool import BlockPool
from services.worker.engine.chunk_cost import attention_parity
from services.worker.engine.grammar_matchers import GrammarMatchers
from services.worker.engine.kv_cache_manager import KVCacheManager
from services.worker.engine.kv_handoffs import KVHandoffs
from services.worker.engine.logprobs import Sampled, TokenLogprobs
from services.worker.engine.model import LlamaModel
from services.worker.engine.model_runner import ModelRunner, PendingStep, RunnerConfig
from services.worker.engine.request import Request, RequestStatus
from services.worker.engine.scheduler import PLACEHOLDER, Scheduler, SchedulerConfig, SchedulerOutput
from services.worker.engine.settings import (
    CPU_MAX_BATCH_TOKENS,
    GPU_MAX_BATCH_TOKENS,
    EngineSettings,
)
from services.worker.engine.tenant_order import FCFS, TenantOrder
from services.worker.engine.types import (
    EngineLoad,
    FailureCode,
    FinishReason,
    HandoffReady,
    RequestRejected,
    StartListener,
)
from services.worker.engine.vtc import VirtualTokenCounters, VTCCosts
from shared.models.shapes import ModelConfig
from shared.models.spec import context_length

log = logging.getLogger(__name__)

STEP_FAILED = "the engine failed while running this request"  # a request's error when its part of a step raised


def resolve(
    settings: EngineSettings, config: ModelConfig, max_model_len: int, device: torch.device
) -> tuple[SchedulerConfig, RunnerConfig]:
    """The scheduler's and the runner's configs for a model of this shape, with every 0 = auto filled in."""
    auto_tokens = GPU_MAX_BATCH_TOKENS if device.type == "cuda" else CPU_MAX_BATCH_TOKENS
    scheduler = SchedulerConfig(
        max_num_seqs=settings.max_num_seqs,
        max_batch_tokens=settings.max_batch_tokens or auto_tokens,
        max_model_len=max_model_len,
        long_prefill_token_threshold=settings.long_prefill_token_threshold,
        attention_parity=attention_parity(config) if settings.count_chunk_attention else 0,
        enable_chunked_prefill=settings.enable_chunked_prefill,
        static_batching=settings.static_batching,
    )
    runner = RunnerConfig(
        block_size=settings.block_size,
        max_model_len=max_model_len,
        max_num_seqs=settings.max_num_seqs,
        # Without chunking, one whole prompt may go in over the budget beside the decodes.
        max_step_tokens=scheduler.max_batch_tokens + (0 if settings.enable_chunked_prefill else max_model_len),
        num_kv_blocks=settings.num_kv_blocks,
        kv_memory_fraction=settings.kv_memory_fraction,
        cuda_graphs=settings.cuda_graphs,
        cpu_compile=settings.cpu_compile,
        cpu_attention_kernel=settings.cpu_attention_kernel,
        cpu_output_screen=settings.cpu_output_screen,
        cpu_graph_store=cpu_graph_store.default_store() if settings.cpu_graph_store else None,
        kv_cache_dtype=None if settings.kv_cache_dtype == "auto" else getattr(torch, settings.kv_cache_dtype),
    )
    return scheduler, runner


@dataclass(slots=True)
class RequestUpdate:
    """What one step did for one request."""

    request_id: str
    new_token_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None  # set once it finished
    error: str | None = None  # why the request failed, when it failed alone
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # of new_token_ids, when the request asked
    handoff: HandoffReady | None = None  # parked after this step, for another engine (kv_handoffs.py)


@dataclass(slots=True)
class InFlight:
    """A step launched on the device whose tokens are not back yet."""

    out: SchedulerOutput
    pending: PendingStep
    holds_back: bool  # a request in it needs the token it draws before its next step


def waiting_order(settings: EngineSettings) -> TenantOrder:
    if settings.fair_share == "fcfs":
        return FCFS()
    costs = VTCCosts(w_out=settings.vtc_output_weight, w_cached=settings.vtc_cached_weight, weights=settings.weights())
    return VirtualTokenCounters(costs)


class Engine:
    def __init__(
        self,
        model: LlamaModel,
        settings: EngineSettings = EngineSettings(),
        max_model_len: int = 0,  # 0 = the model's context, at most 8192
        eos_token_ids: tuple[int, ...] | None = None,  # None = the model's; () = never stop on EOS
        tenant_order: TenantOrder | None = None,
        runner_cls: type[ModelRunner] = ModelRunner,  # tests inject faults through a subclass
    ) -> None:
        device = next(model.parameters()).device
        scheduler_config, runner_config = resolve(
            settings, model.config, context_length(model.config, max_model_len), device
        )
        eos = model.config.eos_token_ids if eos_token_ids is None else eos_token_ids
        self.eos_token_ids = frozenset(eos)
        self.settings = settings
        self.vocab_size = model.config.vocab_size
        self.runner = runner_cls(model, dataclasses.replace(runner_config, eos_token_ids=self.eos_token_ids))
        self.grammars = GrammarMatchers(self.vocab_size)  # constrained requests' grammar state
        self.runner.grammars = self.grammars
        pool = BlockPool(self.runner.num_blocks, settings.block_size, enable_caching=settings.enable_prefix_caching)
        self.kv_cache_manager = KVCacheManager(pool, scheduler_config.max_model_len)
        self.scheduler = Scheduler(scheduler_config, self.kv_cache_manager, tenant_order or waiting_order(settings))
        self.handoffs = KVHandoffs(self.scheduler, self.kv_cache_manager, self.runner.kv_caches, self.runner.kv_dtype)
        self.start_listener: StartListener | None = None
        self._started: set[str] = set()  # requests already announced to start_listener
        overlap = settings.overlap_scheduling
        self.overlap = overlap == "on" or (overlap == "auto" and device.type == "cuda")
        self._in_flight: InFlight | None = None  # overlapped: the step on the device now
        self.num_steps = 0
        self.num_isolated_failures = 0  # steps that raised and were re-run request by request
        self._last_waiting_tokens = 0

    @property
    def max_model_len(self) -> int:
        return self.scheduler.config.max_model_len

    def add_request(self, request: Request, grammar: LLMatcher | None = None) -> None:
        """Queue a request; RequestRejected, with a typed code, if it can never run here."""
        sampling = request.sampling
        named = [t for t, _ in sampling.logit_bias] + list(sampling.stop_token_ids)
        if any(token >= self.vocab_size for token in named):
            message = f"a token id in logit_bias or stop_token_ids is outside the vocabulary (0..{self.vocab_size - 1})"
            raise RequestRejected(FailureCode.INVALID_REQUEST, message)
        self.scheduler.add_request(request)
        if grammar is not None:  # its sampled tokens keep to the grammar, and it ends when the grammar does
            self.grammars.add(request.request_id, grammar)

    def abort_request(self, request_id: str) -> bool:
        """Cancel a request and free its blocks now (parked or being received too); False if unknown."""
        self.grammars.remove(request_id)
        handoffs = self.handoffs
        return self.scheduler.abort_request(request_id) or handoffs.release(request_id) or handoffs.cancel(request_id)

    def commit_import(self, request_id: str, cached_tokens: int) -> None:
        """A received request runs from the next step; its start was on record where it was prefilled."""
        self.handoffs.commit(request_id, cached_tokens)
        self._started.add(request_id)

    def finish_request(self, request_id: str, reason: FinishReason) -> bool:
        """Finish a request from outside the loop (a stop string found in its text)."""
        self.grammars.remove(request_id)
        return self.scheduler.finish_request(request_id, RequestStatus.finished_with(reason))

    def get_request(self, request_id: str) -> Request | None:
        return self.scheduler.get_request(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def request_ids(self) -> list[str]:
        return [*self.scheduler.requests, *self.handoffs.parked, *self.handoffs.importing]

    def load(self) -> EngineLoad:
        pool = self.kv_cache_manager.block_pool
        return EngineLoad(
            running=self.scheduler.num_running,
            waiting=self.scheduler.num_waiting,
            kv_usage=pool.usage,
            free_kv_blocks=pool.num_free_blocks,
            prefix_hit_rate=self.kv_cache_manager.prefix_hit_rate,
            steps=self.num_steps,
            graph_steps=self.runner.num_graph_steps,
            preemptions=self.scheduler.num_preemptions,
            isolated_failures=self.num_isolated_failures,
            max_running=self.scheduler.config.max_num_seqs,
            waiting_tokens=self._waiting_tokens(),
            kv_tokens=pool.num_usable_blocks * pool.block_size,
        )

    def _waiting_tokens(self) -> int:
        # load() runs beside the engine thread: a queue changed mid-count keeps the last count.
        try:
            self._last_waiting_tokens = sum(r.num_tokens - r.num_computed_tokens for r in self.scheduler.waiting)
        except RuntimeError:
            pass
        return self._last_waiting_tokens

    def step(self) -> list[RequestUpdate]:
        if self.overlap:
            return self._overlapped_step()
        out = self.scheduler.schedule()
        self._announce_starts(out)
        sampled, failed = self._execute(out)
        return self._update(out, sampled, failed)

    def _overlapped_step(self) -> list[RequestUpdate]:
        """Launch the next step, then return the updates of the one launched before it."""
        previous, self._in_flight = self._in_flight, None
        if previous is not None and previous.holds_back:
            return self._finish(previous)  # the next step is scheduled once these tokens are here
        out = self.scheduler.schedule()
        self._announce_starts(out)
        if not out.is_empty:
            try:
                self._in_flight = InFlight(out, self.runner.launch(out), self._holds_back(out))
                self.num_steps += 1
            except Exception:  # noqa: BLE001 - re-run in turn below, where _execute finds the culprit
                log.warning("an overlapped step failed to launch; running it in turn", exc_info=True)
                updates = self._finish(previous) if previous is not None else []
                sampled, failed = self._execute(self._with_known_tokens(out))
                return updates + self._update(out, sampled, failed)
        return self._finish(previous) if previous is not None else []

    def _finish(self, flight: InFlight) -> list[RequestUpdate]:
        try:
            sampled, failed = flight.pending.result(), {}
        except Exception:  # the device failed the step: every request in it fails
            log.exception("step failed on the device for %s", [c.request_id for c in flight.out.chunks])
            sampled, failed = Sampled(), {c.request_id: STEP_FAILED for c in flight.out.chunks}
        return self._update(flight.out, sampled, failed)

    def _holds_back(self, out: SchedulerOutput) -> bool:
        grammars, requests = self.grammars, self.scheduler.requests
        return any(
            chunk.sample
            and (chunk.request_id in grammars or requests[chunk.request_id].handoff)
            for chunk in out.chunks
        )

    def _with_known_tokens(self, out: SchedulerOutput) -> SchedulerOutput:
        """The step with each PLACEHOLDER replaced by its token, now back (0 for a request gone since)."""
        def known(chunk):
            if chunk.token_ids != [PLACEHOLDER]:
                return chunk
            request = self.scheduler.get_request(chunk.request_id)
            tokens = request.all_token_ids if request is not None else ()
            return chunk._replace(token_ids=[tokens[chunk.start_position] if len(tokens) > chunk.start_position else 0])

        return dataclasses.replace(out, chunks=[known(chunk) for chunk in out.chunks])

    def _announce_starts(self, out: SchedulerOutput) -> None:
        # Before the model runs: a request that takes the process down with it is then on
        # record as started. A preempted request coming back is not new.
        self._started.difference_update(out.finished_ids)
        new = [chunk.request_id for chunk in out.chunks if chunk.request_id not in self._started]
        self._started.update(new)
        if new and self.start_listener is not None:
            self.start_listener(new)

    def _execute(self, out: SchedulerOutput) -> tuple[Sampled, dict[str, str]]:
        """Sampled tokens by request, and the requests whose part of the step raised (with why)."""
        self.num_steps += 1
        try:
            return self.runner.run(out), {}
        except Exception:  # any failure: one bad request must not fail the whole batch
            if len(out.chunks) <= 1:
                log.exception("step failed for %s", [c.request_id for c in out.chunks])
                return Sampled(), {c.request_id: STEP_FAILED for c in out.chunks}
            log.exception("batched step of %d requests failed; re-running them one at a time", len(out.chunks))
            self.num_isolated_failures += 1
            return self._isolate(out)

    def _isolate(self, out: SchedulerOutput) -> tuple[Sampled, dict[str, str]]:
        # Re-running a chunk rewrites the same K/V into the same slots and draws from the same
        # seeds, so the chunks that succeed here produce exactly what the batch would have.
        sampled = Sampled()
        failed: dict[str, str] = {}
        for chunk in out.chunks:
            single = SchedulerOutput([chunk], num_scheduled_tokens=chunk.num_tokens, block_tables=out.block_tables)
            try:
                sampled.update(self.runner.run(single))
            except Exception:  # this request is the culprit: it fails alone
                log.exception("request %s fails alone", chunk.request_id)
                failed[chunk.request_id] = STEP_FAILED
        return sampled, failed

    def _update(self, out: SchedulerOutput, sampled: Sampled, failed: dict[str, str]) -> list[RequestUpdate]:
        updates = [RequestUpdate(request_id, error=why) for request_id, why in failed.items()]
        for request_id in failed:
            self.scheduler.finish_request(request_id, RequestStatus.FINISHED_ERROR)
            self.grammars.remove(request_id)
        advanced = self.scheduler.update_from_output(out, sampled.tokens)
        # Once per running request per step: locals, not attribute lookups, at hundreds of requests.
        all_logprobs, grammars, park = sampled.logprobs, self.grammars, self.handoffs.park
        constrained = bool(grammars)  # none now: none of these requests has a grammar
        for request, token in advanced:
            grammar_complete = constrained and grammars.accept(request.request_id, token)
            reason = self._stop_reason(request, token, grammar_complete)
            if reason is not None:
                self.finish_request(request.request_id, reason)
            handoff = park(request) if reason is None and request.handoff else None
            # An end token (EOS, a stop token id) is no text of the reply: it has no logprob entry, as in OpenAI's.
            lp = all_logprobs.get(request.request_id) if all_logprobs else None
            logprobs = [lp] if lp is not None and not self._is_end_token(request, token) else []
            updates.append(RequestUpdate(request.request_id, [token], reason, None, logprobs, handoff))  # error None
        return updates

    def _is_end_token(self, request: Request, token: int) -> bool:
        sampling = request.sampling
        return token in sampling.stop_token_ids or (token in self.eos_token_ids and not sampling.ignore_eos)

    def _stop_reason(self, request: Request, token: int, grammar_complete: bool) -> FinishReason | None:
        # Before min_tokens the sampler masked the end tokens, so reaching one means the request may end;
        # a grammar that is complete allows nothing more.
        if grammar_complete or self._is_end_token(request, token):
            return FinishReason.STOP
        if request.reached_max_num_tokens:  # max_tokens, or max_model_len (add_request capped it)
            return FinishReason.LENGTH
        return None
