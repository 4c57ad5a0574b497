"""A decode worker's end of the KV link (kv_link.py): it takes one handed-off request per
connection, reserves blocks for it in its own pool, writes each layer into them as it lands,
and on the sender's commit runs it on. Whatever breaks before the commit frees the reservation."""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Callable
from dataclasses import asdict

from services.worker.convert import engine_request
from services.worker.engine.types import KVLayout, RequestRejected
from services.worker.engine_thread import EngineThread
from services.worker.kv_link import (
    KV_LINK_PURPOSE,
    Commit,
    Committed,
    KVLinkConnection,
    KVLinkError,
    LayerKV,
    Layout,
    Offer,
    Received,
    Refused,
    Reserved,
    Sent,
)
from services.worker.metrics import WorkerMetrics
from shared import wire
from shared.framing import accept_router
from shared.link_auth import LinkKeys, LinkRefused

log = logging.getLogger(__name__)

FRAME_SLACK_BYTES = 4096  # a layer frame's framing around its K and V bytes


def offer_problem(offer: Offer, layout: KVLayout) -> str | None:
    """Why an offer cannot be taken here, whatever the pool holds; None if it can."""
    if offer.v != wire.WIRE_VERSION:
        return f"unsupported wire version {offer.v}"
    if offer.layout != Layout(**asdict(layout)):
        return f"KV layout {offer.layout} differs from this worker's {layout}"
    if offer.request.request_id == "" or not offer.prompt_token_ids or not offer.output_token_ids:
        return "an offer needs a request id, a prompt and its first token"
    if len(offer.block_ids) != -(-len(offer.prompt_token_ids) // layout.block_size):
        return f"{len(offer.block_ids)} blocks do not hold a {len(offer.prompt_token_ids)}-token prompt"
    if offer.cached_tokens > len(offer.prompt_token_ids):
        return "more cached tokens than the prompt has"
    return None


class KVReceiver:
    """`adopt(offer, commit)` opens the request's stream before the engine may speak of it;
    `disown(request_id)` closes it again if the commit fails after all."""

    def __init__(
        self,
        name: str,
        secret: bytes,
        thread: EngineThread,
        write_layer: Callable[[str, int, bytes, bytes], None],
        layout: KVLayout,
        timeout_s: float,
        adopt: Callable[[Offer, Commit], None],
        disown: Callable[[str], None],
        orphaned: Callable[[Offer, str], None],
        metrics: WorkerMetrics,
    ) -> None:
        self._name = name
        self._keys = LinkKeys(secret, KV_LINK_PURPOSE)
        self._thread = thread
        self._write_layer = write_layer
        self._layout = layout
        self._timeout_s = timeout_s
        self._adopt, self._disown, self._orphaned = adopt, disown, orphaned
        self._metrics = metrics

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One connection, start to end; nothing a peer sends gets further than a log line."""
        link: KVLinkConnection | None = None
        try:
            peer, frames = await accept_router(reader, writer, self._keys, self._name, self._timeout_s)
            link = KVLinkConnection(reader, writer, frames, peer)
            await asyncio.wait_for(self._receive(link), self._timeout_s)
        except (LinkRefused, KVLinkError, TimeoutError, asyncio.IncompleteReadError, ConnectionError, OSError) as exc:
            log.warning("KV link from %s: %s", link.peer[:64] if link else "an unproven peer", exc or type(exc).__name__)
        except Exception:  # noqa: BLE001 - a bug here ends this handoff, never the listener
            log.exception("KV link: a handoff failed")
        finally:
            if link is not None:
                await link.close()
            else:
                writer.close()

    async def _receive(self, link: KVLinkConnection) -> None:
        offer = await link.receive(Offer)
        if (problem := offer_problem(offer, self._layout)) is not None:
            await link.send(Refused(problem))
            return
        request_id = offer.request.request_id
        try:
            request = engine_request(offer.request)
            have = await self._thread.call(lambda e: e.reserve_import(request, offer.prompt_token_ids, offer.output_token_ids))
        except (ValueError, RequestRejected) as exc:
            await link.send(Refused(str(exc)))
            return
        if have is None:
            await link.send(Refused("no room in the KV pool now"))
            return
        committed = received = False
        try:
            await link.send(Reserved(have))
            await self._take_layers(link, offer, have)
            await link.send(Received())
            received = True
            commit = await link.receive(Commit)
            self._adopt(offer, commit)  # before the engine can run it: its first output must find the stream
            try:
                await self._thread.call(lambda e: e.commit_import(request_id, offer.cached_tokens))
            except Exception:
                self._disown(request_id)
                raise
            committed = True
            self._metrics.handoffs.labels("received").inc()
            await link.send(Committed())
        except (KVLinkError, asyncio.CancelledError) as exc:  # cancelled: the link's timeout
            if received and not committed:  # the edge may already take this worker for the stream's owner
                self._orphaned(offer, str(exc) or "the sender did not commit in time")
            raise
        finally:
            if not committed:
                await self._thread.call(lambda e: e.cancel_import(request_id))

    async def _take_layers(self, link: KVLinkConnection, offer: Offer, have: int) -> None:
        num_blocks = len(offer.block_ids) - have
        digest = hashlib.blake2b()
        if num_blocks > 0:
            max_bytes = 2 * num_blocks * self._layout.block_bytes + FRAME_SLACK_BYTES
            for layer in range(self._layout.num_layers):
                message = await link.receive(LayerKV, max_bytes)
                if message.layer != layer:
                    raise KVLinkError(f"expected layer {layer}, got {message.layer}")
                digest.update(message.k)
                digest.update(message.v)
                try:
                    await asyncio.to_thread(self._write_layer, offer.request.request_id, layer, message.k, message.v)
                except ValueError as exc:  # the wrong number of bytes for the reserved blocks
                    await link.send(Refused(str(exc)))
                    raise KVLinkError(str(exc)) from exc
                self._metrics.kv_link_bytes.labels("received").inc(len(message.k) + len(message.v))
        sent = await link.receive(Sent)
        if sent.checksum != digest.digest():
            await link.send(Refused("the checksum of the layers does not match"))
            raise KVLinkError("checksum mismatch")
