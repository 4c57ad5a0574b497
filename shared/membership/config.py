"""Membership settings: one frozen dataclass, with named profiles `local` (one machine, tests) and `lan`."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class MembershipConfig:
    """SWIM gossip settings. The field defaults are the `local` profile."""

    # Packets naming another cluster are dropped, so two fleets sharing a network never merge.
    cluster_name: str = "drivetrain"
    # Shared HMAC-SHA256 key of every member. The local default is for one machine only;
    # `lan` has none and refuses to start until one is given.
    secret: str = "drivetrain-local-gossip"
    # Where the gossip socket binds; port 0 picks a free port (tests).
    bind_host: str = "127.0.0.1"
    bind_port: int = 7946
    # The host others should send to; empty means bind_host (set it when binding 0.0.0.0).
    advertise_host: str = ""

    # Each period one member is probed. Smaller finds failures sooner and costs more packets.
    probe_interval: float = 0.2
    # Time to wait for a direct ack before asking others to probe indirectly; well above a
    # round trip on the network, or healthy members get probed indirectly for nothing.
    probe_timeout: float = 0.1
    # How many members are asked to probe indirectly (k); more survives more packet loss.
    indirect_checks: int = 3
    # Suspicion lasts suspicion_mult * max(1, log10(N)) * probe_interval once confirmed
    # by others, so a refutation has time to spread before a member is declared dead.
    suspicion_mult: int = 3
    # Unconfirmed suspicion lasts this many times longer (Lifeguard); each independent
    # confirmation shrinks it towards the minimum.
    suspicion_max_timeout_mult: int = 2
    # Each update is piggybacked retransmit_mult * ceil(log10(N + 1)) times.
    retransmit_mult: int = 4
    # Updates are also pushed on their own to gossip_nodes random members every gossip_interval,
    # which is what spreads news in O(log N) periods rather than riding on probes alone.
    gossip_interval: float = 0.05
    gossip_nodes: int = 3
    # Dead members still get gossip this long, so a member wrongly declared dead hears it and refutes.
    gossip_to_dead_time: float = 3.0
    # Full state is exchanged with one random member this often (and on join), repairing
    # whatever piggybacking missed; it grows with log2(N) past 32 members.
    push_pull_interval: float = 5.0
    # Repair of drifted views, at most this often per peer: alone, re-contact the seeds (they
    # started late); otherwise swap full state with a member we hold dead (a healed partition), with
    # an unknown sender, or with a pinger whose view of who is active differs from ours.
    resync_interval: float = 1.0
    # Local health (Lifeguard): a member that misses acks stretches its probe interval and
    # timeout by up to this factor, so a slow member stops accusing healthy ones.
    awareness_max_multiplier: int = 8
    # Dead and left members stay in the view this long, so services can see what happened
    # and stale updates about them cannot revive them.
    dead_retention: float = 10.0
    # Load changes are published at most this often; each publication bumps the incarnation.
    meta_min_interval: float = 0.5
    # Packets whose timestamp is further than this from our clock are dropped as replays,
    # and a sender's sequence numbers are remembered about twice this long.
    replay_window: float = 30.0
    # Datagram size limit; piggybacked updates are trimmed to fit under a 1500-byte MTU.
    max_packet_size: int = 1400
    # How long `start` waits for a seed to answer, and `stop` for its leave to spread.
    join_timeout: float = 2.0
    leave_timeout: float = 1.0

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

    @classmethod
    def local(cls, **overrides: Any) -> MembershipConfig:
        return profile("local", **overrides)

    @classmethod
    def lan(cls, **overrides: Any) -> MembershipConfig:
        return profile("lan", **overrides)


# Values that differ from the field defaults (which are `local`); close to memberlist's LAN config.
PROFILES: dict[str, dict[str, Any]] = {
    "local": {},
    "lan": {
        "secret": "",
        "bind_host": "0.0.0.0",
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
    },
}


def profile(name: str, **overrides: Any) -> MembershipConfig:
    """The named profile, with any fields replaced."""
    if name not in PROFILES:
        raise ValueError(f"unknown membership profile {name!r}; known: {', '.join(PROFILES)}")
    values = {**PROFILES[name], **overrides}
    unknown = set(values) - {f.name for f in dataclasses.fields(MembershipConfig)}
    if unknown:
        raise ValueError(f"unknown membership settings: {', '.join(sorted(unknown))}")
    return MembershipConfig(**values)
