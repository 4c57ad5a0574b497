"""Who shares cached prefixes with whom: the cache-isolation settings and the salt rule they make.

One section read by both sides: workers' engines salt their prefix-cache hashes with it, and
edges salt the hashes of a prompt the same way to find the worker that holds its blocks. The
engine's settings inherit it, and an edge reads it as its own `engine` section, so both take
the same flags and the same variables (DRIVETRAIN_ENGINE_CACHE_ISOLATION, ..._CACHE_GROUPS).
"""

from __future__ import annotations

from typing import Annotated

from pydantic import ConfigDict, Field
from pydantic.dataclasses import dataclass

GROUPS_PATTERN = r"^(\s*[^:,\s]+\s*:\s*[^:,\s]+\s*(,|$))*$"


@dataclass(frozen=True, config=ConfigDict(use_attribute_docstrings=True, extra="ignore"))
class CacheSharing:
    """Prefix-cache isolation between tenants; edges and workers must agree on it."""

    # Described in Field, not by a docstring below the field: subclasses (the engine's settings)
    # inherit a Field's description, but pydantic reads field docstrings of a class's own source only.
    cache_isolation: Annotated[
        bool,
        Field(
            description="salt prefix-cache hashes per tenant: no tenant can time its first token to learn how another's prompts begin"
        ),
    ] = True
    cache_groups: Annotated[
        str,
        Field(
            pattern=GROUPS_PATTERN,
            description="tenant:group[,tenant:group]: tenants of one group share cached prefixes (say, a public system prompt)",
        ),
    ] = ""

    def cache_salt(self, tenant: str) -> str:
        """The salt of a tenant's prefix-cache hashes: its group's, its own, or none without isolation."""
        if not self.cache_isolation:
            return ""
        groups = dict(item.replace(" ", "").split(":") for item in self.cache_groups.split(",") if item.strip())
        return f"group:{groups[tenant]}" if tenant in groups else f"tenant:{tenant}"
