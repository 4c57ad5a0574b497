"""Fair share between tenants: weighted virtual token counters (Sheng et al., "Fairness in
Serving Large Language Models", OSDI'24).

Each tenant has a counter of the service it received, in weighted tokens. The next request
admitted is the head of the backlogged tenant with the smallest counter; the scheduler stops
at the first head that does not fit, so no request is skipped and none starves. A tenant
whose queue goes from empty to non-empty has its counter lifted to the smallest counter of
those backlogged (or, with none, to the last one served): time spent idle is not banked.

Admission charges the prompt, (uncached × w_in + cached × w_cached) / weight; each token
generated charges w_out / weight. Cached prompt tokens cost what the GPU did for them, so
a tenant living off the prefix cache still pays in fair share for its reads. Within one
tenant, requests wait by priority (lower first), then by arrival.
"""

from __future__ import annotations

import itertools
from collections import Counter, OrderedDict
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

from services.worker.engine.request import Request
from services.worker.engine.tenant_order import TenantOrder


@dataclass(frozen=True)
class VTCCosts:
    w_in: float = 1.0  # per prompt token computed
    w_out: float = 2.0  # per token generated
    w_cached: float = 0.1  # per prompt token read from the prefix cache
    weights: Mapping[str, float] = field(default_factory=dict)  # tenant -> weight, over the requests' own

    def weight(self, tenant: str, requested: float = 1.0) -> float:
        """This engine's setting for the tenant if it has one, else the weight its request carries (its tier's)."""
        return self.weights.get(tenant, requested)


class VirtualTokenCounters(TenantOrder):
    def __init__(self, costs: VTCCosts | None = None) -> None:
        self.costs = costs or VTCCosts()
        self.counters: dict[str, float] = {}
        self._backlog: dict[str, OrderedDict[str, Request]] = {}  # tenants with requests waiting
        self._arrival: dict[str, int] = {}
        self._clock = itertools.count()
        self._last_served = 0.0  # counter of the tenant admitted last

    # Queue ------------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        self._check_new(request)
        tenant = request.tenant
        if tenant not in self._backlog:
            floor = min((self.counters[t] for t in self._backlog), default=self._last_served)
            self.counters[tenant] = max(self.counters.get(tenant, 0.0), floor)
            self._backlog[tenant] = OrderedDict()
        queue = self._backlog[tenant]
        jumps = bool(queue) and request.priority < next(reversed(queue.values())).priority
        queue[request.request_id] = request
        self._arrival[request.request_id] = next(self._clock)
        if jumps:  # rare: most requests carry the default priority and simply queue last
            ordered = sorted(queue.values(), key=lambda r: (r.priority, self._arrival[r.request_id]))
            self._backlog[tenant] = OrderedDict((r.request_id, r) for r in ordered)

    def push_front(self, request: Request) -> None:
        """A preempted request goes ahead of its own tenant's, not of everyone's: it was
        charged already, and jumping the other tenants would hand a hot tenant's preempted
        work the slots the counters meant for the rest."""
        self.add(request)
        queue = self._backlog[request.tenant]
        queue.move_to_end(request.request_id, last=False)
        self._arrival[request.request_id] = -next(self._clock)  # oldest of its tenant

    def peek(self) -> Request | None:
        tenant = self._next_tenant()
        return None if tenant is None else next(iter(self._backlog[tenant].values()))

    def pop_next(self) -> Request:
        request = self.peek()
        if request is None:
            raise IndexError("pop_next from an empty queue")
        self.remove(request.request_id)
        return request

    def remove(self, request_id: str) -> Request | None:
        for tenant, queue in self._backlog.items():
            if (request := queue.pop(request_id, None)) is not None:
                self._arrival.pop(request_id, None)
                if not queue:
                    del self._backlog[tenant]
                return request
        return None

    def __len__(self) -> int:
        return sum(len(queue) for queue in self._backlog.values())

    def __iter__(self) -> Iterator[Request]:
        """Tenants by counter, each tenant's requests in its order (admission order, were nobody charged meanwhile)."""
        tenants = sorted(self._backlog, key=self._rank)
        return iter([r for t in tenants for r in self._backlog[t].values()])

    def __contains__(self, request_id: object) -> bool:
        return any(request_id in queue for queue in self._backlog.values())

    # Charges ----------------------------------------------------------------------------
    def on_admitted(self, request: Request, num_cached: int) -> None:
        if request.num_preemptions == 0:  # a recomputation after preemption is the system's doing
            costs = self.costs
            cost = (request.num_prompt_tokens - num_cached) * costs.w_in + num_cached * costs.w_cached
            self._charge(request.tenant, request.weight, cost)
        self._last_served = self.counters.get(request.tenant, 0.0)

    def on_scheduled(self, step: Mapping[Request, int]) -> None:
        # Hundreds of requests a step, a handful of tenants: one charge per (tenant, weight).
        sampling = Counter(
            (request.tenant, request.weight) for request, num_tokens in step.items()
            # the step draws a token: it reaches the end of the tokens known or pending
            if request.num_computed_tokens + num_tokens == len(request.all_token_ids) + request.num_pending_tokens
        )  # fmt: skip
        for (tenant, weight), num_sampled in sampling.items():
            self._charge(tenant, weight, num_sampled * self.costs.w_out)

    def _charge(self, tenant: str, weight: float, cost: float) -> None:
        self.counters[tenant] = self.counters.get(tenant, 0.0) + cost / self.costs.weight(tenant, weight)

    # Order ------------------------------------------------------------------------------
    def _next_tenant(self) -> str | None:
        return min(self._backlog, key=self._rank, default=None)

    def _rank(self, tenant: str) -> tuple[float, int]:
        head = next(iter(self._backlog[tenant]))
        return self.counters[tenant], self._arrival[head]

    def _check_new(self, request: Request) -> None:
        if request.request_id in self:
            raise ValueError(f"request {request.request_id} is already queued")
