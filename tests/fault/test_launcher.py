"""The product's own launcher under faults: `drivetrain up` keeps serving when a child dies, says so,
and starts it again; Ctrl-C / SIGTERM stops everything; a failed start leaves nothing behind."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from services.launcher.fleet import Fleet
from services.launcher.spec import FleetSpec
from shared.chat_client import ChatResult, ChatSocket
from tests.conftest import RESUME_GRACE_S, TEST_PORT
from tests.fault.conftest import assert_worker_loss, finish, intact, start_streams

SPEC = FleetSpec.at(TEST_PORT, edges=2, workers=2, routers=2)


def health(url: str) -> dict | None:
    try:
        with urllib.request.urlopen(url, timeout=1.0) as response:
            return json.loads(response.read()) | {"http": response.status}
    except urllib.error.HTTPError as exc:
        return json.loads(exc.read()) | {"http": exc.code}
    except (urllib.error.URLError, OSError):
        return None


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@dataclass
class Launcher:
    process: subprocess.Popen
    output: Path

    def said(self, text: str) -> bool:
        return text in self.output.read_text(errors="replace")

    def wait_for(self, predicate, what: str, timeout: float = 90.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.process.poll() is None, f"drivetrain up exited: {self.output.read_text()[-3000:]}"
            if value := predicate():
                return value
            time.sleep(0.2)
        raise AssertionError(f"{what} within {timeout} s; launcher said:\n{self.output.read_text()[-3000:]}")

    def serving_pid(self, url: str, other_than: int | None = None) -> int:
        def serving() -> int | None:
            body = health(url)
            ok = body is not None and body["http"] == 200 and body["pid"] != other_than
            return body["pid"] if ok else None

        return self.wait_for(serving, f"{url} serving (pid other than {other_than})")


def children_urls() -> dict[str, str]:
    return {spec.name: spec.health_url for spec in
            [*map(SPEC.edge, range(2)), *map(SPEC.worker, range(2)), *map(SPEC.router, range(2))]}


def run_up(log_dir: Path, *flags: str) -> Launcher:
    output = log_dir / f"drivetrain-up-{uuid.uuid4().hex[:6]}.out"
    env = {
        **os.environ,
        "DRIVETRAIN_TOPICS_PREFIX": f"test-up-{uuid.uuid4().hex[:8]}",
        "DRIVETRAIN_RESUME_GRACE_S": str(RESUME_GRACE_S),
    }
    command = [
        sys.executable, "-m", "services.cli", "up", "--model", "echo", "--echo-delay-ms", "20",
        "--edges", "2", "--workers", "2", "--routers", "2", "--base-port", str(TEST_PORT),
        "--log-dir", str(log_dir / "up"), *flags,
    ]  # fmt: skip
    with output.open("wb") as sink:
        process = subprocess.Popen(command, env=env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
    launcher = Launcher(process, output)
    launcher.wait_for(lambda: launcher.said("Drivetrain is up"), "the fleet up", timeout=180)
    return launcher


@pytest.fixture
def up(fleet_logs, infra) -> Iterator[Launcher]:
    launcher = run_up(fleet_logs)
    yield launcher
    if launcher.process.poll() is None:
        launcher.process.send_signal(signal.SIGTERM)
        launcher.process.wait(60)


async def chat_once(url: str, text: str, timeout: float = 60.0) -> ChatResult:
    sock = await ChatSocket.open(url)
    try:
        await sock.chat("p", text)
        return await sock.collect("p", timeout=timeout)
    finally:
        await sock.close()


@dataclass
class Chat:
    text: str
    started_at: float
    result: ChatResult


async def keep_chatting(stop: asyncio.Event) -> list[Chat]:
    """A new chat every 0.3 s, alternately on each edge, until told to stop; every one is kept."""
    pending: list[tuple[str, float, asyncio.Task[ChatResult]]] = []
    n = 0
    try:
        while not stop.is_set():
            text = f"still here {n}"
            started_at = time.perf_counter()
            pending.append((text, started_at, asyncio.create_task(chat_once(SPEC.chat_url(n % 2), text))))
            n += 1
            try:
                await asyncio.wait_for(stop.wait(), 0.3)
            except TimeoutError:
                pass
        return [Chat(text, started_at, await task) for text, started_at, task in pending]
    finally:
        for _, _, task in pending:  # cancelled: none may chat on into the next test's fleet
            task.cancel()


async def test_a_killed_worker_and_router_are_restarted_while_the_fleet_serves(up: Launcher):
    worker_url, router_url = SPEC.worker(0).health_url, SPEC.router(0).health_url
    stop = asyncio.Event()
    chatting = asyncio.create_task(keep_chatting(stop))
    try:
        # A worker dies mid-stream: its streams fail fast, the others finish, and it comes back.
        sockets = [s for edge in range(2) for s in (await start_streams(SPEC.chat_url(edge), 10))[0]]
        await asyncio.sleep(0.5)
        worker_pid = health(worker_url)["pid"]
        os.kill(worker_pid, signal.SIGKILL)
        killed_at = time.perf_counter()
        results = await finish(sockets)
        assert_worker_loss(results, killed_at)
        new_worker = await asyncio.to_thread(up.serving_pid, worker_url, worker_pid)
        assert new_worker != worker_pid and up.said("worker-0 killed by SIGKILL; restarting in")
        assert up.said(f"worker-0 restarted (pid {new_worker})")
        # The launcher notices on its next round (every 0.25 s) what the test may have seen first.
        back = lambda: up.said("worker-0 is serving again")  # noqa: E731
        await asyncio.to_thread(up.wait_for, back, "the launcher to see it back", 10)

        # A router dies mid-stream: no stream loses anything, and it comes back.
        sockets = [s for edge in range(2) for s in (await start_streams(SPEC.chat_url(edge), 5))[0]]
        await asyncio.sleep(0.5)
        router_pid = health(router_url)["pid"]
        os.kill(router_pid, signal.SIGKILL)
        results = await finish(sockets)
        assert all(intact(r) for r in results), [r.final for r in results if not intact(r)]
        new_router = await asyncio.to_thread(up.serving_pid, router_url, router_pid)
        assert new_router != router_pid and up.said("router-0 killed by SIGKILL")
        assert up.said(f"router-0 restarted (pid {new_router})")

        stop.set()
        chats = await chatting
    finally:
        # Every test shares one event loop: chats left running after a failure here would go on
        # to the next test's fleet, on the same ports with the same key, and count as its own.
        chatting.cancel()
    assert len(chats) > 10
    # A chat the killed worker was serving ends with a retryable worker_lost, like the streams above,
    # and one it was starting is quarantined by the worker after it (never run twice); every other
    # chat, and every chat started after the kill, is served in full.
    lost = ("worker_lost", "request_quarantined")
    lost_at_kill = [c for c in chats if c.started_at < killed_at and c.result.final.get("code") in lost]
    failed = [(c.text, c.result.final) for c in chats
              if c not in lost_at_kill and (c.result.final["type"] != "done" or c.result.text != c.text)]  # fmt: skip
    assert failed == [], "new chats must be served throughout"
    assert len([c for c in chats if c.started_at > killed_at]) > 5


async def test_sigterm_stops_every_child_even_when_sent_twice(up: Launcher):
    pids = {name: up.serving_pid(url) for name, url in children_urls().items()}
    up.process.send_signal(signal.SIGTERM)
    await asyncio.sleep(0.5)
    up.process.send_signal(signal.SIGTERM)  # an impatient supervisor: the shutdown still runs to its end
    assert up.process.wait(60) == 0
    assert [name for name, pid in pids.items() if pid_alive(pid)] == []
    assert all(health(url) is None for url in children_urls().values())


async def test_without_restarts_a_dead_child_stays_dead_and_the_rest_serves(fleet_logs, infra):
    launcher = run_up(fleet_logs, "--no-restart")
    try:
        url = SPEC.worker(1).health_url
        os.kill(health(url)["pid"], signal.SIGKILL)
        launcher.wait_for(lambda: launcher.said("worker-1 killed by SIGKILL; left stopped"), "the death reported")
        result = await chat_once(SPEC.chat_url(0), "one worker is enough", timeout=60)
        assert result.final["type"] == "done" and result.text == "one worker is enough"
        assert health(url) is None and launcher.process.poll() is None
    finally:
        launcher.process.send_signal(signal.SIGTERM)
        assert launcher.process.wait(60) == 0


def test_a_failed_start_stops_every_child_it_started(fleet_logs, infra, topics):
    started: list[subprocess.Popen] = []

    class Recording(Fleet):
        def start_child(self, spec, life=None):
            child = super().start_child(spec, life)
            started.append(child.process)
            return child

    spec = FleetSpec.at(TEST_PORT, edges=1, routers=1, workers=1, worker_args=("--model", "nowhere"),
                        extra_env={"DRIVETRAIN_TOPICS_PREFIX": topics.prefix})
    fleet = Recording(spec, log_dir=fleet_logs, echo_logs=False)
    with pytest.raises(RuntimeError, match="worker-0 exited with code 2"):
        fleet.start(ready_timeout_s=120)
    assert len(started) == 3 and all(process.poll() is not None for process in started)
    assert fleet.children == {}
