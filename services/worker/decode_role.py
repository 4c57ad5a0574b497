"""A decode worker's part of the service: the KV link's listener (kv_receiver.py), and the
streams it takes over, which from then on are this worker's like any it started itself."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from cachetools import TTLCache

from services.worker.engine.types import KVLayout
from services.worker.engine_thread import EngineThread
from services.worker.kv_link import Commit, Offer
from services.worker.kv_link_settings import KVLinkSettings
from services.worker.kv_receiver import KVReceiver
from services.worker.metrics import WorkerMetrics
from services.worker.streams import StreamRegistry
from services.worker.token_path import TokenPublisher
from shared import wire
from shared.addresses import advertised_host
from shared.codes import ErrorCode
from shared.metering.records import UsageContext

log = logging.getLogger(__name__)


class DecodeRole:
    def __init__(
        self,
        name: str,
        secret: bytes,
        settings: KVLinkSettings,
        thread: EngineThread,
        write_layer: Callable[[str, int, bytes, bytes], None],
        layout: KVLayout,
        streams: StreamRegistry,
        tokens: TokenPublisher,
        cancelled: TTLCache[str, str],
        metrics: WorkerMetrics,
    ) -> None:
        self._name = name
        self._settings = settings
        self._thread = thread
        self._streams = streams
        self._tokens = tokens
        self._cancelled = cancelled  # cancels that came before their stream did
        self.receiver = KVReceiver(
            name, secret, thread, write_layer, layout, settings.timeout_s, self._adopt, self._streams.forget, self._orphaned,
            metrics,
        )
        self._server: asyncio.Server | None = None
        self._background: set[asyncio.Task] = set()

    async def start(self) -> str:
        """Listen; the `host:port` prefill workers reach this worker at (gossip publishes it)."""
        self._server = await asyncio.start_server(self.receiver.handle, self._settings.host, self._settings.port)
        port = self._server.sockets[0].getsockname()[1]
        log.info("KV link listening on %s:%d", self._settings.host, port)
        return f"{advertised_host(self._settings.host)}:{port}"

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        for task in self._background:
            task.cancel()

    def _adopt(self, offer: Offer, commit: Commit) -> None:
        request_id = offer.request.request_id
        events = [wire.Started(request_id, wire.OUT_OF_BAND, self._name), *offer.events]  # a replay names the owner first
        stream = self._streams.adopt(request_id, commit.edge_id, commit.epoch, events)
        stream.usage = UsageContext.of(offer.request)
        if self._cancelled.pop(request_id, None) == commit.edge_id:  # cancelled while it was on its way
            self._thread.abort(request_id)

    def _orphaned(self, offer: Offer, why: str) -> None:
        """The sender went quiet between our Received and its commit: if it had already told the edge
        this worker runs the stream, only this worker can end it, so it does (retryable)."""
        request_id = offer.request.request_id
        log.warning("handoff of %s not committed (%s); ending its stream", request_id, why)
        seq = sum(isinstance(e, wire.Token) for e in offer.events)
        message = "the worker handing this stream over was lost; retry the request"
        error = wire.Error.of(request_id, ErrorCode.WORKER_LOST, message, seq)
        epochs = {request_id: offer.epoch} if offer.epoch else {}
        task = asyncio.create_task(self._tokens.send(offer.edge_id, [error], epochs))
        self._background.add(task)
        task.add_done_callback(self._background.discard)
