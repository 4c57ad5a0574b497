"""The GenerationEngine over a model: chat messages in, text out, over the token-id Engine; plus
`build_llm_engine`, which loads a model spec's weights and builds it all."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from llguidance import LLMatcher

from kernels import cpu_panel_linear
from services.worker.engine.block_pool import KVCacheListener
from services.worker.engine.cpu_linear import use_cpu_linear_
from services.worker.engine.detokenizer import IncrementalDetokenizer
from services.worker.engine.engine import Engine, RequestUpdate
from services.worker.engine.grammar_compiler import GrammarCompiler, GrammarQueue
from services.worker.engine.logprobs import TokenLogprobs
from services.worker.engine.model import LlamaModel
from services.worker.engine.prompt_ids import prompt_token_ids
from services.worker.engine.quantize import quantize_
from services.worker.engine.request import Request
from services.worker.engine.sampling_params import SamplingParams
from services.worker.engine.settings import EngineSettings
from services.worker.engine.types import (
    EngineLoad,
    EngineOutput,
    EngineRequest,
    Failure,
    FailureCode,
    FinishReason,
    KVLayout,
    Logprob,
    RequestRejected,
    StartListener,
    Usage,
)
from services.worker.engine.weights import load_model
from shared.models.errors import ModelError
from shared.models.spec import ModelSpec
from shared.models.tokenizer import Tokenizer

log = logging.getLogger(__name__)
GRAMMAR_WAIT_S = 0.05  # an engine with nothing else to run waits this long for a grammar to compile


@dataclass
class _Stream:
    request: Request
    detokenizer: IncrementalDetokenizer

    def usage(self) -> Usage:
        request = self.request
        return Usage(request.num_prompt_tokens, request.num_cached_tokens, request.num_output_tokens)


class LLMEngine:
    """One incremental detokenizer per request turns its tokens into text; stop strings are found
    there, in the text, and end the request in the engine at once."""

    def __init__(self, engine: Engine, tokenizer: Tokenizer) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self._streams: dict[str, _Stream] = {}
        # Handoffs (kv_handoffs.py): parked here for another engine; being received from one.
        self._parked: dict[str, _Stream] = {}
        self._importing: dict[str, _Stream] = {}
        compiler = GrammarCompiler(tokenizer, engine.vocab_size, tuple(sorted(engine.eos_token_ids)))
        self.compiling = GrammarQueue(compiler)  # constrained requests wait here for their grammar

    def add_request(self, request: EngineRequest) -> None:
        prompt = prompt_token_ids(self.tokenizer, request, self.engine.vocab_size)
        if request.constraint is not None:
            self.compiling.add(request, prompt)  # joins the engine in a later step, with its grammar
            return
        r = request
        self.add_prompt(r.request_id, prompt, r.sampling, r.tenant, r.weight, r.priority, handoff=r.handoff)

    def add_prompt(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        tenant: str = "default",
        weight: float = 1.0,
        priority: int = 0,
        grammar: LLMatcher | None = None,
        handoff: bool = False,
    ) -> Request:
        """Queue a prompt already in token ids; the engine's Request, which grows as it runs."""
        request = self._request(request_id, prompt_token_ids, sampling, tenant, weight, priority, handoff)
        self.engine.add_request(request, grammar)  # raises RequestRejected, with the scheduler's code
        self._streams[request_id] = _Stream(request, IncrementalDetokenizer(self.tokenizer, sampling.stop))
        return request

    def _request(self, request_id: str, prompt: list[int], sampling: SamplingParams, tenant: str, weight: float,
                 priority: int, handoff: bool = False) -> Request:  # fmt: skip
        salt = self.engine.settings.cache_salt(tenant)
        return Request(request_id, prompt, sampling, tenant, salt, weight, priority, handoff)

    def abort_request(self, request_id: str) -> EngineOutput | None:
        if self.compiling.remove(request_id):
            return EngineOutput(request_id, finish_reason=FinishReason.CANCELLED, usage=Usage(0, 0, 0))
        stream = self._streams.pop(request_id, None) or self._parked.pop(request_id, None) or self._importing.pop(request_id, None)
        if stream is None:
            return None
        self.engine.abort_request(request_id)
        return EngineOutput(request_id, finish_reason=FinishReason.CANCELLED, usage=stream.usage())

    def step(self) -> list[EngineOutput]:
        rejected = self._admit_compiled()
        if not self.engine.has_unfinished_requests():
            return rejected
        outputs = (self._process(update) for update in self.engine.step() if update.request_id in self._streams)
        return rejected + [o for o in outputs if o.text or o.finished or o.logprobs or o.handoff is not None]

    def _admit_compiled(self) -> list[EngineOutput]:
        """Requests whose grammar is ready join the engine; one whose grammar failed ends here."""
        idle = not self.engine.has_unfinished_requests()
        rejected: list[EngineOutput] = []
        for compiling, grammar in self.compiling.ready(wait_s=GRAMMAR_WAIT_S if idle else 0.0):
            r = compiling.request
            try:
                if isinstance(grammar, Exception):
                    raise RequestRejected(FailureCode.INVALID_REQUEST, f"the grammar does not compile: {grammar}")
                prompt = compiling.prompt_token_ids
                self.add_prompt(r.request_id, prompt, r.sampling, r.tenant, r.weight, r.priority, grammar)
            except RequestRejected as exc:
                rejected.append(EngineOutput(r.request_id, usage=Usage(0, 0, 0), failure=exc.failure))
        return rejected

    @property
    def start_listener(self) -> StartListener | None:
        return self.engine.start_listener

    @start_listener.setter
    def start_listener(self, listener: StartListener | None) -> None:
        self.engine.start_listener = listener

    @property
    def kv_listener(self) -> KVCacheListener | None:
        return self.engine.kv_cache_manager.block_pool.listener

    @kv_listener.setter
    def kv_listener(self, listener: KVCacheListener | None) -> None:
        self.engine.kv_cache_manager.block_pool.listener = listener

    def load(self) -> EngineLoad:
        return self.engine.load()

    def has_unfinished_requests(self) -> bool:
        return self.engine.has_unfinished_requests() or len(self.compiling) > 0

    def request_ids(self) -> list[str]:
        return [*self._streams, *self._parked, *self._importing, *self.compiling.ids()]

    def _process(self, update: RequestUpdate) -> EngineOutput:
        request_id = update.request_id
        stream = self._streams[request_id]
        if update.error is not None:
            del self._streams[request_id]
            return EngineOutput(request_id, usage=stream.usage(), failure=Failure(FailureCode.ENGINE_ERROR, update.error))
        detokenizer = stream.detokenizer
        text = "".join(detokenizer.push(token) for token in update.new_token_ids)
        logprobs = tuple(self._logprob(lp) for lp in update.logprobs)
        finish_reason = update.finish_reason
        if detokenizer.stopped:
            if finish_reason is None and not self.engine.finish_request(request_id, FinishReason.STOP):
                self.engine.handoffs.release(request_id)  # parked in this very step: it ends here instead
            finish_reason = FinishReason.STOP
        elif finish_reason is not None:
            text += detokenizer.flush()
        if finish_reason is None:
            if update.handoff is not None:
                self._parked[request_id] = self._streams.pop(request_id)
            return EngineOutput(request_id, text, logprobs=logprobs, handoff=update.handoff)
        del self._streams[request_id]
        return EngineOutput(request_id, text, finish_reason, usage=stream.usage(), logprobs=logprobs)

    # Handoffs: this engine's half of moving a request to or from another (kv_handoffs.py) ----------
    @property
    def kv_layout(self) -> KVLayout:
        return self.engine.handoffs.layout

    def read_kv_layer(self, request_id: str, layer: int, first_block: int) -> tuple[bytes, bytes]:
        """Any thread: K and V of a parked request's blocks from `first_block` on, in one layer."""
        return self.engine.handoffs.read_layer(request_id, layer, first_block)

    def release_handoff(self, request_id: str) -> None:
        """The parked request is another engine's now (or nobody's): free its blocks."""
        if self._parked.pop(request_id, None) is not None:
            self.engine.handoffs.release(request_id)

    def resume_handoff(self, request_id: str) -> bool:
        """Decode the parked request here after all; False if it is no longer parked (cancelled)."""
        stream = self._parked.pop(request_id, None)
        if stream is None:
            return False
        self._streams[request_id] = stream
        return self.engine.handoffs.resume(request_id)

    def reserve_import(self, request: EngineRequest, prompt_token_ids: list[int], output_token_ids: list[int]) -> int | None:
        """Blocks for a request prefilled elsewhere: how many leading ones this prefix cache holds
        already, or None if there is no room now; RequestRejected if it can never run here."""
        r = request
        received = self._request(r.request_id, list(prompt_token_ids), r.sampling, r.tenant, r.weight, r.priority)
        for token in output_token_ids:
            received.append_output_token(token)
        have = self.engine.handoffs.reserve(received)
        if have is not None:
            detokenizer = IncrementalDetokenizer(self.tokenizer, r.sampling.stop)
            for token in output_token_ids:
                detokenizer.push(token)  # its text went out from the engine that sampled it
            self._importing[r.request_id] = _Stream(received, detokenizer)
        return have

    def write_kv_layer(self, request_id: str, layer: int, k: bytes, v: bytes) -> None:
        """Any thread: one layer of a reserved request's blocks still to receive."""
        self.engine.handoffs.write_layer(request_id, layer, k, v)

    def commit_import(self, request_id: str, cached_tokens: int) -> None:
        stream = self._importing.pop(request_id)
        self.engine.commit_import(request_id, cached_tokens)
        self._streams[request_id] = stream

    def cancel_import(self, request_id: str) -> None:
        if self._importing.pop(request_id, None) is not None:
            self.engine.handoffs.cancel(request_id)

    def _logprob(self, lp: TokenLogprobs) -> Logprob:
        def text(token_id: int) -> str:
            return self.tokenizer.decode([token_id], skip_special_tokens=False)

        return Logprob(text(lp.token_id), lp.logprob, tuple((text(t), p) for t, p in lp.top))


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def load_engine_model(spec: ModelSpec, settings: EngineSettings, device: torch.device) -> tuple[LlamaModel, Tokenizer]:
    """The spec's model in the settings' dtype and quantization, and its tokenizer."""
    if settings.quantization != "none" and device.type != "cpu":
        raise ModelError(f"{settings.quantization} quantization runs on a CPU; {device} serves bfloat16")
    if device.type == "cpu" and settings.cpu_threads:
        torch.set_num_threads(settings.cpu_threads)
    dtype = None if settings.dtype == "auto" else getattr(torch, settings.dtype)
    model, tokenizer = load_model(spec, device, dtype)
    weights = next(model.parameters()).dtype
    if settings.quantization != "none":
        quantize_(model, settings.quantization)
    elif device.type == "cpu" and weights == torch.float32 and torch.backends.mkldnn.is_available():
        use_cpu_linear_(model, panels=settings.cpu_panel_products)  # packed float32 products
    elif device.type == "cpu" and settings.cpu_panel_products and cpu_panel_linear.available(weights):
        use_cpu_linear_(model)  # bfloat16 in panels; elsewhere the graphs' frozen linears pack it for oneDNN
    return model, tokenizer


def build_llm_engine(spec: ModelSpec, settings: EngineSettings = EngineSettings(), device: str = "auto") -> LLMEngine:
    """Load the spec's model onto the device and build the engine around it."""
    torch_device = resolve_device(device)
    model, tokenizer = load_engine_model(spec, settings, torch_device)
    eos = tuple(dict.fromkeys(tokenizer.eos_token_ids + model.config.eos_token_ids))
    engine = Engine(model, settings, spec.max_model_len, eos_token_ids=eos)
    log.info(
        "engine ready: model %s on %s (%s, quantization %s), %d KV blocks of %s, max_model_len %d",
        spec.name, torch_device, engine.runner.dtype, settings.quantization, engine.runner.num_blocks,
        engine.runner.kv_dtype,
        engine.max_model_len,
    )
    return LLMEngine(engine, tokenizer)
