"""What the simulated fleet is asked to do: requests with lengths, arriving as a Poisson process
(steady, or with a sinusoidal day), and the record each request keeps of how it was served."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class Lengths:
    """Prompt and output lengths, lognormal around their medians, clipped."""

    prompt_median: int = 1500
    output_median: int = 200
    sigma: float = 0.5  # of log(length): ~1.65x between median and p84
    prompt_max: int = 6144
    output_max: int = 1024

    def sample(self, rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
        prompts = rng.lognormal(math.log(self.prompt_median), self.sigma, n)
        outputs = rng.lognormal(math.log(self.output_median), self.sigma, n)
        return (np.clip(prompts.round(), 16, self.prompt_max).astype(int),
                np.clip(outputs.round(), 2, self.output_max).astype(int))

    def means(self) -> tuple[float, float]:
        """Means before clipping (lognormal: median x exp(sigma^2 / 2))."""
        grow = math.exp(self.sigma**2 / 2)
        return self.prompt_median * grow, self.output_median * grow


@dataclass(slots=True, eq=False)
class SimRequest:
    id: int
    arrival: float
    prompt: int
    output: int  # tokens generated, the first one included
    home: int = 0  # the region its user is in
    region: int = -1  # the region it was placed in; set once, never changed
    placements: int = 0  # how many times it was placed: 1 for every request served
    rtt_s: float = 0.0  # added to its TTFT when served away from home
    transfer_s: float = 0.0  # its KV handoff, disaggregated only
    prefill_done: float = math.nan
    first_token: float = math.nan  # as the serving region sees it (without rtt_s)
    finish: float = math.nan
    worker: Any = None  # the worker that took it first (unified, or prefill)
    decode_worker: Any = None  # whose step ends are tokens 2..output
    decode_from: int = 0  # index of that worker's step that emitted token 2

    @property
    def ttft(self) -> float:
        return self.first_token - self.arrival + self.rtt_s

    @property
    def done(self) -> bool:
        return not math.isnan(self.finish)


def poisson_arrivals(rng: np.random.Generator, rate: float, horizon: float) -> np.ndarray:
    """Arrival times of a Poisson process of `rate` per second on [0, horizon)."""
    n = int(rate * horizon + 6 * math.sqrt(rate * horizon) + 10)
    times = np.cumsum(rng.exponential(1.0 / rate, n))
    while times[-1] < horizon:  # rare: draw on
        times = np.concatenate([times, times[-1] + np.cumsum(rng.exponential(1.0 / rate, n))])
    return times[times < horizon]


def diurnal_rate(t: np.ndarray | float, mean: float, amplitude: float, phase: float, day_s: float):
    """mean x (1 + amplitude x sin(2 pi (t / day - phase))): phase in days, peak at t/day = phase + 1/4."""
    return mean * (1.0 + amplitude * np.sin(2 * math.pi * (np.asarray(t) / day_s - phase)))


def diurnal_arrivals(rng: np.random.Generator, mean: float, amplitude: float, phase: float,
                     day_s: float, horizon: float) -> np.ndarray:
    """A Poisson process whose rate follows diurnal_rate, by thinning one at the peak rate."""
    peak = mean * (1.0 + abs(amplitude))
    times = poisson_arrivals(rng, peak, horizon)
    keep = rng.random(len(times)) * peak < diurnal_rate(times, mean, amplitude, phase, day_s)
    return times[keep]


def make_requests(arrivals: np.ndarray, prompts: np.ndarray, outputs: np.ndarray, home: int = 0,
                  first_id: int = 0) -> list[SimRequest]:
    return [SimRequest(first_id + i, float(t), int(p), int(o), home)
            for i, (t, p, o) in enumerate(zip(arrivals, prompts, outputs))]
