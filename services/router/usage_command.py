"""`drivetrain usage [--tenant T] [--since 7d] [--json]`: tokens and money per tenant and tier, from
the usage counters the routers keep in the Redis Cluster, priced now by the `billing` settings.

Money is computed at report time from the counts, so a price change applies to any span
asked about; counts are kept per hour, so a span starts at an hour (the one `--since` falls in).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import re
import sys

from shared.metering.ledger import Ledger
from shared.metering.pricing import BillingSettings, Tokens
from shared.redis_client import REDIS_UNAVAILABLE, make_cluster
from shared.service_settings import ServiceSettings
from shared.settings import add_arguments

SPAN = re.compile(r"^(\d+)([mhdw])$")
UNITS = {"m": "minutes", "h": "hours", "d": "days", "w": "weeks"}
DEFAULT_SINCE = "30d"


class UsageSettings(ServiceSettings):
    """drivetrain usage: tokens and money per tenant, from the usage counters in the Redis Cluster."""

    billing: BillingSettings = BillingSettings()


def add_usage_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tenant", help="only this tenant (default: every tenant counted)")
    parser.add_argument(
        "--since", default=DEFAULT_SINCE,
        help=f"start of the span: an age (90m, 24h, 7d, 2w) or a UTC date or time (2026-01-31, 2026-01-31T12:00); default {DEFAULT_SINCE}",
    )
    parser.add_argument("--json", action="store_true", help="JSON instead of a table")
    parser.set_defaults(settings_source=add_arguments(parser, UsageSettings))


def parse_since(text: str, now: dt.datetime) -> dt.datetime:
    """An age before `now`, or an ISO date/time (UTC unless it says); ValueError if neither."""
    if match := SPAN.match(text.strip()):
        return now - dt.timedelta(**{UNITS[match[2]]: int(match[1])})
    try:
        at = dt.datetime.fromisoformat(text.strip())
    except ValueError:
        raise ValueError(f"--since {text!r}: not an age (90m, 24h, 7d, 2w) nor an ISO date or time") from None
    return at if at.tzinfo else at.replace(tzinfo=dt.UTC)


def report_rows(totals: dict[str, dict[str, Tokens]], billing: BillingSettings) -> list[dict]:
    """One row per (tenant, tier), with its counts and their price."""
    rows = []
    for tenant in sorted(totals):
        for tier in sorted(totals[tenant]):
            tokens = totals[tenant][tier]
            charge = billing.charge(tier, tokens)
            rows.append({
                "tenant": tenant, "tier": tier, "requests": tokens.requests,
                "prompt_tokens": tokens.prompt, "cached_tokens": tokens.cached, "completion_tokens": tokens.completion,
                "prompt_cost": round(charge.prompt, 6), "cached_cost": round(charge.cached, 6),
                "completion_cost": round(charge.completion, 6), "total_cost": round(charge.total, 6),
            })
    return rows


def render(rows: list[dict], billing: BillingSettings, since: dt.datetime, as_json: bool) -> str:
    if as_json:
        policy = billing.model_dump(mode="json")
        return json.dumps({"since": since.isoformat(), "currency": billing.currency, "policy": policy, "usage": rows}, indent=2)
    head = f"{'tenant':<20} {'tier':<11} {'requests':>8} {'prompt':>11} {'cached':>11} {'completion':>11} {'cost ' + billing.currency:>12}"
    lines = [f"usage since {since:%Y-%m-%d %H:00} UTC (cached prompt tokens: {billing.cached_pricing}, x{billing.cached_weight():g})", head]
    for r in rows:
        lines.append(
            f"{r['tenant']:<20} {r['tier']:<11} {r['requests']:>8} {r['prompt_tokens']:>11} {r['cached_tokens']:>11} "
            f"{r['completion_tokens']:>11} {r['total_cost']:>12.4f}"
        )
    if not rows:
        lines.append("(no usage counted)")
    return "\n".join(lines)


async def _totals(settings: UsageSettings, tenant: str | None, since: dt.datetime, until: dt.datetime) -> dict[str, dict[str, Tokens]]:
    redis = make_cluster(settings.redis)
    try:
        ledger = Ledger(redis)
        tenants = [tenant] if tenant else await ledger.tenants()
        return {t: totals for t in tenants if (totals := await ledger.totals(t, since, until))}
    finally:
        await redis.aclose()


def run(args: argparse.Namespace, settings: UsageSettings) -> int:
    now = dt.datetime.now(dt.UTC)
    try:
        since = parse_since(args.since, now)
    except ValueError as exc:
        print(f"drivetrain usage: {exc}", file=sys.stderr)
        return 2
    try:
        totals = asyncio.run(_totals(settings, args.tenant, since, now))
    except REDIS_UNAVAILABLE as exc:
        print(f"drivetrain usage: cannot read the usage counters: {exc}", file=sys.stderr)
        return 1
    print(render(report_rows(totals, settings.billing), settings.billing, since, args.json))
    return 0
