"""Membership timing math: suspicion timeouts, Lifeguard's confirmation shrink, retransmit limits, health scaling."""

import pytest

from shared.membership.awareness import Awareness
from shared.membership.suspicion import Suspicion
from shared.membership.timing import (
    confirmed_timeout,
    expected_confirmations,
    node_scale,
    push_pull_interval,
    retransmit_limit,
    scaled,
    suspicion_bounds,
    suspicion_timeout,
)


@pytest.mark.parametrize(
    "members, scale",
    [(0, 1.0), (1, 1.0), (5, 1.0), (10, 1.0), (50, 1.69897), (100, 2.0), (500, 2.69897), (1000, 3.0)],
)
def test_suspicion_timeout_grows_with_log10_of_the_cluster(members, scale):
    assert node_scale(members) == pytest.approx(scale, abs=1e-5)
    assert suspicion_timeout(3, members, 1.0) == pytest.approx(3 * scale, abs=1e-4)
    assert suspicion_timeout(4, members, 0.2) == pytest.approx(0.8 * scale, abs=1e-4)


def test_suspicion_bounds_are_min_and_max_mult_times_min():
    assert suspicion_bounds(4, 6, 100, 1.0) == pytest.approx((8.0, 48.0))


@pytest.mark.parametrize(
    "mult, members, limit",
    [(3, 0, 0), (3, 1, 3), (3, 9, 3), (3, 10, 6), (3, 99, 6), (3, 100, 9), (4, 200, 12), (4, 1000, 16)],
)
def test_retransmit_limit(mult, members, limit):
    assert retransmit_limit(mult, members) == limit


@pytest.mark.parametrize(
    "confirmations, expected, timeout",
    [
        (0, 3, 30.0),  # unconfirmed: the longest
        (1, 3, 16.0),  # 30 - 28 * log 2 / log 4
        (2, 3, 7.8104),  # 30 - 28 * log 3 / log 4
        (3, 3, 2.0),  # all expected confirmations: the shortest
        (5, 3, 2.0),  # never below the shortest
        (0, 0, 2.0),  # nobody could confirm: the shortest at once
    ],
)
def test_lifeguard_confirmations_shrink_the_timeout(confirmations, expected, timeout):
    assert confirmed_timeout(2.0, 30.0, confirmations, expected) == pytest.approx(timeout, abs=1e-3)


@pytest.mark.parametrize("mult, members, k", [(4, 3, 0), (4, 4, 2), (4, 64, 2), (3, 100, 1), (2, 100, 0), (6, 5, 0)])
def test_expected_confirmations(mult, members, k):
    assert expected_confirmations(mult, members) == k


@pytest.mark.parametrize("members, interval", [(1, 30.0), (32, 30.0), (33, 60.0), (64, 60.0), (65, 90.0), (200, 120.0)])
def test_push_pull_slows_past_32_members(members, interval):
    assert push_pull_interval(30.0, members) == interval


@pytest.mark.parametrize("score, factor", [(0, 1), (1, 2), (7, 8)])
def test_health_scales_timeouts(score, factor):
    assert scaled(0.5, score) == 0.5 * factor


def test_awareness_is_clamped_to_its_range():
    awareness = Awareness(max_multiplier=3)
    awareness.apply_delta(-1)
    assert awareness.score == 0
    awareness.apply_delta(5)
    assert awareness.score == 2
    assert awareness.scale(1.0) == 3.0


def test_suspicion_counts_each_independent_confirmation_once():
    suspicion = Suspicion("a", started=100.0, shortest=2.0, longest=30.0, expected=3)
    assert suspicion.deadline == 130.0
    assert not suspicion.confirm("a")  # the first accuser is not a confirmation
    assert suspicion.confirm("b")
    assert not suspicion.confirm("b")
    assert suspicion.deadline == pytest.approx(116.0)
    assert suspicion.confirm("c") and suspicion.confirm("d")
    assert suspicion.deadline == pytest.approx(102.0)
    assert not suspicion.confirm("e")  # beyond K nothing more to gain
