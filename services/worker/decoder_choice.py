"""Which decode worker a prefill worker offers a request to: the least loaded, and among those
about as free, the one a prompt's first block points at, so prompts that share a prefix meet
the decode worker whose prefix cache already holds it (and less KV has to move)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from shared.addresses import parse_address
from shared.membership import MemberView
from shared.rendezvous import rendezvous

KV_ADDRESS = "kv"  # the membership address a decode worker takes handed-off requests at
LOAD_SLACK = 2.0  # requests: decoders within this of the least loaded count as equally free


@dataclass(frozen=True)
class Decoder:
    worker_id: str
    address: tuple[str, int]
    load: float  # running + waiting, as it gossips them, plus this worker's handoffs to it in flight


def decoders_of(members: Iterable[MemberView], in_flight: Mapping[str, int]) -> list[Decoder]:
    """Alive decode workers from gossip; one whose address or load does not parse is left out."""
    decoders = []
    for member in members:
        text = member.addresses.get(KV_ADDRESS)
        if member.role != "worker" or not text:
            continue
        try:
            address = parse_address(text)
            load = float(member.load.get("running", 0)) + float(member.load.get("waiting", 0))
        except (ValueError, TypeError):
            continue
        if load == load:  # not NaN
            decoders.append(Decoder(member.id, address, load + in_flight.get(member.id, 0)))
    return decoders


def decoder_order(decoders: Sequence[Decoder], prefix: Sequence[int]) -> list[Decoder]:
    """Whom to offer to, first to last."""
    if not decoders:
        return []
    least = min(d.load for d in decoders)
    near = [d for d in decoders if d.load <= least + LOAD_SLACK]
    rest = sorted((d for d in decoders if d.load > least + LOAD_SLACK), key=lambda d: d.load)
    key = ",".join(map(str, prefix))
    near.sort(key=lambda d: rendezvous(key, d.worker_id), reverse=True)
    return near + rest
