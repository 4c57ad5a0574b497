"""A local Redis Cluster (3 masters, 3 replicas by default) from Debian's redis-server.

Starts daemonized nodes, forms the cluster once with `redis-cli --cluster create`, and
calls it ready only when every node says cluster_state:ok, every replica's link is up,
and every node's slot map (what clients load) names the replicas too.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from shared.infra import credentials
from shared.infra.errors import InfraError, MissingPrerequisite
from shared.infra.permissions import Role, redis_acl_file
from shared.infra.process import log_tail
from shared.infra.settings import InfraSettings

Report = Callable[[str], None]
INSTALL_HINT = "apt-get update && apt-get install -y redis-server"
SUDO_INSTALL_HINT = "sudo apt-get update && sudo apt-get install -y redis-server"
CLUSTER_SLOTS = 16384


def _install_with_apt(report: Report) -> None:
    report(f"redis: redis-server not found; running `{INSTALL_HINT}`")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for command in (["apt-get", "update"], ["apt-get", "install", "-y", "redis-server"]):
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
        except subprocess.TimeoutExpired as exc:
            raise MissingPrerequisite(f"`{' '.join(command)}` took over 600 s") from exc
        if done.returncode != 0:
            raise MissingPrerequisite(
                f"`{' '.join(command)}` failed:\n{done.stderr.strip()[-2000:]}"
            )


def find_redis(report: Report) -> tuple[str, str]:
    """Paths of redis-server and redis-cli, installing them with apt-get when root."""
    if shutil.which("redis-server") is None or shutil.which("redis-cli") is None:
        if os.geteuid() == 0 and shutil.which("apt-get"):
            _install_with_apt(report)
        else:
            raise MissingPrerequisite(
                f"redis-server / redis-cli not found; install them with: {SUDO_INSTALL_HINT}"
            )
    server, cli = shutil.which("redis-server"), shutil.which("redis-cli")
    if server is None or cli is None:
        raise MissingPrerequisite(f"redis-server still missing after `{INSTALL_HINT}`")
    return server, cli


def _admin_auth(cfg: InfraSettings) -> dict[str, str]:
    """redis-py keyword arguments that log the infra code in: none, or the admin user."""
    if not cfg.secure:
        return {}
    found = credentials.load(cfg)
    # Without secrets the nodes (if any) are not ours; asking as nobody reads as "down".
    return {"username": str(Role.ADMIN), "password": found.redis[Role.ADMIN]} if found else {}


def _client(cfg: InfraSettings, port: int) -> redis.Redis:
    # No retries: a refused connection must answer "down" at once, not after
    # redis-py's default backoff (seconds per node).
    return redis.Redis(
        host=cfg.redis_host, port=port, socket_timeout=2.0, socket_connect_timeout=1.0,
        retry=Retry(NoBackoff(), 0), decode_responses=True, **_admin_auth(cfg),
    )  # fmt: skip


def _parse_info(text: str) -> dict[str, str]:
    pairs = (line.split(":", 1) for line in text.splitlines() if ":" in line)
    return {key.strip(): value.strip() for key, value in pairs}


@dataclass(frozen=True)
class NodeStatus:
    port: int
    running: bool
    role: str = ""  # "master" or "slave" (Redis's word for a replica)
    cluster_state: str = ""  # "ok" once the node sees every slot served
    known_nodes: int = 0
    slots_assigned: int = 0
    link_up: bool = False  # replicas: master_link_status:up; masters: always False
    # Fewest replicas listed for a slot range in this node's CLUSTER SLOTS. Redis leaves
    # out replicas with replication offset 0, so a fresh cluster hides them from clients.
    slot_replicas: int = 0


def node_status(cfg: InfraSettings, port: int) -> NodeStatus:
    try:
        with _client(cfg, port) as client:
            cluster = _parse_info(client.execute_command("CLUSTER", "INFO"))
            replication = client.info("replication")
            slot_ranges = client.execute_command("CLUSTER", "SLOTS")
    except redis.RedisError:
        return NodeStatus(port=port, running=False)
    return NodeStatus(
        port=port,
        running=True,
        role=str(replication.get("role", "")),
        cluster_state=cluster.get("cluster_state", ""),
        known_nodes=int(cluster.get("cluster_known_nodes", 0)),
        slots_assigned=int(cluster.get("cluster_slots_assigned", 0)),
        link_up=replication.get("master_link_status") == "up",
        # Each range reads [start, end, master, replica, ...].
        slot_replicas=min((len(r) - 3 for r in slot_ranges), default=0),
    )


@dataclass(frozen=True)
class RedisStatus:
    nodes: list[NodeStatus]
    expected_masters: int
    replicas_per_master: int

    @property
    def masters(self) -> int:
        return sum(n.running and n.role == "master" for n in self.nodes)

    @property
    def replicas(self) -> int:
        return sum(n.running and n.role == "slave" for n in self.nodes)

    @property
    def replicas_linked(self) -> int:
        return sum(n.running and n.role == "slave" and n.link_up for n in self.nodes)

    @property
    def all_running(self) -> bool:
        return all(n.running for n in self.nodes)

    @property
    def formed(self) -> bool:
        size = len(self.nodes)
        return all(n.known_nodes == size and n.slots_assigned == CLUSTER_SLOTS for n in self.nodes)

    @property
    def blank(self) -> bool:
        """No node has met another or owns a slot: `--cluster create` can run."""
        return all(n.known_nodes <= 1 and n.slots_assigned == 0 for n in self.nodes)

    @property
    def ready(self) -> bool:
        return (
            self.all_running
            and self.formed
            and all(n.cluster_state == "ok" for n in self.nodes)
            and self.masters == self.expected_masters
            and self.replicas_linked == len(self.nodes) - self.expected_masters
            and all(n.slot_replicas >= self.replicas_per_master for n in self.nodes)
        )


def status(cfg: InfraSettings) -> RedisStatus:
    masters = len(cfg.redis_ports) // (cfg.redis_replicas + 1)
    nodes = [node_status(cfg, p) for p in cfg.redis_ports]
    return RedisStatus(nodes, expected_masters=masters, replicas_per_master=cfg.redis_replicas)


def secure_node_config(cfg: InfraSettings, port: int) -> list[str]:
    """A secure node's ACL file and replication login, written beside its data.

    The config file, not the command line, holds masterauth: `ps` shows command lines.
    """
    found = credentials.require(cfg)
    node_dir = cfg.redis_node_dir(port)
    acl_file, conf = node_dir / "users.acl", node_dir / "secure.conf"
    credentials.write_private(acl_file, redis_acl_file(found.redis_sha256()))
    lines = [f"aclfile {acl_file}", f"masteruser {Role.ADMIN}", f"masterauth {found.redis[Role.ADMIN]}"]
    credentials.write_private(conf, "\n".join(lines) + "\n")
    return [str(conf)]


def start_node(cfg: InfraSettings, port: int, server: str) -> None:
    node_dir = cfg.redis_node_dir(port)
    node_dir.mkdir(parents=True, exist_ok=True)
    command = [
        server, *(secure_node_config(cfg, port) if cfg.secure else []), "--port", str(port), "--bind", cfg.redis_host,
        "--cluster-enabled", "yes", "--cluster-config-file", f"nodes-{port}.conf",
        "--cluster-node-timeout", str(cfg.redis_node_timeout_ms),
        "--dir", str(node_dir), "--daemonize", "yes",
        "--pidfile", str(node_dir / "redis.pid"), "--logfile", str(cfg.redis_log_file(port)),
        # A cache of routes for development: no snapshots or append-only file.
        "--save", "", "--appendonly", "no",
        # Masters ping replicas every second (default 10): replica offsets leave 0
        # at once, so the slot map lists them, and a replica's data age stays fresh
        # enough for it to be allowed to take over soon after the cluster forms.
        "--repl-ping-replica-period", "1",
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=15)
    if done.returncode != 0:
        raise InfraError(f"redis-server on port {port} failed to start: {done.stderr.strip()}")


def _wait_running(cfg: InfraSettings, ports: list[int], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    pending = list(ports)
    while pending:
        pending = [p for p in pending if not node_status(cfg, p).running]
        if pending and time.monotonic() > deadline:
            port = pending[0]
            raise InfraError(
                f"redis on port {port} does not answer (port, or bus port {port + 10000}, "
                f"taken?); end of "
                f"{cfg.redis_log_file(port)}:\n{log_tail(cfg.redis_log_file(port))}"
            )
        time.sleep(0.05)


def create_cluster(cfg: InfraSettings, cli: str, report: Report) -> None:
    addresses = [f"{cfg.redis_host}:{p}" for p in cfg.redis_ports]
    report(f"redis: forming the cluster ({cfg.redis_replicas} replica per master)")
    command = [cli, "--cluster", "create", *addresses,
               "--cluster-replicas", str(cfg.redis_replicas), "--cluster-yes"]  # fmt: skip
    env = None
    if cfg.secure:
        # redis-cli reads the password from REDISCLI_AUTH, out of sight of `ps`.
        command += ["--user", str(Role.ADMIN)]
        env = {**os.environ, "REDISCLI_AUTH": credentials.require(cfg).redis[Role.ADMIN]}
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)
    except subprocess.TimeoutExpired as exc:
        raise InfraError("`redis-cli --cluster create` took over 120 s") from exc
    if done.returncode != 0 or "[OK]" not in done.stdout:
        raise InfraError(f"redis-cli --cluster create failed:\n{done.stdout[-2000:]}{done.stderr}")


def wait_ready(cfg: InfraSettings) -> RedisStatus:
    deadline = time.monotonic() + cfg.redis_ready_timeout_s
    while not (current := status(cfg)).ready:
        if time.monotonic() > deadline:
            raise InfraError(
                f"Redis Cluster not ready after {cfg.redis_ready_timeout_s:.0f} s: "
                f"{describe(current)}; logs in {cfg.redis_dir}/<port>/redis.log"
            )
        time.sleep(0.1)
    return current


def describe(current: RedisStatus) -> str:
    down = [n.port for n in current.nodes if not n.running]
    states = sorted({n.cluster_state for n in current.nodes if n.running})
    text = (
        f"{current.masters} masters, {current.replicas} replicas "
        f"({current.replicas_linked} linked), cluster_state {'/'.join(states) or '-'}"
    )
    hidden = sum(n.running and n.slot_replicas < current.replicas_per_master for n in current.nodes)
    text += f", {hidden} nodes' slot maps lack replicas" if hidden else ""
    return text + (f", nodes down: {down}" if down else "")


def up(cfg: InfraSettings, report: Report) -> RedisStatus:
    """Idempotent: start missing nodes, form the cluster if blank, wait until ready."""
    current = status(cfg)
    if current.ready:
        return current
    if not current.all_running:
        server, _ = find_redis(report)
        stopped = [n.port for n in current.nodes if not n.running]
        for port in stopped:
            start_node(cfg, port, server)
        _wait_running(cfg, stopped)
        report(f"redis: started nodes {stopped}, logs in {cfg.redis_dir}/<port>/redis.log")
        current = status(cfg)
    if not current.formed:
        if not current.blank:
            raise InfraError(
                "the Redis nodes are half-formed into a cluster (" + describe(current) + "); "
                "`drivetrain infra down --only redis --purge` then `up` starts afresh"
            )
        _, cli = find_redis(report)
        create_cluster(cfg, cli, report)
    started = time.monotonic()
    ready = wait_ready(cfg)
    report(f"redis: ready after {time.monotonic() - started:.1f} s: {describe(ready)}")
    return ready


def _kill_from_pidfile(cfg: InfraSettings, port: int) -> None:
    try:
        pid = int((cfg.redis_node_dir(port) / "redis.pid").read_text().strip())
    except (OSError, ValueError):
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def _shutdown_node(cfg: InfraSettings, port: int) -> None:
    try:
        with _client(cfg, port) as client:
            # NOW: do not wait for lagging replicas; NOSAVE: nothing here is kept.
            client.shutdown(nosave=True, now=True)
    except redis.RedisError:
        _kill_from_pidfile(cfg, port)
    deadline = time.monotonic() + 10.0
    while node_status(cfg, port).running:
        if time.monotonic() > deadline:
            _kill_from_pidfile(cfg, port)
            break
        time.sleep(0.05)


def down(cfg: InfraSettings, report: Report) -> list[int]:
    """Shut every running node down; replicas first, so no failover starts meanwhile."""
    current = status(cfg)
    running = [n for n in current.nodes if n.running]
    running.sort(key=lambda n: n.role != "slave")
    for node in running:
        _shutdown_node(cfg, node.port)
    ports = [n.port for n in running]
    if ports:
        report(f"redis: stopped nodes {sorted(ports)}")
    return ports
