"""The `regions` section: single-region by default, peers from JSON, and a bad peer list stops the edge at start."""

from __future__ import annotations

import pytest

from services.edge.settings import EdgeSettings
from shared.settings import SettingsError, load

PEER = '[{"name": "r2", "edge_url": "ws://10.0.0.2:8080/v1/chat", "rtt_ms": 40}]'


def test_by_default_an_edge_is_single_region():
    assert not EdgeSettings().regions.enabled and EdgeSettings().regions.peers == ()


def test_peers_come_from_a_flag_as_json():
    regions = load(EdgeSettings, ["--regions.name", "r1", "--regions.peers", PEER, "--regions.overflow-load", "0.8"]).regions
    assert regions.enabled and regions.overflow_load == 0.8
    assert [(p.name, p.edge_url, p.rtt_ms) for p in regions.peers] == [("r2", "ws://10.0.0.2:8080/v1/chat", 40.0)]


@pytest.mark.parametrize(
    "args",
    [
        ["--regions.name", "r2", "--regions.peers", PEER],  # itself as a peer
        ["--regions.peers", PEER[:-1] + ', {"name": "r2", "edge_url": "ws://x/"}]'],  # one region twice
        ["--regions.peers", '[{"name": "r2", "edge_url": "http://x/"}]'],  # not a WebSocket URL
        ["--regions.overflow-load", "-1"],
    ],
)
def test_a_bad_regions_setting_stops_the_edge(args):
    with pytest.raises(SettingsError, match="regions"):
        load(EdgeSettings, args)
