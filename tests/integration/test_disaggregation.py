"""Disaggregated prefill and decode through the whole path: a `tiny` prefill worker computes each
prompt and its first token, hands the KV over the KV link to a decode worker, which streams the
rest; the client sees one gap-free stream with the text one engine alone produces, and the bytes
moved are the KV of the prompt's blocks (fewer once the decode worker holds the prefix)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from services.launcher.fleet import Fleet
from services.worker.decoder_choice import KV_ADDRESS
from services.worker.engine.llm_engine import build_llm_engine
from services.worker.engine.sampling_params import SamplingParams
from services.worker.engine.settings import EngineSettings
from services.worker.engine.types import EngineRequest, Message
from shared import wire
from shared.chat_client import ChatSocket
from shared.models.shapes import SHAPES
from shared.models.spec import resolve_model
from tests.conftest import KafkaTap, gossip_until, start_fleet
from tests.integration.test_metrics import scrape, value

QUESTION = "Tell me about the lighthouse keeper who watched the ships come in through the winter storms."
MAX_TOKENS = 20
BLOCK_SIZE = EngineSettings().block_size


@pytest.fixture(scope="module")
def disaggregated(topics, fleet_logs) -> Iterator[Fleet]:
    fleet = start_fleet(topics, fleet_logs, edges=1, routers=1, workers=2, decode_workers=1, model="tiny")
    yield fleet
    fleet.stop()


async def decoder_known(fleet: Fleet, topics) -> None:
    def decoder(rows: list[dict]) -> bool:
        return any(r["addresses"].get(KV_ADDRESS) for r in rows if r["role"] == "worker")

    await gossip_until(fleet, topics, decoder, "a decode worker")


def one_engine_alone(text: str) -> str:
    llm = build_llm_engine(resolve_model("tiny"), EngineSettings(num_kv_blocks=64), "cpu")
    sampling = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    llm.add_request(EngineRequest("alone", "dev", [Message("user", text)], sampling))
    out = []
    while llm.has_unfinished_requests():
        out.extend(o.text for o in llm.step())
    return "".join(out)


def kv_bytes(num_blocks: int) -> int:
    shape = SHAPES["tiny"]
    return num_blocks * shape.num_layers * 2 * BLOCK_SIZE * shape.num_kv_heads * shape.head_dim * 4  # float32 on a CPU


async def test_a_prefill_and_a_decode_worker_stream_what_one_worker_does(disaggregated, topics, infra):
    spec = disaggregated.spec
    await decoder_known(disaggregated, topics)
    decode_port = spec.worker_metrics_port(1)
    before = value(scrape(decode_port), "drivetrain_worker_kv_link_bytes_total", direction="received")
    sock = await ChatSocket.open(spec.chat_url(0))
    try:
        async with KafkaTap(infra, topics.tokens, topics.tokens_partitions) as tap:
            results = []
            for i in range(2):  # the second time, the decode worker's prefix cache holds the prompt's full blocks
                frame = {"type": "chat", "id": f"c{i}", "messages": [{"role": "user", "content": QUESTION}],
                         "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}  # fmt: skip
                await sock.send(frame)
                results.append(await sock.collect(f"c{i}", timeout=60))
            # Up to the first chat's handoff: a poll may bring the second chat's partition first.
            request_id = results[0].frames[0]["request_id"]
            events = await tap.events_until(lambda e: isinstance(e, wire.HandedOff) and e.request_id == request_id, 10)
    finally:
        await sock.close()

    alone = one_engine_alone(QUESTION)
    for result in results:
        assert result.final["type"] == "done", result.final
        assert [t["seq"] for t in result.tokens] == list(range(len(result.tokens)))
        assert result.text == alone
        assert result.final["usage"]["completion_tokens"] == MAX_TOKENS
    started = [e.worker_id for e in events if isinstance(e, wire.Started) and e.request_id == request_id]
    handed = [e.worker_id for e in events if isinstance(e, wire.HandedOff) and e.request_id == request_id]
    assert started and started[0].startswith("worker-0") and handed and handed[0].startswith("worker-1")

    prompt_tokens = results[0].final["usage"]["prompt_tokens"]
    num_blocks, num_full = -(-prompt_tokens // BLOCK_SIZE), prompt_tokens // BLOCK_SIZE
    after = value(scrape(decode_port), "drivetrain_worker_kv_link_bytes_total", direction="received")
    assert after - before == kv_bytes(num_blocks) + kv_bytes(num_blocks - num_full)
    prefill = scrape(spec.worker_metrics_port(0))
    assert value(prefill, "drivetrain_worker_handoffs_total", outcome="handed_off") >= 2
    decode = scrape(decode_port)
    assert value(decode, "drivetrain_worker_running_requests") == 0
    assert value(decode, "drivetrain_worker_kv_free_blocks") > 0
