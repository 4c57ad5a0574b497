"""Starts a local fleet as child processes, supervises it, and stops it.

`drivetrain up` and the integration tests both use it. Every child's output is prefixed with
its name (and kept in a log file per child); readiness is each child's /healthz answering 200.
A failed start stops every child it started. Under `supervise`, a child that dies is
reported and, unless the policy says otherwise, started again after a backoff while the
rest of the fleet keeps serving.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from services.edge.settings import EdgeSettings
from services.launcher.restarts import ChildLife, ChildState, RestartPolicy
from services.launcher.spec import ChildSpec, FleetSpec
from services.worker.settings import WorkerSettings


def _default(settings: type, name: str) -> float:
    return settings.model_fields[name].default


# A stopped child drains first (docs/operations.md#draining): the longest drain by default, and a margin to exit.
DRAIN_TIMEOUT_S = max(_default(WorkerSettings, "drain_timeout_s"), _default(EdgeSettings, "drain_timeout_s"))
STOP_TIMEOUT_S = DRAIN_TIMEOUT_S + 15.0
ROUTER_STOP_TIMEOUT_S = 15.0
HEALTH_PROBE_TIMEOUT_S = 0.5


@dataclass
class Child:
    spec: ChildSpec
    process: subprocess.Popen
    pump: threading.Thread | None = None
    life: ChildLife = field(default_factory=ChildLife)

    @property
    def name(self) -> str:
        return self.spec.name


def healthy(url: str, timeout_s: float = HEALTH_PROBE_TIMEOUT_S) -> bool:
    """True when the URL answers 200 (a 503 while starting or draining is not healthy)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


class Fleet:
    def __init__(
        self,
        spec: FleetSpec,
        log_dir: Path | None = None,
        echo_logs: bool = True,
        policy: RestartPolicy = RestartPolicy(restart=False),
        say: Callable[[str], None] | None = None,
        label: str = "",
    ) -> None:
        self.spec = spec
        self.label = label  # put before each child's name in its log lines ("r1/": one region of several)
        self.log_dir = log_dir
        self.echo_logs = echo_logs
        self.policy = policy
        self._say = say or (lambda line: print(f"[launcher] {line}", flush=True))
        self.children: dict[str, Child] = {}

    # Starting -----------------------------------------------------------------------------
    def start(self, ready_timeout_s: float = 120.0) -> None:
        """Every child, serving; on any failure, every child started so far is stopped again."""
        try:
            deadline = time.monotonic() + ready_timeout_s
            for i in range(self.spec.edges):
                self.start_child(self.spec.edge(i))
            # The edges are everyone's gossip seeds: let them come up first.
            self.wait_ready(deadline - time.monotonic())
            for i in range(self.spec.routers):
                self.start_child(self.spec.router(i))
            for i in range(self.spec.workers):
                self.start_child(self.spec.worker(i))
            self.wait_ready(deadline - time.monotonic())
        except BaseException:
            self.stop()
            raise

    def start_child(self, spec: ChildSpec, life: ChildLife | None = None) -> Child:
        env = {**os.environ, "DRIVETRAIN_GOSSIP_SEEDS": self.spec.gossip_seeds(), **self.spec.extra_env, **self.spec.role_env.get(spec.command, {}), "PYTHONUNBUFFERED": "1"}
        argv = [sys.executable, "-m", "services.cli", spec.command, *spec.args]
        process = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        child = Child(spec, process, life=life or ChildLife())
        child.life.started(time.monotonic())
        child.pump = threading.Thread(target=self._pump, args=(spec.name, process.stdout), daemon=True)
        child.pump.start()
        self.children[spec.name] = child
        return child

    def _pump(self, name: str, stream: IO[bytes]) -> None:
        log_file = open(self.log_dir / f"{name}.log", "ab") if self.log_dir else None
        try:
            for line in iter(stream.readline, b""):
                if log_file:
                    log_file.write(line)
                    log_file.flush()
                if self.echo_logs:
                    sys.stdout.write(f"[{self.label}{name}] {line.decode(errors='replace')}")
                    sys.stdout.flush()
        finally:
            if log_file:
                log_file.close()

    def wait_ready(self, timeout_s: float) -> None:
        """Every child's /healthz answers 200; RuntimeError at once if one exits meanwhile."""
        deadline = time.monotonic() + timeout_s
        pending = [child for child in self.children.values() if child.life.state is ChildState.STARTING]
        while pending:
            self.check_alive()
            for child in list(pending):
                if healthy(child.spec.health_url):
                    child.life.serving()
                    pending.remove(child)
            if pending and time.monotonic() > deadline:
                names = ", ".join(child.name for child in pending)
                raise TimeoutError(f"{names} did not answer {pending[0].spec.health_url} in time")
            time.sleep(0.1)

    def check_alive(self) -> None:
        for child in self.children.values():
            if child.life.state is not ChildState.DEAD and child.process.poll() is not None:
                raise RuntimeError(f"{child.name} {describe_exit(child.process.returncode)}")

    # Supervising --------------------------------------------------------------------------
    def supervise(self) -> None:
        """One round: report and schedule the children that died, restart those due, and
        notice those that came back. Call it every fraction of a second."""
        now = time.monotonic()
        for child in list(self.children.values()):
            state = child.life.state
            if state in (ChildState.STARTING, ChildState.SERVING) and child.process.poll() is not None:
                if child.pump:
                    child.pump.join(1.0)  # its last words before ours
                delay = child.life.died(now, self.policy)
                how = describe_exit(child.process.returncode)
                self._say(f"{child.name} {how}; " + (f"restarting in {delay:.1f} s" if delay is not None else "left stopped"))
            elif child.life.due(now):
                restarted = self.start_child(self.spec.child(child.name), child.life)
                self._say(f"{child.name} restarted (pid {restarted.process.pid})")
            elif state is ChildState.STARTING and child.life.generation > 1 and healthy(child.spec.health_url):
                child.life.serving()
                self._say(f"{child.name} is serving again")

    # Stopping -------------------------------------------------------------------------------
    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Signal one child and forget it: it is not restarted."""
        child = self.children.pop(name)
        child.process.send_signal(sig)
        child.process.wait(STOP_TIMEOUT_S)

    def stop(self) -> None:
        """SIGTERM, SIGKILL to those still running after their time. Edges and workers first, all
        at once: they drain, and routers carry the last tokens of their streams; then routers."""
        for child in self.children.values():
            child.life.state = ChildState.STOPPING
        first = [child for child in self.children.values() if child.spec.command != "router"]
        routers = [child for child in self.children.values() if child.spec.command == "router"]
        self._stop_all(first, STOP_TIMEOUT_S)
        self._stop_all(routers, ROUTER_STOP_TIMEOUT_S)
        self.children.clear()

    def _stop_all(self, children: list[Child], timeout_s: float) -> None:
        for child in children:
            if child.process.poll() is None:
                child.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for child in children:
            try:
                child.process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self._say(f"{child.name} did not stop within {timeout_s:.0f} s; killing it")
                child.process.kill()
                child.process.wait()
            if child.pump:
                child.pump.join(1.0)
