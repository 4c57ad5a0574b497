"""The tenants file: keys only as hashes, clear errors for anything wrong, and edits that
return a new book (a new key shown once, a rotated or revoked one dead at once)."""

from __future__ import annotations

import re

import pytest

from services.edge.tenant_directory import TenantDirectory
from services.edge.tenants import (
    Limits,
    TenantBook,
    TenantsError,
    hash_key,
    parse_tenants,
)

GOOD = f"""
[tenants.acme]
tier = "pro"
keys = ["{hash_key("acme-key")}"]

[tenants.acme.limits]
requests_per_min = 600
"""


def test_a_key_finds_its_tenant_by_hash_and_the_file_never_holds_it():
    book = parse_tenants(GOOD)
    tenant = book.tenant_of("acme-key")
    assert tenant.id == "acme" and tenant.tier == "pro" and tenant.limits == Limits(requests_per_min=600)
    assert book.tenant_of("wrong") is None and "acme-key" not in book.dumps()
    assert parse_tenants(book.dumps()) == book  # what is written reads back the same


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("[tenants.acme\n", "not TOML"),
        ('[tenants.acme]\ntier = "gold"\n', "unknown tier 'gold'"),
        ('[tenants.acme]\nkeys = ["acme-key"]\n', "keys in clear are refused"),
        (f'[tenants.a]\nkeys = ["{hash_key("k")}"]\n[tenants.b]\nkeys = ["{hash_key("k")}"]\n', "also 'a''s"),
        ('[tenants.acme]\ncolour = "blue"\n', "unknown fields ['colour']"),
        ("[tenants.acme.limits]\nrequests_per_min = -1\n", "must be a number >= 0"),
        ('[tenant.acme]\ntier = "pro"\n', "unknown top-level tables"),
        ("[tenants.'bad id!']\n", "ids are letters"),
        ("[tiers.gold]\nweight = 0\n", "tier 'gold': weight must be in (0, 1000]"),
        ("[tiers.gold]\nreserve = 1.5\n", "reserve in [0, 1)"),
    ],
)
def test_anything_wrong_in_the_file_is_refused_with_the_reason(text, reason):
    with pytest.raises(TenantsError, match=re.escape(reason)):
        parse_tenants(text)


def test_add_rotate_and_revoke():
    book, key = TenantBook().add("acme", "enterprise")
    assert book.tenant_of(key).id == "acme"
    rotated, new = book.rotate_key("acme")
    assert rotated.tenant_of(key) is None and rotated.tenant_of(new).id == "acme"
    revoked = rotated.revoke("acme")
    assert revoked.tenant_of(new) is None and not revoked.holds("acme", hash_key(new))
    with pytest.raises(TenantsError, match="already exists"):
        book.add("acme", "pro")
    with pytest.raises(TenantsError, match="no tenant"):
        book.revoke("nobody")


def test_an_edit_that_does_not_parse_keeps_the_last_good_book(tmp_path):
    path = tmp_path / "tenants.toml"
    path.write_text(GOOD)
    directory = TenantDirectory(path, "", "")
    assert not directory.reload_if_changed()  # unchanged
    path.write_text(GOOD + "\n[tenants.broken\n")
    assert not directory.reload_if_changed() and directory.tenant_of("acme-key").id == "acme"
    path.write_text(parse_tenants(GOOD).revoke("acme").dumps())
    assert directory.reload_if_changed() and directory.tenant_of("acme-key") is None


def test_without_a_file_the_settings_keys_work():
    directory = TenantDirectory(None, "dev-key:dev,other:dev", "dev:pro")
    assert directory.tenant_of("dev-key").id == "dev" and directory.tenant_of("other").id == "dev"
    assert directory.tier_of("dev") == "pro" and directory.tier_of("stranger") == "standard"
