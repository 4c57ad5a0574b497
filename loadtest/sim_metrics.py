"""What a simulated run measured: TTFT, inter-token gaps, SLO attainment, goodput and throughput.

A request meets an SLO pair when it finished, its TTFT is within the TTFT bound and the p90 of
its own inter-token gaps (or their max or mean, as asked) is within the ITL bound. Goodput is
the rate of requests that meet it; the fleet's goodput capacity is DistServe's: the highest
offered rate at which at least 90 % of requests meet the SLO."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from sim_workload import SimRequest

ATTAINMENT_GOAL = 0.9
ITL_STATS = ("p90", "max", "mean")


@dataclass(frozen=True)
class SLO:
    name: str
    ttft_s: float
    itl_s: float

    def as_dict(self) -> dict:
        return {"ttft_s": self.ttft_s, "itl_s": self.itl_s}


def percentiles(values: np.ndarray) -> dict[str, float]:
    if len(values) == 0:
        return {"p50": math.nan, "p90": math.nan, "p99": math.nan}
    p50, p90, p99 = np.percentile(values, [50, 90, 99])
    return {"p50": float(p50), "p90": float(p90), "p99": float(p99)}


def itl_gaps(request: SimRequest, steps: dict[int, np.ndarray]) -> np.ndarray:
    """Gaps between the request's tokens, as far as it got: first token, then its decode steps' ends."""
    if request.decode_worker is None or math.isnan(request.first_token):
        return np.empty(0)
    ends = steps[id(request.decode_worker)]
    decoded = ends[request.decode_from:request.decode_from + request.output - 1]
    return np.diff(np.concatenate(([request.first_token], decoded)))


def itl_statistics(gaps: list[np.ndarray], stat: str) -> np.ndarray:
    """Each request's p90 (numpy's linear interpolation), max or mean gap; 0 for one with no gap.

    Vectorised over all requests at once: one np.percentile per request would cost more than the run."""
    lengths = np.array([len(g) for g in gaps], dtype=int)
    out = np.zeros(len(gaps))
    if lengths.sum() == 0:
        return out
    flat = np.concatenate(gaps)
    starts = np.concatenate(([0], np.cumsum(lengths)[:-1]))
    has = lengths > 0
    if stat == "max":
        out[has] = np.maximum.reduceat(flat, starts[has])
    elif stat == "mean":
        out[has] = np.add.reduceat(flat, starts[has]) / lengths[has]
    else:
        segment = np.repeat(np.arange(len(gaps)), lengths)
        ordered = flat[np.lexsort((flat, segment))]
        position = starts[has] + 0.9 * (lengths[has] - 1)
        lo = np.floor(position).astype(int)
        hi = np.minimum(lo + 1, starts[has] + lengths[has] - 1)
        out[has] = ordered[lo] + (ordered[hi] - ordered[lo]) * (position - lo)
    return out


def summarize(requests: list[SimRequest], workers: list, window: tuple[float, float], horizon: float,
              slos: list[SLO], itl_stat: str) -> dict:
    """Figures over the requests that arrived inside `window`; one not done by `horizon` fails every SLO."""
    t0, t1 = window
    steps = {id(w): np.asarray(w.step_ends) for w in workers}
    measured = [r for r in requests if t0 <= r.arrival < t1]
    done = np.array([r.done for r in measured], dtype=bool)
    # A request without its first token by the horizon: its TTFT is at least horizon - arrival.
    ttft = np.array([r.ttft if not math.isnan(r.first_token) else horizon - r.arrival + r.rtt_s for r in measured])
    gaps = [itl_gaps(r, steps) for r in measured]
    itl = itl_statistics(gaps, itl_stat)
    all_gaps = np.concatenate(gaps) if gaps else np.empty(0)
    span = t1 - t0
    out = {
        "requests": len(measured),
        "completed_fraction": float(done.mean()) if len(done) else math.nan,
        "ttft_s": percentiles(ttft),
        "ttft_censored": int(sum(math.isnan(r.first_token) for r in measured)),
        "itl_s": percentiles(all_gaps),
        "request_itl_s": percentiles(itl),
        "output_tok_s": output_tokens_in(requests, workers, window) / span,
        "transfer_s_mean": float(np.mean([r.transfer_s for r in measured])) if measured else math.nan,
        "slo": {},
    }
    for slo in slos:
        ok = done & (ttft <= slo.ttft_s) & (itl <= slo.itl_s)
        out["slo"][slo.name] = {
            "attainment": float(ok.mean()) if len(ok) else math.nan,
            "goodput_req_s": float(ok.sum()) / span,
            "ttft_ok": float((ttft <= slo.ttft_s).mean()) if len(ok) else math.nan,  # which bound failed
            "itl_ok": float((done & (itl <= slo.itl_s)).mean()) if len(ok) else math.nan,
        }
    return out


def output_tokens_in(requests: list[SimRequest], workers: list, window: tuple[float, float]) -> int:
    """Tokens emitted inside the window: first tokens, and every decode step's tokens."""
    t0, t1 = window
    first = np.array([r.first_token for r in requests if not math.isnan(r.first_token)])
    total = int(((first >= t0) & (first < t1)).sum())
    for worker in workers:
        ends = np.asarray(worker.step_ends)
        lo, hi = np.searchsorted(ends, [t0, t1])
        total += int(sum(worker.step_decodes[lo:hi]))
    return total


def capacity(rates: list[float], attainments: list[float], goal: float = ATTAINMENT_GOAL) -> dict:
    """Highest rate with attainment >= goal, interpolated to where the curve first falls below it."""
    if not rates or attainments[0] < goal:
        return {"rate": 0.0, "bounded": True, "note": f"below the goal already at the lowest rate {rates[0] if rates else 0:.3g}"}
    for i in range(1, len(rates)):
        if attainments[i] < goal:
            a0, a1 = attainments[i - 1], attainments[i]
            rate = rates[i - 1] + (rates[i] - rates[i - 1]) * (a0 - goal) / (a0 - a1)
            return {"rate": float(rate), "bounded": True}
    return {"rate": float(rates[-1]), "bounded": False, "note": "goal met at every rate swept: a lower bound"}
