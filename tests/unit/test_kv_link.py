"""The KV link between two engines in one process, over real loopback sockets: a handoff lands and
the two halves of the stream make one engine's reply; a decode worker with no room, one that never
answers, and a sender that vanishes mid-transfer or before its commit each end cleanly, with every
KV block back in its pool; a peer without the fleet secret gets nowhere."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
from collections.abc import Callable

import pytest
from cachetools import TTLCache
from prometheus_client import CollectorRegistry

from services.worker.convert import engine_request
from services.worker.decode_role import DecodeRole
from services.worker.decoder_choice import Decoder
from services.worker.engine.llm_engine import LLMEngine, build_llm_engine
from services.worker.engine.settings import EngineSettings
from services.worker.engine.types import EngineOutput
from services.worker.engine_thread import EngineThread
from services.worker.kv_link import (
    KV_LINK_PURPOSE,
    KVLinkConnection,
    LayerKV,
    Layout,
    Offer,
    Received,
    Reserved,
    Sent,
)
from services.worker.kv_link_settings import KVLinkSettings
from services.worker.metrics import WorkerMetrics
from services.worker.prefill_role import PrefillRole
from services.worker.streams import StreamRegistry
from shared import wire
from shared.framing import connect_edge
from shared.link_auth import LinkKeys
from shared.models.spec import resolve_model
from tests.conftest import eventually

SECRET = b"fleet-secret-for-the-kv-link-tests"
LINK = KVLinkSettings(timeout_s=2.0)


class RecordedTokens:
    """The token path, as what was sent where (Kafka is the integration tests' business)."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, wire.Event]] = []

    async def send(self, edge_id: str, events: list[wire.Event], epochs: dict[str, int], wait: bool = False) -> bool:
        self.sent.extend((edge_id, e) for e in events)
        return True


@dataclasses.dataclass
class Worker:
    engine: LLMEngine
    thread: EngineThread
    streams: StreamRegistry
    tokens: RecordedTokens
    metrics: WorkerMetrics
    outputs: asyncio.Queue
    registry: CollectorRegistry

    @property
    def free_blocks(self) -> int:
        return self.engine.load().free_kv_blocks


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture
def make_worker() -> Callable[..., Worker]:
    threads: list[EngineThread] = []

    def make(num_kv_blocks: int = 64) -> Worker:
        engine = build_llm_engine(resolve_model("tiny", max_model_len=512), EngineSettings(num_kv_blocks=num_kv_blocks), "cpu")
        outputs: asyncio.Queue = asyncio.Queue()
        thread = EngineThread(engine, asyncio.get_running_loop(), outputs.put_nowait)
        thread.start()
        threads.append(thread)
        registry = CollectorRegistry()
        metrics = WorkerMetrics(registry, engine.load)
        return Worker(engine, thread, StreamRegistry(60), RecordedTokens(), metrics, outputs, registry)

    yield make
    for thread in threads:
        thread.stop()


def decode_role(worker: Worker) -> DecodeRole:
    e = worker.engine
    return DecodeRole("decode", SECRET, LINK, worker.thread, e.write_kv_layer, e.kv_layout, worker.streams, worker.tokens,
                      TTLCache(100, 60), worker.metrics)  # fmt: skip


def prefill_role(worker: Worker, decoders: list[Decoder]) -> PrefillRole:
    return PrefillRole("prefill", SECRET, LINK, worker.thread, worker.engine.read_kv_layer, lambda _: decoders,
                       worker.streams, worker.tokens, worker.metrics)  # fmt: skip


def decoder_at(address: str) -> Decoder:
    host, port = address.rsplit(":", 1)
    return Decoder("decode", (host, int(port)), 0.0)


CHAT = wire.ChatRequest("r1", "edge-0", "conn-0", "tenant-a", [wire.Message("user", "Tell me about the sea and the wind.")],
                        max_tokens=16, temperature=0.0, controls=wire.Controls(ignore_eos=True))  # fmt: skip


async def serve(worker: Worker, role: PrefillRole | None, until: str) -> list[EngineOutput]:
    """The worker service's output loop, reduced: outputs to streams, a parked request to its handoff."""
    seen = []
    while True:
        for output in await asyncio.wait_for(worker.outputs.get(), 20):
            seen.append(output)
            stream = worker.streams.active.get(output.request_id)
            if stream is not None:
                stream.events_for(output)
            if output.handoff is not None and role is not None:
                role.start(stream, output.handoff)
            if until == "handoff" and output.handoff is not None or output.finished:
                return seen


async def prefill(worker: Worker, role: PrefillRole | None) -> list[EngineOutput]:
    stream = worker.streams.open(CHAT.request_id, CHAT.edge_id)
    stream.request = CHAT
    worker.thread.add(dataclasses.replace(engine_request(CHAT), handoff=True))
    return await serve(worker, role, "handoff")


async def one_engine_alone(make_worker) -> str:
    alone = make_worker()
    alone.streams.open(CHAT.request_id, CHAT.edge_id)
    alone.thread.add(engine_request(CHAT))
    return "".join(o.text for o in await serve(alone, None, "finished"))


async def test_a_handoff_lands_and_the_two_halves_make_one_engines_reply(make_worker):
    sender, receiver = make_worker(), make_worker()
    free = sender.free_blocks, receiver.free_blocks
    decoder = decode_role(receiver)
    role = prefill_role(sender, [decoder_at(await decoder.start())])
    first = await prefill(sender, role)
    rest = await serve(receiver, None, "finished")
    await decoder.stop()

    assert "".join(o.text for o in first + rest) == await one_engine_alone(make_worker)
    assert rest[-1].usage.completion_tokens == 16
    handed = [e for _, e in sender.tokens.sent if isinstance(e, wire.HandedOff)]
    assert handed == [wire.HandedOff("r1", wire.OUT_OF_BAND, "decode")]
    assert "r1" not in sender.streams.active and receiver.streams.find("r1").log[0] == wire.Started("r1", -1, "decode")
    await eventually(lambda: (sender.free_blocks, receiver.free_blocks) == free)


async def test_no_room_on_the_decoder_or_no_answer_leaves_the_request_to_the_prefill_worker(make_worker):
    alone = await one_engine_alone(make_worker)
    sender, full = make_worker(), make_worker(num_kv_blocks=2)  # one usable block: no room for the prompt
    decoder = decode_role(full)
    silent = await asyncio.start_server(lambda r, w: asyncio.sleep(30), "127.0.0.1", 0)  # takes the connection, says nothing
    silent_at = f"127.0.0.1:{silent.sockets[0].getsockname()[1]}"
    role = prefill_role(sender, [decoder_at(await decoder.start()), dataclasses.replace(decoder_at(silent_at), worker_id="mute")])
    free = sender.free_blocks
    started = asyncio.get_running_loop().time()
    outputs = await prefill(sender, role) + await serve(sender, role, "finished")
    assert "".join(o.text for o in outputs) == alone  # decoded where it was prefilled, after both tries
    assert asyncio.get_running_loop().time() - started < LINK.timeout_s + 5
    assert not any(isinstance(e, wire.HandedOff) for _, e in sender.tokens.sent)
    assert full.engine.request_ids() == []
    silent.close()
    await decoder.stop()
    await eventually(lambda: sender.free_blocks == free)


async def sender_link(address: str) -> KVLinkConnection:
    host, port = address.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    frames = await connect_edge(reader, writer, LinkKeys(SECRET, KV_LINK_PURPOSE), "prefill", "decode", 2.0)
    return KVLinkConnection(reader, writer, frames, "decode")


async def test_a_sender_that_vanishes_mid_transfer_or_before_its_commit_leaves_nothing_held(make_worker):
    sender, receiver = make_worker(), make_worker()
    free = receiver.free_blocks
    decoder = decode_role(receiver)
    address = await decoder.start()
    ready = next(o.handoff for o in await prefill(sender, None) if o.handoff is not None)
    events = [e for e in sender.streams.active["r1"].log if isinstance(e, wire.Token)]
    offer = Offer(CHAT, list(ready.prompt_token_ids), list(ready.output_token_ids), 0, Layout(**dataclasses.asdict(ready.layout)),
                  list(ready.block_ids), "edge-0", 0, events)  # fmt: skip

    link = await sender_link(address)  # gone after one layer
    await link.send(offer)
    assert (await link.receive(Reserved)).have_blocks == 0
    await link.send(LayerKV(0, *sender.engine.read_kv_layer("r1", 0, 0)))
    await link.close()
    await eventually(lambda: receiver.free_blocks == free and receiver.engine.request_ids() == [])

    link = await sender_link(address)  # gone after the receiver took every layer, before the commit
    await link.send(offer)
    await link.receive(Reserved)
    digest = hashlib.blake2b()
    for layer in range(ready.layout.num_layers):
        k, v = sender.engine.read_kv_layer("r1", layer, 0)
        digest.update(k)
        digest.update(v)
        await link.send(LayerKV(layer, k, v))
    await link.send(Sent(digest.digest()))
    await link.receive(Received)
    await link.close()
    await eventually(lambda: receiver.free_blocks == free and receiver.engine.request_ids() == [])
    # The edge may already take the decode worker for the owner: it ends the stream, retryable, after the tokens seen.
    errors = [(edge, e) for edge, e in receiver.tokens.sent if isinstance(e, wire.Error)]
    assert [(edge, e.code, e.seq, e.retryable) for edge, e in errors] == [("edge-0", "worker_lost", len(events), True)]
    await decoder.stop()


async def test_a_peer_without_the_fleet_secret_or_with_garbage_gets_nowhere(make_worker):
    receiver = make_worker()
    decoder = decode_role(receiver)
    host, port = (await decoder.start()).rsplit(":", 1)
    for junk in (b"", b"\x00" * 64, b"\xff\xff\xff\xff" + b"x" * 100, b"GET / HTTP/1.1\r\n\r\n"):
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(junk)
        await writer.drain()
        writer.close()
    reader, writer = await asyncio.open_connection(host, int(port))
    with pytest.raises(Exception):  # the wrong secret: the handshake fails, nothing is reserved
        await connect_edge(reader, writer, LinkKeys(b"another secret", KV_LINK_PURPOSE), "prefill", "decode", 2.0)
    writer.close()
    assert receiver.engine.request_ids() == [] and receiver.streams.active == {}
    await decoder.stop()


async def test_a_parked_request_that_vanishes_under_its_handoff_ends_it_without_a_trace(make_worker):
    sender, receiver = make_worker(), make_worker()
    free = sender.free_blocks, receiver.free_blocks
    decoder = decode_role(receiver)
    role = prefill_role(sender, [decoder_at(await decoder.start())])
    ready = next(o.handoff for o in await prefill(sender, None) if o.handoff is not None)
    await sender.thread.call(lambda e: e.release_handoff("r1"))  # the engine let it go; the stream does not know yet
    role.start(sender.streams.active["r1"], ready)
    await eventually(lambda: value(sender, "ended") == 1)
    assert value(sender, "handed_off") == value(sender, "decoded_here") == 0
    assert not any(isinstance(e, wire.HandedOff) for _, e in sender.tokens.sent)
    await eventually(lambda: (sender.free_blocks, receiver.free_blocks) == free and receiver.engine.request_ids() == [])
    await decoder.stop()


def value(worker: Worker, outcome: str) -> float:
    return worker.registry.get_sample_value("drivetrain_worker_handoffs_total", {"outcome": outcome}) or 0.0
