"""Joins a service to the fleet's gossip membership, from its config.

Each test fleet runs under its own topic prefix, which also names its gossip
cluster, so fleets sharing a machine never merge.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable

from shared.config import CommonConfig
from shared.membership import MemberEvent, Membership, Status, profile
from shared.membership.member import GONE

log = logging.getLogger(__name__)


def advertised_host(bind_host: str) -> str:
    return socket.gethostname() if bind_host == "0.0.0.0" else bind_host


async def join_fleet(
    config: CommonConfig, member_id: str, role: str, addresses: dict[str, str], load: dict[str, int | float]
) -> Membership:
    overrides = {
        "cluster_name": config.topic_prefix,
        "bind_host": config.gossip_host,
        "bind_port": config.gossip_port,
        "advertise_host": advertised_host(config.gossip_host),
    }
    if config.gossip_secret:
        overrides["secret"] = config.gossip_secret
    membership = Membership(profile(config.gossip_profile, **overrides), member_id, role, addresses, load)
    own = (overrides["advertise_host"], config.gossip_port)
    # The first seed need not wait for itself to answer.
    await membership.start([seed for seed in config.gossip_seed_addresses() if seed != own])
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


async def publish_load(membership: Membership, load: Callable[[], dict[str, int | float]], period_s: float = 1.0) -> None:
    """Keep the member's load current for the rest of the fleet (edges read workers' load)."""
    while True:
        membership.set_load(load())
        await asyncio.sleep(period_s)
