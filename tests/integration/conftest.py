"""The integration tests' fleet: two edges, two routers, two echo workers."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from services.launcher.fleet import Fleet
from tests.conftest import start_fleet

# A tool the OpenAI and WebSocket tool-call tests offer the model.
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}}, "required": ["city"]},
    },
}


@pytest.fixture(scope="module")
def echo_fleet(topics, fleet_logs) -> Iterator[Fleet]:
    """Two edges, two routers, two workers serving the echo model at a steady pace."""
    fleet = start_fleet(topics, fleet_logs, edges=2, routers=2, workers=2, model="echo", echo_delay_ms=5)
    yield fleet
    fleet.stop()
