"""Disaggregated workers dying or stalling around a handoff: each stream ends with the usual
retryable code within the usual bound, or, when nothing was handed over yet, is decoded by the
prefill worker after all; and no KV block stays held on either side."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Callable, Iterator

import pytest

from services.launcher.fleet import Fleet
from shared.chat_client import ChatResult, ChatSocket
from tests.conftest import eventually, start_fleet
from tests.fault.conftest import WORKER_LOSS_WITHIN_S
from tests.integration.test_metrics import scrape, value

PROMPT = "Write down every number you know, one after the other, and never stop."
PREFILL, DECODE = "worker-0", "worker-1"


@pytest.fixture
def make_pair(topics, fleet_logs) -> Iterator[Callable[..., Fleet]]:
    fleets: list[Fleet] = []

    def make(*worker_args: str) -> Fleet:
        fleet = start_fleet(topics, fleet_logs, workers=2, decode_workers=1, model="tiny", worker_args=worker_args)
        fleets.append(fleet)
        return fleet

    yield make
    for fleet in fleets:
        for child in fleet.children.values():
            child.process.send_signal(signal.SIGCONT)  # a stopped child could not drain
        fleet.stop()


def metric(fleet: Fleet, worker: int, name: str, **labels: str) -> float:
    return value(scrape(fleet.spec.worker_metrics_port(worker)), name, **labels)


async def decoder_ready(fleet: Fleet) -> None:
    """A first chat is handed off: the prefill worker's gossip knows the decode worker."""
    sock = await ChatSocket.open(fleet.spec.chat_url(0))
    try:
        for i in range(50):
            await sock.send(chat(f"warm{i}", 4))
            assert (await sock.collect(f"warm{i}", timeout=30)).final["type"] == "done"
            if metric(fleet, 0, "drivetrain_worker_handoffs_total", outcome="handed_off"):
                return
            await asyncio.sleep(0.2)
    finally:
        await sock.close()
    raise AssertionError("no chat was ever handed off")


def chat(chat_id: str, max_tokens: int) -> dict:
    return {"type": "chat", "id": chat_id, "messages": [{"role": "user", "content": PROMPT}],
            "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}  # fmt: skip


def gap_free(result: ChatResult) -> bool:
    """The tokens collected run on without a gap (from wherever collecting began)."""
    seqs = [t["seq"] for t in result.tokens]
    return seqs == list(range(seqs[0], seqs[0] + len(seqs))) if seqs else True


def stop(fleet: Fleet, name: str, sig: int) -> None:
    fleet.children[name].process.send_signal(sig)


async def test_a_decode_worker_killed_after_the_handoff_ends_its_streams_fast(make_pair):
    fleet = make_pair()
    await decoder_ready(fleet)
    sockets = [await ChatSocket.open(fleet.spec.chat_url(0)) for _ in range(3)]
    try:
        for sock in sockets:
            await sock.send(chat("c", 8000))
        for sock in sockets:  # each is streaming from the decode worker: past its handoff
            while (frame := await sock.next_frame("c"))["type"] != "token" or frame["seq"] < 20:
                assert frame["type"] in ("accepted", "token"), frame
        fleet.kill(DECODE)
        killed_at = time.perf_counter()
        results = await asyncio.gather(*(sock.collect("c", timeout=30) for sock in sockets))
    finally:
        await asyncio.gather(*(sock.close() for sock in sockets), return_exceptions=True)
    for result in results:
        assert result.final["type"] == "error" and result.final["code"] == "worker_lost", result.final
        assert result.final["retryable"] is True and gap_free(result)
        waited = result.arrivals[-1] - killed_at
        assert waited <= WORKER_LOSS_WITHIN_S, f"error after {waited:.2f} s"


async def test_a_prefill_worker_killed_during_its_handoff_ends_the_stream_and_the_decoder_holds_nothing(make_pair):
    fleet = make_pair()
    await decoder_ready(fleet)
    free = metric(fleet, 1, "drivetrain_worker_kv_free_blocks")
    stop(fleet, DECODE, signal.SIGSTOP)  # the handoff hangs on the decode worker's side of the link
    sock = await ChatSocket.open(fleet.spec.chat_url(0))
    try:
        await sock.send(chat("c", 200))
        while (await sock.next_frame("c"))["type"] != "token":
            pass  # the first token is out: the prefill worker is handing the request off now
        fleet.kill(PREFILL)
        killed_at = time.perf_counter()
        result = await sock.collect("c", timeout=30)
    finally:
        await sock.close()
        stop(fleet, DECODE, signal.SIGCONT)
    assert result.final["type"] == "error" and result.final["code"] == "worker_lost", result.final
    # The stopped decode worker cannot confirm the suspicion, so it runs its unconfirmed length
    # (suspicion_max_timeout_mult x suspicion_mult x probe_interval = 1.2 s): a second more than
    # the bound where every member is awake.
    assert result.arrivals[-1] - killed_at <= 3.0, f"error after {result.arrivals[-1] - killed_at:.2f} s"
    await asyncio.sleep(1.0)  # the decode worker reads the dead link and lets it go
    assert metric(fleet, 1, "drivetrain_worker_kv_free_blocks") == free
    assert metric(fleet, 1, "drivetrain_worker_running_requests") == 0


async def test_a_handoff_that_times_out_is_decoded_by_the_prefill_worker(make_pair):
    fleet = make_pair("--kv-link.timeout-s", "1.5")
    await decoder_ready(fleet)
    free = [metric(fleet, i, "drivetrain_worker_kv_free_blocks") for i in (0, 1)]
    handed = metric(fleet, 0, "drivetrain_worker_handoffs_total", outcome="handed_off")
    stop(fleet, DECODE, signal.SIGSTOP)
    sock = await ChatSocket.open(fleet.spec.chat_url(0))
    try:
        await sock.send(chat("late", 40))
        late = await sock.collect("late", timeout=30)
        stop(fleet, DECODE, signal.SIGCONT)
        await eventually(lambda: metric(fleet, 1, "drivetrain_worker_kv_free_blocks") == free[1])
        await sock.send(chat("again", 40))  # the decode worker is back: handoffs land again
        again = await sock.collect("again", timeout=30)
    finally:
        await sock.close()
    assert late.final["type"] == "done" and gap_free(late) and late.final["usage"]["completion_tokens"] == 40
    assert again.final["type"] == "done" and again.text == late.text
    assert metric(fleet, 0, "drivetrain_worker_handoffs_total", outcome="decoded_here") >= 1
    assert metric(fleet, 0, "drivetrain_worker_handoffs_total", outcome="handed_off") == handed + 1
    await eventually(lambda: [metric(fleet, i, "drivetrain_worker_kv_free_blocks") for i in (0, 1)] == free)
