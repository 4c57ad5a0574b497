"""A single-node Kafka broker (KRaft, broker and controller in one JVM) run from Maven jars.

Fetches the jars once, formats the storage once, starts `kafka.Kafka` detached with a
pid file, waits for an admin request to succeed, and stops it with SIGTERM then SIGKILL.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import os
import shutil
import signal
import string
import subprocess
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path

from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import KafkaError

from shared.infra import credentials
from shared.infra.acls import grant_roles
from shared.infra.errors import InfraError, MissingPrerequisite
from shared.infra.permissions import Role
from shared.infra.process import log_tail, port_open, run_sync
from shared.infra.settings import COMPOSE_LOCAL_DIR, InfraSettings
from shared.infra.topics import TopicPlan, describe_partitions, prepare_broker

Report = Callable[[str], None]
MAIN_CLASS = "kafka.Kafka"


def jars_cached(cfg: InfraSettings) -> bool:
    return any(cfg.kafka_lib_dir.glob("kafka_2.13-*.jar"))


def find_java() -> str:
    java_home = os.environ.get("JAVA_HOME")
    if java_home and (Path(java_home) / "bin" / "java").exists():
        return str(Path(java_home) / "bin" / "java")
    java = shutil.which("java")
    if java is None:
        raise MissingPrerequisite(
            "java not found: Kafka needs a Java 17+ runtime "
            "(Debian: apt-get install -y openjdk-17-jre-headless)"
        )
    return java


def fetch_jars(cfg: InfraSettings, report: Report) -> float:
    """Copy Kafka and its runtime dependencies from Maven Central; returns seconds taken."""
    mvn = shutil.which("mvn")
    if mvn is None:
        raise MissingPrerequisite(
            f"mvn not found: it fetches the Kafka jars once into {cfg.kafka_lib_dir} "
            "(Debian: apt-get install -y maven)"
        )
    # Download beside the final folder and rename it at the end, so that an
    # interrupted download never looks like a complete one.
    partial = cfg.kafka_lib_dir.with_name(cfg.kafka_lib_dir.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.parent.mkdir(parents=True, exist_ok=True)
    command = [
        mvn, "-q", "-B", "-f", str(COMPOSE_LOCAL_DIR / "pom.xml"),
        "dependency:copy-dependencies", "-DincludeScope=runtime",
        f"-DoutputDirectory={partial}",
        f"-Dkafka.version={cfg.kafka_version}", f"-Dlog4j.version={cfg.log4j_version}",
    ]  # fmt: skip
    report(f"kafka: fetching kafka_2.13 {cfg.kafka_version} jars with Maven (once)")
    started = time.monotonic()
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=cfg.download_timeout_s
        )
    except subprocess.TimeoutExpired as exc:
        raise InfraError(f"Maven download took over {cfg.download_timeout_s:.0f} s") from exc
    if done.returncode != 0:
        output = (done.stdout + done.stderr).strip()[-3000:]
        raise InfraError(f"Maven could not fetch the Kafka jars:\n{output}")
    shutil.rmtree(cfg.kafka_lib_dir, ignore_errors=True)
    partial.rename(cfg.kafka_lib_dir)
    elapsed = time.monotonic() - started
    report(f"kafka: {len(list(cfg.kafka_lib_dir.glob('*.jar')))} jars in {elapsed:.1f} s")
    return elapsed


def server_properties(cfg: InfraSettings, secrets: credentials.InfraSecrets | None = None) -> str:
    """The broker's configuration, from the templates beside the POM (secure: with passwords)."""
    template = string.Template((COMPOSE_LOCAL_DIR / "kafka-server.properties").read_text())
    text = template.substitute(
        protocol="SASL_PLAINTEXT" if cfg.secure else "PLAINTEXT",
        host=cfg.kafka_host,
        port=cfg.kafka_port,
        controller_port=cfg.kafka_controller_port,
        data_dir=cfg.kafka_data_dir,
        offsets_partitions=cfg.kafka_offsets_partitions,
    )
    if not cfg.secure:
        return text
    if secrets is None:
        raise InfraError("the secure broker's configuration needs its secrets")
    security = string.Template((COMPOSE_LOCAL_DIR / "kafka-security.properties").read_text())
    return text + "\n" + security.substitute(
        admin_password=secrets.kafka[Role.ADMIN], controller_password=secrets.controller
    )


def client_auth(cfg: InfraSettings) -> dict[str, str]:
    """aiokafka keyword arguments that log the infra code in: none, or the admin user."""
    if not cfg.secure:
        return {}
    return {
        "security_protocol": "SASL_PLAINTEXT",
        "sasl_mechanism": "SCRAM-SHA-512",
        "sasl_plain_username": str(Role.ADMIN),
        "sasl_plain_password": credentials.require(cfg).kafka[Role.ADMIN],
    }


def new_cluster_id() -> str:
    """A cluster id as `StorageTool random-uuid` makes, without starting a JVM."""
    while True:
        cluster_id = base64.urlsafe_b64encode(uuid.uuid4().bytes).rstrip(b"=").decode()
        # Kafka's own generator never starts one with "-": command lines mistake it for a flag.
        if not cluster_id.startswith("-"):
            return cluster_id


def _java_command(cfg: InfraSettings, java: str, main: str, *args: str) -> list[str]:
    return [
        java, f"-Xms{cfg.kafka_heap}", f"-Xmx{cfg.kafka_heap}",
        "-XX:+UseG1GC", "-XX:MaxGCPauseMillis=20", "-XX:+ExitOnOutOfMemoryError",
        "-Djava.awt.headless=true",
        f"-Dlog4j2.configurationFile={COMPOSE_LOCAL_DIR / 'log4j2.xml'}",
        "-cp", f"{cfg.kafka_lib_dir}/*", main, *args,
    ]  # fmt: skip


def scram_arguments(secrets: credentials.InfraSecrets) -> list[str]:
    """`--add-scram` per user: KRaft has no other way to hold SCRAM users before it starts."""
    args: list[str] = []
    for role, password in secrets.kafka.items():
        args += ["--add-scram", f"SCRAM-SHA-512=[name={role},password={password}]"]
    return args


def format_storage(cfg: InfraSettings, java: str, report: Report) -> None:
    """Format the KRaft log directory once; a formatted one is left as it is."""
    if (cfg.kafka_data_dir / "meta.properties").exists():
        return
    cluster_id = new_cluster_id()
    report(f"kafka: formatting storage in {cfg.kafka_data_dir} (cluster id {cluster_id})")
    command = _java_command(
        cfg, java, "kafka.tools.StorageTool",
        "format", "--standalone", "-t", cluster_id, "-c", str(cfg.kafka_properties_file),
        *(scram_arguments(credentials.require(cfg)) if cfg.secure else []),
    )  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        raise InfraError(f"Kafka storage format failed:\n{(done.stdout + done.stderr)[-3000:]}")


def _is_running(pid: int) -> bool:
    """True if `pid` exists and is not a zombie, whatever it runs."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[0] not in ("Z", "X")


def _is_broker(pid: int) -> bool:
    """True if `pid` is a live (not zombie) JVM running kafka.Kafka."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return _is_running(pid) and MAIN_CLASS.encode() in cmdline.split(b"\0")


def broker_pid(cfg: InfraSettings) -> int | None:
    """Pid of the broker this infra dir started, if it is still running."""
    try:
        pid = int(cfg.kafka_pid_file.read_text().strip())
    except (OSError, ValueError):
        return None
    return pid if _is_broker(pid) else None


def start_broker(cfg: InfraSettings, java: str) -> int:
    """Start the broker in its own session, not as our child, and write its pid file."""
    log = cfg.kafka_log_file
    if log.exists():
        log.replace(log.with_name(log.name + ".1"))  # keep the previous run's log
    command = _java_command(cfg, java, MAIN_CLASS, str(cfg.kafka_properties_file))
    # A shell starts the JVM in the background and exits at once, so the broker is
    # reparented and never lingers as our zombie; it prints the JVM's pid.
    launcher = 'log=$1; shift; "$@" >>"$log" 2>&1 </dev/null & echo $!'
    done = subprocess.run(
        ["sh", "-c", launcher, "kafka-launcher", str(log), *command],
        capture_output=True, text=True, timeout=30, start_new_session=True,
    )  # fmt: skip
    if done.returncode != 0 or not done.stdout.strip().isdigit():
        raise InfraError(f"could not start the Kafka broker: {done.stderr.strip()}")
    pid = int(done.stdout.strip())
    cfg.kafka_pid_file.write_text(f"{pid}\n")
    return pid


def _signal_and_wait(pid: int, signum: signal.Signals, timeout_s: float) -> bool:
    """Send a signal and wait for the broker to exit; True if it did in time."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signum)
    deadline = time.monotonic() + timeout_s
    while _is_broker(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def stop_broker(cfg: InfraSettings, report: Report) -> bool:
    """SIGTERM, wait for a clean shutdown, SIGKILL if it takes too long. False if none ran."""
    pid = broker_pid(cfg)
    if pid is None:
        cfg.kafka_pid_file.unlink(missing_ok=True)
        return False
    report(f"kafka: stopping broker (pid {pid})")
    if not _signal_and_wait(pid, signal.SIGTERM, cfg.kafka_stop_timeout_s):
        report(f"kafka: no exit after {cfg.kafka_stop_timeout_s:.0f} s, sending SIGKILL")
        _signal_and_wait(pid, signal.SIGKILL, 10.0)
    cfg.kafka_pid_file.unlink(missing_ok=True)
    return True


@contextlib.asynccontextmanager
async def open_admin(
    cfg: InfraSettings, timeout_s: float = 5.0
) -> AsyncIterator[AIOKafkaAdminClient]:
    """An admin client whose start and requests give up after `timeout_s`."""
    admin = AIOKafkaAdminClient(
        bootstrap_servers=cfg.kafka_bootstrap, request_timeout_ms=int(timeout_s * 1000), **client_auth(cfg)
    )
    try:
        await asyncio.wait_for(admin.start(), timeout_s)
        yield admin
    finally:
        await admin.close()


async def _probe(cfg: InfraSettings, timeout_s: float, with_topics: bool) -> dict[str, int] | None:
    try:
        async with open_admin(cfg, timeout_s) as admin:
            await asyncio.wait_for(admin.describe_cluster(), timeout_s)
            if not with_topics:
                return {}
            names = list(cfg.topics.partitions())
            return await asyncio.wait_for(describe_partitions(admin, names), timeout_s)
    except (TimeoutError, KafkaError, OSError):
        return None


def probe(
    cfg: InfraSettings, with_topics: bool = False, timeout_s: float = 3.0
) -> dict[str, int] | None:
    """None unless a metadata request succeeds (a closed port is ruled out cheaply
    first); otherwise the project topics' partition counts, if asked for."""
    if not port_open(cfg.kafka_host, cfg.kafka_port):
        return None
    if cfg.secure and credentials.load(cfg) is None:
        return None  # not ours: it cannot be asked without the admin's password
    return run_sync(lambda: _probe(cfg, timeout_s, with_topics))


def answers(cfg: InfraSettings) -> bool:
    """Ready means a metadata request succeeds."""
    return probe(cfg) is not None


def wait_ready(cfg: InfraSettings, pid: int | None) -> float:
    """Wait until the broker answers; fail early, with its log, if the JVM exits."""
    started = time.monotonic()
    deadline = started + cfg.kafka_ready_timeout_s
    while not answers(cfg):
        # The pid is the one just started: whether it still runs is all that counts. Its command
        # line is no test here, as it reads empty while the process execs the JVM.
        if pid is not None and not _is_running(pid):
            raise InfraError(
                f"the Kafka broker exited during start-up; end of {cfg.kafka_log_file}:\n"
                + log_tail(cfg.kafka_log_file)
            )
        if time.monotonic() > deadline:
            raise InfraError(
                f"Kafka did not answer on {cfg.kafka_bootstrap} within "
                f"{cfg.kafka_ready_timeout_s:.0f} s; see {cfg.kafka_log_file}"
            )
        time.sleep(0.25)
    return time.monotonic() - started


def prepare_topics(cfg: InfraSettings) -> TopicPlan:
    """Create or grow the project topics (secure: grant the roles on them) and make the
    group coordinator ready."""

    async def prepare() -> TopicPlan:
        async with open_admin(cfg) as admin:
            plan = await prepare_broker(admin, cfg.topics.partitions())
            if cfg.secure:
                await grant_roles(admin, cfg.topics)
            return plan

    return run_sync(prepare)


@dataclass(frozen=True)
class KafkaStatus:
    pid: int | None  # our broker's pid, None if it is not running
    answering: bool  # a metadata request succeeded
    topics: dict[str, int] = field(default_factory=dict)  # project topic -> partitions

    def missing_topics(self, cfg: InfraSettings) -> list[str]:
        wanted = cfg.topics.partitions()
        return [name for name, n in wanted.items() if self.topics.get(name, 0) < n]


def status(cfg: InfraSettings) -> KafkaStatus:
    topics = probe(cfg, with_topics=True)
    return KafkaStatus(pid=broker_pid(cfg), answering=topics is not None, topics=topics or {})


def up(cfg: InfraSettings, report: Report) -> KafkaStatus:
    """Idempotent: fetch, format and start only what is missing, then wait until ready."""
    pid = broker_pid(cfg)
    if pid is None and answers(cfg):
        report(f"kafka: a broker not started from {cfg.infra_dir} answers; using it")
    elif pid is None:
        java = find_java()
        if not jars_cached(cfg):
            fetch_jars(cfg, report)
        for port in (cfg.kafka_port, cfg.kafka_controller_port):
            if port_open(cfg.kafka_host, port):
                raise InfraError(f"{cfg.kafka_host}:{port} is taken by another program")
        cfg.kafka_dir.mkdir(parents=True, exist_ok=True)
        found = credentials.require(cfg) if cfg.secure else None
        credentials.write_private(cfg.kafka_properties_file, server_properties(cfg, found))
        format_storage(cfg, java, report)
        pid = start_broker(cfg, java)
        report(f"kafka: started broker (pid {pid}), log {cfg.kafka_log_file}")
        waited = wait_ready(cfg, pid)
        report(f"kafka: ready on {cfg.kafka_bootstrap} after {waited:.1f} s")
    else:
        wait_ready(cfg, pid)
    plan = prepare_topics(cfg)
    for name, n in plan.create.items():
        report(f"kafka: created topic {name} ({n} partitions)")
    for name, n in plan.grow.items():
        report(f"kafka: grew topic {name} to {n} partitions")
    for name, (have, want) in plan.cannot_shrink.items():
        report(f"kafka: WARNING topic {name} has {have} partitions, layout says {want}; "
               "Kafka cannot remove partitions (`down --purge` starts afresh)")  # fmt: skip
    return status(cfg)
