"""Process plumbing shared by every service: logging, and running until SIGINT/SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Coroutine
from typing import Any


def setup_logging(level: str, name: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        format=f"%(asctime)s {name} %(levelname)s %(name)s: %(message)s",
    )
    logging.getLogger("aiokafka").setLevel(logging.WARNING)


def run_until_signalled(main: Coroutine[Any, Any, None]) -> None:
    """Run `main`; SIGINT or SIGTERM cancels it, so its `finally` blocks shut it down cleanly."""

    async def runner() -> None:
        task = asyncio.create_task(main)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, task.cancel)
        with contextlib.suppress(asyncio.CancelledError):
            await task

    asyncio.run(runner())
