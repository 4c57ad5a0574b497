"""Runs a GenerationEngine on its own thread, so the asyncio side never waits on the model.

Commands go in through a thread-safe queue; each step's outputs come back to the
event loop through a callback scheduled with `call_soon_threadsafe`.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Callable

from services.worker.generation import (
    GenerationEngine,
    GenerationRequest,
    RequestRejected,
    StepOutput,
)

log = logging.getLogger(__name__)

IDLE_WAIT_S = 0.5  # how long an idle engine sleeps between checks for new commands


class EngineThread:
    def __init__(
        self,
        engine: GenerationEngine,
        loop: asyncio.AbstractEventLoop,
        on_outputs: Callable[[list[StepOutput]], None],
    ) -> None:
        self._engine = engine
        self._loop = loop
        self._on_outputs = on_outputs
        self._commands: queue.SimpleQueue[tuple[str, object]] = queue.SimpleQueue()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stopping.set()
        self._commands.put(("wake", None))
        self._thread.join(timeout)

    def add(self, request: GenerationRequest) -> None:
        self._commands.put(("add", request))

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))

    def _run(self) -> None:
        while not self._stopping.is_set():
            busy = self._engine.has_unfinished_requests()
            outputs = self._apply_commands(block=not busy)
            if self._engine.has_unfinished_requests():
                outputs.extend(self._step())
            if outputs:
                self._loop.call_soon_threadsafe(self._on_outputs, outputs)

    def _apply_commands(self, block: bool) -> list[StepOutput]:
        outputs: list[StepOutput] = []
        try:
            command, arg = self._commands.get(timeout=IDLE_WAIT_S) if block else self._commands.get_nowait()
            while True:
                output = self._apply(command, arg)
                if output is not None:
                    outputs.append(output)
                command, arg = self._commands.get_nowait()
        except queue.Empty:
            return outputs

    def _apply(self, command: str, arg: object) -> StepOutput | None:
        if command == "add":
            assert isinstance(arg, GenerationRequest)
            try:
                self._engine.add_request(arg)
            except RequestRejected as exc:
                return StepOutput(arg.request_id, error_code=exc.code, error_message=exc.message)
            return None
        if command == "abort":
            assert isinstance(arg, str)
            return self._engine.abort_request(arg)
        return None

    def _step(self) -> list[StepOutput]:
        try:
            return self._engine.step()
        except Exception:  # noqa: BLE001 - an engine bug must not take the worker down
            log.exception("engine step failed; failing its running requests")
            return self._fail_all("engine_error", "the engine failed while running this request")

    def _fail_all(self, code: str, message: str) -> list[StepOutput]:
        failed = []
        for request_id in self._engine.request_ids():
            self._engine.abort_request(request_id)
            failed.append(StepOutput(request_id, error_code=code, error_message=message))
        return failed
