"""The pricing policy (the `billing` settings section) and the money a tenant's token counts come to.

Prices are per million tokens and per tier. A prompt token read from the prefix cache costs
a chosen share of a computed one (docs/billing.md says why that share is a trade-off); the
default share, 0.1, is the fair share's charge for the same token on the GPU
(EngineSettings.vtc_cached_weight), so what a tenant pays and what it is served agree.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Annotated

from pydantic import Field

from shared.settings import Section

PER = 1_000_000  # prices are per million tokens
Price = Annotated[float, Field(ge=0.0)]
TIER_PRICES = r"^(\s*[^:,/\s]+\s*:\s*\d+(\.\d+)?\s*/\s*\d+(\.\d+)?\s*(,|$))*$"


class CachedPricing(StrEnum):
    FULL = "full"  # a cached prompt token costs what a computed one does
    FRACTION = "fraction"  # it costs cached_fraction of one
    COMPUTE_ONLY = "compute_only"  # it costs nothing: only compute is billed


@dataclass(frozen=True)
class TierPrices:
    prompt: float  # per million prompt tokens computed
    completion: float  # per million tokens generated


@dataclass(frozen=True)
class Tokens:
    """Token counts of any span: one request, or a tenant's hour, or its month."""

    prompt: int = 0  # every prompt token, cached ones included
    cached: int = 0  # of those, read from the prefix cache
    completion: int = 0
    requests: int = 0

    def __add__(self, other: Tokens) -> Tokens:
        return Tokens(
            self.prompt + other.prompt, self.cached + other.cached,
            self.completion + other.completion, self.requests + other.requests,
        )

    @property
    def computed(self) -> int:
        return max(self.prompt - self.cached, 0)


@dataclass(frozen=True)
class Charge:
    prompt: float  # the computed prompt tokens, write surcharge included
    cached: float
    completion: float

    @property
    def total(self) -> float:
        return self.prompt + self.cached + self.completion


class BillingSettings(Section):
    """What usage costs: prices per tier, and how cached prompt tokens are billed (docs/billing.md)."""

    currency: str = "USD"
    """currency the prices are in; only printed"""
    prompt_price: Price = 1.0
    """price of a million prompt tokens computed, for a tier tier_prices does not name"""
    completion_price: Price = 4.0
    """price of a million generated tokens, for a tier tier_prices does not name"""
    tier_prices: Annotated[str, Field(pattern=TIER_PRICES)] = ""
    """per-tier prices per million tokens, tier:prompt/completion[,...] (say free:0/0,pro:0.8/3.2); other tiers pay prompt_price and completion_price"""
    cached_pricing: CachedPricing = CachedPricing.FRACTION
    """how a prompt token read from the prefix cache is billed: full (as computed) | fraction (cached_fraction of it) | compute_only (free)"""
    cached_fraction: Annotated[float, Field(ge=0.0, le=1.0)] = 0.1
    """fraction: share of the prompt price a cached prompt token costs (0.1 as Anthropic bills cache reads, 0.5 or 0.25 as OpenAI, about 0.26 as DeepSeek); keep it equal to the worker's engine.vtc_cached_weight, so fair share charges what billing does"""
    cache_write_surcharge: Annotated[float, Field(ge=1.0)] = 1.0
    """factor on the price of prompt tokens computed, which the prefix cache then holds (1.25 as Anthropic bills cache writes; 1: none)"""

    def cached_weight(self) -> float:
        """What a cached prompt token costs against a computed one (before the write surcharge)."""
        if self.cached_pricing is CachedPricing.FULL:
            return 1.0
        if self.cached_pricing is CachedPricing.COMPUTE_ONLY:
            return 0.0
        return self.cached_fraction

    def prices(self, tier: str) -> TierPrices:
        return self.tier_table().get(tier, TierPrices(self.prompt_price, self.completion_price))

    def tier_table(self) -> dict[str, TierPrices]:
        table = {}
        for item in filter(None, (part.strip() for part in self.tier_prices.split(","))):
            tier, _, pair = item.partition(":")
            prompt, _, completion = pair.partition("/")
            table[tier.strip()] = TierPrices(float(prompt), float(completion))
        return table

    def charge(self, tier: str, tokens: Tokens) -> Charge:
        prices = self.prices(tier)
        return Charge(
            prompt=tokens.computed * prices.prompt * self.cache_write_surcharge / PER,
            cached=min(tokens.cached, tokens.prompt) * prices.prompt * self.cached_weight() / PER,
            completion=tokens.completion * prices.completion / PER,
        )
