"""The integration tests' fleet: two edges, two routers, two echo workers."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from shared.launcher import Fleet
from tests.fleet_fixtures import RESUME_GRACE_S, fleet_logs, infra, start_fleet, topics  # noqa: F401


@pytest.fixture(scope="module")
def echo_fleet(topics, fleet_logs) -> Iterator[Fleet]:  # noqa: F811
    """Two edges, two routers, two workers serving the echo model at a steady pace."""
    fleet = start_fleet(topics, fleet_logs, edges=2, routers=2, workers=2, model="echo", echo_delay_ms=5)
    yield fleet
    fleet.stop()
