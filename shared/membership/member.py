"""What a member is: its status and their precedence, its mutable state, and the read-only views services get."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

Address = tuple[str, int]
Load = dict[str, int | float]


class Status(enum.StrEnum):
    ALIVE = "alive"
    SUSPECT = "suspect"
    DEAD = "dead"
    LEFT = "left"


# At one incarnation: alive < suspect < dead < left. Left outranks dead because only the
# member itself can say it left, which is the better-informed account.
RANK = {Status.ALIVE: 0, Status.SUSPECT: 1, Status.DEAD: 2, Status.LEFT: 3}
GONE = (Status.DEAD, Status.LEFT)


def supersedes(new_status: Status, new_incarnation: int, old_status: Status, old_incarnation: int) -> bool:
    """SWIM precedence: a higher incarnation wins; at the same one the higher-ranked status does."""
    return (new_incarnation, RANK[new_status]) > (old_incarnation, RANK[old_status])


@dataclass(frozen=True)
class MemberView:
    """A member as one node sees it; what services read."""

    id: str
    role: str
    address: Address
    addresses: Mapping[str, str]
    load: Mapping[str, int | float]
    status: Status
    incarnation: int
    pid: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "role": self.role,
            "address": f"{self.address[0]}:{self.address[1]}",
            "addresses": dict(self.addresses),
            "load": dict(self.load),
            "status": str(self.status),
            "incarnation": self.incarnation,
            "pid": self.pid,
        }


@dataclass(frozen=True)
class MemberEvent:
    """A change seen by one node: old_status is None for a newcomer; equal statuses mean new addresses or load."""

    member: MemberView
    old_status: Status | None
    new_status: Status


@dataclass(slots=True)
class MemberState:
    """A member's entry in one node's table, changed only by the table's precedence rules."""

    id: str
    role: str
    host: str
    port: int
    addresses: dict[str, str] = field(default_factory=dict)
    load: Load = field(default_factory=dict)
    pid: int = 0
    incarnation: int = 0
    status: Status = Status.ALIVE
    status_since: float = 0.0

    @property
    def address(self) -> Address:
        return (self.host, self.port)

    def view(self) -> MemberView:
        return MemberView(
            id=self.id,
            role=self.role,
            address=self.address,
            addresses=MappingProxyType(dict(self.addresses)),
            load=MappingProxyType(dict(self.load)),
            status=self.status,
            incarnation=self.incarnation,
            pid=self.pid,
        )
