"""How datagrams leave and arrive: the Transport interface and its UDP implementation (asyncio)."""

from __future__ import annotations

import abc
import asyncio
import logging
from collections.abc import Awaitable, Callable

from shared.membership.member import Address

log = logging.getLogger(__name__)

Receiver = Callable[[bytes, Address], None]
TransportFactory = Callable[[str, int, Receiver], Awaitable["Transport"]]


class Transport(abc.ABC):
    """Unreliable, unordered datagrams; `send` never blocks and never raises for a lost packet."""

    @property
    @abc.abstractmethod
    def address(self) -> Address:
        """Where this transport receives (the real port when bound to port 0)."""

    @abc.abstractmethod
    def send(self, address: Address, data: bytes) -> None: ...

    @abc.abstractmethod
    async def close(self) -> None: ...


class _Protocol(asyncio.DatagramProtocol):
    def __init__(self, receive: Receiver) -> None:
        self.receive = receive
        self.errors = 0

    def datagram_received(self, data: bytes, addr: tuple) -> None:
        self.receive(data, (addr[0], addr[1]))

    def error_received(self, exc: Exception) -> None:
        # ICMP port-unreachable from a dead peer lands here; the protocol copes with the silence.
        self.errors += 1
        log.debug("gossip socket error: %s", exc)


class UdpTransport(Transport):
    def __init__(self, transport: asyncio.DatagramTransport, protocol: _Protocol) -> None:
        self._transport = transport
        self._protocol = protocol
        host, port = transport.get_extra_info("sockname")[:2]
        self._address: Address = (host, port)

    @classmethod
    async def open(cls, host: str, port: int, receive: Receiver) -> UdpTransport:
        loop = asyncio.get_running_loop()
        transport, protocol = await loop.create_datagram_endpoint(
            lambda: _Protocol(receive), local_addr=(host, port)
        )
        return cls(transport, protocol)

    @property
    def address(self) -> Address:
        return self._address

    @property
    def errors(self) -> int:
        return self._protocol.errors

    def send(self, address: Address, data: bytes) -> None:
        if not self._transport.is_closing():
            self._transport.sendto(data, address)

    async def close(self) -> None:
        self._transport.close()
