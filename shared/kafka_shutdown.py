"""Stopping a Kafka client for good, whatever became of the broker.

aiokafka's `stop()` marks a client closed first and closes its connections last, and with the
broker gone it fails or hangs in between: a consumer's fetcher awaits the fetch task it has just
cancelled, so that task's CancelledError escapes `stop()` (aio-libs/aiokafka#647); a producer
waits, with no end, to deliver what it holds to a broker that is not there. A caller that took
the first for its own cancellation ended its shutdown there, leaving its other clients open; the
second held a service until its stop backstop. Here a stop has a bound, a producer's undelivered
records then fail (as any send to an absent broker would), the connections are closed all the
same, and only a cancellation of the caller goes on up.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from aiokafka import AIOKafkaClient, AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.errors import KafkaTimeoutError

log = logging.getLogger(__name__)

STOP_WITHIN_S = 5.0  # leaving the group and flushing take milliseconds with a broker there
COMMIT_WITHIN_S = 2.0  # a commit takes one round trip with a broker there


async def stop_client(client: AIOKafkaConsumer | AIOKafkaProducer, within_s: float = STOP_WITHIN_S) -> None:
    """Leave the group, flush, close; if that fails or overruns, drop what is unsent and close."""
    try:
        async with asyncio.timeout(within_s):
            await client.stop()
        return
    except asyncio.CancelledError:
        if _caller_cancelled():
            raise
        why = "its own fetch was cancelled"
    except TimeoutError:
        why = f"no broker answered within {within_s:.0f} s"
    except Exception as exc:  # the broker's error: there is nothing more to do with it
        why = repr(exc)
    log.warning("a Kafka client stopped part-way (%s); closing its connections regardless", why)
    await _abandon(client)


async def commit_bounded(consumer: AIOKafkaConsumer, offsets: dict, within_s: float = COMMIT_WITHIN_S) -> None:
    """A commit that gives up: nothing to commit, no call; else bounded, since aiokafka's commit
    waits for a group coordinator with no end, even with nothing to commit, and a broker gone would
    hold a stopping service until its backstop. A commit not made leaves the partitions' next owner
    to read those records again from the last one made."""
    if not offsets:
        return
    try:
        async with asyncio.timeout(within_s):
            await consumer.commit(offsets)
    except TimeoutError:
        log.warning("a commit found no broker within %.0f s; the next owner re-reads from the one before", within_s)
    except Exception as exc:  # noqa: BLE001 - the broker's or the group's error: the next owner re-reads
        log.warning("a commit failed (%r); the next owner re-reads from the one before", exc)


def _caller_cancelled() -> bool:
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


async def _abandon(client: AIOKafkaConsumer | AIOKafkaProducer) -> None:
    """What `stop()` left undone, through the parts it uses (aiokafka has no public way)."""
    if isinstance(client, AIOKafkaProducer):
        _fail_undelivered(client)
        sender = client._sender
        if sender.sender_task is not None:
            # Its callback for a sender that failed would fail the batches again and then raise
            # inside aiokafka (an idempotent producer has no transaction to fail): they are failed.
            sender.sender_task.remove_done_callback(sender._fail_all)
        with contextlib.suppress(Exception):
            await sender.close()
        connections = client.client
    else:
        connections = client._client
    await _close_connections(connections)


async def _close_connections(connections: AIOKafkaClient) -> None:
    """AIOKafkaClient.close, whose metadata task, cancelled, can fail instead of stopping: a request it was
    writing to a connection the broker dropped raises, close() raises that in turn, and the connections
    stay open. That failure is the broker's absence, already known; the connections close regardless."""
    sync_task = connections._sync_task
    if sync_task is not None:
        sync_task.cancel()
        try:
            await sync_task
        except asyncio.CancelledError:
            if _caller_cancelled():
                raise
        except Exception as exc:  # noqa: BLE001 - the absent broker's error, from inside aiokafka
            log.info("the Kafka client's metadata task failed as it stopped (%r)", exc)
        connections._sync_task = None
    await connections.close()


class _ForgivingPending(set):
    """An abandoned producer's pending batches: a batch may leave twice, and the second time is no error.
    A produce request that failed waits out a backoff before it puts its batches back in the queue
    (taking them out of this set); failed meanwhile, each batch's own callback takes it out as well,
    and whichever comes second raised a KeyError inside aiokafka."""

    def remove(self, batch: object) -> None:
        self.discard(batch)


def _fail_undelivered(producer: AIOKafkaProducer) -> None:
    """Fail every record the producer still holds, queued or in flight, as its sender does when it
    fails. Three things aiokafka leaves wrong for that are set right around it: a batch put back in
    the queue for a retry has left the pending set yet keeps the callback that removes it from there
    once it fails (a KeyError inside aiokafka); a batch whose request is waiting out its backoff is
    put back after it failed (_ForgivingPending); and a failed batch's drain waiter, which nobody
    awaits once the producer is stopping, would be logged as an exception never retrieved."""
    accumulator = producer._message_accumulator
    queued = [batch for batches in accumulator._batches.values() for batch in batches]
    accumulator._pending_batches = _ForgivingPending(accumulator._pending_batches)
    accumulator._pending_batches.update(batch for batch in queued if batch.retry_count > 0)
    held = {*queued, *accumulator._pending_batches}
    accumulator.fail_all(KafkaTimeoutError("the producer stopped before delivering"))
    for batch in held:
        if batch._drain_waiter.done() and not batch._drain_waiter.cancelled():
            batch._drain_waiter.exception()  # marks it retrieved; a waiter still awaiting it gets it all the same
