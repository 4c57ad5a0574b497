"""The browser chat page: static HTML, CSS and JavaScript served by the edge at `/`.

The page renders replies as Markdown with two npm packages, `marked` and `DOMPurify`, whose
browser builds `make install` puts in node_modules (package.json at the repository root). The
edge serves them at /vendor/; without them it still serves the page, which then shows replies
as plain text, and says so once in its log.
"""

from __future__ import annotations

import logging
from pathlib import Path

from starlette.responses import FileResponse
from starlette.routing import BaseRoute, Mount, Route
from starlette.staticfiles import StaticFiles

log = logging.getLogger(__name__)

STATIC_DIR = Path(__file__).resolve().parent / "static"
NODE_MODULES = Path(__file__).resolve().parents[2] / "node_modules"
# The URL name under /vendor/ -> the minified browser build inside node_modules.
VENDOR_FILES = {
    "marked.min.js": Path("marked/lib/marked.umd.js"),
    "purify.min.js": Path("dompurify/dist/purify.min.js"),
}
JS_MEDIA_TYPE = "text/javascript"


def vendor_routes(node_modules: Path = NODE_MODULES) -> list[BaseRoute]:
    """Routes for the page's browser libraries, or none (and one warning) when any is missing."""
    found = {name: node_modules / path for name, path in VENDOR_FILES.items()}
    missing = sorted(str(path) for path in found.values() if not path.is_file())
    if missing:
        log.warning(
            "chat page: Markdown libraries not installed (%s missing; run `make install`); "
            "replies are shown as plain text",
            ", ".join(missing),
        )
        return []

    def serve(path: Path):
        async def endpoint(_request) -> FileResponse:
            return FileResponse(path, media_type=JS_MEDIA_TYPE)

        return endpoint

    return [Route(f"/vendor/{name}", serve(path)) for name, path in found.items()]


def chat_page_routes(node_modules: Path = NODE_MODULES) -> list[BaseRoute]:
    async def index(_request) -> FileResponse:
        return FileResponse(STATIC_DIR / "index.html")

    return [
        Route("/", index),
        *vendor_routes(node_modules),
        Mount("/static", StaticFiles(directory=STATIC_DIR), name="static"),
    ]
