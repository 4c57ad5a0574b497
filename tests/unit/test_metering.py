"""Metering's pure parts: prices, building a usage record, the counters' keys and dedupe, the report."""

from __future__ import annotations

import asyncio
import datetime as dt

import pytest
from prometheus_client import CollectorRegistry

from services.router import metering
from services.router.metrics import RouterMetrics
from services.router.usage_command import parse_since, report_rows
from services.worker.engine.settings import EngineSettings
from services.worker.engine.vtc import VTCCosts
from shared import wire
from shared.codes import ErrorCode, FinishReason
from shared.metering import ledger
from shared.metering.pricing import BillingSettings, CachedPricing, Tokens
from shared.metering.records import UsageContext, record_problem, usage_record
from shared.seal import Seal
from shared.service_settings import KafkaSettings
from shared.topics import TopicLayout

CONTEXT = UsageContext("acme", "pro", prompt_tokens=12, created_at=100.0)
T0 = dt.datetime(2026, 3, 1, 10, 30, tzinfo=dt.UTC).timestamp()


def record(**fields) -> wire.UsageRecord:
    base = dict(
        request_id="r1", tenant="acme", tier="pro", prompt_tokens=100, cached_tokens=40, completion_tokens=10,
        reporter="worker-0", worker_id="worker-0", created_at=T0, finished_at=T0, finish_reason=FinishReason.STOP,
    )
    return wire.UsageRecord(**{**base, **fields})


# Pricing ----------------------------------------------------------------------------------
def test_the_default_cached_price_is_the_fair_shares_cached_charge():
    # What a tenant pays for a cached prompt token, against a computed one, is what fair share charges it.
    billing, engine = BillingSettings(), EngineSettings()
    assert billing.cached_weight() * billing.cache_write_surcharge == engine.vtc_cached_weight / VTCCosts().w_in
    assert VTCCosts().w_cached == engine.vtc_cached_weight


def test_prices_per_million_and_per_tier():
    billing = BillingSettings(prompt_price=2.0, completion_price=8.0, tier_prices="free:0/0, pro:1/4")
    tokens = Tokens(prompt=3_000_000, cached=1_000_000, completion=500_000, requests=7)
    pro = billing.charge("pro", tokens)
    assert (pro.prompt, pro.completion) == pytest.approx((2.0, 2.0))  # 2M computed x 1, 0.5M x 4
    assert pro.cached == pytest.approx(0.1)  # 1M cached x 1 x 0.1
    assert billing.charge("free", tokens).total == 0.0
    other = billing.charge("standard", tokens)
    assert other.total == pytest.approx(4.0 + 0.2 + 4.0)


@pytest.mark.parametrize(
    ("policy", "cached_cost", "prompt_cost"),
    [
        (dict(cached_pricing=CachedPricing.FULL), 1.0, 1.0),
        (dict(cached_pricing=CachedPricing.COMPUTE_ONLY), 0.0, 1.0),
        (dict(cached_fraction=0.1, cache_write_surcharge=1.25), 0.1, 1.25),  # Anthropic
        (dict(cached_fraction=0.5), 0.5, 1.0),  # OpenAI
    ],
)
def test_cached_prompt_tokens_by_policy(policy, cached_cost, prompt_cost):
    charge = BillingSettings(prompt_price=1.0, **policy).charge("any", Tokens(prompt=2_000_000, cached=1_000_000))
    assert (charge.cached, charge.prompt) == pytest.approx((cached_cost, prompt_cost))


def test_bad_tier_prices_are_refused():
    with pytest.raises(ValueError):
        BillingSettings(tier_prices="pro:cheap")


# Records ----------------------------------------------------------------------------------
def test_a_done_stream_bills_the_engines_exact_counts():
    usage = wire.Usage(prompt_tokens=30, cached_tokens=16, completion_tokens=5)
    made = usage_record("r1", CONTEXT, "worker-0", "worker-0", 200.0, usage=usage, tokens_sent=5, finish_reason=FinishReason.STOP)
    assert (made.prompt_tokens, made.cached_tokens, made.completion_tokens) == (30, 16, 5)
    assert (made.tenant, made.tier, made.created_at, made.finished_at) == ("acme", "pro", 100.0, 200.0)
    assert made.finish_reason == "stop" and made.error is None


def test_without_the_engines_counts_the_edges_prompt_and_the_tokens_sent():
    made = usage_record("r1", CONTEXT, "edge-0", "worker-1", 200.0, tokens_sent=7, error=ErrorCode.WORKER_LOST)
    assert (made.prompt_tokens, made.cached_tokens, made.completion_tokens) == (12, 0, 7)
    assert (made.reporter, made.worker_id, made.error) == ("edge-0", "worker-1", "worker_lost")


def test_what_is_not_billed():
    assert usage_record("r", CONTEXT, "w", "w", 1.0, tokens_sent=0, error=ErrorCode.WORKER_DRAINING) is None
    empty = UsageContext("acme", "pro")
    zero = wire.Usage(0, 0, 0)
    assert usage_record("r", empty, "w", "w", 1.0, usage=zero, finish_reason=FinishReason.CANCELLED) is None
    # A cancelled request whose prompt was computed is billed for it.
    assert usage_record("r", empty, "w", "w", 1.0, usage=wire.Usage(9, 0, 0), finish_reason=FinishReason.CANCELLED)


def test_a_record_ends_one_way():
    with pytest.raises(ValueError):
        usage_record("r", CONTEXT, "w", "w", 1.0)
    with pytest.raises(ValueError):
        usage_record("r", CONTEXT, "w", "w", 1.0, tokens_sent=1, finish_reason=FinishReason.STOP, error=ErrorCode.WORKER_LOST)


def test_records_the_aggregate_refuses():
    assert record_problem(record()) is None
    assert "hash tag" in record_problem(record(tenant="a}b"))
    assert "hash tag" in record_problem(record(tenant=""))
    assert "cached" in record_problem(record(cached_tokens=101))
    assert "not both" in record_problem(record(error=ErrorCode.WORKER_LOST))


def test_a_usage_record_is_sealed_by_its_reporter():
    seal = Seal(b"secret", "worker-0")
    topic = "p.usage"
    assert seal.decode(topic, seal.encode(topic, record()), wire.UsageRecord)[1] == record()
    with pytest.raises(wire.WireError, match="claims"):
        seal.decode(topic, seal.encode(topic, record(reporter="edge-0")), wire.UsageRecord)
    with pytest.raises(wire.WireError):
        wire.decode(wire.encode(wire.Cancel(["r"])), wire.UsageRecord)
    with pytest.raises(wire.WireError):
        seal.decode(topic, seal.encode(topic, record(prompt_tokens=-1)), wire.UsageRecord)


# Counters -----------------------------------------------------------------------------------
def test_a_tenants_keys_share_one_hash_slot():
    from redis.crc import key_slot

    seen = ledger.seen_key("acme", "r1")
    hour = ledger.hour_key("acme", ledger.hour_of(T0))
    assert hour.endswith(":hour:2026030110")
    assert key_slot(seen.encode()) == key_slot(hour.encode())


def test_increments_and_buckets_read_back():
    fields = ledger.increments(record())
    assert fields == {"pro|prompt": 100, "pro|cached": 40, "pro|completion": 10, "pro|requests": 1}
    read = ledger.parse_bucket({k: str(v) for k, v in fields.items()} | {"junk": "1"})
    assert read == {"pro": Tokens(prompt=100, cached=40, completion=10, requests=1)}


def test_the_first_report_of_a_request_wins_within_a_poll():
    worker = record(reporter="worker-0")
    edge = record(reporter="edge-0", completion_tokens=3, finish_reason=None, error=ErrorCode.WORKER_LOST)
    other = record(request_id="r2")
    assert ledger.first_of_each([worker, edge, other, worker]) == [worker, other]


def test_hours_between_covers_both_ends():
    since = dt.datetime(2026, 3, 1, 10, 59, tzinfo=dt.UTC)
    hours = ledger.hours_between(since, since + dt.timedelta(hours=2, minutes=2))
    assert [h.hour for h in hours] == [10, 11, 12, 13]


# The report ---------------------------------------------------------------------------------
def test_since_takes_ages_and_dates():
    now = dt.datetime(2026, 3, 8, 12, tzinfo=dt.UTC)
    assert parse_since("7d", now) == dt.datetime(2026, 3, 1, 12, tzinfo=dt.UTC)
    assert parse_since("90m", now) == now - dt.timedelta(minutes=90)
    assert parse_since("2026-03-01", now) == dt.datetime(2026, 3, 1, tzinfo=dt.UTC)
    with pytest.raises(ValueError, match="--since"):
        parse_since("last tuesday", now)


def test_report_rows_price_each_tier():
    totals = {"acme": {"pro": Tokens(1_000_000, 500_000, 1_000_000, 3)}}
    (row,) = report_rows(totals, BillingSettings())
    assert row["requests"] == 3 and row["cached_tokens"] == 500_000
    assert row["total_cost"] == pytest.approx(0.5 + 0.05 + 4.0)


# The aggregate's restarts ----------------------------------------------------------------------
async def test_an_aggregate_that_cannot_start_waits_longer_each_time_up_to_its_cap(monkeypatch, caplog):
    # Nothing listens on port 1: the consumer's start fails at once, again and again, before any poll.
    monkeypatch.setattr(metering, "RESTART_S", 0.01)
    monkeypatch.setattr(metering, "RESTART_MAX_S", 0.04)
    registry = CollectorRegistry()
    aggregator = metering.UsageAggregator(
        KafkaSettings(bootstrap="127.0.0.1:1"), TopicLayout(prefix="restarts"), "restarts-usage-meter", "router-t",
        Seal(b"k" * 32, "router-t"), None, None, RouterMetrics(registry),  # no record is read: no ledger, no letters
    )  # fmt: skip
    stopping = asyncio.Event()
    counting = asyncio.create_task(aggregator.run(stopping))
    while registry.get_sample_value("drivetrain_router_usage_restarts_total") < 5:
        assert not counting.done()
        await asyncio.sleep(0.01)
    stopping.set()
    await asyncio.wait_for(counting, 5)
    pauses = [record.args[0] for record in caplog.records if record.getMessage().startswith("the usage aggregate failed")]
    assert pauses[:4] == [0.02, 0.04, 0.04, 0.04]  # doubled from the first pause, then held at the cap
