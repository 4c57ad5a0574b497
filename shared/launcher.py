"""Starts a local fleet (edges, workers, routers) as child processes, and stops it.

`drivetrain up` and the integration tests both use it: edge i listens on 8080+i for
clients and 9180+i for routers; every child's output is prefixed with its name.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from shared.infra import ensure_up, load_config
from shared.infra.kafka import open_admin
from shared.infra.topics import ensure_topics
from shared.topics import TopicLayout

STOP_TIMEOUT_S = 10.0


def fresh_topics(tag: str, partitions: int = 4) -> TopicLayout:
    """Topics of their own, created now: a fleet on them shares no consumer group, no
    gossip cluster and no message with any other (tests and benchmarks use this)."""
    infra = load_config()
    ensure_up(infra)
    layout = TopicLayout(prefix=f"{tag}-{uuid.uuid4().hex[:8]}", requests_partitions=partitions, tokens_partitions=partitions)

    async def create() -> None:
        async with open_admin(infra) as admin:
            await ensure_topics(admin, layout.partitions())

    asyncio.run(create())
    return layout


@dataclass(frozen=True)
class FleetSpec:
    edges: int = 1
    workers: int = 1
    routers: int = 1
    model: str = "echo"
    echo_delay_ms: float = 0.0
    base_port: int = 8080
    base_internal_port: int = 9180
    base_gossip_port: int = 7946  # edge i gossips on this + i; the edges are everyone's seeds
    extra_env: dict[str, str] = field(default_factory=dict)
    worker_args: tuple[str, ...] = ()

    def edge_ids(self) -> list[str]:
        return [f"edge-{i}" for i in range(self.edges)]

    def worker_metrics_port(self, i: int) -> int:
        return self.base_port + 200 + i

    def router_metrics_port(self, i: int) -> int:
        return self.base_port + 300 + i

    def gossip_seeds(self) -> str:
        return ",".join(f"127.0.0.1:{self.base_gossip_port + i}" for i in range(self.edges))

    def chat_url(self, edge: int = 0) -> str:
        return f"ws://127.0.0.1:{self.base_port + edge}/v1/chat"


@dataclass
class Child:
    name: str
    process: subprocess.Popen
    pump: threading.Thread | None = None
    log_offset: int = 0  # where this run's lines start in a log file shared with earlier runs


class Fleet:
    def __init__(self, spec: FleetSpec, log_dir: Path | None = None, echo_logs: bool = True) -> None:
        self.spec = spec
        self.log_dir = log_dir
        self.echo_logs = echo_logs
        self.children: dict[str, Child] = {}

    # Starting -----------------------------------------------------------------------------
    def start(self, ready_timeout_s: float = 120.0) -> None:
        for i in range(self.spec.edges):
            self.start_edge(i)
        # The edges are everyone's gossip seeds: let them come up first.
        deadline = time.monotonic() + ready_timeout_s
        for i in range(self.spec.edges):
            self._wait_http(f"http://127.0.0.1:{self.spec.base_port + i}/healthz", deadline)
        for i in range(self.spec.routers):
            self.start_child(f"router-{i}", "router", "--router-id", f"router-{i}", "--metrics-port", str(self.spec.router_metrics_port(i)))
        for i in range(self.spec.workers):
            self.start_worker(i)
        self.wait_ready(ready_timeout_s)

    def start_edge(self, i: int) -> None:
        self.start_child(
            f"edge-{i}", "edge", "--edge-id", f"edge-{i}", "--port", str(self.spec.base_port + i),
            "--internal-port", str(self.spec.base_internal_port + i), "--model", self.spec.model,
            "--gossip-port", str(self.spec.base_gossip_port + i),
        )

    def start_worker(self, i: int) -> None:
        args = ["--worker-id", f"worker-{i}", "--model", self.spec.model, "--metrics-port", str(self.spec.worker_metrics_port(i))]
        if self.spec.model == "echo":
            args += ["--echo-delay-ms", str(self.spec.echo_delay_ms)]
        self.start_child(f"worker-{i}", "worker", *args, *self.spec.worker_args)

    def start_child(self, name: str, command: str, *args: str) -> Child:
        env = {**os.environ, "DRIVETRAIN_GOSSIP_SEEDS": self.spec.gossip_seeds(), **self.spec.extra_env, "PYTHONUNBUFFERED": "1"}
        argv = [sys.executable, "-m", "shared.cli", command, *args]
        log_path = self.log_dir / f"{name}.log" if self.log_dir else None
        offset = log_path.stat().st_size if log_path and log_path.exists() else 0
        process = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        child = Child(name, process, log_offset=offset)
        child.pump = threading.Thread(target=self._pump, args=(name, process.stdout), daemon=True)
        child.pump.start()
        self.children[name] = child
        return child

    def _pump(self, name: str, stream: IO[bytes]) -> None:
        log_file = open(self.log_dir / f"{name}.log", "ab") if self.log_dir else None
        try:
            for line in iter(stream.readline, b""):
                if log_file:
                    log_file.write(line)
                    log_file.flush()
                if self.echo_logs:
                    sys.stdout.write(f"[{name}] {line.decode(errors='replace')}")
                    sys.stdout.flush()
        finally:
            if log_file:
                log_file.close()

    def wait_ready(self, timeout_s: float) -> None:
        """Edges answer /healthz; workers and routers have logged that they joined."""
        deadline = time.monotonic() + timeout_s
        for i in range(self.spec.edges):
            self._wait_http(f"http://127.0.0.1:{self.spec.base_port + i}/healthz", deadline)
        for name in self.children:
            if not name.startswith("edge"):
                self.wait_logged(name, " ready", deadline)

    def _wait_http(self, url: str, deadline: float) -> None:
        while True:
            self.check_alive()
            try:
                with urllib.request.urlopen(url, timeout=1.0) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{url} did not answer in time")
            time.sleep(0.2)

    def wait_logged(self, name: str, text: str, deadline: float) -> None:
        if self.log_dir is None:
            return
        path, offset = self.log_dir / f"{name}.log", self.children[name].log_offset
        while not (path.exists() and text.encode() in path.read_bytes()[offset:]):
            self.check_alive()
            if time.monotonic() > deadline:
                raise TimeoutError(f"{name} did not log {text!r} in time")
            time.sleep(0.2)

    def check_alive(self) -> None:
        for child in self.children.values():
            if child.process.poll() is not None:
                raise RuntimeError(f"{child.name} exited with code {child.process.returncode}")

    # Stopping -------------------------------------------------------------------------------
    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        child = self.children.pop(name)
        child.process.send_signal(sig)
        child.process.wait(STOP_TIMEOUT_S)

    def stop(self) -> None:
        for child in self.children.values():
            if child.process.poll() is None:
                child.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for child in self.children.values():
            try:
                child.process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.process.kill()
                child.process.wait()
            if child.pump:
                child.pump.join(1.0)
        self.children.clear()
