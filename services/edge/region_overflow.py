"""Regions with overflow, as the edge service sees them: where each new chat goes, and the relays
of the chats placed in a peer region.

The choice is made once, when a chat arrives (region_choice.py, on this region's load and the
peers' summaries, region_summaries.py); a chat placed in a peer is relayed over a socket of
this client connection's to that peer's edge (region_relay.py), and never moved afterwards.
Only WebSocket chats from a client are relayed: the HTTP API's and those that came in over a
relay stay where they are.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry

from services.edge.auth import presented_key
from services.edge.connection import Connection
from services.edge.protocol import ChatFrame
from services.edge.region_choice import choose_region
from services.edge.region_metrics import RegionMetrics, RelayFailure
from services.edge.region_relay import RELAYED_HEADER, RelayLink, RelayUnavailable
from services.edge.region_settings import RegionSettings
from services.edge.region_summaries import PeerSummaries, RegionSummaries
from services.edge.tenancy import FleetLoad
from shared.producer import Producer
from shared.seal import Seal
from shared.service_settings import KafkaSettings

log = logging.getLogger(__name__)


@dataclass
class RelayClient:
    """A client socket that may be relayed: the key it proved itself with, and its relays by peer."""

    api_key: str
    relayed_in: bool  # it is itself a relay from another region: its chats stay here
    links: dict[str, RelayLink] = field(default_factory=dict)


class RegionOverflow:
    def __init__(self, settings: RegionSettings, seal: Seal, fleet_load: FleetLoad, registry: CollectorRegistry) -> None:
        self.settings = settings
        self.metrics = RegionMetrics(registry)
        self.summaries = PeerSummaries(settings, seal)
        self._seal = seal
        self._fleet_load = fleet_load
        self._peers = {peer.name: peer for peer in settings.peers}
        self._clients: dict[str, RelayClient] = {}
        self._closing: set[asyncio.Task] = set()
        for name in self._peers:
            self.metrics.peer_load.labels(name).set_function(lambda name=name: _or_minus_one(self.summaries.load_of(name)))
        self.metrics.relayed.set_function(self.num_chats)
        self.metrics.load.set_function(lambda: _or_minus_one(fleet_load.load()))

    def summaries_io(self, kafka: KafkaSettings, client_id: str, producer: Producer) -> RegionSummaries | None:
        """The publisher and reader of capacity summaries for this edge to start; None when single-region."""
        if not self.settings.enabled:
            return None
        return RegionSummaries(
            self.settings, kafka, client_id, producer, self._seal, self.summaries, self._fleet_load.load,
            self.metrics.summaries_skipped,
        )  # fmt: skip

    # Client sockets ------------------------------------------------------------------------
    def opened(self, conn_id: str, headers: Mapping[str, str], query: Mapping[str, str]) -> None:
        """A WebSocket client was admitted: remember its key, so its chats can be relayed as that tenant."""
        key = presented_key(headers, query)
        if self.settings.enabled and key:
            self._clients[conn_id] = RelayClient(key, RELAYED_HEADER in headers)

    def close_connection(self, conn_id: str) -> None:
        """The client socket is gone: its relays cancel their chats at the peers and close."""
        client = self._clients.pop(conn_id, None)
        for link in client.links.values() if client else ():
            link.close()
            self._own(asyncio.create_task(link.wait_closed()))

    def has_chat(self, conn_id: str, chat_id: str) -> bool:
        return self._link_holding(conn_id, chat_id) is not None

    def num_chats(self, conn_id: str | None = None) -> int:
        clients = [self._clients.get(conn_id)] if conn_id is not None else list(self._clients.values())
        return sum(link.num_chats() for client in clients if client for link in client.links.values())

    # Placement -------------------------------------------------------------------------------
    async def place(self, conn: Connection, frame: ChatFrame) -> bool:
        """True when the chat was relayed to a peer region (its frames come from there); False: serve it here."""
        if not self.settings.enabled:
            return False
        here = self.settings.name
        client = self._clients.get(conn.conn_id)
        region = here
        if client is not None and not client.relayed_in:
            region = choose_region(here, self._fleet_load.load(), self.settings.overflow_load, self.summaries.rooms())
        if region != here and client is not None and (link := await self._link(conn, client, region)) is not None:
            link.start(frame)
            self.metrics.placements.labels(region).inc()
            return True
        self.metrics.placements.labels(here).inc()
        return False

    def cancel(self, conn_id: str, chat_id: str) -> bool:
        """Forward a cancel to the peer serving the chat; False when the chat is not relayed."""
        link = self._link_holding(conn_id, chat_id)
        if link is None:
            return False
        link.cancel(chat_id)
        return True

    async def _link(self, conn: Connection, client: RelayClient, region: str) -> RelayLink | None:
        link = client.links.get(region)
        if link is not None and link.usable:
            return link
        try:
            link = await RelayLink.open(
                self._peers[region], client.api_key, self.settings.name, deliver=conn.send,
                delay_s=self.settings.added_delay_ms / 1000,
                on_ended=lambda ended, failed: self._link_ended(conn.conn_id, ended, failed),
                on_bad_frame=self.metrics.relay_errors.labels(RelayFailure.BAD_FRAME).inc,
            )  # fmt: skip
        except RelayUnavailable as exc:
            self.metrics.relay_errors.labels(RelayFailure.CONNECT).inc()
            log.warning("cannot relay a chat to region %s, serving it here: %s", region, exc)
            return None
        if self._clients.get(conn.conn_id) is not client:  # the client left while the relay opened
            await link.abort()
            return None
        client.links[region] = link
        return link

    def _link_ended(self, conn_id: str, link: RelayLink, chats_failed: int) -> None:
        client = self._clients.get(conn_id)
        if client is not None and client.links.get(link.peer.name) is link:
            del client.links[link.peer.name]
        if chats_failed:
            self.metrics.relay_errors.labels(RelayFailure.BROKEN).inc()
            log.warning("the relay to region %s broke: %d chats ended with a retryable error", link.peer.name, chats_failed)

    def _link_holding(self, conn_id: str, chat_id: str) -> RelayLink | None:
        client = self._clients.get(conn_id)
        return next((link for link in client.links.values() if link.holds(chat_id)), None) if client else None

    def _own(self, task: asyncio.Task) -> None:
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def aclose(self) -> None:
        """The edge is stopping: every relay closes now."""
        links = [link for client in self._clients.values() for link in client.links.values()]
        self._clients.clear()
        await asyncio.gather(*(link.abort() for link in links), *self._closing, return_exceptions=True)


def _or_minus_one(load: float | None) -> float:
    return -1.0 if load is None else load
