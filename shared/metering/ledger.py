"""Per-tenant usage counters in the Redis Cluster, in hourly buckets, each request counted once.

Keys of one tenant share a hash slot (the tenant is the hash tag), so one script can, at once,
mark the request as seen (SET NX with a TTL) and add its counts to its hour: a record read again
(a consumer died before committing it, or a second reporter spoke of the same request) finds its
mark and adds nothing. The first record of a request wins.

    usage:{TENANT}:seen:REQUEST_ID     "1", for DEDUPE_TTL_S
    usage:{TENANT}:hour:YYYYMMDDHH      hash: TIER|prompt, TIER|cached, TIER|completion, TIER|requests
    usage:tenants                       set of every tenant counted (for a report of all of them)
"""

from __future__ import annotations

import datetime as dt
from collections import defaultdict
from collections.abc import Iterable

from redis.asyncio.cluster import RedisCluster

from shared import wire
from shared.metering.pricing import Tokens

DEDUPE_TTL_S = 14 * 24 * 3600  # far past any redelivery: a consumer group's lag, a stuck partition
BUCKET_TTL_S = 400 * 24 * 3600  # counters of the last year or so; the usage topic is the full record
TENANTS_KEY = "usage:tenants"
FIELDS = ("prompt", "cached", "completion", "requests")
HOUR = dt.timedelta(hours=1)

# KEYS: the seen mark, the hour's hash. ARGV: the mark's TTL, the hash's TTL, then field, amount pairs.
COUNT_ONCE = """
if not redis.call('SET', KEYS[1], '1', 'NX', 'EX', ARGV[1]) then return 0 end
for i = 3, #ARGV, 2 do redis.call('HINCRBY', KEYS[2], ARGV[i], ARGV[i + 1]) end
redis.call('EXPIRE', KEYS[2], ARGV[2])
return 1
"""


def _tag(tenant: str) -> str:
    return "usage:{" + tenant + "}"


def seen_key(tenant: str, request_id: str) -> str:
    return f"{_tag(tenant)}:seen:{request_id}"


def hour_of(at: float) -> dt.datetime:
    return dt.datetime.fromtimestamp(at, dt.UTC).replace(minute=0, second=0, microsecond=0)


def hour_key(tenant: str, hour: dt.datetime) -> str:
    return f"{_tag(tenant)}:hour:{hour:%Y%m%d%H}"


def increments(record: wire.UsageRecord) -> dict[str, int]:
    """The hour-hash fields one record adds to."""
    tier = record.tier or "-"
    counts = (record.prompt_tokens, record.cached_tokens, record.completion_tokens, 1)
    return {f"{tier}|{name}": n for name, n in zip(FIELDS, counts, strict=True)}


def first_of_each(records: Iterable[wire.UsageRecord]) -> list[wire.UsageRecord]:
    """One record per request id, the first: a poll may hold two reports of one request."""
    seen: set[str] = set()
    firsts = []
    for record in records:
        if record.request_id not in seen:
            seen.add(record.request_id)
            firsts.append(record)
    return firsts


def hours_between(since: dt.datetime, until: dt.datetime) -> list[dt.datetime]:
    """Every hour bucket that overlaps [since, until]."""
    hour, last = hour_of(since.timestamp()), hour_of(until.timestamp())
    hours = []
    while hour <= last:
        hours.append(hour)
        hour += HOUR
    return hours


def parse_bucket(fields: dict[str, str]) -> dict[str, Tokens]:
    """One hour's hash as token counts per tier; fields it does not know are left out."""
    counts: dict[str, dict[str, int]] = defaultdict(dict)
    for name, value in fields.items():
        tier, _, kind = name.rpartition("|")
        if kind in FIELDS and tier:
            counts[tier][kind] = int(value)
    return {tier: Tokens(**kinds) for tier, kinds in counts.items()}


class Ledger:
    """The counters, on a Redis Cluster client (an I/O shell over the functions above)."""

    def __init__(self, redis: RedisCluster) -> None:
        self._redis = redis

    async def count(self, record: wire.UsageRecord) -> bool:
        """Add the record's counts unless its request was counted already; True if it was added now."""
        keys = (seen_key(record.tenant, record.request_id), hour_key(record.tenant, hour_of(record.finished_at)))
        args = [DEDUPE_TTL_S, BUCKET_TTL_S]
        for name, n in increments(record).items():
            args += [name, n]
        await self._redis.sadd(TENANTS_KEY, record.tenant)  # first, and idempotent: a retry finds it either way
        return bool(await self._redis.eval(COUNT_ONCE, len(keys), *keys, *args))

    async def tenants(self) -> list[str]:
        return sorted(member.decode() if isinstance(member, bytes) else member for member in await self._redis.smembers(TENANTS_KEY))

    async def totals(self, tenant: str, since: dt.datetime, until: dt.datetime) -> dict[str, Tokens]:
        """A tenant's counts per tier over the hours from `since` to `until`."""
        totals: dict[str, Tokens] = defaultdict(Tokens)
        async with self._redis.pipeline(transaction=False) as pipe:
            for hour in hours_between(since, until):
                pipe.hgetall(hour_key(tenant, hour))
            buckets = await pipe.execute()
        for bucket in buckets:
            decoded = {_text(k): _text(v) for k, v in bucket.items()}
            for tier, tokens in parse_bucket(decoded).items():
                totals[tier] = totals[tier] + tokens
        return dict(totals)


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
