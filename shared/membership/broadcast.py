"""The broadcast queue: encoded updates waiting to be piggybacked, fewest-sent first, each sent a limited number of times."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class _Pending:
    blob: bytes
    transmits: int
    order: int  # larger is newer


def blob_cost(blob: bytes) -> int:
    """Bytes one update adds to a packet: its msgpack bin header plus the blob."""
    return len(blob) + (2 if len(blob) < 256 else 3)


class BroadcastQueue:
    """One pending update per key (a member id): a newer update about a member replaces the older one."""

    def __init__(self) -> None:
        self._pending: dict[str, _Pending] = {}
        self._order = 0

    def queue(self, key: str, blob: bytes) -> None:
        self._order += 1
        self._pending[key] = _Pending(blob, 0, self._order)

    def take(self, budget: int, limit: int) -> list[bytes]:
        """Updates whose encoded cost fits in budget bytes; each counts as sent once more.

        Fewest transmissions first, so fresh news spreads before old news is repeated;
        among equals the newest first. Updates sent `limit` times are retired.
        """
        chosen: list[bytes] = []
        ranked = sorted(self._pending.items(), key=lambda kv: (kv[1].transmits, -kv[1].order))
        for key, item in ranked:
            cost = blob_cost(item.blob)
            if cost > budget:
                continue
            budget -= cost
            chosen.append(item.blob)
            item.transmits += 1
            if item.transmits >= limit:
                del self._pending[key]
            if budget < 8:
                break
        return chosen

    def pending(self, key: str) -> bytes | None:
        item = self._pending.get(key)
        return item.blob if item else None

    def __len__(self) -> int:
        return len(self._pending)
