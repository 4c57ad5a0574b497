"""The GenerationEngine over a model: chat messages in, text out, over the token-id Engine; plus
`build_llm_engine`, which loads a model spec's weights and builds it all."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import jinja2
import torch

from services.worker.engine.block_pool import KVCacheListener
from services.worker.engine.detokenizer import IncrementalDetokenizer
from services.worker.engine.engine import Engine, RequestUpdate
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
    RequestRejected,
    StartListener,
    Usage,
)
from services.worker.engine.weights import load_model
from shared.models.spec import ModelSpec
from shared.models.tokenizer import Tokenizer, template_messages

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

    def add_request(self, request: EngineRequest) -> None:
        try:
            prompt = self.tokenizer.apply_chat_template(template_messages(request.messages))
        except (jinja2.TemplateError, ValueError, KeyError, TypeError) as exc:
            raise RequestRejected(FailureCode.INVALID_REQUEST, f"the messages do not fit the chat template: {exc}") from exc
        self.add_prompt(request.request_id, prompt, request.sampling, request.tenant, request.weight, request.priority)

    def add_prompt(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        tenant: str = "default",
        weight: float = 1.0,
        priority: int = 0,
    ) -> Request:
        """Queue a prompt already in token ids; the engine's Request, which grows as it runs."""
        salt = self.engine.settings.cache_salt(tenant)
        request = Request(request_id, prompt_token_ids, sampling, tenant, salt, weight, priority)
        self.engine.add_request(request)  # raises RequestRejected, with the scheduler's code
        self._streams[request_id] = _Stream(request, IncrementalDetokenizer(self.tokenizer, sampling.stop))
        return request

    def abort_request(self, request_id: str) -> EngineOutput | None:
        stream = self._streams.pop(request_id, None)
        if stream is None:
            return None
        self.engine.abort_request(request_id)
        return EngineOutput(request_id, finish_reason=FinishReason.CANCELLED, usage=stream.usage())

    def step(self) -> list[EngineOutput]:
        outputs = (self._process(update) for update in self.engine.step() if update.request_id in self._streams)
        return [output for output in outputs if output.text or output.finished]

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
        return self.engine.has_unfinished_requests()

    def request_ids(self) -> list[str]:
        return list(self._streams)

    def _process(self, update: RequestUpdate) -> EngineOutput:
        request_id = update.request_id
        stream = self._streams[request_id]
        if update.error is not None:
            del self._streams[request_id]
            return EngineOutput(request_id, usage=stream.usage(), failure=Failure(FailureCode.ENGINE_ERROR, update.error))
        detokenizer = stream.detokenizer
        text = "".join(detokenizer.push(token) for token in update.new_token_ids)
        finish_reason = update.finish_reason
        if detokenizer.stopped:
            if finish_reason is None:
                self.engine.finish_request(request_id, FinishReason.STOP)
            finish_reason = FinishReason.STOP
        elif finish_reason is not None:
            text += detokenizer.flush()
        if finish_reason is None:
            return EngineOutput(request_id, text)
        del self._streams[request_id]
        return EngineOutput(request_id, text, finish_reason, usage=stream.usage())


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def build_llm_engine(spec: ModelSpec, settings: EngineSettings = EngineSettings(), device: str = "auto") -> LLMEngine:
    """Load the spec's model onto the device and build the engine around it."""
    torch_device = resolve_device(device)
    model, tokenizer = load_model(spec, torch_device)
    eos = tuple(dict.fromkeys(tokenizer.eos_token_ids + model.config.eos_token_ids))
    engine = Engine(model, settings, spec.max_model_len, eos_token_ids=eos)
    log.info(
        "engine ready: model %s on %s, %d KV blocks, max_model_len %d",
        spec.name, torch_device, engine.runner.num_blocks, engine.max_model_len,
    )
    return LLMEngine(engine, tokenizer)
