"""The edge's tenants as they are now: the tenants file when one is set, re-read when it changes
(an edit that does not parse keeps the last good book, and says why), else the keys in settings."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from services.edge.auth import DEFAULT_TIER, parse_api_keys, parse_tiers
from services.edge.tenants import (
    Tenant,
    TenantBook,
    TenantsError,
    Tier,
    book_from_keys,
    parse_tenants,
)

log = logging.getLogger(__name__)


def read_book(path: Path) -> TenantBook:
    try:
        return parse_tenants(path.read_text())
    except OSError as exc:
        raise TenantsError(f"cannot read {path}: {exc.strerror}") from exc


class TenantDirectory:
    def __init__(self, tenants_file: Path | None, api_keys: str, tenant_tiers: str) -> None:
        self._path = tenants_file
        if tenants_file is None:
            self.book = book_from_keys(parse_api_keys(api_keys), parse_tiers(tenant_tiers), DEFAULT_TIER)
        else:
            self.book = read_book(tenants_file)  # a bad file at start stops the edge, with the reason
        self._stamp = self._stat()

    def tenant_of(self, key: str) -> Tenant | None:
        return self.book.tenant_of(key)

    def tier_of(self, tenant_id: str) -> str:
        tenant = self.book.tenants.get(tenant_id)
        return tenant.tier if tenant is not None else DEFAULT_TIER

    def tier(self, tenant_id: str) -> Tier:
        """The tenant's tier: its fair-share weight and its reserve."""
        return self.book.tiers.get(self.tier_of(tenant_id), Tier())

    def holds(self, tenant_id: str, key_hash: str) -> bool:
        return self.book.holds(tenant_id, key_hash)

    def reload_if_changed(self) -> bool:
        """Re-read the file if it changed; True when a new book took effect."""
        stamp = self._stat()
        if stamp == self._stamp:
            return False
        self._stamp = stamp
        try:
            self.book = read_book(self._path)
        except TenantsError as exc:
            log.error("tenants file %s not reloaded, the last good one stays: %s", self._path, exc)
            return False
        log.info("tenants file %s reloaded: %d tenants", self._path, len(self.book.tenants))
        return True

    def _stat(self) -> tuple[int, int] | None:
        if self._path is None:
            return None
        try:
            stat = os.stat(self._path)
        except OSError:
            return None
        return stat.st_mtime_ns, stat.st_size
