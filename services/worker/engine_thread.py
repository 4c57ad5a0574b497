"""Runs a GenerationEngine on its own thread, so the asyncio side never waits on the model.

Commands go in through a thread-safe queue and are applied between steps, in the order they
were given; each step's outputs come back to the event loop through `call_soon_threadsafe`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from services.worker.engine.types import (
    EngineOutput,
    EngineRequest,
    Failure,
    FailureCode,
    GenerationEngine,
    RequestRejected,
)

log = logging.getLogger(__name__)

IDLE_WAIT_S = 0.5  # how long an idle engine sleeps between checks for new commands


@dataclass(frozen=True)
class Add:
    request: EngineRequest


@dataclass(frozen=True)
class Abort:
    request_id: str
    quiet: bool = False  # no `cancelled` output: nobody may hear of this request from here again


@dataclass(frozen=True)
class Wake:
    """Nothing to do but look at the stop flag."""


@dataclass(frozen=True)
class Call:
    """Run a function of the engine on its thread, between steps (a handoff's bookkeeping)."""

    fn: Callable[[GenerationEngine], Any]
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)


Command = Add | Abort | Wake | Call


class EngineThread:
    def __init__(
        self,
        engine: GenerationEngine,
        loop: asyncio.AbstractEventLoop,
        on_outputs: Callable[[list[EngineOutput]], None],
    ) -> None:
        self._engine = engine
        self._loop = loop
        self._on_outputs = on_outputs
        self._commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stopping.set()
        self._commands.put(Wake())
        self._thread.join(timeout)

    def add(self, request: EngineRequest) -> None:
        self._commands.put(Add(request))

    def abort(self, request_id: str) -> None:
        """Cancel a request; the engine answers with its `cancelled` output."""
        self._commands.put(Abort(request_id))

    def drop(self, request_id: str) -> None:
        """Cancel a request without a word: its stream is gone from this worker (handed back, or
        ended here), and a late `cancelled` would be taken for a later arrival of the same request."""
        self._commands.put(Abort(request_id, quiet=True))

    def call(self, fn: Callable[[GenerationEngine], Any]) -> asyncio.Future:
        """`fn(engine)` on the engine's thread; its result (or what it raised) on the event loop."""
        command = Call(fn)
        self._commands.put(command)
        return asyncio.wrap_future(command.future, loop=self._loop)

    def _run(self) -> None:
        while not self._stopping.is_set():
            busy = self._engine.has_unfinished_requests()
            outputs = self._apply_commands(block=not busy)
            if self._engine.has_unfinished_requests():
                outputs.extend(self._step())
            if outputs:
                self._loop.call_soon_threadsafe(self._on_outputs, outputs)

    def _apply_commands(self, block: bool) -> list[EngineOutput]:
        """Every queued command; an idle engine first waits (a while) for one to arrive."""
        outputs: list[EngineOutput] = []
        try:
            command = self._commands.get(timeout=IDLE_WAIT_S) if block else self._commands.get_nowait()
            while True:
                if (output := self._apply(command)) is not None:
                    outputs.append(output)
                command = self._commands.get_nowait()
        except queue.Empty:
            return outputs

    def _apply(self, command: Command) -> EngineOutput | None:
        match command:
            case Add(request):
                try:
                    self._engine.add_request(request)
                except RequestRejected as exc:
                    return EngineOutput(request.request_id, failure=exc.failure)
            case Abort(request_id, quiet):
                output = self._engine.abort_request(request_id)
                return None if quiet else output
            case Call(fn, future):
                try:
                    future.set_result(fn(self._engine))
                except Exception as exc:  # noqa: BLE001 - the caller's to handle, on its side
                    future.set_exception(exc)
        return None

    def _step(self) -> list[EngineOutput]:
        try:
            return self._engine.step()
        except Exception:  # noqa: BLE001 - an engine bug must not take the worker down
            log.exception("engine step failed; failing its running requests")
            failure = Failure(FailureCode.ENGINE_ERROR, "the engine failed while running this request")
            return self._fail_all(failure)

    def _fail_all(self, failure: Failure) -> list[EngineOutput]:
        failed = []
        for request_id in self._engine.request_ids():
            self._engine.abort_request(request_id)
            failed.append(EngineOutput(request_id, failure=failure))
        return failed
