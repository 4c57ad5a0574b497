"""The pure part of `drivetrain chat`'s interactive session: what a typed line means, and the
conversation sent each turn (the whole of it: the edge keeps no history)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

HELP = """/reset         forget the conversation (the system prompt stays)
/system TEXT   set the system prompt (/system alone clears it)
/exit          leave (Ctrl-D too); Ctrl-C stops the reply being written"""


@dataclass(frozen=True)
class Say:
    text: str


@dataclass(frozen=True)
class Reset:
    pass


@dataclass(frozen=True)
class SetSystem:
    text: str  # "" clears it


@dataclass(frozen=True)
class Exit:
    pass


@dataclass(frozen=True)
class Help:
    pass


@dataclass(frozen=True)
class Unknown:
    name: str


@dataclass(frozen=True)
class Blank:
    pass


Command = Say | Reset | SetSystem | Exit | Help | Unknown | Blank
COMMANDS = {"/reset": Reset, "/exit": Exit, "/quit": Exit, "/help": Help}


def parse_line(line: str) -> Command:
    """A typed line as a command. Text is sent as typed; a line starting with "//" sends one "/"."""
    text = line.strip()
    if not text:
        return Blank()
    if text.startswith("//"):
        return Say(text[1:])
    if not text.startswith("/"):
        return Say(text)
    name, _, rest = text.partition(" ")
    if name == "/system":
        return SetSystem(rest.strip())
    if name in COMMANDS:
        return COMMANDS[name]() if not rest.strip() else Unknown(text)
    return Unknown(name)


@dataclass
class Conversation:
    """The turns so far and the system prompt; `messages_for` is what one turn sends."""

    system: str = ""
    turns: list[dict[str, str]] = field(default_factory=list)

    def messages_for(self, text: str) -> list[dict[str, Any]]:
        head = [{"role": "system", "content": self.system}] if self.system else []
        return [*head, *self.turns, {"role": "user", "content": text}]

    def record(self, text: str, reply: str) -> None:
        """Keeps a finished turn: a stopped reply too (it was read), an empty or failed one not."""
        if reply:
            self.turns += [{"role": "user", "content": text}, {"role": "assistant", "content": reply}]

    def reset(self) -> None:
        self.turns.clear()

    @property
    def turn_count(self) -> int:
        return len(self.turns) // 2
