"""Tool calls: the Hermes prompt, the forced-call grammar, and reading calls out of a reply (whole or streamed)."""

from __future__ import annotations

import json

import llguidance

from services.worker.engine.types import Message, ToolCall
from shared import wire
from shared.models.tool_call_parser import (
    ArgumentsDelta,
    CallStart,
    ContentDelta,
    ToolCallStream,
    collect,
    parse_reply,
)
from shared.models.tool_calls import call_grammar, call_text, hermes_messages

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "q": {"a": [1, 2]}}}\n</tool_call>'
WEATHER = wire.Tool("get_weather", "Weather now", '{"type":"object","properties":{"city":{"type":"string"}}}')


def test_a_whole_reply_with_content_and_two_calls():
    reply = parse_reply("Let me look.\n" + CALL + "\n" + call_text("time", '{"tz": "UTC"}'))
    assert reply.content == "Let me look."
    assert [(c.name, json.loads(c.arguments)) for c in reply.calls] == [
        ("get_weather", {"city": "Paris", "q": {"a": [1, 2]}}),
        ("time", {"tz": "UTC"}),
    ]
    assert all(c.id.startswith("call_") for c in reply.calls) and reply.calls[0].id != reply.calls[1].id


def test_plain_text_and_broken_calls_stay_content():
    assert parse_reply("no calls < here").content == "no calls < here"
    broken = "<tool_call>\n{not json}\n</tool_call>"
    assert parse_reply(broken).content == broken and not parse_reply(broken).calls
    cut = '<tool_call>\n{"name": "f", "arguments": {"x": '  # stopped mid-arguments
    assert parse_reply(cut).content == cut and not parse_reply(cut).calls


def test_an_unclosed_last_call_still_counts():
    reply = parse_reply(CALL.removesuffix("\n</tool_call>"))
    assert reply.calls[0].name == "get_weather" and json.loads(reply.calls[0].arguments)["city"] == "Paris"


def test_streamed_one_character_at_a_time_arguments_come_as_deltas():
    stream = ToolCallStream()
    deltas = [d for ch in "Hi " + CALL for d in stream.feed(ch)] + stream.finish()
    assert deltas[0] == ContentDelta("H") and isinstance(deltas[3], CallStart)
    arguments = [d for d in deltas if isinstance(d, ArgumentsDelta)]
    assert len(arguments) > 3  # it streams, not in one piece at the end
    whole = collect(deltas)
    assert whole.content == "Hi" and json.loads(whole.calls[0].arguments) == {"city": "Paris", "q": {"a": [1, 2]}}
    assert not any(isinstance(d, ContentDelta) and "<" in d.text for d in deltas)  # the tag never leaks as text


def test_hermes_prompt_lists_tools_and_replays_calls_and_results():
    turns = [
        Message("system", "Be brief."),
        Message("user", "Weather in Paris?"),
        Message("assistant", "", (ToolCall("call_1", "get_weather", '{"city": "Paris"}'),)),
        Message("tool", '{"temp": 21}', tool_call_id="call_1"),
    ]
    messages = hermes_messages(turns, [WEATHER])
    assert messages[0]["role"] == "system" and messages[0]["content"].startswith("Be brief.")
    assert "<tools>" in messages[0]["content"] and '"name": "get_weather"' in messages[0]["content"]
    assert messages[2]["content"] == call_text("get_weather", '{"city": "Paris"}')
    assert messages[3] == {"role": "user", "content": '<tool_response>\n{"temp": 21}\n</tool_response>'}


def test_forced_call_grammar_accepts_a_call_and_refuses_another_name():
    grammar = llguidance.LLMatcher.grammar_from_lark(call_grammar([WEATHER], parallel=False))
    assert llguidance.LLMatcher.validate_grammar(grammar) == ""
    tokenizer = llguidance.LLTokenizer(_tokenizer_json(), n_vocab=49152, eos_token=[2])
    ok = llguidance.LLMatcher(tokenizer, grammar)
    good = call_text("get_weather", '{"city": "Paris"}')
    assert ok.consume_tokens(tokenizer.tokenize_str(good)) and ok.is_accepting()
    wrong = llguidance.LLMatcher(tokenizer, grammar)
    ids = tokenizer.tokenize_str(call_text("other", "{}"))
    assert wrong.try_consume_tokens(ids) < len(ids)


def _tokenizer_json() -> str:
    from shared.models.spec import resolve_model

    return (resolve_model("tiny").tokenizer_folder / "tokenizer.json").read_text()
