"""A worker's usage records: one for each stream it ends, queued before the event that ends it.

The record goes on the same idempotent producer as the stream's last token batch and is
queued first, so the broker has it no later than the `done` a client sees. Counts are the
engine's when it gave them (done, cancelled, a request that failed alone); a stream the
worker ends itself (the drain timeout, a broken token path) has the tokens that went out
and the prompt as its edge counted it.
"""

from __future__ import annotations

import time

from services.worker.convert import wire_usage
from services.worker.engine.types import EngineOutput
from services.worker.streams import Stream
from shared.codes import ErrorCode, FinishReason
from shared.metering.publisher import UsagePublisher
from shared.metering.records import usage_record


class WorkerMeter:
    def __init__(self, publisher: UsagePublisher, worker_id: str) -> None:
        self._publisher = publisher
        self._worker_id = worker_id

    async def output_ended(self, stream: Stream, output: EngineOutput) -> None:
        """The engine ended the stream (its events already counted into `stream.next_seq`)."""
        if stream.usage is None:
            return  # never given to the engine (cancelled before it arrived): nothing was done
        failure = output.failure
        record = usage_record(
            stream.request_id, stream.usage, self._worker_id, self._worker_id, time.time(),
            usage=wire_usage(output.usage) if output.usage is not None else None,
            tokens_sent=stream.next_seq,
            finish_reason=None if failure is not None else FinishReason(output.finish_reason),
            error=ErrorCode(failure.code) if failure is not None else None,
        )
        await self._publisher.publish(record)

    async def worker_ended(self, streams: list[Stream], error: ErrorCode) -> None:
        """The worker ended these streams itself, without the engine's counts."""
        now = time.time()
        for stream in streams:
            if stream.usage is not None:
                record = usage_record(
                    stream.request_id, stream.usage, self._worker_id, self._worker_id, now,
                    tokens_sent=stream.next_seq, error=error,
                )
                await self._publisher.publish(record)
