"""`host:port` as settings write it."""

from __future__ import annotations

import socket


def parse_address(text: str) -> tuple[str, int]:
    host, _, port = text.strip().rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"expected host:port, got {text!r}")
    return host, int(port)


def parse_addresses(text: str) -> list[tuple[str, int]]:
    """`host:port[,host:port]`; empty entries are skipped."""
    return [parse_address(part) for part in text.split(",") if part.strip()]


def advertised_host(bind_host: str) -> str:
    """The host others reach a socket bound here at: the machine's name when bound to every interface."""
    return socket.gethostname() if bind_host == "0.0.0.0" else bind_host
