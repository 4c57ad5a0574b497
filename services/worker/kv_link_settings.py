"""The worker's role in a disaggregated fleet, and the KV link's settings (the `kv_link` section)."""

from __future__ import annotations

from typing import Literal

from shared.settings import Section

WorkerRole = Literal["unified", "prefill", "decode"]


class KVLinkSettings(Section):
    """Prefill workers hand requests, KV cache and all, to decode workers over this direct link."""

    host: str = "127.0.0.1"
    """address a decode worker takes handed-off requests on; published through gossip (as the host name when 0.0.0.0)"""
    port: int = 0
    """port of that listener; 0: any free port (gossip tells prefill workers which)"""
    timeout_s: float = 10.0
    """a handoff's whole transfer, from connecting to the decode worker's commit; past it the prefill worker decodes the request itself"""
    max_tries: int = 2
    """decode workers a prefill worker offers one request to (the next if one refuses) before decoding it itself"""
