"""What a local fleet is: how many of each service, the model, and the ports each child takes.

Edge i listens on base_port + i for clients and base_internal_port + i for routers and gossips
on base_gossip_port + i (the edges are everyone's seeds); worker i and router i answer /metrics
and /healthz on base_port + 200 + i and base_port + 300 + i. `FleetSpec.at(base_port)` moves
them all together: 8080 gives 9180 and 7946, the defaults.
"""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass, field

from shared.models.echo import ECHO


@dataclass(frozen=True)
class ChildSpec:
    name: str  # edge-0, worker-1, ...: the launcher's name for the slot, across restarts
    command: str  # edge | worker | router
    args: tuple[str, ...]
    health_url: str
    member_id: str  # the name it gossips under (a worker's changes at every start)


@dataclass(frozen=True)
class FleetSpec:
    edges: int = 1
    workers: int = 1
    routers: int = 1
    model: str = ECHO
    echo_delay_ms: float = 0.0
    base_port: int = 8080
    base_internal_port: int = 9180
    base_gossip_port: int = 7946
    extra_env: dict[str, str] = field(default_factory=dict)
    # Per service kind (edge | worker | router), on top of extra_env: each role's own credentials.
    role_env: dict[str, dict[str, str]] = field(default_factory=dict)
    worker_args: tuple[str, ...] = ()
    # Disaggregated: the last `decode_workers` workers decode, the others prefill; 0: every worker is unified.
    decode_workers: int = 0

    @classmethod
    def at(cls, base_port: int, **fields: object) -> FleetSpec:
        """A fleet whose every port is placed relative to `base_port`, as the defaults are to 8080."""
        return cls(base_port=base_port, base_internal_port=base_port + 1100, base_gossip_port=base_port - 134, **fields)

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

    def edge(self, i: int) -> ChildSpec:
        port = self.base_port + i
        args = (
            "--edge-id", f"edge-{i}", "--port", str(port), "--internal.port", str(self.base_internal_port + i),
            "--model", self.model, "--gossip.port", str(self.base_gossip_port + i),
        )  # fmt: skip
        return ChildSpec(f"edge-{i}", "edge", args, _health(port), f"edge-{i}")

    def worker(self, i: int) -> ChildSpec:
        # A fresh name at every start: a restarted worker must never take its predecessor's
        # claims for its own (it would run again what the dead one had started).
        worker_id = f"worker-{i}-{secrets.token_hex(3)}"
        port = self.worker_metrics_port(i)
        args = ["--worker-id", worker_id, "--model", self.model, "--metrics.port", str(port)]
        if self.model == ECHO:
            args += ["--echo.delay-ms", str(self.echo_delay_ms)]
        else:  # the workers of one machine split its cores: oversubscribed, every small op waits for a core
            args += ["--engine.cpu-threads", str(max(1, (os.cpu_count() or 1) // self.workers))]
        if self.decode_workers:
            args += ["--role", "decode" if i >= self.workers - self.decode_workers else "prefill"]
        return ChildSpec(f"worker-{i}", "worker", (*args, *self.worker_args), _health(port), worker_id)

    def router(self, i: int) -> ChildSpec:
        port, router_id = self.router_metrics_port(i), f"router-{i}"
        return ChildSpec(router_id, "router", ("--router-id", router_id, "--metrics.port", str(port)), _health(port), router_id)

    def child(self, name: str) -> ChildSpec:
        """The spec of a slot by its name, fresh (a worker gets a new id each time)."""
        kind, _, index = name.rpartition("-")
        return {"edge": self.edge, "worker": self.worker, "router": self.router}[kind](int(index))


def _health(port: int) -> str:
    return f"http://127.0.0.1:{port}/healthz"
