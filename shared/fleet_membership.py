"""Joins a service to the fleet's gossip membership, from its settings.

Each test fleet runs under its own topic prefix, which also names its gossip
cluster, so fleets sharing a machine never merge.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping

from shared.membership import MemberEvent, Membership, Status
from shared.membership.member import GONE
from shared.service_settings import ServiceSettings

log = logging.getLogger(__name__)

Load = Mapping[str, int | float]


async def join_fleet(
    settings: ServiceSettings, member_id: str, role: str, addresses: dict[str, str], load: Load
) -> Membership:
    gossip = settings.membership()
    # On its own thread: a service loop busy for a while (load) must not look like a crash.
    membership = Membership(gossip, member_id, role, addresses, dict(load), own_thread=True)
    own = (gossip.advertised_host, gossip.port)
    # The first seed need not wait for itself to answer.
    await membership.start([seed for seed in gossip.seed_addresses() if seed != own])
    return membership


def on_departure(membership: Membership, role: str, callback: Callable[[str, bool], object]) -> None:
    """Call `callback(member_id, died)` when a member of `role` is declared dead (True) or leaves (False)."""

    def changed(event: MemberEvent) -> None:
        if event.member.role == role and event.new_status in GONE and event.old_status not in GONE:
            log.warning("%s %s is %s", role, event.member.id, event.new_status)
            callback(event.member.id, event.new_status is Status.DEAD)

    membership.on_change(changed)


def is_alive(membership: Membership, member_id: str) -> bool:
    """Alive or merely suspected: only a member declared dead (or unknown) counts as gone."""
    member = membership.member(member_id)
    return member is not None and member.status not in GONE


async def publish_load(membership: Membership, load: Callable[[], Load], period_s: float = 1.0) -> None:
    """Keep the member's load current for the rest of the fleet (edges read workers' load)."""
    while True:
        membership.set_load(dict(load()))
        await asyncio.sleep(period_s)
