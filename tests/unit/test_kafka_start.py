"""Waiting for a broker just started: one still starting is waited for, whatever its command line
reads yet; one that exited is reported at once. No broker answers on the port in either."""

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from shared.infra import kafka
from shared.infra.errors import InfraError
from shared.infra.settings import InfraSettings


def silent_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def settings(tmp_path: Path, ready_timeout_s: float) -> InfraSettings:
    return InfraSettings(infra_dir=tmp_path, kafka_port=silent_port(), kafka_ready_timeout_s=ready_timeout_s)


def test_a_broker_still_starting_is_waited_for_though_its_command_line_does_not_name_kafka(tmp_path: Path):
    # As the launched process is while it execs the JVM: running, its command line not (yet) Kafka's.
    starting = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        with pytest.raises(InfraError, match="did not answer"):
            kafka.wait_ready(settings(tmp_path, ready_timeout_s=1.0), starting.pid)
    finally:
        starting.kill()
        starting.wait()


def test_a_broker_that_exited_during_start_up_is_reported_at_once(tmp_path: Path):
    exited = subprocess.Popen([sys.executable, "-c", "pass"])
    exited.wait()
    with pytest.raises(InfraError, match="exited during start-up"):
        kafka.wait_ready(settings(tmp_path, ready_timeout_s=60.0), exited.pid)
