"""The HTTP endpoint of a worker or router: /metrics (Prometheus) and /healthz, on the metrics port.

It runs on the service's own event loop, so a loop that stops turning stops answering too.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator

import uvicorn
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from shared.health import Health, health_route


class QuietServer(uvicorn.Server):
    """Signals belong to the process runner, which shuts everything down in order."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def metrics_route(registry: CollectorRegistry) -> Route:
    async def metrics(_: Request) -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return Route("/metrics", metrics)


@contextlib.asynccontextmanager
async def status_endpoint(registry: CollectorRegistry, health: Health, host: str, port: int) -> AsyncIterator[None]:
    """Serve /metrics and /healthz on host:port while the block runs (port 0: serve nothing)."""
    if not port:
        yield
        return
    app = Starlette(routes=[metrics_route(registry), health_route(health)])
    server = QuietServer(uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="off"))
    serving = asyncio.create_task(server.serve(), name="status-endpoint")
    try:
        while not server.started:
            if serving.done():
                serving.result()  # the bind failed: say why
                raise RuntimeError(f"the status endpoint on {host}:{port} stopped at start")
            await asyncio.sleep(0.01)
        yield
    finally:
        server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await serving
