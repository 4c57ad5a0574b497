"""OpenAI-compatible HTTP API on the edge's port: /v1/chat/completions and /v1/models."""

from __future__ import annotations

from starlette.routing import BaseRoute

from services.edge.service import EdgeService


def openai_routes(service: EdgeService, api_keys: dict[str, str]) -> list[BaseRoute]:
    return []
