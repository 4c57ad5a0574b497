"""A prefill worker's handoffs: each request its engine parked after the first token goes, KV
cache and all, to a decode worker over the KV link (kv_link.py), or, when none takes it in time,
is decoded here after all. The client sees one stream either way.

Ownership moves only once the decode worker holds every layer: this worker then puts HandedOff
on the token path (waiting for Kafka), and only after that tells the decode worker to commit, so
the edge has heard of the new owner before the new owner says anything (both go to the same
partition). Until then a failure leaves the request here; after it, the stream is the decode
worker's (its death or its deadline ends it, with the codes of any other stream).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict
from enum import StrEnum

from services.worker.decoder_choice import Decoder, decoder_order
from services.worker.engine.types import HandoffReady
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
    Reserved,
    Sent,
)
from services.worker.kv_link_settings import KVLinkSettings
from services.worker.metrics import WorkerMetrics
from services.worker.streams import Stream, StreamRegistry
from services.worker.token_path import TokenPublisher
from shared import wire
from shared.framing import connect_edge
from shared.link_auth import LinkKeys, LinkRefused

log = logging.getLogger(__name__)


class Outcome(StrEnum):
    HANDED_OFF = "handed_off"  # a decode worker runs it now
    DECODED_HERE = "decoded_here"  # no decode worker took it: this worker decodes it
    ENDED = "ended"  # the stream ended meanwhile (cancelled, or Kafka lost its events)


class _Gone(Exception):
    """The stream ended while its handoff was under way."""


class PrefillRole:
    def __init__(
        self,
        name: str,
        secret: bytes,
        settings: KVLinkSettings,
        thread: EngineThread,
        read_layer: Callable[[str, int, int], tuple[bytes, bytes]],
        decoders: Callable[[dict[str, int]], list[Decoder]],
        streams: StreamRegistry,
        tokens: TokenPublisher,
        metrics: WorkerMetrics,
    ) -> None:
        self._name = name
        self._keys = LinkKeys(secret, KV_LINK_PURPOSE)
        self._settings = settings
        self._thread = thread
        self._read_layer = read_layer
        self._decoders = decoders
        self._streams = streams
        self._tokens = tokens
        self._in_flight: Counter[str] = Counter()  # decode worker -> handoffs to it under way
        self._tasks: set[asyncio.Task] = set()
        self._metrics = metrics

    def start(self, stream: Stream, ready: HandoffReady) -> None:
        task = asyncio.create_task(self._hand_off(stream, ready))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def stop(self) -> None:
        for task in self._tasks:
            task.cancel()

    async def _hand_off(self, stream: Stream, ready: HandoffReady) -> None:
        request_id = ready.request_id
        outcome = Outcome.DECODED_HERE
        try:
            order = decoder_order(self._decoders(dict(self._in_flight)), ready.prompt_token_ids[: ready.layout.block_size])
            if not order:
                log.info("no decode worker known: %s decodes here", request_id)
            for decoder in order[: self._settings.max_tries]:
                if await self._offer(decoder, stream, ready):
                    outcome = Outcome.HANDED_OFF
                    return
            if not await self._thread.call(lambda e: e.resume_handoff(request_id)):
                outcome = Outcome.ENDED  # cancelled while parked: the engine said so
        except _Gone:
            outcome = Outcome.ENDED
            await self._thread.call(lambda e: e.release_handoff(request_id))
        except Exception:  # noqa: BLE001 - a bug here must not leave the request parked for good
            log.exception("handoff of %s failed; decoding it here", request_id)
            if not await self._thread.call(lambda e: e.resume_handoff(request_id)):
                outcome = Outcome.ENDED
        finally:
            self._metrics.handoffs.labels(outcome.value).inc()
            log.debug("handoff of %s: %s", request_id, outcome)

    async def _offer(self, decoder: Decoder, stream: Stream, ready: HandoffReady) -> bool:
        """True once `decoder` runs the request; False if it did not take it (it is still here)."""
        self._in_flight[decoder.worker_id] += 1
        started = time.monotonic()
        link: KVLinkConnection | None = None
        try:
            async with asyncio.timeout(self._settings.timeout_s):
                link = await self._connect(decoder)
                await self._transfer(link, stream, ready)
            self._check_alive(stream)
            # Decided: the edge hears of the new owner before the new owner may say anything.
            handed = wire.HandedOff(ready.request_id, wire.OUT_OF_BAND, decoder.worker_id)
            await self._tokens.send(stream.edge_id, [handed], {}, wait=True)
            self._check_alive(stream)  # Kafka lost it: the stream ended broken (token_path.py)
            self._streams.forget(ready.request_id)
            await self._commit(link, stream, decoder)
            self._metrics.handoff_seconds.observe(time.monotonic() - started)
            await self._thread.call(lambda e: e.release_handoff(ready.request_id))
            return True
        except (KVLinkError, LinkRefused, TimeoutError, OSError, asyncio.IncompleteReadError) as exc:
            log.warning("handoff of %s to %s failed: %s", ready.request_id, decoder.worker_id, exc or type(exc).__name__)
            return False
        finally:
            self._in_flight[decoder.worker_id] -= 1
            if link is not None:
                await link.close()

    async def _connect(self, decoder: Decoder) -> KVLinkConnection:
        reader, writer = await asyncio.open_connection(*decoder.address)
        try:
            frames = await connect_edge(reader, writer, self._keys, self._name, decoder.worker_id, self._settings.timeout_s)
        except BaseException:
            writer.close()
            raise
        return KVLinkConnection(reader, writer, frames, decoder.worker_id)

    async def _transfer(self, link: KVLinkConnection, stream: Stream, ready: HandoffReady) -> None:
        """Offer, then every layer of the blocks the decode worker lacks, until it holds them all."""
        events = [e for e in stream.log if not isinstance(e, wire.Started)]
        offer = Offer(
            stream.request, list(ready.prompt_token_ids), list(ready.output_token_ids), ready.cached_tokens,
            Layout(**asdict(ready.layout)), list(ready.block_ids), stream.edge_id, stream.epoch, events,
        )  # fmt: skip
        await link.send(offer)
        have = (await link.receive(Reserved)).have_blocks
        digest = hashlib.blake2b()
        if 0 <= have < len(ready.block_ids):
            for layer in range(ready.layout.num_layers):
                self._check_alive(stream)
                try:
                    k, v = await asyncio.to_thread(self._read_layer, ready.request_id, layer, have)
                except KeyError as exc:  # no longer parked: cancelled, or dropped with its stream
                    raise _Gone(ready.request_id) from exc
                digest.update(k)
                digest.update(v)
                await link.send(LayerKV(layer, k, v))
                self._metrics.kv_link_bytes.labels("sent").inc(len(k) + len(v))
        await link.send(Sent(digest.digest()))
        await link.receive(Received)

    async def _commit(self, link: KVLinkConnection, stream: Stream, decoder: Decoder) -> None:
        try:
            async with asyncio.timeout(self._settings.timeout_s):
                await link.send(Commit(stream.edge_id, stream.epoch))
                await link.receive(Committed)
        except (KVLinkError, TimeoutError, OSError) as exc:
            # The stream is the decode worker's at the edge: if it is alive it ends it (it holds the
            # offer), and if it is not, its loss does.
            log.warning("commit of %s on %s not confirmed: %s", stream.request_id, decoder.worker_id, exc)

    def _check_alive(self, stream: Stream) -> None:
        if self._streams.active.get(stream.request_id) is not stream:
            raise _Gone(stream.request_id)
