"""The fleet simulator's event model: every request completes once, TTFT is never below the prefill
it needs (and includes the KV transfer when disaggregated), a long prompt stalls a unified
worker's decodes, overflow never moves a placed request, and the results say they are simulated."""

from __future__ import annotations

import importlib
import json
import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

LOADTEST = Path(__file__).resolve().parents[2] / "loadtest"
MODULES = ("sim_events", "sim_model", "sim_workload", "sim_dispatch", "sim_metrics", "sim_single_region",
           "sim_regions", "sim_fleet", "sim_plot")


@pytest.fixture
def sim(monkeypatch):
    monkeypatch.syspath_prepend(str(LOADTEST))
    return SimpleNamespace(**{name.removeprefix("sim_"): importlib.import_module(name) for name in MODULES})


def small_model(sim, **changes):
    """Round numbers: a 10 ms step, 1 ms per decode, 0.1 ms per prompt token, 0.1 s per 1,000-token handoff."""
    fields = dict(fixed_s=0.010, per_seq_s=0.001, prefill_token_s=0.0001, kv_read_token_s=0.0, kv_bytes_per_token=1000,
                  link_bytes_s=1e7, token_budget=512, max_num_seqs=64, kv_capacity_tokens=10**6)
    return sim.model.StepModel(**{**fields, **changes})


def serve(sim, model, kind: str, requests, num_gpus: int = 4):
    """Run `requests` (their arrival times set) through a fleet; returns the finish count per request id."""
    loop = sim.events.EventLoop()
    finished: dict[int, int] = {}

    def on_finish(request):
        finished[request.id] = finished.get(request.id, 0) + 1

    if kind == "unified":
        fleet = sim.dispatch.UnifiedFleet(loop, model, num_gpus, on_finish)
    else:
        fleet = sim.dispatch.DisaggregatedFleet(loop, model, num_gpus // 2, num_gpus - num_gpus // 2, on_finish)
    for request in requests:
        loop.at(request.arrival, fleet.submit, request)
    loop.run()
    return finished, fleet


def loaded_requests(sim, n: int = 300, rate: float = 20.0, seed: int = 3):
    rng = np.random.default_rng(seed)
    arrivals = sim.workload.poisson_arrivals(rng, rate, n / rate)
    prompts, outputs = sim.workload.Lengths(prompt_median=600, output_median=40).sample(rng, len(arrivals))
    return sim.workload.make_requests(arrivals, prompts, outputs)


@pytest.mark.parametrize("kind", ["unified", "disaggregated"])
def test_every_request_completes_exactly_once_and_ttft_covers_its_prefill(sim, kind):
    model = small_model(sim)
    requests = loaded_requests(sim)
    finished, _ = serve(sim, model, kind, requests)
    assert len(requests) > 200
    assert finished == {r.id: 1 for r in requests}
    for r in requests:
        assert r.done and r.finish >= r.first_token >= r.arrival
        assert r.ttft >= model.prefill_s(r.prompt) - 1e-9, (r.id, r.ttft, model.prefill_s(r.prompt))
        if kind == "disaggregated":
            # The first token reaches the client when the KV has landed: its own transfer is in the TTFT.
            assert r.transfer_s == pytest.approx(model.transfer_s(r.prompt))
            assert r.first_token - r.prefill_done >= r.transfer_s - 1e-9
            assert r.ttft >= model.prefill_s(r.prompt) + r.transfer_s - 1e-9


def test_with_no_load_disaggregated_ttft_is_unified_plus_the_transfer(sim):
    model = small_model(sim)
    make = lambda: [sim.workload.SimRequest(i, 100.0 * i, 1500 + 100 * i, 20) for i in range(4)]  # noqa: E731
    unified, disaggregated = make(), make()
    serve(sim, model, "unified", unified)
    serve(sim, model, "disaggregated", disaggregated)
    for u, d in zip(unified, disaggregated):
        assert u.ttft == pytest.approx(model.prefill_s(u.prompt))
        assert d.ttft - u.ttft == pytest.approx(model.transfer_s(d.prompt), rel=1e-6)
        assert d.ttft - u.ttft > 0.1  # and the transfer is not negligible here, so the check can fail


def test_a_long_prompt_stalls_every_decode_in_a_unified_worker(sim):
    model = small_model(sim)
    steady = [sim.workload.SimRequest(i, 0.0, 16, 400) for i in range(8)]
    long_prompt = sim.workload.SimRequest(99, 1.0, 4000, 2)
    serve(sim, model, "unified", [*steady, long_prompt], num_gpus=1)
    worker = steady[0].decode_worker
    ends = np.asarray(worker.step_ends)
    gaps = np.diff(ends)
    before = gaps[(ends[1:] > 0.1) & (ends[1:] < long_prompt.arrival)]  # all eight decoding, nothing else
    during = gaps[(ends[:-1] >= long_prompt.arrival) & (ends[1:] <= long_prompt.prefill_done)]  # steps started after it came
    assert len(before) > 10 and len(during) >= 4000 // model.token_budget
    decode_only = model.decode_step_s(8)
    assert before.max() == pytest.approx(decode_only)
    # The chunk steps carry the whole prompt on top of the decodes' own cost, so every decode waits for it.
    assert during.sum() == pytest.approx(len(during) * decode_only + model.prefill_token_s * long_prompt.prompt)
    assert during.min() > decode_only + model.prefill_token_s * 400
    steps = sim.metrics.itl_gaps(steady[0], {id(worker): ends})
    assert steps.max() > 3 * np.median(steps)  # the stall shows in a decoding request's own gaps


def test_overflow_places_each_request_once_and_never_moves_it(sim):
    model = small_model(sim, token_budget=256)
    config = sim.regions.RegionsConfig(num_regions=3, gpus_per_region=1, day_lifetimes=3.0, warmup_days=0.1,
                                       lengths=sim.workload.Lengths(prompt_median=400, output_median=20))
    slo = sim.metrics.SLO("loose", 0.5, 0.05)
    capacity = 1.0 / (model.prefill_s(450) + 20 * model.decode_step_s(16) / 16)
    summary, requests, fleets = sim.regions.run_day(model, config, capacity, 60.0, 0.2, True, slo, seed=5)
    assert summary["cross_region_share"] > 0.01  # overflow did happen, so the invariant is exercised
    for r in requests:
        assert r.placements == 1 and r.done
        assert r.worker.region == r.region  # prefilled and decoded where it was placed
        assert r.decode_worker is None or r.decode_worker is r.worker
        assert r.rtt_s == sim.regions.rtt_s(config, r.home, r.region)
    assert sum(w.unfinished for f in fleets for w in f.workers) == 0


def test_runs_are_deterministic_and_capacity_interpolates(sim):
    model = small_model(sim)
    slos = [sim.metrics.SLO("tight", 0.3, 0.03)]
    rng = np.random.default_rng(11)
    arrivals = sim.workload.poisson_arrivals(rng, 30.0, 20.0)
    prompts, outputs = sim.workload.Lengths(prompt_median=600, output_median=40).sample(rng, len(arrivals))
    first, second = (sim.single_region.run_once("2P2D", model, 4, arrivals, prompts, outputs, (2.0, 15.0), slos, "p90")
                     for _ in range(2))
    assert first == second
    cap = sim.metrics.capacity([1.0, 2.0, 3.0], [0.99, 0.95, 0.85])
    assert cap["rate"] == pytest.approx(2.5) and cap["bounded"]
    assert sim.metrics.capacity([1.0, 2.0], [0.8, 0.5])["rate"] == 0.0


def test_results_say_simulated_in_the_json_and_every_plot_title(sim, tmp_path):
    out = tmp_path / "sim.json"
    results = sim.fleet.main(["--quick", "--profile", "h200-llama8b", "--gpus", "2", "--rates", "0.3,0.9",
                              "--region-gpus", "1", "--day-lifetimes", "3", "--no-plot", "--json", str(out)])
    stored = json.loads(out.read_text())
    assert stored["simulated"] is True and "SIMULATED" in stored["label"]
    assert stored["seed"] == 1 and "sim_fleet.py" in stored["command"]
    profile = stored["profiles"]["h200-llama8b"]
    assert profile["simulated"] is True
    assert profile["inputs"]["link_bytes_s"]["value"] == 50e9 and "ASSUMED" in profile["inputs"]["link_bytes_s"]["source"]
    conclusions = profile["conclusions"]["scenario_a"]
    assert math.isfinite(conclusions["throughput_ratio"]) and conclusions["why"]
    fig = sim.plot.figure(results)
    titles = [ax.get_title() for ax in fig.axes] + [fig._suptitle.get_text()]
    assert len(titles) == 4 and all("SIMULATED" in t for t in titles), titles
