"""Scenario B: regions with a day of load each, phase-shifted, each a unified fleet with an
admission threshold; overflow off (a region over threshold queues its own requests) against on
(a request its region cannot take goes to the nearest region with room, paying that round trip
on its TTFT, and stays there). One simulated day is compressed so that it still spans many
request lifetimes: each hour of it is long against a request, as a real hour is."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
from sim_dispatch import UnifiedFleet
from sim_events import EventLoop
from sim_metrics import SLO, percentiles
from sim_model import StepModel
from sim_workload import (
    Lengths,
    SimRequest,
    diurnal_arrivals,
    diurnal_rate,
    make_requests,
)


@dataclass(frozen=True)
class RegionsConfig:
    num_regions: int = 3
    gpus_per_region: int = 4
    rtt_ms: tuple[float, float] = (70.0, 140.0)  # to a neighbouring region, to one further away
    peak_over_capacity: float = 1.25  # each region's peak offered load over its saturated throughput
    trough_over_capacity: float = 0.1
    day_lifetimes: float = 50.0  # a day lasts this many lifetimes of a request at the loose SLO
    bins: int = 24  # "hours"
    warmup_days: float = 1 / 3  # simulated before the measured day, so no region starts its peak empty
    lengths: Lengths = field(default_factory=Lengths)


def rtt_s(config: RegionsConfig, a: int, b: int) -> float:
    """Regions on a line: neighbours at the near RTT, the rest at the far one."""
    if a == b:
        return 0.0
    return (config.rtt_ms[0] if abs(a - b) == 1 else config.rtt_ms[1]) / 1000.0


class Placement:
    """Where a request runs: its home region, or with overflow on and home over threshold, the
    nearest region under it. Decided once at arrival; nothing moves a placed request."""

    def __init__(self, fleets: list[UnifiedFleet], config: RegionsConfig, admit_backlog_s: float, overflow: bool):
        self.fleets, self.config, self.admit_backlog_s, self.overflow = fleets, config, admit_backlog_s, overflow
        self.over_threshold = 0  # arrivals whose home region was over its threshold

    def has_room(self, region: int) -> bool:
        return self.fleets[region].backlog_s() < self.admit_backlog_s

    def choose(self, home: int) -> int:
        if self.has_room(home):
            return home
        self.over_threshold += 1
        if self.overflow:
            others = sorted((r for r in range(len(self.fleets)) if r != home), key=lambda r: (rtt_s(self.config, home, r), r))
            for region in others:
                if self.has_room(region):
                    return region
        return home  # nowhere with room, or overflow off: queue at home

    def place(self, request: SimRequest) -> None:
        region = self.choose(request.home)
        request.region, request.placements = region, request.placements + 1
        request.rtt_s = rtt_s(self.config, request.home, region)
        self.fleets[region].submit(request)


def day_requests(config: RegionsConfig, capacity_req_s: float, day_s: float, seed: int) -> list[SimRequest]:
    """Every region's arrivals over the warm-up and the measured day, peaks 1/num_regions of a day
    apart, in time order; the measured day starts at warmup_days x day_s."""
    mean = capacity_req_s * (config.peak_over_capacity + config.trough_over_capacity) / 2
    amplitude = (config.peak_over_capacity - config.trough_over_capacity) / (config.peak_over_capacity + config.trough_over_capacity)
    requests: list[SimRequest] = []
    for region in range(config.num_regions):
        rng = np.random.default_rng([seed, 7, region])
        arrivals = diurnal_arrivals(rng, mean, amplitude, phase(config, region) + config.warmup_days, day_s,
                                    (1 + config.warmup_days) * day_s)
        prompts, outputs = config.lengths.sample(rng, len(arrivals))
        requests += make_requests(arrivals, prompts, outputs, home=region, first_id=len(requests))
    return sorted(requests, key=lambda r: (r.arrival, r.id))


def phase(config: RegionsConfig, region: int) -> float:
    """In days; region r peaks (r / num_regions) of a day after region 0."""
    return region / config.num_regions


def run_day(model: StepModel, config: RegionsConfig, capacity_req_s: float, day_s: float, admit_backlog_s: float,
            overflow: bool, slo: SLO, seed: int) -> tuple[dict, list[SimRequest], list[UnifiedFleet]]:
    """One day of every region's arrivals, run until the last request is done; TTFT as the user sees it."""
    loop = EventLoop()
    fleets = [UnifiedFleet(loop, model, config.gpus_per_region, lambda r: None, region=r) for r in range(config.num_regions)]
    placement = Placement(fleets, config, admit_backlog_s, overflow)
    requests = everyone = day_requests(config, capacity_req_s, day_s, seed)

    def arrive(i: int) -> None:
        placement.place(requests[i])
        if i + 1 < len(requests):
            loop.at(requests[i + 1].arrival, arrive, i + 1)

    loop.at(requests[0].arrival, arrive, 0)
    loop.run()
    start = config.warmup_days * day_s
    requests = [r for r in requests if r.arrival >= start]  # the warm-up's are not measured
    ttft = np.array([r.ttft for r in requests])
    moved = np.array([r.region != r.home for r in requests])
    home = np.array([r.home for r in requests])
    hour = np.minimum(((np.array([r.arrival for r in requests]) - start) / day_s * config.bins).astype(int), config.bins - 1)
    meets = ttft <= slo.ttft_s
    centres = (np.arange(config.bins) + 0.5) * day_s / config.bins
    mean = capacity_req_s * (config.peak_over_capacity + config.trough_over_capacity) / 2
    amplitude = (config.peak_over_capacity - config.trough_over_capacity) / (config.peak_over_capacity + config.trough_over_capacity)
    regions = []
    for region in range(config.num_regions):
        mine = home == region
        offered = diurnal_rate(centres, mean, amplitude, phase(config, region), day_s)
        peak_hours = offered > capacity_req_s
        in_peak = mine & peak_hours[hour]
        regions.append({
            "region": region,
            "offered_req_s_by_hour": offered.tolist(),
            "ttft_p99_s_by_hour": [percentiles(ttft[mine & (hour == h)])["p99"] for h in range(config.bins)],
            "served_away_by_hour": [float(moved[mine & (hour == h)].mean()) if (mine & (hour == h)).any() else math.nan
                                    for h in range(config.bins)],
            "peak_hours": np.flatnonzero(peak_hours).tolist(),
            "ttft_s": percentiles(ttft[mine]),
            "ttft_peak_s": percentiles(ttft[in_peak]),
            "ttft_slo_attainment": float(meets[mine].mean()),
            "ttft_slo_attainment_peak": float(meets[in_peak].mean()) if in_peak.any() else math.nan,
            "served_away_share": float(moved[mine].mean()),
            "served_here_for_others": int(sum(1 for r in requests if r.region == region and r.home != region)),
        })
    rtts = np.array([r.rtt_s for r in requests])
    summary = {
        "overflow": overflow,
        "requests": len(requests),
        "over_threshold_share": placement.over_threshold / len(everyone),
        "cross_region_share": float(moved.mean()),
        "added_rtt_ms_mean_moved": float(rtts[moved].mean() * 1000) if moved.any() else 0.0,
        "ttft_s": percentiles(ttft),
        "ttft_moved_s": percentiles(ttft[moved]),
        "ttft_slo_attainment": float(meets.mean()),
        "regions": regions,
    }
    return summary, everyone, fleets


def scenario(model: StepModel, config: RegionsConfig, capacity_per_gpu: float, admit_backlog_s: float,
             slo: SLO, seed: int) -> dict:
    """The same day, overflow off and on. capacity_per_gpu: a unified GPU's saturated requests/s."""
    capacity_req_s = capacity_per_gpu * config.gpus_per_region
    life = slo.ttft_s + (config.lengths.output_median - 1) * slo.itl_s
    day_s = config.day_lifetimes * life
    runs = {}
    for overflow in (False, True):
        runs["on" if overflow else "off"], _, _ = run_day(model, config, capacity_req_s, day_s, admit_backlog_s,
                                                          overflow, slo, seed)
    offered = np.sum([r["offered_req_s_by_hour"] for r in runs["off"]["regions"]], axis=0)
    return {
        "num_regions": config.num_regions, "gpus_per_region": config.gpus_per_region,
        "region_capacity_req_s": capacity_req_s,
        "fleet_offered_over_capacity_max": float(offered.max() / (capacity_req_s * config.num_regions)),
        "region_capacity_source": "scenario A: a unified GPU's saturated throughput (closed loop) x GPUs per region",
        "peak_over_capacity": config.peak_over_capacity, "trough_over_capacity": config.trough_over_capacity,
        "peak_hour_of_day": [(24 * (phase(config, r) + 0.25)) % 24 for r in range(config.num_regions)],
        "rtt_ms": {f"{a}-{b}": 1000 * rtt_s(config, a, b) for a in range(config.num_regions) for b in range(a + 1, config.num_regions)},
        "day_s": day_s, "day_note": f"24 h compressed into {day_s:.0f} simulated s ({config.day_lifetimes:g} request lifetimes at the "
                                    f"{slo.name} SLO); a queue that builds while a peak lasts grows with day_s, so overflow-off peak "
                                    "TTFTs are smaller here than a real day's would be",
        "ttft_slo_s": slo.ttft_s,
        "admit_backlog_s": admit_backlog_s,
        "admission_rule": "a region has room while its queued prompt work per worker (tokens x prefill time) is under admit_backlog_s; "
                          "overflow off: over threshold, requests queue at home (none is rejected)",
        "runs": runs,
    }
