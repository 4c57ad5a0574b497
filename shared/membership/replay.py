"""Replay protection: per-sender sequence numbers with a sliding window, and a timestamp window."""

from __future__ import annotations

from dataclasses import dataclass

# UDP reorders, so an older sequence number is still accepted if it falls inside this
# window and has not been seen (as IPsec does); "newer than the last" alone would drop
# honest packets that merely overtook each other.
SEQ_WINDOW = 64
_MASK = (1 << SEQ_WINDOW) - 1


@dataclass(slots=True)
class _SenderWindow:
    highest: int
    seen: int  # bit i set: sequence number highest - i was accepted
    last_heard: float


class ReplayGuard:
    """Accepts each (sender, seq) once, and only with a timestamp within window_s of now."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._senders: dict[str, _SenderWindow] = {}

    def accept(self, sender: str, seq: int, ts: float, now: float) -> bool:
        if abs(now - ts) > self.window_s:
            return False
        state = self._senders.get(sender)
        if state is None:
            self._senders[sender] = _SenderWindow(seq, 1, now)
            return True
        if seq > state.highest:
            shift = seq - state.highest
            state.seen = ((state.seen << shift) | 1) & _MASK if shift < SEQ_WINDOW else 1
            state.highest = seq
        else:
            offset = state.highest - seq
            if offset >= SEQ_WINDOW or (state.seen >> offset) & 1:
                return False
            state.seen |= 1 << offset
        state.last_heard = now
        return True

    def prune(self, now: float) -> None:
        """Forget quiet senders; anything they sent is by now outside the timestamp window."""
        cutoff = now - 2 * self.window_s
        for sender in [s for s, w in self._senders.items() if w.last_heard < cutoff]:
            del self._senders[sender]

    def __len__(self) -> int:
        return len(self._senders)
