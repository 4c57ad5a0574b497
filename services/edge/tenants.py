"""Who the tenants are: the tenants file (TOML), its tiers, API keys kept only as SHA-256
hashes, and each tenant's limits. Pure: parsing, lookup and edits return new books; the
file is read and written by its callers (the edge's watcher, `drivetrain tenants`).

    [tiers.pro]                 # optional: these three are the defaults
    weight = 2
    reserve = 0.1

    [tenants.acme]
    tier = "pro"
    keys = ["sha256:5e884898da28047151d0e56f8dc62927..."]

    [tenants.acme.limits]       # optional; 0 = no limit of that kind
    requests_per_min = 600
    concurrent_streams = 32
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import re
import secrets
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field

import tomli_w

MAX_WEIGHT = 1000.0  # what the wire carries (wire.Weight)
KEY_HASH = re.compile(r"^sha256:[0-9a-f]{64}$")
TENANT_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


class TenantsError(ValueError):
    """The tenants file cannot be used; the message says where and why."""


@dataclass(frozen=True)
class Tier:
    weight: float = 1.0  # share of the GPU against other tiers' tenants (fair share)
    reserve: float = 0.0  # fraction of the fleet's capacity kept for this tier and those above it


DEFAULT_TIERS = {"enterprise": Tier(4.0, 0.2), "pro": Tier(2.0, 0.1), "free": Tier(1.0, 0.0)}


@dataclass(frozen=True)
class Limits:
    requests_per_min: int = 0
    tokens_per_min: int = 0
    concurrent_streams: int = 0
    connections: int = 0
    max_prompt_tokens: int = 0


@dataclass(frozen=True)
class Tenant:
    id: str
    tier: str
    key_hashes: tuple[str, ...] = ()
    limits: Limits = Limits()


def hash_key(key: str) -> str:
    return "sha256:" + hashlib.sha256(key.encode()).hexdigest()


def new_key() -> str:
    return "dt-" + secrets.token_urlsafe(32)


@dataclass(frozen=True)
class TenantBook:
    tenants: Mapping[str, Tenant] = field(default_factory=dict)
    tiers: Mapping[str, Tier] = field(default_factory=lambda: dict(DEFAULT_TIERS))

    def __post_init__(self) -> None:
        for name, tier in self.tiers.items():
            if not 0 < tier.weight <= MAX_WEIGHT or not 0 <= tier.reserve < 1:
                raise TenantsError(f"tier {name!r}: weight must be in (0, {MAX_WEIGHT:g}] and reserve in [0, 1)")
        by_hash: dict[str, str] = {}
        for tenant in self.tenants.values():
            if tenant.tier not in self.tiers:
                raise TenantsError(f"tenant {tenant.id!r}: unknown tier {tenant.tier!r} (tiers: {', '.join(self.tiers)})")
            for key_hash in tenant.key_hashes:
                if not KEY_HASH.match(key_hash):
                    raise TenantsError(f"tenant {tenant.id!r}: a key is not 'sha256:' and 64 hex digits (keys in clear are refused)")
                if key_hash in by_hash:
                    raise TenantsError(f"tenant {tenant.id!r}: a key is also {by_hash[key_hash]!r}'s")
                by_hash[key_hash] = tenant.id
        object.__setattr__(self, "_by_hash", by_hash)

    def tenant_of(self, key: str) -> Tenant | None:
        """The tenant holding this key, compared by hash (the hash is what the file keeps)."""
        digest = hash_key(key)
        tenant_id = self._by_hash.get(digest)  # type: ignore[attr-defined]
        if tenant_id is None:
            return None
        tenant = self.tenants[tenant_id]
        return tenant if any(hmac.compare_digest(digest, h) for h in tenant.key_hashes) else None

    def holds(self, tenant_id: str, key_hash: str) -> bool:
        tenant = self.tenants.get(tenant_id)
        return tenant is not None and key_hash in tenant.key_hashes

    # Edits: each returns the new book and, where one was made, the new key in clear (shown once).
    def add(self, tenant_id: str, tier: str, limits: Limits = Limits()) -> tuple[TenantBook, str]:
        if not TENANT_ID.match(tenant_id):
            raise TenantsError(f"tenant id {tenant_id!r}: letters, digits, '.', '_' and '-', at most 64")
        if tenant_id in self.tenants:
            raise TenantsError(f"tenant {tenant_id!r} already exists (rotate-key gives it a new key)")
        key = new_key()
        return self._with(Tenant(tenant_id, tier, (hash_key(key),), limits)), key

    def rotate_key(self, tenant_id: str) -> tuple[TenantBook, str]:
        """A new key; the old ones stop working."""
        key = new_key()
        return self._with(dataclasses.replace(self._get(tenant_id), key_hashes=(hash_key(key),))), key

    def revoke(self, tenant_id: str) -> TenantBook:
        """Every key of the tenant stops working; its live sockets are closed by the edges."""
        return self._with(dataclasses.replace(self._get(tenant_id), key_hashes=()))

    def _get(self, tenant_id: str) -> Tenant:
        if tenant_id not in self.tenants:
            raise TenantsError(f"no tenant {tenant_id!r}")
        return self.tenants[tenant_id]

    def _with(self, tenant: Tenant) -> TenantBook:
        return TenantBook({**self.tenants, tenant.id: tenant}, self.tiers)

    # The file -----------------------------------------------------------------------------
    def dumps(self) -> str:
        doc: dict = {"tiers": {name: dataclasses.asdict(tier) for name, tier in self.tiers.items()}, "tenants": {}}
        for tenant in self.tenants.values():
            limits = {k: v for k, v in dataclasses.asdict(tenant.limits).items() if v}
            entry: dict = {"tier": tenant.tier, "keys": list(tenant.key_hashes)}
            if limits:
                entry["limits"] = limits
            doc["tenants"][tenant.id] = entry
        return tomli_w.dumps(doc)


def parse_tenants(text: str) -> TenantBook:
    """A book from the file's text; TenantsError names the line (TOML) or the tenant at fault."""
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise TenantsError(f"not TOML: {exc}") from exc
    unknown = set(doc) - {"tiers", "tenants"}
    if unknown:
        raise TenantsError(f"unknown top-level tables {sorted(unknown)}; expected [tiers.*] and [tenants.*]")
    tiers = dict(DEFAULT_TIERS)
    for name, spec in _tables(doc, "tiers").items():
        tiers[name] = _build(Tier, spec, f"tier {name!r}")
    tenants: dict[str, Tenant] = {}
    for tenant_id, spec in _tables(doc, "tenants").items():
        where = f"tenant {tenant_id!r}"
        if not TENANT_ID.match(tenant_id):
            raise TenantsError(f"{where}: ids are letters, digits, '.', '_' and '-', at most 64")
        spec = dict(spec)
        limits = _build(Limits, spec.pop("limits", {}), f"{where} limits")
        keys = spec.pop("keys", [])
        if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
            raise TenantsError(f"{where}: keys must be a list of strings")
        tier = spec.pop("tier", "free")
        if spec:
            raise TenantsError(f"{where}: unknown fields {sorted(spec)}")
        tenants[tenant_id] = Tenant(tenant_id, tier, tuple(keys), limits)
    return TenantBook(tenants, tiers)


def book_from_keys(api_keys: Mapping[str, str], tiers: Mapping[str, str], default_tier: str) -> TenantBook:
    """The book of a fleet without a tenants file: keys from settings (`dev-key:dev` locally)."""
    tenants: dict[str, Tenant] = {}
    for key, tenant_id in api_keys.items():
        known = tenants.get(tenant_id)
        hashes = (*known.key_hashes, hash_key(key)) if known else (hash_key(key),)
        tenants[tenant_id] = Tenant(tenant_id, tiers.get(tenant_id, default_tier), hashes)
    all_tiers = {**DEFAULT_TIERS, **{name: Tier() for name in {*tiers.values(), default_tier} if name not in DEFAULT_TIERS}}
    return TenantBook(tenants, all_tiers)


def _tables(doc: dict, name: str) -> dict[str, dict]:
    tables = doc.get(name, {})
    if not isinstance(tables, dict) or not all(isinstance(v, dict) for v in tables.values()):
        raise TenantsError(f"[{name}] must hold one table per entry, [{name}.NAME]")
    return tables


def _build(cls: type, spec: object, where: str):  # noqa: ANN202 - one of the frozen dataclasses above
    if not isinstance(spec, dict):
        raise TenantsError(f"{where}: must be a table")
    names = {f.name: f.type for f in dataclasses.fields(cls)}
    unknown = set(spec) - set(names)
    if unknown:
        raise TenantsError(f"{where}: unknown fields {sorted(unknown)} (known: {', '.join(names)})")
    for key, value in spec.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise TenantsError(f"{where}: {key} must be a number >= 0, not {value!r}")
    return cls(**spec)
