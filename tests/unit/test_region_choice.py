"""Where a new chat goes: its home region until that is at its overflow load, then the nearest peer with room."""

from __future__ import annotations

import pytest

from services.edge.region_choice import PeerRoom, choose_region

NEAR = PeerRoom("near", rtt_ms=20, load=0.5, overflow_load=0.9)
FAR = PeerRoom("far", rtt_ms=80, load=0.1, overflow_load=0.9)
FULL_NEAR = PeerRoom("full-near", rtt_ms=5, load=0.95, overflow_load=0.9)
UNKNOWN = PeerRoom("unknown", rtt_ms=1, load=None, overflow_load=0.9)


@pytest.mark.parametrize(
    ("load", "peers", "chosen"),
    [
        (0.5, [NEAR, FAR], "home"),  # under its overflow load: stays home
        (0.89, [NEAR], "home"),
        (0.9, [NEAR, FAR], "near"),  # at it: the nearest peer with room
        (1.5, [FAR, NEAR], "near"),  # order of the peers does not matter
        (0.95, [FULL_NEAR, FAR], "far"),  # the nearest has no room: the next one
        (0.95, [UNKNOWN, FAR], "far"),  # no fresh summary: no room
        (0.95, [FULL_NEAR, UNKNOWN], "home"),  # nobody has room: stays (admission may refuse it)
        (0.95, [], "home"),
        (None, [NEAR], "home"),  # no worker known here yet: admitted here, as without regions
    ],
)
def test_the_chat_goes_home_unless_full_then_to_the_nearest_peer_with_room(load, peers, chosen):
    assert choose_region("home", load, 0.9, peers) == chosen


def test_a_peer_has_room_only_under_its_own_overflow_load():
    strict = PeerRoom("strict", rtt_ms=1, load=0.5, overflow_load=0.5)
    lenient = PeerRoom("lenient", rtt_ms=50, load=0.5, overflow_load=0.6)
    assert not strict.has_room
    assert choose_region("home", 1.0, 0.9, [strict, lenient]) == "lenient"


def test_an_overflow_load_of_zero_always_overflows_and_ties_go_to_the_emptier_peer():
    a = PeerRoom("a", rtt_ms=10, load=0.4, overflow_load=0.9)
    b = PeerRoom("b", rtt_ms=10, load=0.2, overflow_load=0.9)
    assert choose_region("home", 0.0, 0.0, [a, b]) == "b"
