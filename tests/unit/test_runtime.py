"""Running a service until signalled: a signal drains it, a second one (or the backstop) cancels it
quietly, and a cancellation nobody asked for is a failure, not a quiet exit. And the collector's
settings a worker takes once its engine is built."""

from __future__ import annotations

import asyncio
import gc
import os
import signal

import pytest
import uvloop

from shared.runtime import YOUNG_COLLECTION_AFTER, run_until_signalled, settle_heap
from shared.service_settings import EventLoop


def signal_soon(sig: signal.Signals = signal.SIGTERM, after_s: float = 0.05) -> None:
    asyncio.get_running_loop().call_later(after_s, os.kill, os.getpid(), sig)


def test_a_signal_sets_stopping_and_the_service_returns_after_its_drain():
    drained = []

    async def main(stopping: asyncio.Event) -> None:
        signal_soon()
        await stopping.wait()
        drained.append(True)

    run_until_signalled(main)
    assert drained == [True]


def test_a_drain_past_its_backstop_is_cancelled_and_the_process_ends_without_error():
    closed = []

    async def main(stopping: asyncio.Event) -> None:
        signal_soon()
        try:
            await asyncio.sleep(3600)  # a drain that never ends
        finally:
            closed.append(True)

    run_until_signalled(main, backstop_s=0.05)
    assert closed == [True]


def test_a_cancellation_no_signal_asked_for_fails_the_process(caplog):
    async def main(stopping: asyncio.Event) -> None:
        raise asyncio.CancelledError  # as a library's own cancellation escaping into the service

    with pytest.raises(SystemExit) as ended:
        run_until_signalled(main)
    assert ended.value.code == 1
    assert "no signal asked for" in caplog.text


@pytest.mark.parametrize("event_loop", list(EventLoop))
def test_the_service_runs_on_the_loop_its_settings_choose(event_loop):
    loops = []

    async def main(stopping: asyncio.Event) -> None:
        loops.append(type(asyncio.get_running_loop()))

    run_until_signalled(main, loop_factory=event_loop.factory())
    made = event_loop.factory()()
    made.close()
    assert loops == [type(made)]
    assert (loops[0] is uvloop.Loop) == (event_loop is EventLoop.UVLOOP)


def test_settling_the_heap_freezes_what_lives_and_makes_young_collections_rarer():
    threshold = gc.get_threshold()
    try:
        settle_heap()
        assert gc.get_freeze_count() > 0
        assert gc.get_threshold() == (YOUNG_COLLECTION_AFTER, *threshold[1:]) and YOUNG_COLLECTION_AFTER > threshold[0]
    finally:
        gc.unfreeze()
        gc.set_threshold(*threshold)
