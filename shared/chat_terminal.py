"""`drivetrain chat` in a terminal: one question, or with no text an interactive session.

The session reads lines on the main thread (`input()`, with readline's editing on a terminal),
so Ctrl-C arrives there: at the prompt it drops the line, during a reply it sends a `cancel`
frame and the session goes on. The socket lives on an event loop in a second thread. Each turn
sends the whole conversation (shared/chat_session.py). `--json` prints every frame received,
one JSON object a line, and nothing else on stdout.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, TextIO

from websockets.exceptions import InvalidStatus, WebSocketException

from shared.chat_client import ChatSocket
from shared.chat_session import (
    HELP,
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

REPLY_TIMEOUT_S = 300.0  # no frame for this long: the reply is given up
CANCEL_TIMEOUT_S = 5.0
PROMPT = "you> "


@dataclass
class Turn:
    text: str
    final: dict[str, Any]  # the `done` or `error` frame, or {"type": "closed"}

    @property
    def done(self) -> bool:
        return self.final["type"] == "done"


def figures(final: dict[str, Any], sent_at: float, first_at: float | None, done_at: float) -> str:
    """The line under a reply: finish reason, usage, time to first token and tokens/s."""
    usage = final["usage"]
    parts = [
        f"{final['finish_reason']}: {usage['prompt_tokens']} prompt tokens ({usage['cached_tokens']} cached)",
        f"{usage['completion_tokens']} completion tokens",
    ]
    if first_at is not None:
        parts.append(f"{(first_at - sent_at) * 1000:.0f} ms to first token")
        if usage["completion_tokens"] > 1 and done_at > first_at:
            parts.append(f"{(usage['completion_tokens'] - 1) / (done_at - first_at):.1f} tokens/s")
    return f"[{', '.join(parts)}]"


class TerminalChat:
    def __init__(
        self,
        url: str,
        api_key: str,
        params: dict[str, Any],
        json_frames: bool,
        out: TextIO = sys.stdout,
        err: TextIO = sys.stderr,
    ) -> None:
        self.url = url
        self.api_key = api_key
        self.params = params
        self.json_frames = json_frames
        self.out = out
        self.err = err
        self.sock: ChatSocket | None = None
        self.turns = 0
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="chat-socket", daemon=True)

    # The socket's thread -------------------------------------------------------------------
    def call(self, coro, timeout: float | None = None):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def _connect(self) -> None:
        if self.sock is None or self.sock.close_code is not None:
            self.sock = await ChatSocket.open(self.url, self.api_key)

    async def _turn(self, chat_id: str, messages: list[dict[str, Any]]) -> Turn:
        await self._connect()
        assert self.sock is not None
        sent_at, first_at, text = time.perf_counter(), None, []
        await self.sock.send({"type": "chat", "id": chat_id, "messages": messages, **self.params})
        while True:
            frame = await self.sock.next_frame(chat_id, timeout=REPLY_TIMEOUT_S)
            if self.json_frames and frame["type"] != "closed":
                print(json.dumps(frame), file=self.out, flush=True)
            if frame["type"] == "token":
                first_at = first_at or time.perf_counter()
                text.append(frame["text"])
                if not self.json_frames:
                    print(frame["text"], end="", file=self.out, flush=True)
            elif frame["type"] in ("done", "error", "closed"):
                if not self.json_frames:
                    self._say_end(frame, sent_at, first_at)
                return Turn("".join(text), frame)

    def _say_end(self, frame: dict[str, Any], sent_at: float, first_at: float | None) -> None:
        if frame["type"] == "done":
            print(f"\n{figures(frame, sent_at, first_at, time.perf_counter())}", file=self.out, flush=True)
        elif frame["type"] == "error":
            print(f"\nerror {frame['code']}: {frame['message']}", file=self.err, flush=True)
        else:
            code = self.sock.close_code if self.sock else None
            print(f"\nconnection closed ({code}); the next message reconnects", file=self.err, flush=True)

    async def _cancel(self, chat_id: str) -> None:
        if self.sock is not None:
            with contextlib.suppress(WebSocketException):  # gone already: the reply ends as closed
                await self.sock.send({"type": "cancel", "id": chat_id})

    async def _close(self) -> None:
        sock, self.sock = self.sock, None
        if sock is not None:
            await sock.close()

    # The main thread -------------------------------------------------------------------------
    def ask(self, messages: list[dict[str, Any]]) -> Turn:
        """One reply; Ctrl-C while it streams cancels it (the edge answers `done: cancelled`)."""
        self.turns += 1
        chat_id = f"t{self.turns}"
        reply = asyncio.run_coroutine_threadsafe(self._turn(chat_id, messages), self.loop)
        cancelled = False
        while True:
            try:
                return reply.result()
            except (OSError, TimeoutError, WebSocketException) as exc:  # no socket, or no frame in time
                self.note(f"\nno reply: {exc!r}; the next message reconnects")
                self.call(self._close(), CANCEL_TIMEOUT_S)
                return Turn("", {"type": "closed"})
            except KeyboardInterrupt:
                if cancelled:  # a second Ctrl-C: stop waiting for the edge's answer
                    reply.cancel()
                    return Turn("", {"type": "closed"})
                cancelled = True
                self.call(self._cancel(chat_id), CANCEL_TIMEOUT_S)

    def start(self) -> None:
        self.thread.start()
        self.call(self._connect())

    def stop(self) -> None:
        try:
            self.call(self._close(), CANCEL_TIMEOUT_S)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(CANCEL_TIMEOUT_S)

    def note(self, text: str) -> None:
        print(text, file=self.err, flush=True)

    def session(self, conversation: Conversation, interactive: bool) -> int:
        if interactive and not self.json_frames:
            self.note(f"Connected to {self.url}. /help lists the commands; Ctrl-D leaves.")
        prompt = PROMPT if interactive and not self.json_frames else ""
        while True:
            try:
                line = input(prompt)
            except EOFError:
                return 0
            except KeyboardInterrupt:  # at the prompt: the line typed so far is dropped
                print(file=self.err)
                continue
            command = parse_line(line)
            if isinstance(command, Say):
                turn = self.ask(conversation.messages_for(command.text))
                if turn.done:
                    conversation.record(command.text, turn.text)
            elif isinstance(command, Exit):
                return 0
            elif isinstance(command, Reset):
                conversation.reset()
                self.note("history cleared")
            elif isinstance(command, SetSystem):
                conversation.system = command.text
                self.note(f"system prompt set: {command.text}" if command.text else "system prompt cleared")
            elif isinstance(command, Help):
                self.note(HELP)
            elif isinstance(command, Unknown):
                self.note(f"unknown command {command.name}; /help lists them (// sends a leading /)")
            else:
                assert isinstance(command, Blank)


def run(
    url: str, api_key: str, text: str | None, params: dict[str, Any], system: str = "", json_frames: bool = False
) -> int:
    """`drivetrain chat`: with text, one reply (exit status 0 on `done`); without, a session."""
    chat = TerminalChat(url, api_key, params, json_frames)
    try:
        chat.start()
    except InvalidStatus as exc:
        chat.stop()
        print(f"refused: HTTP {exc.response.status_code}", file=sys.stderr)
        return 1
    except (OSError, TimeoutError) as exc:
        chat.stop()
        print(f"cannot reach {url}: {exc!r}", file=sys.stderr)
        return 1
    try:
        conversation = Conversation(system=system)
        if text is not None:
            return 0 if chat.ask(conversation.messages_for(text)).done else 1
        if sys.stdin.isatty():
            import readline  # noqa: F401  (line editing and history for input())
        return chat.session(conversation, interactive=sys.stdin.isatty())
    finally:
        chat.stop()
