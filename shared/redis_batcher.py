"""Coalesces Redis commands issued at about the same moment into one pipeline.

redis-py's cluster client spends about a millisecond of CPU on every call, pipelined
or not; a burst of chats, each writing its route, costs a hundred times that. Calls
made while a pipeline is in flight wait for the next one, so a burst becomes a few
round trips instead of a hundred.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from redis.asyncio.cluster import ClusterPipeline, RedisCluster

Commands = Callable[[ClusterPipeline], None]


class RedisBatcher:
    def __init__(self, redis: RedisCluster) -> None:
        self._redis = redis
        self._waiting: list[tuple[Commands, asyncio.Future[None]]] = []
        self._flushing: asyncio.Task | None = None

    async def run(self, commands: Commands) -> None:
        """Queue `commands(pipe)` for the next pipeline and wait until it has run."""
        done = asyncio.get_running_loop().create_future()
        self._waiting.append((commands, done))
        if self._flushing is None:
            self._flushing = asyncio.create_task(self._flush())
        await done

    async def _flush(self) -> None:
        try:
            while self._waiting:
                batch, self._waiting = self._waiting, []
                try:
                    async with self._redis.pipeline(transaction=False) as pipe:
                        for commands, _ in batch:
                            commands(pipe)
                        await pipe.execute()
                except Exception as exc:  # noqa: BLE001 - every caller of the batch gets the failure
                    for _, done in batch:
                        if not done.done():
                            done.set_exception(exc)
                else:
                    for _, done in batch:
                        if not done.done():
                            done.set_result(None)
        finally:
            self._flushing = None
