"""One simulated GPU worker each: unified (chunked prefill and decodes in one step), prefill-only,
or decode-only. Each runs engine steps back to back while it has work, as the engine loop does.

A decoding request emits one token at the end of every step it is in, so its token times are a
slice of its worker's step end times: a worker keeps those, and a step costs O(1) however big
its batch, which keeps a minutes-long fleet run to seconds."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from sim_events import EventLoop
from sim_model import StepModel
from sim_workload import SimRequest


class Worker:
    """The step loop and the decode batch every kind shares."""

    def __init__(self, loop: EventLoop, model: StepModel, name: str, on_finish: Callable[[SimRequest], None]):
        self.loop, self.model, self.name, self.on_finish = loop, model, name, on_finish
        self.region = -1
        self.step_ends: list[float] = []  # end time of step k at index k
        self.step_decodes: list[int] = []  # tokens its decodes emitted at the end of step k
        self.busy = False
        self.num_decodes = 0
        self.context_tokens = 0  # KV tokens the decodes read in a step
        self.kv_used = 0  # reserved as prompt + output at admission, so nothing is ever preempted
        self.unfinished = 0  # requests given to this worker and not finished
        self._finishing: dict[int, list[SimRequest]] = {}  # step index -> requests whose last token it emits

    # -- what a kind of worker decides -------------------------------------------------------------
    def _admit(self, step: int) -> None:
        """Move what may start into the running set, before step `step` is planned."""

    def _plan_prefill(self) -> list[list]:
        """[entry, tokens] chunks of prompts this step computes (entry = [request, tokens left])."""
        return []

    def _after_prefill(self, chunks: list[list], step: int, now: float) -> None:
        """Account the step's chunks; a prompt whose last chunk ran has its first token now."""

    # -- the loop ------------------------------------------------------------------------------------
    def kick(self) -> None:
        if not self.busy:
            self._start_step()

    def _start_step(self) -> None:
        step = len(self.step_ends)
        self._admit(step)
        chunks = self._plan_prefill()
        prefill_tokens = sum(n for _, n in chunks)
        if self.num_decodes == 0 and prefill_tokens == 0:
            self.busy = False
            return
        self.busy = True
        duration = self.model.step_s(self.num_decodes, prefill_tokens, self.context_tokens)
        self.loop.after(duration, self._end_step, chunks)

    def _end_step(self, chunks: list[list]) -> None:
        step, now = len(self.step_ends), self.loop.now
        self.step_ends.append(now)
        self.step_decodes.append(self.num_decodes)
        self.context_tokens += self.num_decodes  # every decode appended one token
        for request in self._finishing.pop(step, ()):
            self.num_decodes -= 1
            self.context_tokens -= request.prompt + request.output
            self._finish(request, now)
        self._after_prefill(chunks, step, now)
        self._start_step()

    def _can_reserve(self, request: SimRequest) -> bool:
        return self.kv_used == 0 or self.kv_used + request.prompt + request.output <= self.model.kv_capacity_tokens

    def _join_decode(self, request: SimRequest, first_step: int) -> None:
        """Decode from step `first_step` on: tokens 2..output at its end and the steps after."""
        if request.output <= 1:
            self._finish(request, request.first_token)
            return
        request.decode_worker, request.decode_from = self, first_step
        self.num_decodes += 1
        self.context_tokens += request.prompt + 1
        self._finishing.setdefault(first_step + request.output - 2, []).append(request)

    def _finish(self, request: SimRequest, now: float) -> None:
        request.finish = now
        self.kv_used -= request.prompt + request.output
        self.unfinished -= 1
        self.on_finish(request)


class UnifiedWorker(Worker):
    """Chunked prefill: each step takes the running decodes first, then prompt chunks up to the budget."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.waiting: deque[SimRequest] = deque()  # not yet admitted (FCFS)
        self.prefilling: deque[list] = deque()  # admitted: [request, prompt tokens left]
        self.pending_prefill = 0  # prompt tokens not computed yet, waiting ones included

    def add(self, request: SimRequest) -> None:
        request.worker = self
        self.unfinished += 1
        self.pending_prefill += request.prompt
        self.waiting.append(request)
        self.kick()

    def _admit(self, step: int) -> None:
        while self.waiting and self.num_decodes + len(self.prefilling) < self.model.max_num_seqs:
            if not self._can_reserve(self.waiting[0]):
                break
            request = self.waiting.popleft()
            self.kv_used += request.prompt + request.output
            self.prefilling.append([request, request.prompt])

    def _plan_prefill(self) -> list[list]:
        budget, chunks = self.model.token_budget - self.num_decodes, []
        for entry in self.prefilling:
            if budget <= 0:
                break
            n = min(entry[1], budget)
            chunks.append([entry, n])
            budget -= n
        return chunks

    def _after_prefill(self, chunks: list[list], step: int, now: float) -> None:
        for entry, n in chunks:
            entry[1] -= n
            self.pending_prefill -= n
            if entry[1] == 0:  # chunks run in order, so a finished prompt is at the head
                self.prefilling.popleft()
                request = entry[0]
                request.prefill_done = request.first_token = now
                self._join_decode(request, step + 1)


class PrefillWorker(Worker):
    """Prompts only, FCFS up to the budget; a finished prompt's KV goes to `handoff`. Its own KV
    memory is not modelled: a prompt's cache leaves as soon as its link has sent it."""

    def __init__(self, *args, handoff: Callable[[SimRequest, PrefillWorker], None], **kwargs):
        super().__init__(*args, **kwargs)
        self.handoff = handoff
        self.prefilling: deque[list] = deque()
        self.pending_prefill = 0
        self.link_free_at = 0.0  # its link sends one KV transfer at a time

    def add(self, request: SimRequest) -> None:
        request.worker = self
        self.pending_prefill += request.prompt
        self.prefilling.append([request, request.prompt])
        self.kick()

    _plan_prefill = UnifiedWorker._plan_prefill

    def _after_prefill(self, chunks: list[list], step: int, now: float) -> None:
        for entry, n in chunks:
            entry[1] -= n
            self.pending_prefill -= n
            if entry[1] == 0:
                self.prefilling.popleft()
                entry[0].prefill_done = now
                self.handoff(entry[0], self)


class DecodeWorker(Worker):
    """Decodes only: a request joins at the next step after its KV landed (its first token then)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.landed: deque[SimRequest] = deque()
        self.inbound = 0  # transfers on their way here

    @property
    def load(self) -> int:
        return self.num_decodes + len(self.landed) + self.inbound

    def expect(self) -> None:
        self.inbound += 1
        self.unfinished += 1

    def land(self, request: SimRequest) -> None:
        self.inbound -= 1
        request.first_token = self.loop.now
        self.landed.append(request)
        self.kick()

    def _admit(self, step: int) -> None:
        while self.landed and self.num_decodes < self.model.max_num_seqs and self._can_reserve(self.landed[0]):
            request = self.landed.popleft()
            self.kv_used += request.prompt + request.output
            self._join_decode(request, step)
