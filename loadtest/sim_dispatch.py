"""The two shapes of a simulated fleet and how each places a request on a worker.

Unified: every worker prefills and decodes; a request goes to the worker with the fewest
unfinished requests (then the fewest prompt tokens queued). Disaggregated: a request goes to
the prefill worker with the fewest prompt tokens queued; when its prompt is done, its KV goes
over that worker's link (one transfer at a time) to the decode worker with the least load,
and it decodes there from the step after the KV has landed."""

from __future__ import annotations

from collections.abc import Callable

from sim_events import EventLoop
from sim_model import StepModel
from sim_workers import DecodeWorker, PrefillWorker, UnifiedWorker
from sim_workload import SimRequest


class UnifiedFleet:
    def __init__(self, loop: EventLoop, model: StepModel, num_workers: int,
                 on_finish: Callable[[SimRequest], None], region: int = 0):
        self.loop, self.model, self.region = loop, model, region
        self.workers = [UnifiedWorker(loop, model, f"r{region}u{i}", on_finish) for i in range(num_workers)]
        for worker in self.workers:
            worker.region = region

    @property
    def all_workers(self) -> list:
        return self.workers

    def submit(self, request: SimRequest) -> None:
        min(self.workers, key=lambda w: (w.unfinished, w.pending_prefill)).add(request)

    def backlog_s(self) -> float:
        """Prompt work queued on this fleet, in seconds per worker: what a new request would wait."""
        return sum(w.pending_prefill for w in self.workers) * self.model.prefill_token_s / len(self.workers)


class DisaggregatedFleet:
    def __init__(self, loop: EventLoop, model: StepModel, num_prefill: int, num_decode: int,
                 on_finish: Callable[[SimRequest], None], region: int = 0):
        if num_prefill < 1 or num_decode < 1:
            raise ValueError("a disaggregated fleet needs at least one prefill and one decode worker")
        self.loop, self.model, self.region = loop, model, region
        self.prefills = [PrefillWorker(loop, model, f"r{region}p{i}", on_finish, handoff=self._handoff)
                         for i in range(num_prefill)]
        self.decodes = [DecodeWorker(loop, model, f"r{region}d{i}", on_finish) for i in range(num_decode)]
        for worker in self.all_workers:
            worker.region = region

    @property
    def all_workers(self) -> list:
        return [*self.prefills, *self.decodes]

    def submit(self, request: SimRequest) -> None:
        min(self.prefills, key=lambda w: w.pending_prefill).add(request)

    def _handoff(self, request: SimRequest, sender: PrefillWorker) -> None:
        target = min(self.decodes, key=lambda w: w.load)
        target.expect()
        request.transfer_s = self.model.transfer_s(request.prompt)
        sender.link_free_at = max(self.loop.now, sender.link_free_at) + request.transfer_s
        self.loop.at(sender.link_free_at, target.land, request)
