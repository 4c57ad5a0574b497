"""`drivetrain tenants add | list | rotate-key | revoke`: edits the tenants file that edges read.

A new key is printed once and never stored in clear; the file is replaced whole (written
beside it, then renamed), so an edge re-reading it never sees half an edit.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
from pathlib import Path

from services.edge.tenant_directory import read_book
from services.edge.tenants import Limits, TenantBook, TenantsError

DEFAULT_FILE = Path(os.environ.get("DRIVETRAIN_TENANTS_FILE", "tenants.toml"))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--file", type=Path, default=DEFAULT_FILE, help=f"the tenants file (default {DEFAULT_FILE}, or DRIVETRAIN_TENANTS_FILE)")
    sub = parser.add_subparsers(dest="action", required=True)
    add = sub.add_parser("add", help="a new tenant with one key, printed once")
    add.add_argument("tenant")
    add.add_argument("--tier", default="free")
    for field in dataclasses.fields(Limits):
        add.add_argument(f"--{field.name.replace('_', '-')}", type=int, default=0, help="0: no limit")
    listing = sub.add_parser("list", help="tenants, tiers, number of keys and limits")
    listing.add_argument("--json", action="store_true")
    sub.add_parser("rotate-key", help="a new key, printed once; the old ones stop working").add_argument("tenant")
    sub.add_parser("revoke", help="every key of the tenant stops working; edges close its sockets").add_argument("tenant")


def run(args: argparse.Namespace) -> int:
    try:
        book = read_book(args.file) if args.file.exists() or args.action != "add" else TenantBook()
        if args.action == "list":
            print(render(book, args.json))
            return 0
        key = None
        if args.action == "add":
            limits = Limits(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Limits)})
            book, key = book.add(args.tenant, args.tier, limits)
        elif args.action == "rotate-key":
            book, key = book.rotate_key(args.tenant)
        else:
            book = book.revoke(args.tenant)
        write_atomically(args.file, book.dumps())
    except TenantsError as exc:
        print(f"drivetrain tenants: {args.file}: {exc}", file=sys.stderr)
        return 2
    print(f"{args.tenant}: {key}" if key else f"{args.tenant}: revoked")
    return 0


def render(book: TenantBook, as_json: bool) -> str:
    rows = [
        {"tenant": t.id, "tier": t.tier, "keys": len(t.key_hashes),
         "limits": {k: v for k, v in dataclasses.asdict(t.limits).items() if v}}
        for t in sorted(book.tenants.values(), key=lambda t: t.id)
    ]
    if as_json:
        return json.dumps(rows, indent=2)
    lines = [f"{'tenant':<24} {'tier':<12} {'keys':>4}  limits"]
    lines += [f"{r['tenant']:<24} {r['tier']:<12} {r['keys']:>4}  {r['limits'] or '-'}" for r in rows]
    return "\n".join(lines)


def write_atomically(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=f".{path.name}.", delete=False) as tmp:
        tmp.write(text)
    os.chmod(tmp.name, 0o600)
    os.replace(tmp.name, path)
