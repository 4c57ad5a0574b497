"""The pipeline benchmark's per-hop breakdown: histograms scraped before and after a run, subtracted, summarised."""

from __future__ import annotations

import math

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from loadtest.pipeline_hops import HopCounts, breakdown, parse, token_path
from shared.hop_timing import Hop, HopTimer


def exposition(observations: dict[Hop, list[float]]) -> str:
    registry = CollectorRegistry()
    timer = HopTimer(registry, *observations)
    for hop, values in observations.items():
        for seconds in values:
            timer.observe(hop, seconds)
    return generate_latest(registry).decode()


def test_a_run_is_what_was_observed_between_the_two_scrapes():
    before = parse(exposition({Hop.LINK: [0.5, 0.5], Hop.ROUTE: [0.002]}))
    after = parse(exposition({Hop.LINK: [0.5, 0.5, 0.0012, 0.0018], Hop.ROUTE: [0.002]}))
    rows = breakdown(before, after)
    assert list(rows) == ["link"]  # route saw nothing new
    assert rows["link"]["count"] == 2
    assert rows["link"]["mean_ms"] == pytest.approx(1.5)
    assert 1.0 <= rows["link"]["p50_ms"] <= 2.0  # both fall in the (1, 2] ms buckets


def test_hops_come_in_path_order():
    text = exposition({Hop.SOCKET_WRITE: [0.001], Hop.ADMISSION: [0.001], Hop.TOKEN_KAFKA: [0.001]})
    assert list(breakdown({}, parse(text))) == ["admission", "token_kafka", "socket_write"]


def test_quantiles_interpolate_inside_a_bucket_as_prometheus_does():
    counts = HopCounts({0.001: 0.0, 0.002: 10.0, math.inf: 10.0}, sum=0.015)
    assert counts.quantile(0.5) == pytest.approx(0.0015)
    assert counts.quantile(0.99) == pytest.approx(0.00199)
    beyond = HopCounts({0.001: 0.0, math.inf: 4.0}, sum=40.0)
    assert beyond.quantile(0.5) == 0.001  # past the last bound: that bound is all one can say
    assert math.isnan(HopCounts().quantile(0.5))


def test_a_negative_time_between_two_clocks_counts_as_zero():
    rows = breakdown({}, parse(exposition({Hop.REQUEST_KAFKA: [-0.0004, 0.001]})))
    assert rows["request_kafka"]["mean_ms"] == pytest.approx(0.5)


def test_the_token_path_adds_up_its_own_hops_only():
    text = exposition({Hop.ADMISSION: [0.05], Hop.TOKEN_KAFKA: [0.002], Hop.ROUTE: [0.001], Hop.SOCKET_WRITE: [0.0005]})
    path = token_path(breakdown({}, parse(text)))
    assert path["mean_ms"] == pytest.approx(3.5)  # admission is no part of it
