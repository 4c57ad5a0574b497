"""SWIM gossip membership with Lifeguard's refinements: who is alive, where, and how loaded.

Services use `Membership` (asyncio, UDP); `Node` is the sans-I/O core and `Simulation`
runs whole clusters in virtual time.
"""

from shared.membership.codec import Drop
from shared.membership.member import (
    Address,
    MemberEvent,
    MemberView,
    Status,
    supersedes,
)
from shared.membership.memory import FaultModel, InMemoryNetwork, InMemoryTransport
from shared.membership.node import Node, Outgoing
from shared.membership.query import members_json, members_table, query_members
from shared.membership.settings import LAN, MembershipSettings
from shared.membership.shell import Membership
from shared.membership.simulation import Simulation
from shared.membership.transport import Transport, UdpTransport

__all__ = [
    "LAN",
    "Address",
    "Drop",
    "FaultModel",
    "InMemoryNetwork",
    "InMemoryTransport",
    "MemberEvent",
    "MemberView",
    "Membership",
    "MembershipSettings",
    "Node",
    "Outgoing",
    "Simulation",
    "Status",
    "Transport",
    "UdpTransport",
    "members_json",
    "members_table",
    "query_members",
    "supersedes",
]
