"""The chat page's browser libraries: served from node_modules when installed, and the page
served without them (plain-text replies, one warning) when not."""

from __future__ import annotations

import asyncio
import logging

from services.edge import chat_page
from services.edge.chat_page import (
    NODE_MODULES,
    VENDOR_FILES,
    chat_page_routes,
    vendor_routes,
)


def paths(routes) -> list[str]:
    return [route.path for route in routes]


def install_fakes(node_modules) -> None:
    for name, path in VENDOR_FILES.items():
        (node_modules / path).parent.mkdir(parents=True, exist_ok=True)
        (node_modules / path).write_text(f"/* {name} */")


def test_installed_libraries_are_served_as_javascript(tmp_path, caplog):
    install_fakes(tmp_path)
    with caplog.at_level(logging.WARNING, logger=chat_page.__name__):
        routes = vendor_routes(tmp_path)
    assert paths(routes) == ["/vendor/marked.min.js", "/vendor/purify.min.js"]
    assert caplog.records == []
    for route, path in zip(routes, VENDOR_FILES.values(), strict=True):
        response = asyncio.run(route.endpoint(None))
        assert response.path == tmp_path / path and response.media_type == "text/javascript"


def test_missing_libraries_leave_the_page_served_and_say_so_once(tmp_path, caplog):
    install_fakes(tmp_path)
    (tmp_path / VENDOR_FILES["purify.min.js"]).unlink()  # one of two missing is as good as none
    with caplog.at_level(logging.WARNING, logger=chat_page.__name__):
        routes = chat_page_routes(tmp_path)
    assert paths(routes) == ["/", "/static"]
    (warning,) = caplog.records
    assert "purify.min.js" in warning.getMessage() and "plain text" in warning.getMessage()


def test_the_repository_names_the_builds_it_serves():
    """package.json pins both packages; after `make install` the two builds are where the edge looks."""
    import json

    manifest = json.loads((NODE_MODULES.parent / "package.json").read_text())
    assert set(manifest["dependencies"]) == {"marked", "dompurify"}
    if NODE_MODULES.is_dir():
        assert all((NODE_MODULES / path).is_file() for path in VENDOR_FILES.values())
