"""The launcher's pure parts: when a dead child comes back, and what each child is started with."""

import pytest

from services.cli import COMPILING_READY_TIMEOUT_S, READY_TIMEOUT_S, ready_timeout_s
from services.launcher.restarts import ChildLife, ChildState, RestartPolicy
from services.launcher.spec import FleetSpec
from services.worker.engine.settings import EngineSettings
from services.worker.settings import WorkerSettings


def test_backoff_doubles_up_to_its_ceiling():
    policy = RestartPolicy(initial_s=1.0, max_s=30.0)
    assert [policy.delay(n) for n in range(1, 8)] == [1, 2, 4, 8, 16, 30, 30]


def test_deaths_in_a_row_back_off_and_a_long_life_starts_afresh():
    policy = RestartPolicy(stable_s=60.0)
    life = ChildLife()
    life.started(now=0.0)
    life.serving()
    assert life.died(now=5.0, policy=policy) == 1.0 and life.state is ChildState.WAITING
    assert not life.due(5.5) and life.due(6.0)
    life.started(now=6.0)
    assert life.died(now=7.0, policy=policy) == 2.0  # it died again at once
    life.started(now=9.0)
    assert life.died(now=9.5, policy=policy) == 4.0
    life.started(now=14.0)
    assert life.died(now=14.0 + 61.0, policy=policy) == 1.0  # it served a minute: a fresh count
    assert life.generation == 4


def test_without_restarts_a_dead_child_stays_dead():
    life = ChildLife()
    life.started(now=0.0)
    assert life.died(now=1.0, policy=RestartPolicy(restart=False)) is None
    assert life.state is ChildState.DEAD and not life.due(1e9)


def test_children_get_their_ports_and_a_worker_a_fresh_name_each_start():
    spec = FleetSpec.at(18080, edges=2, workers=1, routers=1, model="echo", echo_delay_ms=5)
    edge = spec.edge(1)
    assert edge.args == ("--edge-id", "edge-1", "--port", "18081", "--internal.port", "19181",
                         "--model", "echo", "--gossip.port", "17947")
    assert edge.health_url == "http://127.0.0.1:18081/healthz"
    first, second = spec.worker(0), spec.child("worker-0")
    assert first.name == second.name == "worker-0" and first.member_id != second.member_id
    assert first.member_id.startswith("worker-0-") and ("--worker-id", first.member_id) == first.args[:2]
    assert "--echo.delay-ms" in first.args and first.health_url.endswith(":18280/healthz")
    assert spec.router(0).health_url.endswith(":18380/healthz")
    assert spec.gossip_seeds() == "127.0.0.1:17946,127.0.0.1:17947"
    assert FleetSpec.at(8080) == FleetSpec()  # the defaults are the fleet at 8080
    with pytest.raises(KeyError):
        spec.child("broker-0")


def test_up_waits_longer_for_workers_that_compile_their_decode_graphs_first():
    compiling = WorkerSettings(engine=EngineSettings(cpu_compile="on"))
    assert ready_timeout_s("smollm2", compiling) == COMPILING_READY_TIMEOUT_S > READY_TIMEOUT_S
    assert ready_timeout_s("echo", compiling) == READY_TIMEOUT_S  # the echo model compiles nothing
    for mode in ("off", "background"):  # serves at once
        assert ready_timeout_s("smollm2", WorkerSettings(engine=EngineSettings(cpu_compile=mode))) == READY_TIMEOUT_S
