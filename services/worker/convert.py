"""Wire messages <-> engine types, in one place: the engine knows no Kafka, the wire no engine.

The engine's finish reasons and failure codes are words of the wire's vocabulary
(shared/codes.py); a unit test holds every one of them to it.
"""

from __future__ import annotations

from services.worker.engine.sampling_params import SamplingParams
from services.worker.engine.types import (
    Constraint,
    EngineOutput,
    EngineRequest,
    Message,
    Tool,
    ToolCall,
    Usage,
)
from shared import wire
from shared.codes import ErrorCode, FinishReason
from shared.models.raw_prompt import RawPrompt


def engine_request(chat: wire.ChatRequest) -> EngineRequest:
    """The engine's request for a chat; ValueError if its sampling is out of the engine's range."""
    c = chat.controls
    sampling = SamplingParams(
        max_tokens=chat.max_tokens, temperature=chat.temperature, top_p=chat.top_p, seed=chat.seed,
        top_k=c.top_k, stop=tuple(c.stop), stop_token_ids=tuple(c.stop_token_ids), ignore_eos=c.ignore_eos,
        min_tokens=min(c.min_tokens, chat.max_tokens), frequency_penalty=c.frequency_penalty,
        presence_penalty=c.presence_penalty, repetition_penalty=c.repetition_penalty,
        logit_bias=tuple(c.logit_bias.items()), logprobs=c.logprobs,
    )  # fmt: skip
    messages = tuple(
        Message(m.role, m.content, tuple(ToolCall(c.id, c.name, c.arguments) for c in m.tool_calls), m.tool_call_id)
        for m in chat.messages
    )
    structured = {
        "constraint": Constraint(chat.grammar.kind, chat.grammar.spec) if chat.grammar is not None else None,
        "tools": tuple(Tool(t.name, t.description, t.parameters) for t in chat.tools),
    }
    prompt = RawPrompt.of(chat.prompt) if chat.prompt is not None else None
    return EngineRequest(chat.request_id, chat.tenant, messages, sampling, chat.weight, chat.priority, prompt, **structured)


def wire_usage(usage: Usage | None) -> wire.Usage:
    if usage is None:
        return wire.Usage(0, 0, 0)
    return wire.Usage(usage.prompt_tokens, usage.cached_tokens, usage.completion_tokens)


def wire_events(output: EngineOutput, seq: int) -> list[wire.Event]:
    """One step's output as token-path events from `seq` on: its text as a token, then its ending."""
    events: list[wire.Event] = []
    if output.logprobs:
        logprobs = [wire.Logprob(lp.token, lp.logprob, list(lp.top)) for lp in output.logprobs]
        events.append(wire.LoggedToken(output.request_id, seq, output.text, logprobs))
        seq += 1
    elif output.text:
        events.append(wire.Token(output.request_id, seq, output.text))
        seq += 1
    if output.failure is not None:
        events.append(wire.Error.of(output.request_id, ErrorCode(output.failure.code), output.failure.message, seq))
    elif output.finish_reason is not None:
        events.append(wire.Done(output.request_id, seq, FinishReason(output.finish_reason), wire_usage(output.usage)))
    return events
