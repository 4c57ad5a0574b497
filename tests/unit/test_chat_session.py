"""`drivetrain chat`'s session without a socket: typed lines as commands, and the conversation."""

from __future__ import annotations

import pytest

from shared.chat_session import (
    Blank,
    Conversation,
    Exit,
    Help,
    Reset,
    Say,
    SetSystem,
    Unknown,
    parse_line,
)


@pytest.mark.parametrize(
    ("line", "command"),
    [
        ("hello", Say("hello")),
        ("  two words \n", Say("two words")),
        ("", Blank()),
        ("   ", Blank()),
        ("/exit", Exit()),
        ("/quit", Exit()),
        ("/reset", Reset()),
        ("/help", Help()),
        ("/system Answer in French.", SetSystem("Answer in French.")),
        ("/system    spaced   out  ", SetSystem("spaced   out")),
        ("/system", SetSystem("")),
        ("/systemic", Unknown("/systemic")),
        ("/reset now", Unknown("/reset now")),
        ("/nope x", Unknown("/nope")),
        ("//etc/hosts is a file", Say("/etc/hosts is a file")),
        ("a /reset in the middle", Say("a /reset in the middle")),
    ],
)
def test_parse_line(line, command):
    assert parse_line(line) == command


def test_each_turn_sends_the_whole_conversation_with_the_system_prompt_first():
    chat = Conversation()
    assert chat.messages_for("hi") == [{"role": "user", "content": "hi"}]
    chat.record("hi", "hello there")
    chat.system = "Be brief."
    assert chat.messages_for("and?") == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello there"},
        {"role": "user", "content": "and?"},
    ]
    assert chat.turn_count == 1


def test_a_reply_with_no_text_leaves_no_turn_and_reset_keeps_the_system_prompt():
    chat = Conversation(system="S")
    chat.record("lost", "")  # failed, or stopped before its first token
    assert chat.turns == []
    chat.record("q", "a")
    chat.reset()
    assert chat.turns == [] and chat.messages_for("x") == [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "x"},
    ]
