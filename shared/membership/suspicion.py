"""One suspicion timer: starts at its longest and shrinks with each independent confirmation."""

from __future__ import annotations

from shared.membership.timing import confirmed_timeout


class Suspicion:
    """When a suspected member is to be declared dead, as confirmations from distinct members arrive."""

    def __init__(self, first_by: str, started: float, shortest: float, longest: float, expected: int) -> None:
        self.started = started
        self.shortest = shortest
        self.longest = longest
        self.expected = expected
        # The member whose accusation started the timer does not count as a confirmation.
        self.first_by = first_by
        self.confirmers = {first_by}
        # A suspicion still open after `shortest` is gossiped again: anyone who has heard the
        # refutation answers stale news with it, so a holder that missed it is not left waiting.
        self.regossip_at = started + shortest
        self.confirmations = 0
        self.deadline = started + confirmed_timeout(shortest, longest, 0, expected)

    def confirm(self, by: str) -> bool:
        """Count an accusation from a new member; True if it was new (worth re-gossiping)."""
        if self.confirmations >= self.expected or by in self.confirmers:
            return False
        self.confirmers.add(by)
        self.confirmations += 1
        self.deadline = self.started + confirmed_timeout(
            self.shortest, self.longest, self.confirmations, self.expected
        )
        return True
