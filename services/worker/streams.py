"""A worker's record of each stream it produces: where it goes, its seq, and what it said.

The record outlives the request by a grace period, so a client that reconnects
(to any edge) can have the stream replayed from the last seq it saw.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cachetools import TTLCache

from services.worker.convert import wire_events
from services.worker.engine.types import EngineOutput
from shared import wire
from shared.metering.records import UsageContext


@dataclass
class Stream:
    request_id: str
    edge_id: str
    epoch: int = 0
    next_seq: int = 0
    log: list[wire.Event] = field(default_factory=list)
    usage: UsageContext | None = None  # who is billed for it, once it has reached the engine
    consumed_at: float = 0.0  # when its request was taken from Kafka (unix seconds): times the start
    request: wire.ChatRequest | None = None  # kept by a prefill worker, to hand the request on with its KV

    def events_for(self, output: EngineOutput) -> list[wire.Event]:
        """The output as the next seq-numbered events, kept for a replay."""
        events = wire_events(output, self.next_seq)
        self.next_seq += sum(isinstance(e, wire.Token) for e in events)
        self.log.extend(events)
        return events

    def replay_from(self, seq: int) -> list[wire.Event] | None:
        """Events from `seq` on; None when `seq` is beyond anything this stream has sent."""
        if seq > self.next_seq:
            return None
        # The start goes along, so the new edge knows whose loss would end this stream.
        return [e for e in self.log if e.seq >= seq or isinstance(e, wire.Started)]


class StreamRegistry:
    def __init__(self, grace_s: float) -> None:
        self.active: dict[str, Stream] = {}
        self._ended: TTLCache[str, Stream] = TTLCache(maxsize=100_000, ttl=grace_s)

    def open(self, request_id: str, edge_id: str) -> Stream:
        stream = self.active[request_id] = Stream(request_id, edge_id)
        return stream

    def end(self, request_id: str) -> None:
        stream = self.active.pop(request_id, None)
        if stream is not None:
            self._ended[request_id] = stream

    def adopt(self, request_id: str, edge_id: str, epoch: int, events: list[wire.Event]) -> Stream:
        """A stream another worker began and handed over (a decode worker's): its seq goes on after `events`."""
        stream = self.open(request_id, edge_id)
        stream.epoch = epoch
        stream.log = list(events)
        stream.next_seq = sum(isinstance(e, wire.Token) for e in events)
        return stream

    def forget(self, request_id: str) -> None:
        """The stream is another worker's now: this one neither replays nor cancels it."""
        self.active.pop(request_id, None)

    def find(self, request_id: str) -> Stream | None:
        return self.active.get(request_id) or self._ended.get(request_id)

    def on_edge(self, edge_id: str) -> list[str]:
        return [rid for rid, stream in self.active.items() if stream.edge_id == edge_id]
