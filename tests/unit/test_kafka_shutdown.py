"""Stopping a Kafka client whose broker is gone: aiokafka's stop() failing from inside, or never
returning, still ends with the connections closed; the caller's own cancellation goes on up; a
commit never holds a stop.
(Against a real broker that goes away: tests/fault/test_broker_loss.py.)"""

from __future__ import annotations

import asyncio

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.errors import KafkaTimeoutError

from shared.kafka_shutdown import commit_bounded, stop_client


class Connections:
    def __init__(self) -> None:
        self.closed = False
        self._sync_task = None  # AIOKafkaClient's metadata task

    async def close(self) -> None:
        self.closed = True


class CancelledInside(AIOKafkaConsumer):
    """As aiokafka's fetcher does with the broker gone: its own task's cancellation escapes."""

    async def stop(self) -> None:
        self._closed = True  # as aiokafka's stop() does first
        raise asyncio.CancelledError


class NeverStops(AIOKafkaConsumer):
    async def stop(self) -> None:
        self._closed = True
        await asyncio.sleep(3600)


def consumer(kind: type[AIOKafkaConsumer]) -> tuple[AIOKafkaConsumer, Connections]:
    client = kind(bootstrap_servers="127.0.0.1:1")
    client._client = Connections()
    return client, client._client


async def test_a_cancellation_from_inside_stop_is_not_the_callers_and_the_connections_close():
    client, connections = consumer(CancelledInside)
    await stop_client(client)
    assert connections.closed


async def test_a_stop_that_never_returns_is_cut_short_and_the_connections_close():
    client, connections = consumer(NeverStops)
    await asyncio.wait_for(stop_client(client, within_s=0.05), 5)
    assert connections.closed


async def test_the_callers_own_cancellation_goes_on_up():
    client, connections = consumer(NeverStops)
    stopping = asyncio.create_task(stop_client(client))
    await asyncio.sleep(0.01)
    stopping.cancel()
    with pytest.raises(asyncio.CancelledError):
        await stopping
    assert not connections.closed


class NeverFlushes(AIOKafkaProducer):
    async def stop(self) -> None:
        self._closed = True
        await asyncio.sleep(3600)


async def test_a_producer_that_cannot_deliver_fails_its_records_and_closes_without_an_error_logged(caplog):
    client = NeverFlushes(bootstrap_servers="127.0.0.1:1", enable_idempotence=True)
    client.client = connections = Connections()

    async def sending() -> None:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            raise ConnectionError("a produce request in flight to the absent broker") from None

    # The sender as aiokafka starts it, its done callback included.
    client._sender._sender_task = asyncio.create_task(sending())
    client._sender._sender_task.add_done_callback(client._sender._fail_all)
    await asyncio.sleep(0)
    await stop_client(client, within_s=0.05)
    await asyncio.sleep(0)  # any done callbacks run
    assert connections.closed
    assert client._sender.sender_task.done()
    assert [r.message for r in caplog.records if r.levelname == "ERROR"] == []


async def test_records_queued_retried_and_in_flight_all_fail_and_aiokafka_logs_no_error(caplog):
    # aiokafka puts a batch whose produce request failed back in its queue for a retry: it leaves the
    # pending set then, but keeps the callback that removes it from there once it fails, and gets a
    # fresh drain waiter, which nobody awaits once the producer is stopping.
    client = NeverFlushes(bootstrap_servers="127.0.0.1:1", enable_idempotence=True)
    client.client = Connections()
    client._txn_manager.set_pid_and_epoch(1, 0)  # as the broker gives an idempotent producer at its start
    accumulator = client._message_accumulator
    deliveries = [await accumulator.add_message(TopicPartition("t", p), None, b"record", timeout=1) for p in range(3)]
    in_flight = accumulator._pop_batch(TopicPartition("t", 1))
    retried = accumulator._pop_batch(TopicPartition("t", 2))
    accumulator.reenqueue(retried)  # its produce request failed
    batches = [*accumulator._batches[TopicPartition("t", 0)], in_flight, retried]
    await stop_client(client, within_s=0.05)
    await asyncio.sleep(0)  # the batches' done callbacks run
    for delivery in deliveries:
        with pytest.raises(KafkaTimeoutError):
            await delivery
    assert [r.getMessage() for r in caplog.records if r.levelname == "ERROR"] == []
    # An exception set on a future that nobody retrieves is logged as an error when it is collected.
    assert not [batch for batch in batches if batch._drain_waiter._log_traceback]


async def test_a_batch_put_back_for_a_retry_after_the_stop_raises_nothing_inside_aiokafka(caplog):
    # A produce request that failed waits out a backoff, then puts its batches back in the queue, taking
    # them out of the pending set; a stop in between has failed them, and their callbacks took them out
    # already (a broker gone while the edge stopped, in tests/fault/test_broker_loss.py).
    client = NeverFlushes(bootstrap_servers="127.0.0.1:1", enable_idempotence=True)
    client.client = Connections()
    client._txn_manager.set_pid_and_epoch(1, 0)
    accumulator = client._message_accumulator
    delivery = await accumulator.add_message(TopicPartition("t", 0), None, b"record", timeout=1)
    in_flight = accumulator._pop_batch(TopicPartition("t", 0))
    await stop_client(client, within_s=0.05)
    await asyncio.sleep(0)  # its done callback runs
    accumulator.reenqueue(in_flight)  # the request's backoff ends
    await asyncio.sleep(0)
    with pytest.raises(KafkaTimeoutError):
        await delivery
    assert [r.getMessage() for r in caplog.records if r.levelname == "ERROR"] == []


async def test_a_metadata_task_that_fails_as_it_stops_still_lets_the_connections_close(caplog):
    # aiokafka's client cancels its metadata task on close and awaits it; a request that task was
    # writing to a connection the broker had dropped raised instead (a closed transport), and close()
    # raised it in turn, out of the service's shutdown, its connections left open.
    client = NeverStops(bootstrap_servers="127.0.0.1:1")
    connections = client._client

    async def synchronizing() -> None:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            raise RuntimeError("unable to perform operation on <TCPTransport closed=True>") from None

    connections._sync_task = asyncio.create_task(synchronizing())
    closed = []
    conn = type("Conn", (), {"close": lambda self, reason=None: closed.append(reason) or asyncio.sleep(0)})()
    connections._conns = {1: conn}
    await asyncio.sleep(0)
    await asyncio.wait_for(stop_client(client, within_s=0.05), 5)
    assert closed and connections._sync_task is None
    assert [r.getMessage() for r in caplog.records if r.levelname == "ERROR"] == []


class NeverCommits(AIOKafkaConsumer):
    """As aiokafka's commit does with the broker gone: it waits for a group coordinator, whatever it
    is given to commit, an empty mapping included."""

    commits = 0

    async def commit(self, offsets=None) -> None:
        self.commits += 1
        await asyncio.sleep(3600)


async def test_a_commit_is_skipped_when_empty_and_bounded_otherwise(caplog):
    client, _ = consumer(NeverCommits)
    await asyncio.wait_for(commit_bounded(client, {}), 1)
    assert client.commits == 0
    await asyncio.wait_for(commit_bounded(client, {TopicPartition("t", 0): 5}, within_s=0.05), 5)
    assert client.commits == 1 and "a commit found no broker" in caplog.text
