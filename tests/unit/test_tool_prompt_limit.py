"""The edge's prompt-length check counts the tool listing: the same prompt the worker renders, so a chat
its tools push over the context is refused at the edge (prompt_too_long), not on the worker."""

from __future__ import annotations

import json

import pytest

from services.edge.protocol import parse_client_frame
from services.edge.structured_request import wire_tools
from services.worker.engine.prompt_ids import prompt_token_ids
from services.worker.engine.sampling_params import SamplingParams
from services.worker.engine.types import EngineRequest, Message, Tool, ToolCall
from shared.models.echo import count_prompt_pieces
from shared.models.prompt_length import PromptLimit, prompt_limit, prompt_tokens
from shared.models.spec import resolve_model
from shared.models.tokenizer import Tokenizer

LONG_TOOL = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "Looks things up. " * 200,
        "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
    },
}


def chat_frame(words: int, tools: list | None = None, tool_choice: str = "auto"):
    frame = {"type": "chat", "id": "c1", "messages": [{"role": "user", "content": "w " * words}]}
    if tools is not None:
        frame |= {"tools": tools, "tool_choice": tool_choice}
    return parse_client_frame(json.dumps(frame))


def test_echo_counts_the_listing_the_hermes_prompt_carries():
    limit = prompt_limit(resolve_model("echo"))
    plain = chat_frame(limit.context - 100)
    assert limit.excess(plain.prompt_input(), wire_tools(plain)) is None  # fits without tools
    tooled = chat_frame(limit.context - 100, [LONG_TOOL])
    length, reason = limit.measure(tooled.prompt_input(), wire_tools(tooled))
    assert length > limit.context + 300 and reason is not None and "context" in reason
    unused = chat_frame(limit.context - 100, [LONG_TOOL], tool_choice="none")  # `none` leaves them out
    assert limit.excess(unused.prompt_input(), wire_tools(unused)) is None


def test_the_echo_worker_counts_as_the_edge_does():
    frame = chat_frame(10, [LONG_TOOL])
    tools = [Tool(t.name, t.description, t.parameters) for t in wire_tools(frame)]
    assert count_prompt_pieces([Message("user", "w " * 10)], tools) == count_prompt_pieces(
        frame.prompt_input(), wire_tools(frame)
    )


@pytest.fixture(scope="module")
def smollm2():
    spec = resolve_model("smollm2")
    return spec, Tokenizer.from_folder(spec.tokenizer_folder)


def test_a_real_model_counts_the_ids_its_worker_computes_tools_and_calls_included(smollm2):
    spec, tokenizer = smollm2
    count = prompt_tokens(spec)
    frame = parse_client_frame(json.dumps({
        "type": "chat", "id": "c1", "tools": [LONG_TOOL],
        "messages": [
            {"role": "user", "content": "Look up cats."},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "lookup", "arguments": '{"q": "cats"}'}}]},
            {"role": "tool", "content": "Cats purr.", "tool_call_id": "call_1"},
        ],
    }))  # fmt: skip
    request = EngineRequest(
        "r", "t",
        (Message("user", "Look up cats."), Message("assistant", "", (ToolCall("call_1", "lookup", '{"q": "cats"}'),)),
         Message("tool", "Cats purr.", tool_call_id="call_1")),
        SamplingParams(max_tokens=4), tools=tuple(Tool(t.name, t.description, t.parameters) for t in wire_tools(frame)),
    )  # fmt: skip
    worker_ids = prompt_token_ids(tokenizer, request, tokenizer.vocab_size)
    assert count(frame.prompt_input(), wire_tools(frame)) == worker_ids
    assert len(worker_ids) > len(count(frame.prompt_input())) + 500  # the listing is most of it


def test_a_prompt_within_the_context_alone_is_refused_with_its_tools(smollm2):
    spec, _ = smollm2
    full = prompt_limit(spec)
    plain, tooled = chat_frame(50), chat_frame(50, [LONG_TOOL])
    context = full.count(plain.prompt_input()) + 100  # a model whose context holds the messages with room
    limit = PromptLimit(full.count, context)
    assert limit.excess(plain.prompt_input(), wire_tools(plain)) is None
    length, reason = limit.measure(tooled.prompt_input(), wire_tools(tooled))
    assert length > context and reason == f"prompt is {length} tokens; the model's context holds {context}"
