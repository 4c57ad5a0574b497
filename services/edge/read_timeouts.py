"""Header and body read timeouts for uvicorn's HTTP/1.1 protocol, which has neither.

Without them a client holds a connection for ever by sending its headers a byte at a
time (slowloris) or by declaring a body it never sends. h11 tells us which part of a
request we are waiting for; `read_deadline` turns that into a deadline, and the protocol
closes the connection when it passes. Idle keep-alive connections are uvicorn's own
`timeout_keep_alive`; an upgraded WebSocket leaves this protocol and its timers.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

_REQUEST_TIMEOUT = b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"


@dataclass(frozen=True)
class ReadTimeouts:
    header_s: float  # from the first byte of a request (or the connection) to its last header
    body_s: float  # from the last header to the end of the body


def read_deadline(their_state: object, phase_started: float, timeouts: ReadTimeouts) -> float | None:
    """When the part of the request we wait for must have arrived; None when we wait for nothing."""
    if their_state is h11.IDLE:
        return phase_started + timeouts.header_s
    if their_state is h11.SEND_BODY:
        return phase_started + timeouts.body_s
    return None  # the request is in (DONE), or the connection is ending or switching protocol


def timed_protocol(timeouts: ReadTimeouts) -> type[H11Protocol]:
    """An H11Protocol class enforcing `timeouts`, for uvicorn's `http=` option."""

    class TimedH11Protocol(H11Protocol):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._phase: object = None
            self._read_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._track()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            self._track()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._track()

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel()
            super().connection_lost(exc)

        def _track(self) -> None:
            """Re-arm the timer when the request moves to another part; leave it running otherwise."""
            if self.transport.get_protocol() is not self or self.transport.is_closing():
                self._cancel()  # upgraded to a WebSocket, or closed
                return
            state = self.conn.their_state
            # Between keep-alive requests uvicorn's own idle timer runs; ours starts with the next request's first byte.
            idle = state is h11.IDLE and self.timeout_keep_alive_task is not None
            phase = None if idle else state
            if phase is self._phase:
                return
            self._cancel()
            self._phase = phase
            deadline = None if phase is None else read_deadline(state, self.loop.time(), timeouts)
            if deadline is not None:
                self._read_timer = self.loop.call_at(deadline, self._timed_out)

        def _cancel(self) -> None:
            if self._read_timer is not None:
                self._read_timer.cancel()
                self._read_timer = None
            self._phase = None

        def _timed_out(self) -> None:
            self._read_timer = None
            if self.transport.is_closing():
                return
            if self.conn.our_state is h11.IDLE:  # no response begun: say why before closing
                self.transport.write(_REQUEST_TIMEOUT)
            self.transport.close()

    return TimedH11Protocol
