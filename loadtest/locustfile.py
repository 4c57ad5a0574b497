"""Locust load test of the chat WebSocket: many users, one socket each, streaming chats.

Every user holds one socket to an edge (reconnecting when it drops) and sends one chat
at a time. Samples reported to Locust, all of request type "WS":

    connect   the WebSocket handshake; a refusal (HTTP 401 …) is a failure
    accepted  chat sent -> its `accepted` frame
    ttft      chat sent -> first token
    itl       one sample per gap between consecutive tokens
    stream    chat sent -> `done`; its "content size" is the number of tokens.
              A chat that does not end as the protocol promises is a failure here:
              an error frame, a gap or repeat in seq, a reply that is not the echo
              of the prompt, a frame for another chat, a timeout, a dropped socket.

With the echo model the reply is the prompt's first `max_tokens` word pieces, so the
load test checks every reply; `--no-echo-check` keeps only the protocol checks, for
a real model. Each prompt is unique to its user and chat, so cross-talk fails too.

    locust -f loadtest/locustfile.py --headless -u 50 -r 10 -t 60s \\
        --host ws://127.0.0.1:8080/v1/chat --prompt-words 16-64 --max-tokens 32

`--host` takes several edge URLs separated by commas; users are spread over them.
Settings come from these flags or the DRIVETRAIN_LOAD_* environment variables.
"""

from __future__ import annotations

import itertools
import json
import random
import time
from dataclasses import dataclass
from urllib.parse import quote

import gevent
import websocket
from locust import User, events, task
from locust.stats import CSV_STATS_INTERVAL_SEC

REQUEST_TYPE = "WS"
DEFAULT_URL = "ws://127.0.0.1:8080/v1/chat"
CONNECT_TIMEOUT_S = 10.0
CONNECT_RETRY_S = 1.0  # after a failed handshake, like a client that backs off instead of hammering


@events.init_command_line_parser.add_listener
def add_arguments(parser) -> None:
    group = parser.add_argument_group("Drivetrain chat load")
    group.add_argument("--api-keys", env_var="DRIVETRAIN_LOAD_API_KEYS", default="dev-key",
                       help="tenant API keys, comma-separated; users take them in turn")
    group.add_argument("--prompt-words", env_var="DRIVETRAIN_LOAD_PROMPT_WORDS", default="48",
                       help="words per prompt: N, or MIN-MAX drawn uniformly per chat")
    group.add_argument("--max-tokens", env_var="DRIVETRAIN_LOAD_MAX_TOKENS", default="32",
                       help="max_tokens per chat: N or MIN-MAX (the echo model replies with "
                            "min(prompt words, max_tokens) pieces)")
    group.add_argument("--chat-timeout", type=float, env_var="DRIVETRAIN_LOAD_CHAT_TIMEOUT", default=60.0,
                       help="seconds a chat may take from send to done before it fails")
    group.add_argument("--think-time", type=float, env_var="DRIVETRAIN_LOAD_THINK_TIME", default=1.0,
                       help="mean seconds a user waits between chats (exponential; 0: none)")
    group.add_argument("--key-in-query", action="store_true", env_var="DRIVETRAIN_LOAD_KEY_IN_QUERY",
                       help="present the API key as ?api_key= instead of an Authorization header")
    group.add_argument("--no-echo-check", action="store_true", env_var="DRIVETRAIN_LOAD_NO_ECHO_CHECK",
                       help="the model is not echo: check the protocol, not the reply's text")


@events.init.add_listener
def on_init(environment, **_) -> None:
    options = environment.parsed_options
    if options is None:
        return
    LoadSettings.from_options(options)  # bad settings stop Locust now, not every user later
    if getattr(options, "csv_prefix", None):
        # Locust rewrites its CSV files once a second; one more turn after the run makes
        # them hold the final figures, the same as the printed summary and HTML report.
        environment.events.quit.add_listener(lambda **_: gevent.sleep(CSV_STATS_INTERVAL_SEC + 0.2))


class ChatFailure(Exception):
    """A chat that did not end as the protocol promises; `reconnect` when the socket is suspect."""

    def __init__(self, message: str, reconnect: bool = False) -> None:
        super().__init__(message)
        self.reconnect = reconnect


def parse_range(text: str) -> tuple[int, int]:
    """"32" -> (32, 32); "16-64" -> (16, 64)."""
    low, _, high = str(text).partition("-")
    bounds = (int(low), int(high or low))
    if not 1 <= bounds[0] <= bounds[1]:
        raise ValueError(f"{text!r} is not N or MIN-MAX with 1 <= MIN <= MAX")
    return bounds


@dataclass(frozen=True)
class LoadSettings:
    api_keys: tuple[str, ...]
    prompt_words: tuple[int, int]
    max_tokens: tuple[int, int]
    chat_timeout_s: float
    think_time_s: float
    key_in_query: bool
    echo_check: bool

    @classmethod
    def from_options(cls, options) -> LoadSettings:
        keys = tuple(k.strip() for k in options.api_keys.split(",") if k.strip())
        if not keys:
            raise ValueError("--api-keys names no key")
        return cls(keys, parse_range(options.prompt_words), parse_range(options.max_tokens),
                   options.chat_timeout, options.think_time, options.key_in_query, not options.no_echo_check)


@dataclass(frozen=True)
class Expected:
    """What the echo model must answer: the prompt's first max_tokens pieces."""

    text: str
    finish_reason: str


def echo_expectation(words: list[str], max_tokens: int) -> Expected:
    pieces = [w + " " for w in words[:-1]] + words[-1:]
    kept = pieces[:max_tokens]
    return Expected("".join(kept), "stop" if len(pieces) <= max_tokens else "length")


class StreamCheck:
    """Follows one chat's frames, checks each against the protocol, and yields its samples."""

    def __init__(self, chat_id: str, sent_at: float, expected: Expected | None) -> None:
        self.chat_id = chat_id
        self.sent_at = sent_at
        self.expected = expected
        self.accepted = False
        self.pieces: list[str] = []
        self.last_token_at = sent_at
        self.done = False
        self.done_at = sent_at

    def feed(self, frame: dict, at: float) -> list[tuple[str, float]]:
        """One frame in, the (name, milliseconds) samples it completes out; raises ChatFailure."""
        kind, frame_id = frame.get("type"), frame.get("id")
        if kind == "error":
            raise ChatFailure(f"error frame {frame.get('code')}: {frame.get('message')} "
                              f"(retryable={frame.get('retryable')})", reconnect=frame_id != self.chat_id)
        if frame_id != self.chat_id:
            raise ChatFailure(f"{kind} frame for another chat on this socket (cross-talk)", reconnect=True)
        if kind == "accepted":
            if self.accepted or self.pieces:
                raise ChatFailure("accepted frame out of place", reconnect=True)
            self.accepted = True
            return [("accepted", (at - self.sent_at) * 1000)]
        if not self.accepted:
            raise ChatFailure(f"{kind} frame before accepted", reconnect=True)
        if kind == "token":
            return self._token(frame, at)
        if kind == "done":
            self.done_at = at
            self._finish(frame)
            return []
        raise ChatFailure(f"unknown frame type {kind!r}", reconnect=True)

    def _token(self, frame: dict, at: float) -> list[tuple[str, float]]:
        seq = frame.get("seq")
        if seq != len(self.pieces):
            if isinstance(seq, int) and seq < len(self.pieces):
                raise ChatFailure("repeated seq: a token came twice", reconnect=True)
            raise ChatFailure("gap in seq: a token went missing", reconnect=True)
        self.pieces.append(frame.get("text", ""))
        name = "ttft" if seq == 0 else "itl"
        elapsed_ms = (at - self.last_token_at) * 1000
        self.last_token_at = at
        return [(name, elapsed_ms)]

    def _finish(self, frame: dict) -> None:
        self.done = True
        text = "".join(self.pieces)
        if self.expected is None:
            if not self.pieces and frame.get("finish_reason") != "cancelled":
                raise ChatFailure("done without a token")
            return
        if text != self.expected.text:
            if self.expected.text.startswith(text):
                raise ChatFailure("reply is a truncated echo")
            same_length = len(text) == len(self.expected.text)
            raise ChatFailure("reply differs from the echo" + (" (same length)" if same_length else ""))
        if frame.get("finish_reason") != self.expected.finish_reason:
            raise ChatFailure(f"finish_reason {frame.get('finish_reason')!r}, expected {self.expected.finish_reason!r}")
        if (frame.get("usage") or {}).get("completion_tokens") != len(self.pieces):
            raise ChatFailure("usage.completion_tokens differs from the tokens that arrived")


class ChatUser(User):
    """One person chatting: one socket, one chat at a time, a pause between chats."""

    host = DEFAULT_URL
    _numbers = itertools.count()

    def __init__(self, environment) -> None:
        super().__init__(environment)
        self.settings = LoadSettings.from_options(environment.parsed_options)
        self.number = next(ChatUser._numbers)
        urls = [u.strip() for u in (self.host or DEFAULT_URL).split(",") if u.strip()]
        self.url = urls[self.number % len(urls)]
        self.api_key = self.settings.api_keys[self.number % len(self.settings.api_keys)]
        self.ws: websocket.WebSocket | None = None
        self.chats = itertools.count()

    def wait_time(self) -> float:
        think = self.settings.think_time_s
        return random.expovariate(1.0 / think) if think > 0 else 0.0

    def on_stop(self) -> None:
        self.disconnect()

    @task
    def chat(self) -> None:
        if self.ws is None and not self.connect():
            time.sleep(CONNECT_RETRY_S)  # gevent's sleep: Locust has patched the standard library
            return
        chat_id = f"c{next(self.chats)}"
        words = [f"u{self.number}{chat_id}w{i}" for i in range(random.randint(*self.settings.prompt_words))]
        max_tokens = random.randint(*self.settings.max_tokens)
        expected = echo_expectation(words, max_tokens) if self.settings.echo_check else None
        frame = {"type": "chat", "id": chat_id, "messages": [{"role": "user", "content": " ".join(words)}],
                 "max_tokens": max_tokens}
        sent_at = time.perf_counter()
        check = StreamCheck(chat_id, sent_at, expected)
        try:
            self._send(json.dumps(frame))
            deadline = sent_at + self.settings.chat_timeout_s
            while not check.done:
                frame_in, at = self._receive(deadline, len(check.pieces))
                for name, elapsed_ms in check.feed(frame_in, at):
                    self._fire(name, elapsed_ms)
        except ChatFailure as exc:
            self._fire("stream", (time.perf_counter() - sent_at) * 1000, len(check.pieces), exc)
            if exc.reconnect:
                self.disconnect()
            return
        self._fire("stream", (check.done_at - sent_at) * 1000, len(check.pieces))

    # The socket -----------------------------------------------------------------------------
    def connect(self) -> bool:
        url, headers = self.url, []
        if self.settings.key_in_query:
            url += ("&" if "?" in url else "?") + "api_key=" + quote(self.api_key)
        else:
            headers.append(f"Authorization: Bearer {self.api_key}")
        started = time.perf_counter()
        try:
            # A program, not a browser: no Origin header, and replies are JSON it parses anyway.
            self.ws = websocket.create_connection(url, header=headers, timeout=CONNECT_TIMEOUT_S,
                                                  suppress_origin=True, skip_utf8_validation=True)
        except websocket.WebSocketBadStatusException as exc:
            self._fire("connect", _ms_since(started), 0, ChatFailure(f"handshake refused: HTTP {exc.status_code}"))
            return False
        except (OSError, websocket.WebSocketException) as exc:
            self._fire("connect", _ms_since(started), 0, ChatFailure(f"cannot connect: {type(exc).__name__}: {exc}"))
            return False
        self._fire("connect", _ms_since(started))
        return True

    def disconnect(self) -> None:
        if self.ws is not None:
            ws, self.ws = self.ws, None
            try:
                ws.close(timeout=1.0)
            except (OSError, websocket.WebSocketException):
                pass

    def _send(self, text: str) -> None:
        try:
            self.ws.send(text)
        except (OSError, websocket.WebSocketException) as exc:
            raise ChatFailure(f"send failed: {type(exc).__name__}", reconnect=True) from exc

    def _receive(self, deadline: float, tokens_so_far: int) -> tuple[dict, float]:
        """The next text frame as JSON, with its arrival time."""
        remaining = deadline - time.perf_counter()
        try:
            if remaining <= 0:
                raise websocket.WebSocketTimeoutException("chat deadline passed")
            self.ws.settimeout(remaining)
            opcode, payload = self.ws.recv_data()
        except websocket.WebSocketTimeoutException as exc:
            where = "mid-stream" if tokens_so_far else "before the first token"
            raise ChatFailure(f"timeout: no done within {self.settings.chat_timeout_s:g} s, {where}",
                              reconnect=True) from exc
        except (OSError, websocket.WebSocketException) as exc:
            raise ChatFailure(f"socket dropped mid-chat: {type(exc).__name__}", reconnect=True) from exc
        at = time.perf_counter()
        if opcode == websocket.ABNF.OPCODE_CLOSE:
            code = int.from_bytes(payload[:2], "big") if len(payload) >= 2 else None
            raise ChatFailure(f"socket closed by the edge mid-chat (code {code})", reconnect=True)
        try:
            return json.loads(payload), at
        except ValueError as exc:
            raise ChatFailure("frame is not JSON", reconnect=True) from exc

    def _fire(self, name: str, elapsed_ms: float, length: int = 0, exception: Exception | None = None) -> None:
        self.environment.events.request.fire(
            request_type=REQUEST_TYPE, name=name, response_time=elapsed_ms, response_length=length,
            exception=exception, context={},
        )


def _ms_since(started: float) -> float:
    return (time.perf_counter() - started) * 1000
