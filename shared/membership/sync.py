"""Full-state exchange (push/pull): joining through seeds, the periodic swap, and repairs of views that drifted."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

from shared.membership.member import Address, Status
from shared.membership.settings import MembershipSettings
from shared.membership.table import MemberTable
from shared.membership.timing import push_pull_interval


class AntiEntropy:
    """Decides when, and with whom, to swap full state; `push(address)` sends ours with a request for theirs."""

    def __init__(
        self, config: MembershipSettings, table: MemberTable, rng: random.Random, push: Callable[[Address], None],
        now: float,
    ) -> None:
        self.config = config
        self.table = table
        self.rng = rng
        self.push = push
        self.seeds: list[Address] = []
        self._resynced: dict[str, float] = {}  # peers we last swapped with for a repair, and when
        self.next_push_pull = now + config.push_pull_interval * rng.uniform(0.5, 1.0)
        self.next_resync = now + config.resync_interval

    def next_deadline(self) -> float:
        if self.table.leaving:
            return float("inf")  # `step` does nothing more: a deadline left in the past would spin the loop
        return min(self.next_push_pull, self.next_resync)

    def join(self, seeds: Sequence[Address], own: Address, now: float) -> None:
        self.seeds = [(host, port) for host, port in seeds if (host, port) != own]
        for seed in self.seeds:
            self.push(seed)
        self.next_resync = now + self.config.resync_interval

    def resync_with(self, sender: str, source: Address, now: float) -> None:
        """Swap with one peer whose view differs, at most once per resync_interval: views differ
        briefly after every change, and gossip alone usually settles them."""
        if self.table.leaving or now - self._resynced.get(sender, float("-inf")) < self.config.resync_interval:
            return
        self._resynced[sender] = now
        self.push(source)

    def step(self, now: float) -> None:
        if self.table.leaving:
            return
        if now >= self.next_push_pull:
            self.next_push_pull = now + push_pull_interval(self.config.push_pull_interval, self.table.num_active())
            for peer in self.table.pick(self.rng, 1, lambda m: m.status is Status.ALIVE):
                self.push(peer.address)
        if now >= self.next_resync:
            self.next_resync = now + self.config.resync_interval
            self._reconnect()
            self._resynced = {k: t for k, t in self._resynced.items() if now - t < self.config.resync_interval}

    def _reconnect(self) -> None:
        """Knock on every seed that no alive member answers for: one that never answered, or one
        that restarted after we forgot its old self (it knows nobody, and nobody would find it).
        Then swap with one member we hold dead, which is how the two sides of a healed partition
        find each other."""
        answering = {m.address for m in self.table.others() if m.status is Status.ALIVE}
        for seed in self.seeds:
            if seed not in answering:
                self.push(seed)
        dead = [m for m in self.table.others() if m.status is Status.DEAD]
        if dead:
            self.push(self.rng.choice(dead).address)
