"""The browser chat page: static HTML, CSS and JavaScript served by the edge at `/`."""

from __future__ import annotations

from pathlib import Path

from starlette.responses import FileResponse
from starlette.routing import BaseRoute, Mount, Route
from starlette.staticfiles import StaticFiles

STATIC_DIR = Path(__file__).resolve().parent / "static"


def chat_page_routes() -> list[BaseRoute]:
    async def index(_request) -> FileResponse:
        return FileResponse(STATIC_DIR / "index.html")

    return [Route("/", index), Mount("/static", StaticFiles(directory=STATIC_DIR), name="static")]
