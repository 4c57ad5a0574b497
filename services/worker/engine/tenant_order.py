"""The order in which waiting requests are admitted: a pluggable policy, with first-come-first-served."""

from __future__ import annotations

import abc
from collections import OrderedDict
from collections.abc import Iterator, Mapping

from services.worker.engine.request import Request


class TenantOrder(abc.ABC):
    """The scheduler's waiting queue; a policy decides who is next.

    The scheduler peeks at the next request, tries to admit it, and pops it only
    when it was admitted, so a request that does not fit keeps its place.
    `on_scheduled` reports every token a step computes (prefill chunks and decodes
    alike), which is what a fair-share policy charges its tenants' virtual clocks with.
    """

    @abc.abstractmethod
    def add(self, request: Request) -> None:
        """Queue a newly arrived request."""

    @abc.abstractmethod
    def push_front(self, request: Request) -> None:
        """Queue a preempted request ahead of everyone: it already held the client's attention."""

    @abc.abstractmethod
    def peek(self) -> Request | None:
        """The request the policy would admit next, or None when empty."""

    @abc.abstractmethod
    def pop_next(self) -> Request:
        """Remove and return what `peek` returns; raises IndexError when empty."""

    @abc.abstractmethod
    def remove(self, request_id: str) -> Request | None:
        """Take a request out wherever it is (abort); None if it is not queued."""

    @abc.abstractmethod
    def __len__(self) -> int: ...

    @abc.abstractmethod
    def __iter__(self) -> Iterator[Request]:
        """Waiting requests in admission order."""

    def __contains__(self, request_id: object) -> bool:
        return any(request.request_id == request_id for request in self)

    def on_admitted(self, request: Request, num_cached: int) -> None:
        """The request left the queue for the running batch, `num_cached` of its tokens from the prefix cache."""

    def on_scheduled(self, step: Mapping[Request, int]) -> None:
        """Charge the tokens a step computes, per request, to their tenants (no-op by default)."""


class FCFS(TenantOrder):
    """Arrival order, tenants ignored; preempted requests go back to the front."""

    def __init__(self) -> None:
        self._queue: OrderedDict[str, Request] = OrderedDict()

    def add(self, request: Request) -> None:
        self._check_new(request)
        self._queue[request.request_id] = request

    def push_front(self, request: Request) -> None:
        self._check_new(request)
        self._queue[request.request_id] = request
        self._queue.move_to_end(request.request_id, last=False)

    def peek(self) -> Request | None:
        return next(iter(self._queue.values()), None)

    def pop_next(self) -> Request:
        if not self._queue:
            raise IndexError("pop_next from an empty queue")
        return self._queue.popitem(last=False)[1]

    def remove(self, request_id: str) -> Request | None:
        return self._queue.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(list(self._queue.values()))

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._queue

    def _check_new(self, request: Request) -> None:
        if request.request_id in self._queue:
            raise ValueError(f"request {request.request_id} is already queued")
