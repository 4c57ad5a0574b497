"""A chat's structured-output and tool fields, as the client protocol carries them (OpenAI's shapes),
and what they become on the wire: one grammar for the worker's sampler, the tools for its prompt.

Pure; `request_grammar` raises InvalidGrammar for a schema the library cannot compile, which the
edge refuses as `invalid_schema` before anything reaches a worker.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Annotated, Any, Literal

import msgspec

from shared import wire
from shared.models.structured import InvalidGrammar, check_grammar
from shared.models.tool_calls import call_grammar

if TYPE_CHECKING:
    from services.edge.protocol import ChatFrame, ChatMessage

Name = Annotated[str, msgspec.Meta(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")]


class JsonSchemaFormat(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    name: Name
    schema: dict[str, Any] | None = None  # absent: any JSON object
    description: str | None = None
    strict: bool | None = None  # always strict here: decoding cannot leave the schema


class ResponseFormat(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """vLLM's extension: exactly one of these."""

    json: dict[str, Any] | None = None
    regex: Annotated[str, msgspec.Meta(min_length=1)] | None = None
    choice: Annotated[list[str], msgspec.Meta(min_length=1)] | None = None
    grammar: Annotated[str, msgspec.Meta(min_length=1)] | None = None  # Lark, as llguidance reads it


class FunctionSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    name: Name
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    type: Literal["function"]
    function: FunctionSpec


class FunctionName(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    name: Name


class NamedToolChoice(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class FunctionCall(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    name: str
    arguments: str  # JSON text, as OpenAI sends it back


class ToolCallFrame(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    id: str
    type: Literal["function"]
    function: FunctionCall


def request_grammar(frame: ChatFrame) -> wire.Grammar | None:
    """The one grammar the reply must match, or None; InvalidGrammar when it cannot be compiled or
    when the request asks for two at once."""
    grammars = [
        g for g in (_format_grammar(frame.response_format), _extension_grammar(frame.structured_outputs),
                    _tool_grammar(frame)) if g is not None
    ]  # fmt: skip
    if len(grammars) > 1:
        raise InvalidGrammar("ask for one of response_format, structured_outputs and a forced tool call, not several")
    if not grammars:
        return None
    check_grammar(grammars[0])
    return grammars[0]


def structured_fields(frame: ChatFrame) -> dict[str, Any]:
    """The wire.ChatRequest fields of a chat's structured output and tools; InvalidGrammar as above."""
    return {"grammar": request_grammar(frame), "tools": wire_tools(frame)}


def wire_tools(frame: ChatFrame) -> list[wire.Tool]:
    """The tools the prompt offers: none when the client said the model must not call any."""
    if frame.tool_choice == "none":
        return []
    return [
        wire.Tool(t.function.name, t.function.description or "", _schema_text(t.function.parameters))
        for t in frame.tools
    ]


def wire_messages(messages: Sequence[ChatMessage]) -> list[wire.Message]:
    return [
        wire.Message(
            m.role, m.content, [wire.ToolCall(c.id, c.function.name, c.function.arguments) for c in m.tool_calls],
            m.tool_call_id,
        )
        for m in messages
    ]


def parses_tool_calls(frame: ChatFrame) -> bool:
    """Whether the reply's text is read for tool calls."""
    return bool(frame.tools) and frame.tool_choice != "none"


def _format_grammar(response_format: ResponseFormat | None) -> wire.Grammar | None:
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return wire.Grammar("json_object")
    schema = response_format.json_schema
    if schema is None:
        raise InvalidGrammar("response_format of type json_schema needs `json_schema`")
    if schema.schema is None:
        return wire.Grammar("json_object")
    return wire.Grammar("json_schema", _schema_text(schema.schema))


def _extension_grammar(extension: StructuredOutputs | None) -> wire.Grammar | None:
    if extension is None:
        return None
    given = [(k, v) for k, v in (("json", extension.json), ("regex", extension.regex), ("choice", extension.choice),
                                 ("grammar", extension.grammar)) if v is not None]  # fmt: skip
    if len(given) != 1:
        raise InvalidGrammar("structured_outputs takes exactly one of json, regex, choice and grammar")
    kind, value = given[0]
    if kind == "json":
        return wire.Grammar("json_schema", _schema_text(value))
    if kind == "choice":
        return wire.Grammar("choice", json.dumps(value))
    return wire.Grammar("regex" if kind == "regex" else "lark", value)


def _tool_grammar(frame: ChatFrame) -> wire.Grammar | None:
    """`required` and a named function force a call: its arguments follow the function's parameters."""
    choice = frame.tool_choice
    if choice in ("none", "auto"):
        return None
    if not frame.tools:
        raise InvalidGrammar("tool_choice asks for a tool call but the request has no tools")
    tools = wire_tools(frame)
    if isinstance(choice, NamedToolChoice):
        tools = [t for t in tools if t.name == choice.function.name]
        if not tools:
            raise InvalidGrammar(f"tool_choice names {choice.function.name!r}, which is not among the tools")
        return wire.Grammar("lark", call_grammar(tools, parallel=False))
    return wire.Grammar("lark", call_grammar(tools, parallel=frame.parallel_tool_calls))


def _schema_text(schema: dict[str, Any] | None) -> str:
    return json.dumps(schema or {}, separators=(",", ":"))
