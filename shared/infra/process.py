"""Small process and socket helpers of the infrastructure commands."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar


def log_tail(path: Path, lines: int = 20) -> str:
    """Last lines of a log file, to show beside an error; empty if there is none."""
    try:
        with path.open("rb") as f:
            # Logs grow large; the last 64 KiB hold far more than the lines wanted.
            f.seek(max(0, path.stat().st_size - 65536))
            text = f.read().decode(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def port_open(host: str, port: int, timeout_s: float = 0.5) -> bool:
    """True if something accepts TCP connections there: a cheap first probe."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


T = TypeVar("T")


def run_sync(make_coro: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """Run a coroutine to completion from sync code, even inside a running event loop.

    `ensure_up` may be called from a fixture or service that already runs a loop,
    where asyncio.run would refuse; a short-lived thread gets a loop of its own.
    """
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(make_coro())
    results: list[T] = []
    errors: list[BaseException] = []

    def target() -> None:
        try:
            results.append(asyncio.run(make_coro()))
        except BaseException as exc:  # re-raised in the caller's thread below
            errors.append(exc)

    thread = threading.Thread(target=target, name="infra-sync", daemon=True)
    thread.start()
    # No timeout here: every coroutine run this way bounds its own waits.
    thread.join()
    if errors:
        raise errors[0]
    return results[0]
