"""The edge's tenancy settings: when the fleet counts as full, how rate-limit buckets are sized,
and how long a stream's or connection's slot outlives an edge that stopped renewing it."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from shared.settings import Section


class TenancySettings(Section):
    """Admission by tier against the fleet's load, and the tenants' limits (tenants file)."""

    full_load: Annotated[float, Field(gt=0.0, le=10.0)] = 1.0
    """fleet load at which even the top tier is refused (1.0: every worker's batch full, running + waiting = its max_running, or its KV pool full counting waiting prompts); each tier is refused earlier by the reserves of the tiers above it"""
    overloaded_retry_after_ms: Annotated[int, Field(ge=1, le=600_000)] = 1000
    """retry_after_ms sent with `overloaded` (HTTP Retry-After, rounded up to seconds)"""
    rate_burst_s: Annotated[float, Field(gt=0.0, le=60.0)] = 10.0
    """a tenant's rate-limit bucket holds this many seconds of its requests_per_min and tokens_per_min (at least one request): in any minute it gets at most its rate plus one bucket"""
    lease_s: Annotated[float, Field(gt=1.0, le=3600.0)] = 15.0
    """a stream's or connection's slot under the tenant's caps expires this long after its edge last renewed it, so a crashed edge's slots come free"""
    lease_refresh_s: Annotated[float, Field(gt=0.1, le=600.0)] = 5.0
    """how often an edge renews the slots it holds; well under lease_s"""
