"""The OpenAI API's `priority` (as vLLM's) reaches the chat frame; one out of range is a 400 naming it."""

from __future__ import annotations

import json

import pytest

from services.edge.openai_schema import ApiError, parse_completion_request

BODY = {"model": "echo", "messages": [{"role": "user", "content": "hi"}]}


def parse(**fields: object):
    return parse_completion_request(json.dumps(BODY | fields).encode(), "echo", "c1")


def test_priority_becomes_the_chats_and_defaults_to_zero():
    assert parse(priority=-7).frame.priority == -7
    assert parse().frame.priority == 0


def test_a_priority_out_of_range_is_refused_naming_the_field():
    with pytest.raises(ApiError) as info:
        parse(priority=10**6)
    assert info.value.status == 400 and info.value.param == "priority"
