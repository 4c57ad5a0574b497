"""Fault tests kill real processes, so each test gets a fleet, and topics, of its own."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from shared.launcher import Fleet
from shared.topics import TopicLayout
from tests.fleet_fixtures import fleet_logs, infra, new_topics, start_fleet  # noqa: F401


@pytest.fixture
def topics(infra) -> TopicLayout:  # noqa: F811
    return new_topics(infra)


@pytest.fixture
def make_fleet(topics, fleet_logs) -> Iterator[Callable[..., Fleet]]:  # noqa: F811
    fleets: list[Fleet] = []

    def make(**spec: object) -> Fleet:
        fleet = start_fleet(topics, fleet_logs, model="echo", **spec)
        fleets.append(fleet)
        return fleet

    yield make
    for fleet in fleets:
        fleet.stop()
