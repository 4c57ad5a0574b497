"""Real Kafka and Redis Cluster for integration and fault tests, and fleets of real service processes.

Each test session works under its own topic prefix, so leftovers of earlier runs
never reach it.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from shared.infra import ensure_up, load_config
from shared.launcher import Fleet, FleetSpec, fresh_topics
from shared.topics import TopicLayout

# Separate runs on one machine can set their own ports.
TEST_PORT = int(os.environ.get("DRIVETRAIN_TEST_BASE_PORT", "18080"))
TEST_INTERNAL_PORT = TEST_PORT + 1100
RESUME_GRACE_S = 2.0  # short, so tests of a dropped socket need not wait long


@pytest.fixture(scope="session")
def infra():
    cfg = load_config()
    ensure_up(cfg)
    return cfg


def new_topics(infra) -> TopicLayout:
    return fresh_topics("test")


@pytest.fixture(scope="session")
def topics(infra) -> TopicLayout:
    return new_topics(infra)


@pytest.fixture(scope="session")
def fleet_logs(tmp_path_factory) -> Path:
    path = Path(os.environ.get("DRIVETRAIN_TEST_LOGS") or tmp_path_factory.mktemp("fleet-logs"))
    path.mkdir(parents=True, exist_ok=True)
    return path


def start_fleet(topics: TopicLayout, log_dir: Path, **spec: object) -> Fleet:
    fleet_spec = FleetSpec(
        base_port=TEST_PORT,
        base_internal_port=TEST_INTERNAL_PORT,
        base_gossip_port=TEST_PORT + 2200,
        extra_env={"DRIVETRAIN_TOPIC_PREFIX": topics.prefix, "DRIVETRAIN_RESUME_GRACE_S": str(RESUME_GRACE_S)},
        **spec,
    )
    fleet = Fleet(fleet_spec, log_dir=log_dir, echo_logs=False)
    try:
        fleet.start(ready_timeout_s=120)
    except BaseException:
        fleet.stop()
        raise
    return fleet


