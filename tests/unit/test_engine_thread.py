"""The engine thread: commands reach the engine in order, between steps; a rejected request or a
step that raises fails only what it must, on the event loop's side; stop ends it promptly."""

from __future__ import annotations

import asyncio
import threading
import time

from services.worker.echo import EchoEngine
from services.worker.engine.sampling_params import SamplingParams
from services.worker.engine.types import EngineOutput, EngineRequest, Message
from services.worker.engine_thread import EngineThread


def request(request_id: str, text: str = "a b c", max_tokens: int = 256) -> EngineRequest:
    return EngineRequest(request_id, "t", (Message("user", text),), SamplingParams(max_tokens=max_tokens))


class Collector:
    """What the thread hands back to the loop, and on which thread it was handed."""

    def __init__(self) -> None:
        self.outputs: list[EngineOutput] = []
        self.on_loop_thread: list[bool] = []
        self._loop_thread = threading.get_ident()
        self._changed = asyncio.Event()

    def __call__(self, outputs: list[EngineOutput]) -> None:
        self.on_loop_thread.append(threading.get_ident() == self._loop_thread)
        self.outputs.extend(outputs)
        self._changed.set()

    async def until(self, done, timeout: float = 5.0) -> None:
        deadline = time.monotonic() + timeout
        while not done():
            self._changed.clear()
            await asyncio.wait_for(self._changed.wait(), max(0.01, deadline - time.monotonic()))

    def of(self, request_id: str) -> list[EngineOutput]:
        return [o for o in self.outputs if o.request_id == request_id]

    def finished(self, *request_ids: str) -> bool:
        return all(any(o.finished for o in self.of(r)) for r in request_ids)


async def running(engine) -> tuple[EngineThread, Collector]:
    collector = Collector()
    thread = EngineThread(engine, asyncio.get_running_loop(), collector)
    thread.start()
    return thread, collector


async def test_commands_apply_in_order_and_outputs_come_back_on_the_loop():
    thread, got = await running(EchoEngine(delay_ms=5))
    try:
        thread.add(request("a", "one two three four five six"))
        thread.add(request("b", "x y"))
        thread.abort("a")  # queued behind its own add: the engine holds it, then lets it go
        await got.until(lambda: got.finished("a", "b"))
        assert [o.finish_reason for o in got.of("a")] == ["cancelled"]
        assert "".join(o.text for o in got.of("b")) == "x y" and got.of("b")[-1].finish_reason == "stop"
        assert got.on_loop_thread and all(got.on_loop_thread)
        thread.abort("nobody")  # unknown: nothing to say about it
        thread.add(request("c", "later"))
        await got.until(lambda: got.finished("c"))
        assert got.of("nobody") == [] and got.of("c")[-1].text == "later"
    finally:
        thread.stop()


async def test_a_dropped_request_ends_without_a_word_and_may_come_again():
    # A request handed back in a rebalance, then handed to this worker again: the drop must not
    # answer `cancelled`, or that answer would end the request's second arrival.
    thread, got = await running(EchoEngine(delay_ms=5))
    try:
        thread.add(request("a", "one two three four five six"))
        thread.drop("a")
        thread.add(request("a", "again"))
        await got.until(lambda: got.finished("a"))
        assert [o.finish_reason for o in got.of("a") if o.finished] == ["stop"]
        assert "".join(o.text for o in got.of("a")) == "again"
    finally:
        thread.stop()


async def test_a_rejected_request_fails_alone():
    thread, got = await running(EchoEngine(context=3))
    try:
        thread.add(request("long", "too many words here"))
        thread.add(request("ok", "fits"))
        await got.until(lambda: got.finished("long", "ok"))
        (rejected,) = got.of("long")
        assert rejected.failure.code == "prompt_too_long" and rejected.finish_reason is None
        assert got.of("ok")[-1].finish_reason == "stop"
    finally:
        thread.stop()


class BreaksOnce(EchoEngine):
    """Its first step raises, as an engine bug would."""

    def __init__(self) -> None:
        super().__init__(delay_ms=5)
        self.broken = True

    def step(self) -> list[EngineOutput]:
        if self.broken:
            self.broken = False
            raise RuntimeError("injected")
        return super().step()


async def test_a_step_that_raises_fails_what_it_held_and_the_thread_goes_on():
    engine = BreaksOnce()
    thread, got = await running(engine)
    try:
        thread.add(request("a"))
        thread.add(request("b"))
        await got.until(lambda: got.finished("a", "b"))
        assert {o.failure.code for o in got.outputs} == {"engine_error"} and not engine.has_unfinished_requests()
        thread.add(request("c", "after"))
        await got.until(lambda: got.finished("c"))
        assert got.of("c")[-1].text == "after" and got.of("c")[-1].finish_reason == "stop"
    finally:
        thread.stop()


async def test_stop_ends_an_idle_thread_at_once():
    thread, _ = await running(EchoEngine())
    await asyncio.sleep(0.05)  # idle: blocked waiting for a command
    started = time.perf_counter()
    thread.stop(timeout=5.0)
    assert not thread._thread.is_alive() and time.perf_counter() - started < 0.3
