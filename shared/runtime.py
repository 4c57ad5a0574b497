"""Process plumbing shared by every service: logging, and running until SIGINT/SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Callable, Coroutine
from typing import Any


def setup_logging(level: str, name: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        format=f"%(asctime)s {name} %(levelname)s %(name)s: %(message)s",
    )
    logging.getLogger("aiokafka").setLevel(logging.WARNING)


def run_until_signalled(main: Coroutine[Any, Any, None], on_signal: Callable[[], None] | None = None) -> None:
    """Run `main`; SIGINT or SIGTERM calls `on_signal` (say, to report draining), then cancels `main`,
    so its `finally` blocks shut it down cleanly."""

    async def runner() -> None:
        task = asyncio.create_task(main)

        def stop() -> None:
            if on_signal is not None:
                on_signal()
            task.cancel()

        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop)
        with contextlib.suppress(asyncio.CancelledError):
            await task

    asyncio.run(runner())
