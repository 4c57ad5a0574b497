"""Builds outgoing datagrams under the size limit: fills piggyback room from the broadcast queue, splits full state."""

from __future__ import annotations

from collections.abc import Callable

from shared.membership.broadcast import BroadcastQueue, blob_cost
from shared.membership.codec import MAC_SIZE, Codec
from shared.membership.messages import Body, Envelope, encode

# The outer frame around the payload: array header, version, bin16 header, bin8 header of the MAC.
FRAME_OVERHEAD = 1 + 1 + 3 + 2 + MAC_SIZE
# An array header may grow from 1 to 3 bytes once it holds more than 15 entries.
LIST_GROWTH = 2


class PacketWriter:
    """Owns this node's sequence numbers; every datagram it seals is signed and at most max_size bytes."""

    def __init__(self, codec: Codec, sender: str, max_size: int, first_seq: int) -> None:
        self.codec = codec
        self.sender = sender
        self.max_size = max_size
        self.seq = first_seq
        self.oversized = 0  # state records too large to send at all

    def seal(self, body: Body, now: float) -> bytes:
        self.seq += 1
        return self.codec.seal(self.sender, self.seq, now, body)

    def room(self, empty_body: Body, now: float) -> int:
        """Bytes left for list entries once empty_body is sealed."""
        envelope = Envelope(self.codec.cluster, self.sender, self.seq + 1, now, empty_body)
        return self.max_size - FRAME_OVERHEAD - LIST_GROWTH - len(encode(envelope))

    def with_updates(
        self,
        make_body: Callable[[list[bytes]], Body],
        broadcasts: BroadcastQueue,
        limit: int,
        now: float,
        first: list[bytes] | None = None,
    ) -> bytes:
        """A datagram whose spare room is filled with pending updates; `first` goes in ahead of them."""
        updates = list(first or ())
        budget = self.room(make_body([]), now) - sum(blob_cost(b) for b in updates)
        updates += broadcasts.take(budget, limit)
        return self.seal(make_body(updates), now)

    def chunked(self, blobs: list[bytes], make_body: Callable[[list[bytes], int, int], Body], now: float) -> list[bytes]:
        """All blobs spread over as few datagrams as fit; make_body gets (blobs, index, total)."""
        # Index and total are measured at their widest so the estimate holds for every chunk.
        budget = self.room(make_body([], 1 << 20, 1 << 20), now)
        chunks: list[list[bytes]] = [[]]
        left = budget
        for blob in blobs:
            cost = blob_cost(blob)
            if cost > budget:
                self.oversized += 1
                continue
            if cost > left:
                chunks.append([])
                left = budget
            chunks[-1].append(blob)
            left -= cost
        return [self.seal(make_body(chunk, i, len(chunks)), now) for i, chunk in enumerate(chunks)]
