"""An in-memory network for tests and simulations: packet loss, delay, partitions between sets, killed nodes."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterable

from shared.membership.member import Address
from shared.membership.transport import Receiver, Transport


class FaultModel:
    """Decides each datagram's fate: delivered after some delay, or lost."""

    def __init__(self, rng: random.Random, loss: float = 0.0, delay: tuple[float, float] = (0.0005, 0.002)) -> None:
        self.rng = rng
        self.loss = loss
        self.delay = delay
        self.killed: set[Address] = set()
        self.degraded: dict[Address, float] = {}  # extra loss on every link of one address
        self._cuts: list[tuple[frozenset[Address], frozenset[Address]]] = []
        self.delivered = 0
        self.dropped = 0

    def cut(self, side_a: Iterable[Address], side_b: Iterable[Address]) -> None:
        """No datagram crosses between the two sets, in either direction, until heal()."""
        self._cuts.append((frozenset(side_a), frozenset(side_b)))

    def heal(self) -> None:
        self._cuts.clear()

    def kill(self, address: Address) -> None:
        self.killed.add(address)

    def revive(self, address: Address) -> None:
        self.killed.discard(address)

    def degrade(self, address: Address, loss: float) -> None:
        """A sick member (overloaded, bad NIC): this share of its datagrams in and out is lost."""
        self.degraded[address] = loss

    def fate(self, source: Address, destination: Address) -> float | None:
        """Seconds until delivery, or None if the datagram is lost."""
        if source in self.killed or destination in self.killed or self._is_cut(source, destination):
            self.dropped += 1
            return None
        loss = 1 - (1 - self.loss) * (1 - self.degraded.get(source, 0.0)) * (1 - self.degraded.get(destination, 0.0))
        if loss and self.rng.random() < loss:
            self.dropped += 1
            return None
        self.delivered += 1
        return self.rng.uniform(*self.delay)

    def _is_cut(self, a: Address, b: Address) -> bool:
        return any((a in x and b in y) or (a in y and b in x) for x, y in self._cuts)


class InMemoryNetwork:
    """Transports that talk through the running event loop; `open` fits the Membership transport factory."""

    def __init__(self, faults: FaultModel | None = None, host: str = "10.0.0.1") -> None:
        self.faults = faults or FaultModel(random.Random(0))
        self.host = host
        self._receivers: dict[Address, Receiver] = {}
        self._next_port = 10_000

    async def open(self, host: str, port: int, receive: Receiver) -> InMemoryTransport:
        if port == 0:
            self._next_port += 1
            port = self._next_port
        address = (self.host if host in ("", "0.0.0.0") else host, port)
        if address in self._receivers:
            raise OSError(f"address {address} already in use")
        self._receivers[address] = receive
        return InMemoryTransport(self, address)

    def deliver(self, source: Address, destination: Address, data: bytes) -> None:
        delay = self.faults.fate(source, destination)
        if delay is None or destination not in self._receivers:
            return
        asyncio.get_running_loop().call_later(delay, self._arrive, source, destination, data)

    def _arrive(self, source: Address, destination: Address, data: bytes) -> None:
        receive = self._receivers.get(destination)
        if receive is not None and destination not in self.faults.killed:
            receive(data, source)

    def close(self, address: Address) -> None:
        self._receivers.pop(address, None)


class InMemoryTransport(Transport):
    def __init__(self, network: InMemoryNetwork, address: Address) -> None:
        self._network = network
        self._address = address

    @property
    def address(self) -> Address:
        return self._address

    def send(self, address: Address, data: bytes) -> None:
        self._network.deliver(self._address, address, data)

    async def close(self) -> None:
        self._network.close(self._address)
