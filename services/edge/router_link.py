"""The edge's end of the routers' links: who may connect, and what a frame may carry.

A router proves it holds the fleet secret before the edge reads anything bigger than a
handshake (shared/link_auth.py); every frame after must verify, or the link is cut. What
is refused is counted and logged at a bounded rate, since anyone who reaches the port can
cause it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

from prometheus_client import Counter

from shared import wire
from shared.framing import accept_router, read_frame
from shared.hop_timing import Hop, HopTimer
from shared.link_auth import LinkKeys
from shared.rate_limits import LogThrottle, Rate, held_back

log = logging.getLogger(__name__)

HANDSHAKE_TIMEOUT_S = 2.0
REFUSAL_LOG_RATE = Rate(per_s=1.0, burst=10)


class RefusalLog:
    """Counts each refusal; logs them at a bounded rate."""

    def __init__(self, counter: Counter) -> None:
        self._counter = counter
        self._throttle = LogThrottle(REFUSAL_LOG_RATE, time.monotonic())

    def __call__(self, message: str, *args: object) -> None:
        self._counter.inc()
        if (held := self._throttle.admit(time.monotonic())) is not None:
            log.warning(message + "%s", *args, held_back(held))


class RouterLinkServer:
    def __init__(
        self,
        keys: LinkKeys,
        edge_id: str,
        deliver: Callable[[list[wire.Delivery]], None],
        refused: RefusalLog,
        hops: HopTimer | None = None,
    ) -> None:
        self._keys = keys
        self._edge_id = edge_id
        self._deliver = deliver
        self._refused = refused
        self._hops = hops  # times each frame from the router's write to its events queued here

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One router's persistent link: the handshake, then frames of deliveries until it closes.
        One malformed frame inside a verified session is skipped; anything else ends the link."""
        peer = writer.get_extra_info("peername")
        try:
            router_id, frames = await accept_router(reader, writer, self._keys, self._edge_id, HANDSHAKE_TIMEOUT_S)
            while True:
                payload = frames.open(await read_frame(reader))
                try:
                    batch = wire.decode(payload, wire.ForwardBatch)
                except wire.WireError as exc:
                    self._refused("router %s sent a malformed frame: %s", router_id, exc)
                    continue
                self._deliver(batch.deliveries)
                if self._hops is not None and batch.sent_at:
                    self._hops.observe(Hop.LINK, time.time() - batch.sent_at)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the router went away
        except (ValueError, TimeoutError) as exc:  # LinkRefused, FrameTooLarge, no handshake in time
            self._refused("router link from %s refused: %s", peer, exc or "no handshake in time")
        except asyncio.CancelledError:
            # The edge is stopping. Nobody awaits this task, and asyncio's server would log its
            # cancellation as an error with a traceback: end quietly instead.
            pass
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()
