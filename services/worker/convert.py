"""Wire messages <-> engine types, in one place: the engine knows no Kafka, the wire no engine.

The engine's finish reasons and failure codes are words of the wire's vocabulary
(shared/codes.py); a unit test holds every one of them to it.
"""

from __future__ import annotations

from services.worker.engine.sampling_params import SamplingParams
from services.worker.engine.types import EngineOutput, EngineRequest, Message, Usage
from shared import wire
from shared.codes import ErrorCode, FinishReason


def engine_request(chat: wire.ChatRequest) -> EngineRequest:
    """The engine's request for a chat; ValueError if its sampling is out of the engine's range."""
    c = chat.controls
    sampling = SamplingParams(
        max_tokens=chat.max_tokens, temperature=chat.temperature, top_p=chat.top_p, seed=chat.seed,
        top_k=c.top_k, stop=tuple(c.stop), stop_token_ids=tuple(c.stop_token_ids), ignore_eos=c.ignore_eos,
        min_tokens=min(c.min_tokens, chat.max_tokens), frequency_penalty=c.frequency_penalty,
        presence_penalty=c.presence_penalty, repetition_penalty=c.repetition_penalty,
        logit_bias=tuple(c.logit_bias.items()),
    )  # fmt: skip
    messages = tuple(Message(m.role, m.content) for m in chat.messages)
    return EngineRequest(chat.request_id, chat.tenant, messages, sampling, chat.weight, chat.priority)


def wire_usage(usage: Usage | None) -> wire.Usage:
    if usage is None:
        return wire.Usage(0, 0, 0)
    return wire.Usage(usage.prompt_tokens, usage.cached_tokens, usage.completion_tokens)


def wire_events(output: EngineOutput, seq: int) -> list[wire.Event]:
    """One step's output as token-path events from `seq` on: its text as a token, then its ending."""
    events: list[wire.Event] = []
    if output.text:
        events.append(wire.Token(output.request_id, seq, output.text))
        seq += 1
    if output.failure is not None:
        events.append(wire.Error.of(output.request_id, ErrorCode(output.failure.code), output.failure.message, seq))
    elif output.finish_reason is not None:
        events.append(wire.Done(output.request_id, seq, FinishReason(output.finish_reason), wire_usage(output.usage)))
    return events
