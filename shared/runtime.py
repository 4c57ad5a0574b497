"""Process plumbing shared by every service: logging, the collector's settings, and running until
SIGINT/SIGTERM.

The first signal asks the service to drain (it finishes what it holds, takes nothing new, then
returns); a second one, or the drain overrunning its backstop, cancels it outright.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
import time
from collections.abc import Callable, Coroutine
from typing import Any

from shared.rate_limits import LogThrottle, Rate, held_back

log = logging.getLogger(__name__)

Main = Callable[[asyncio.Event], Coroutine[Any, Any, None]]


# aiokafka logs every failed reconnect, hundreds a second while a broker is away.
KAFKA_LOG_RATE = Rate(per_s=0.2, burst=3)


class KafkaLogThrottle(logging.Filter):
    """At most KAFKA_LOG_RATE lines of each kind from the Kafka client; the next one says how many were held."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self._clock = clock
        self._by_kind: dict[str, LogThrottle] = {}  # by message template: a few dozen at most

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.name.startswith("aiokafka"):
            return True
        kind = str(record.msg)
        throttle = self._by_kind.get(kind)
        if throttle is None:
            throttle = self._by_kind[kind] = LogThrottle(KAFKA_LOG_RATE, self._clock())
        held = throttle.admit(self._clock())
        if held:
            record.msg = kind + held_back(held)
        return held is not None


# Allocations a young collection waits for. An engine step of hundreds of requests makes a few
# thousand objects (chunks, updates, token lists): at Python's default, 700, several collections a step.
YOUNG_COLLECTION_AFTER = 5_000


def settle_heap() -> None:
    """What lives now lives as long as the process (a model, its tokenizer, the imported code): frozen
    out of the collector's way, a full collection no longer walks it (with SmolLM2 ~385k objects, a
    ~350 ms pause of every stream). And young collections come less often."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(YOUNG_COLLECTION_AFTER, *gc.get_threshold()[1:])


def setup_logging(level: str, name: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        format=f"%(asctime)s {name} %(levelname)s %(name)s: %(message)s",
    )
    logging.getLogger("aiokafka").setLevel(logging.WARNING)
    for handler in logging.getLogger().handlers:
        handler.addFilter(KafkaLogThrottle())


def run_until_signalled(
    main: Main,
    on_signal: Callable[[], None] | None = None,
    backstop_s: float | None = None,
    loop_factory: Callable[[], asyncio.AbstractEventLoop] | None = None,
) -> None:
    """Run `main(stopping)`. SIGINT or SIGTERM calls `on_signal` (say, to report draining) and sets
    `stopping`, so `main` drains and returns; a second signal, or `main` still running `backstop_s`
    after the first, cancels it, so its `finally` blocks shut it down at once. It runs on a loop
    from `loop_factory` (asyncio's own when none)."""

    async def runner() -> None:
        stopping = asyncio.Event()
        task = asyncio.create_task(main(stopping))
        loop = asyncio.get_running_loop()
        cancelled_here = False

        def cancel() -> None:
            nonlocal cancelled_here
            if not task.done():
                log.warning("stopping now, without finishing the drain")
                cancelled_here = True
                task.cancel()

        def stop() -> None:
            if stopping.is_set():
                cancel()
                return
            if on_signal is not None:
                on_signal()
            stopping.set()
            if backstop_s is not None:
                loop.call_later(backstop_s, cancel)

        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop)
        try:
            await task
        except asyncio.CancelledError:
            if not cancelled_here:
                # A library's own cancellation that escaped into the service: it ended there,
                # whatever it had left to close. Said, and a failure, so a supervisor restarts it.
                log.error("stopped by a cancellation no signal asked for: the service did not finish")
                raise SystemExit(1) from None

    with asyncio.Runner(loop_factory=loop_factory) as loop_runner:
        loop_runner.run(runner())
