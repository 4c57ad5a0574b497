"""Asking a running node for its view over UDP (signed `members` request, chunked answer), and printing it."""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import time
from collections.abc import Iterable
from typing import Any

from shared.membership.codec import Codec
from shared.membership.member import Address, MemberView
from shared.membership.messages import (
    MembersRequest,
    MembersResponse,
    StateRecord,
    decode_record,
)
from shared.membership.settings import MembershipSettings
from shared.membership.transport import UdpTransport


async def query_members(
    address: Address, config: MembershipSettings, timeout: float = 2.0, attempts: int = 3
) -> list[dict[str, Any]]:
    """The members a node at `address` knows, as dicts sorted by (role, id). Raises TimeoutError."""
    codec = Codec(config.cluster_name, config.secret_bytes)
    sender = f"query-{os.getpid()}-{secrets.token_hex(4)}"
    request_id = secrets.randbits(62)
    arrivals: asyncio.Queue[bytes] = asyncio.Queue()
    bind_host = "127.0.0.1" if address[0].startswith("127.") or address[0] == "localhost" else "0.0.0.0"
    transport = await UdpTransport.open(bind_host, 0, lambda data, source: arrivals.put_nowait(data))
    try:
        for attempt in range(attempts):
            data = codec.seal(sender, time.time_ns() // 1000 + attempt, time.time(), MembersRequest(request_id))
            transport.send(address, data)
            chunks = await _collect(codec, arrivals, request_id, timeout / attempts)
            if chunks is not None:
                records = [r for chunk in chunks for r in _decode_all(chunk)]
                return [view_from_record(r).to_dict() for r in sorted(records, key=lambda r: (r.role, r.member))]
    finally:
        await transport.close()
    raise TimeoutError(f"no complete members answer from {address[0]}:{address[1]}")


async def _collect(
    codec: Codec, arrivals: asyncio.Queue[bytes], request_id: int, timeout: float
) -> list[list[bytes]] | None:
    """Every chunk of one answer, or None if some did not arrive in time."""
    chunks: dict[int, list[bytes]] = {}
    total: int | None = None
    deadline = asyncio.get_running_loop().time() + timeout
    while total is None or len(chunks) < total:
        remaining = deadline - asyncio.get_running_loop().time()
        if remaining <= 0:
            return None
        try:
            data = await asyncio.wait_for(arrivals.get(), remaining)
        except TimeoutError:
            return None
        envelope = codec.open(data)
        body = getattr(envelope, "body", None)
        if isinstance(body, MembersResponse) and body.request_id == request_id and body.index < body.total:
            total = body.total
            chunks[body.index] = body.states
    return [chunks[i] for i in range(total)]


def _decode_all(blobs: list[bytes]) -> list[StateRecord]:
    records = []
    for blob in blobs:
        try:
            records.append(decode_record(blob))
        except ValueError:
            continue  # one unreadable entry should not hide the rest of the view
    return records


def view_from_record(record: StateRecord) -> MemberView:
    return MemberView(
        id=record.member, role=record.role, address=(record.host, record.port), addresses=record.addresses,
        load=record.load, status=record.status, incarnation=record.incarnation, pid=record.pid,
    )


def members_json(rows: Iterable[dict[str, Any]]) -> str:
    return json.dumps(list(rows), indent=2, sort_keys=True)


def members_table(rows: Iterable[dict[str, Any]]) -> str:
    """One line per member, for people: id, role, status, incarnation, pid, gossip address, load."""
    lines = [f"{'ID':<24} {'ROLE':<8} {'STATUS':<8} {'INC':>5} {'PID':>8}  {'ADDRESS':<22} LOAD"]
    for row in rows:
        load = " ".join(f"{k}={v:g}" for k, v in sorted(row["load"].items()))
        lines.append(
            f"{row['id']:<24} {row['role']:<8} {row['status']:<8} {row['incarnation']:>5} {row['pid']:>8}"
            f"  {row['address']:<22} {load}"
        )
    return "\n".join(lines)
