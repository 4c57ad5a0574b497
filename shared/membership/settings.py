"""Membership settings: one frozen section, whose defaults suit one machine (tests, `drivetrain up`);
`LAN` holds the values that differ on a real network, which the compose profile takes."""

from __future__ import annotations

import dataclasses
from typing import Any

from pydantic import ConfigDict
from pydantic.dataclasses import dataclass

from shared.addresses import advertised_host, parse_addresses


@dataclass(frozen=True, config=ConfigDict(use_attribute_docstrings=True, extra="ignore"))
class MembershipSettings:
    """SWIM gossip over UDP: who is alive, where, and how loaded."""

    cluster_name: str = ""
    """name carried by every packet, so two fleets sharing a network never merge; empty: the topic prefix"""
    secret: str = "drivetrain-local-gossip"
    """shared HMAC-SHA256 key of every member; the default is for one machine only"""
    host: str = "127.0.0.1"
    """address the gossip socket binds to; at 0.0.0.0 the member advertises the machine's host name"""
    port: int = 0
    """gossip UDP port; 0 picks a free one (then nobody can use this member as a seed)"""
    advertise_host: str = ""
    """the host others send to; empty: the bind address (or the host name when binding 0.0.0.0)"""
    seeds: str = "127.0.0.1:7946"
    """members to join through, host:port[,host:port]; a member keeps re-contacting them until one answers"""

    probe_interval: float = 0.2
    """seconds between probes of one member each; smaller finds failures sooner and costs more packets"""
    probe_timeout: float = 0.1
    """seconds to wait for a direct ack before asking others to probe; well above a round trip"""
    indirect_checks: int = 3
    """members asked to probe indirectly (k); more survives more packet loss"""
    suspicion_mult: int = 3
    """confirmed suspicion lasts suspicion_mult x max(1, log10 N) x probe_interval before a member is dead"""
    suspicion_max_timeout_mult: int = 2
    """unconfirmed suspicion lasts this many times longer (Lifeguard); confirmations shrink it"""
    retransmit_mult: int = 4
    """each update is piggybacked retransmit_mult x ceil(log10(N + 1)) times"""
    gossip_interval: float = 0.05
    """seconds between pushes of fresh updates to gossip_nodes random members"""
    gossip_nodes: int = 3
    """members each push goes to"""
    gossip_to_dead_time: float = 3.0
    """seconds dead members still get gossip, so one wrongly declared dead hears it and refutes"""
    push_pull_interval: float = 5.0
    """seconds between full-state exchanges with one random member (longer past 32 members)"""
    resync_interval: float = 1.0
    """at most this often per peer, repair drifted views (re-contact seeds, swap state with a stranger)"""
    stall_timeout: float = 10.0
    """seconds a service's own loop may go without running before its member (gossiping on a thread of its own) goes silent and the others declare it dead; load that only delays the loop never does"""
    awareness_max_multiplier: int = 8
    """a member missing acks stretches its own probe interval and timeout by up to this factor"""
    dead_retention: float = 10.0
    """seconds dead and left members stay in the view, so stale updates cannot revive them"""
    meta_min_interval: float = 0.5
    """load changes are published at most this often (each bumps the incarnation)"""
    replay_window: float = 30.0
    """packets further than this from our clock are dropped as replays: keep clocks in sync"""
    max_packet_size: int = 1400
    """bytes per datagram; piggybacked updates are trimmed to fit"""
    join_timeout: float = 2.0
    """seconds `start` waits for a seed to answer"""
    leave_timeout: float = 1.0
    """seconds `stop` waits for its leave to spread"""

    def __post_init__(self) -> None:
        if self.probe_timeout >= self.probe_interval:
            raise ValueError("probe_timeout must be shorter than probe_interval")
        if self.max_packet_size < 512:
            raise ValueError("max_packet_size below 512 bytes leaves no room for updates")
        if self.awareness_max_multiplier < 1 or self.indirect_checks < 0:
            raise ValueError("awareness_max_multiplier >= 1 and indirect_checks >= 0 required")

    @property
    def secret_bytes(self) -> bytes:
        return self.secret.encode()

    @property
    def advertised_host(self) -> str:
        return self.advertise_host or advertised_host(self.host)

    def seed_addresses(self) -> list[tuple[str, int]]:
        return parse_addresses(self.seeds)

    def replace(self, **changes: Any) -> MembershipSettings:
        return dataclasses.replace(self, **changes)

    @classmethod
    def lan(cls, **overrides: Any) -> MembershipSettings:
        return cls(**{**LAN, **overrides})


# Values that differ from the defaults on a real network; close to memberlist's LAN config.
# `secret` is empty on purpose: a member refuses to start until one is given.
LAN: dict[str, Any] = {
    "secret": "",
    "host": "0.0.0.0",
    "port": 7946,
    "probe_interval": 1.0,
    "probe_timeout": 0.5,
    "suspicion_mult": 4,
    "suspicion_max_timeout_mult": 6,
    "gossip_interval": 0.2,
    "gossip_to_dead_time": 30.0,
    "push_pull_interval": 30.0,
    "resync_interval": 5.0,
    "dead_retention": 60.0,
    "meta_min_interval": 1.0,
    "join_timeout": 5.0,
    "leave_timeout": 3.0,
}
