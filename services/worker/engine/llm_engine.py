"""The GenerationEngine the worker service drives: chat messages in, text out, over the token-id
Engine; plus `build_llm_engine`, which loads a model and builds it all from a WorkerConfig."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import jinja2
import torch

from services.worker.config import WorkerConfig
from services.worker.engine.detokenizer import IncrementalDetokenizer
from services.worker.engine.engine import (
    Engine,
    EngineConfig,
    RequestUpdate,
    StartListener,
)
from services.worker.engine.request import Request
from services.worker.engine.sampling_params import SamplingParams
from services.worker.engine.tokenizer import Tokenizer
from services.worker.engine.weights import load_model
from services.worker.generation import (
    GenerationRequest,
    RequestRejected,
    StepOutput,
    Usage,
)

log = logging.getLogger(__name__)


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

    def add_request(self, request: GenerationRequest) -> None:
        try:
            prompt = self.tokenizer.apply_chat_template(request.messages)
        except (jinja2.TemplateError, ValueError, KeyError, TypeError) as exc:
            raise RequestRejected("invalid_request", f"the messages do not fit the chat template: {exc}") from exc
        self.add_prompt(request.request_id, prompt, request.sampling, request.tenant)

    def add_prompt(
        self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams, tenant: str = "default"
    ) -> Request:
        """Queue a prompt already in token ids; the engine's Request, which grows as it runs."""
        try:
            sampling.validate()
        except ValueError as exc:
            raise RequestRejected("invalid_request", str(exc)) from exc
        if not prompt_token_ids:
            raise RequestRejected("invalid_request", "the prompt is empty")
        if request_id in self._streams:
            raise RequestRejected("invalid_request", f"request id {request_id} is already in use")
        request = Request(request_id, prompt_token_ids, sampling, tenant)
        reason = self.engine.check_request(request)
        if reason is not None:
            # Sampling and emptiness were checked above: what is left is size.
            raise RequestRejected("prompt_too_long", reason)
        self.engine.add_request(request)
        self._streams[request_id] = _Stream(request, IncrementalDetokenizer(self.tokenizer, sampling.stop))
        return request

    def abort_request(self, request_id: str) -> StepOutput | None:
        stream = self._streams.pop(request_id, None)
        if stream is None:
            return None
        self.engine.abort_request(request_id)
        return StepOutput(request_id, finish_reason="cancelled", usage=stream.usage())

    def step(self) -> list[StepOutput]:
        outputs = (self._process(update) for update in self.engine.step() if update.request_id in self._streams)
        return [output for output in outputs if output.text or output.finished]

    @property
    def start_listener(self) -> StartListener | None:
        return self.engine.start_listener

    @start_listener.setter
    def start_listener(self, listener: StartListener | None) -> None:
        self.engine.start_listener = listener

    def load(self) -> dict[str, int | float]:
        return self.engine.load()

    def has_unfinished_requests(self) -> bool:
        return self.engine.has_unfinished_requests()

    def request_ids(self) -> list[str]:
        return list(self._streams)

    def _process(self, update: RequestUpdate) -> StepOutput:
        request_id = update.request_id
        stream = self._streams[request_id]
        if update.error is not None:
            del self._streams[request_id]
            return StepOutput(request_id, usage=stream.usage(), error_code="engine_error", error_message=update.error)
        detokenizer = stream.detokenizer
        text = "".join(detokenizer.push(token) for token in update.new_token_ids)
        finish_reason = update.finish_reason
        if detokenizer.stopped:
            if finish_reason is None:
                self.engine.finish_request(request_id, "stop")
            finish_reason = "stop"
        elif finish_reason is not None:
            text += detokenizer.flush()
        if finish_reason is None:
            return StepOutput(request_id, text)
        del self._streams[request_id]
        return StepOutput(request_id, text, finish_reason, usage=stream.usage())


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def engine_config(config: WorkerConfig) -> EngineConfig:
    return EngineConfig(
        max_model_len=config.max_model_len,
        max_num_seqs=config.max_num_seqs,
        max_batch_tokens=config.max_batch_tokens,
        num_kv_blocks=config.num_kv_blocks,
        kv_memory_fraction=config.kv_memory_fraction,
        enable_prefix_caching=config.enable_prefix_caching,
        enable_chunked_prefill=config.enable_chunked_prefill,
        cuda_graphs=config.cuda_graphs,
    )


def build_llm_engine(config: WorkerConfig) -> LLMEngine:
    """Load the model named by config.model onto config.device and build the engine around it."""
    device = resolve_device(config.device)
    model, tokenizer = load_model(config.model, device)
    eos = tuple(dict.fromkeys(tokenizer.eos_token_ids + model.config.eos_token_ids))
    engine = Engine(model, engine_config(config), eos_token_ids=eos)
    log.info(
        "engine ready: model %s on %s, %d KV blocks, max_model_len %d",
        config.model, device, engine.runner.num_blocks, engine.max_model_len,
    )
    return LLMEngine(engine, tokenizer)
