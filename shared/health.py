"""A service's lifecycle, and the /healthz answer it gives: 200 only while it serves.

The launcher, compose healthchecks and tests wait on /healthz instead of reading logs.
"""

from __future__ import annotations

import os
from enum import StrEnum

from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route


class Lifecycle(StrEnum):
    STARTING = "starting"  # joining Kafka, loading a model, waiting for partitions
    SERVING = "serving"
    DRAINING = "draining"  # told to stop: finishing, taking nothing new
    STOPPED = "stopped"


class Health:
    def __init__(self, role: str, member_id: str) -> None:
        self.role = role
        self.member_id = member_id
        self.state = Lifecycle.STARTING

    def set(self, state: Lifecycle) -> None:
        # Draining and stopped are final: a late "serving" (a rebalance mid-shutdown) must not undo them.
        if self.state in (Lifecycle.DRAINING, Lifecycle.STOPPED) and state is Lifecycle.SERVING:
            return
        self.state = state

    @property
    def serving(self) -> bool:
        return self.state is Lifecycle.SERVING

    def body(self) -> dict[str, str | int]:
        return {"status": self.state.value, "role": self.role, "id": self.member_id, "pid": os.getpid()}


def health_route(health: Health) -> Route:
    async def healthz(_: Request) -> JSONResponse:
        return JSONResponse(health.body(), status_code=200 if health.serving else 503)

    return Route("/healthz", healthz)
