"""The edge's placement of one chat: the workers and their partitions from gossip, the prompt's block
keys against the KV index, this edge's own count of what it sent where, and the conversation's
earlier worker, into one requests-topic partition (placement.py makes the choice).

A preference, never a correctness rule: with no worker known, or while the gossiped assignments
do not fit together (a rebalance in progress, or gossip behind it: a partition claimed twice, or
none claiming it), the chat goes to its key's default partition; a chat sent to a partition whose
owner just changed is served by the new owner.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from services.edge.fleet_view import worker_load
from services.edge.kv_index import KVIndex
from services.edge.placement import Candidate, Policy, choose
from shared import wire
from shared.membership import MemberView
from shared.models.block_hash import block_key, hash_full_blocks, salted_root
from shared.models.cache_salt import CacheSharing
from shared.models.prompt_length import PromptTokens
from shared.models.raw_prompt import PromptInput
from shared.partition_owners import REQUESTS_ADDRESS, parse_partitions
from shared.rendezvous import rendezvous

log = logging.getLogger(__name__)

IN_FLIGHT_TTL_S = 900.0  # a placed chat whose end this edge never saw stops counting as load after this
# A worker's gossiped load includes the chats placed on it before about this long ago (it publishes
# every second, gossip takes a moment more); later ones are added to it here.
GOSSIP_LAG_S = 2.0
SCORED = (Policy.PREFIX_AFFINITY, Policy.BOUNDED_AFFINITY)


@dataclass(frozen=True)
class WorkerView:
    worker_id: str
    partitions: tuple[int, ...]  # sorted
    load: float  # running + waiting, as it gossips them


def worker_views(members: Iterable[MemberView]) -> dict[str, WorkerView]:
    """Alive workers that own requests partitions; one whose assignment does not parse is left out."""
    views: dict[str, WorkerView] = {}
    for member in members:
        if member.role != "worker" or not (text := member.addresses.get(REQUESTS_ADDRESS)):
            continue
        try:
            partitions = tuple(sorted(parse_partitions(text)))
        except ValueError:
            continue
        gossiped = worker_load(member.load)
        load = float(gossiped.running + gossiped.waiting)
        views[member.id] = WorkerView(member.id, partitions, load)
    return views


def assignment_is_whole(workers: Iterable[WorkerView]) -> bool:
    """Every partition from 0 to the highest claimed has exactly one owner. Placing on a view that
    is half old, half new would send every chat to the workers whose news arrived first."""
    owned = sorted(p for view in workers for p in view.partitions)
    return bool(owned) and owned == list(range(len(owned)))


class InFlight:
    """The chats this edge placed and has not seen end, by worker: the part of a worker's load that
    its gossip cannot show yet (placed in the last `GOSSIP_LAG_S`), and a floor under the rest."""

    def __init__(self, ttl_s: float = IN_FLIGHT_TTL_S) -> None:
        self._ttl_s = ttl_s
        self._workers: dict[str, OrderedDict[str, float]] = {}  # worker -> request id -> placed at, oldest first
        self._placed: OrderedDict[str, str] = OrderedDict()  # request id -> worker, oldest first

    def add(self, request_id: str, worker_id: str, now: float) -> None:
        self._expire(now)
        self.finish(request_id)
        self._workers.setdefault(worker_id, OrderedDict())[request_id] = now
        self._placed[request_id] = worker_id

    def finish(self, request_id: str) -> None:
        worker_id = self._placed.pop(request_id, None)
        if worker_id is not None:
            chats = self._workers[worker_id]
            del chats[request_id]
            if not chats:
                del self._workers[worker_id]

    def count(self, worker_id: str) -> int:
        return len(self._workers.get(worker_id, ()))

    def recent(self, worker_id: str, now: float, window_s: float = GOSSIP_LAG_S) -> int:
        recent = 0
        for at in reversed(self._workers.get(worker_id, {}).values()):
            if now - at >= window_s:
                break
            recent += 1
        return recent

    def load(self, worker_id: str, gossiped: float, now: float) -> float:
        """The worker's load as best known here: its gossip plus what it cannot include yet."""
        return max(gossiped + self.recent(worker_id, now), self.count(worker_id))

    def _expire(self, now: float) -> None:
        while self._placed:
            request_id, worker_id = next(iter(self._placed.items()))
            if now - self._workers[worker_id][request_id] < self._ttl_s:
                return
            self.finish(request_id)


class Placer:
    def __init__(
        self,
        policy: Policy,
        load_bound: float,
        sharing: CacheSharing,
        prompt_tokens: PromptTokens | None,
        index: KVIndex | None = None,
        max_conversations: int = 100_000,
    ) -> None:
        self.policy = policy
        self.load_bound = load_bound
        self.index = index or KVIndex()
        self.in_flight = InFlight()
        self._sharing = sharing
        self._prompt_tokens = prompt_tokens
        self._conversations: OrderedDict[tuple[str, str], str] = OrderedDict()  # (tenant, id) -> worker
        self._max_conversations = max_conversations
        self._turn = 0
        self.members: Callable[[], Iterable[MemberView]] = lambda: ()  # gossip's alive members, once joined

    def place(
        self,
        request_id: str,
        tenant: str,
        messages: PromptInput,
        conversation: str | None,
        now: float | None = None,
    ) -> tuple[str, int] | None:
        """(worker, partition) for a chat, recorded as in flight there; None: the key's default partition."""
        workers = worker_views(self.members())
        if not assignment_is_whole(workers.values()):
            return None
        now = time.monotonic() if now is None else now
        keys = self._prompt_keys(tenant, messages) if self.policy in SCORED else {}
        if conversation:  # held as a digest: a client's id may be long
            conversation = hashlib.blake2b(conversation.encode(), digest_size=16).hexdigest()
        affine = self._conversations.get((tenant, conversation)) if conversation else None
        candidates = [
            Candidate(
                view.worker_id,
                self.in_flight.load(view.worker_id, view.load, now),
                self.index.matched_blocks(view.worker_id, keys.get(self.index.block_size(view.worker_id), ())),
                view.worker_id == affine,
            )
            for view in workers.values()
        ]
        first_block = next((str(k[0]) for k in keys.values() if k), None)
        key = f"c:{tenant}:{conversation}" if conversation else first_block or request_id
        self._turn += 1
        chosen = choose(self.policy, candidates, key, self.load_bound, self._turn)
        worker = workers[chosen.worker]
        self.in_flight.add(request_id, worker.worker_id, now)
        if conversation:
            self._remember(tenant, conversation, worker.worker_id)
        return worker.worker_id, worker.partitions[rendezvous(request_id, "") % len(worker.partitions)]

    def settled(self, event: wire.Event) -> None:
        """A chat's end (done or error) seen: it no longer loads its worker."""
        if isinstance(event, (wire.Done, wire.Error)):
            self.in_flight.finish(event.request_id)

    def forget_worker(self, worker_id: str) -> None:
        self.index.forget(worker_id)

    def _prompt_keys(self, tenant: str, messages: PromptInput) -> dict[int, list[int]]:
        """The prompt's chained block keys under its tenant's salt, for each block size workers use."""
        sizes = self.index.block_sizes()
        if self._prompt_tokens is None or not sizes:
            return {}
        try:
            tokens = self._prompt_tokens(messages)
        except Exception as exc:  # noqa: BLE001 - placement is a preference: it never refuses a chat
            log.debug("no block keys for a prompt: %r", exc)
            return {}
        root = salted_root(self._sharing.cache_salt(tenant))
        return {size: [block_key(h.value) for h in hash_full_blocks(tokens, size, root)] for size in sizes}

    def _remember(self, tenant: str, conversation: str, worker_id: str) -> None:
        self._conversations[(tenant, conversation)] = worker_id
        self._conversations.move_to_end((tenant, conversation))
        while len(self._conversations) > self._max_conversations:
            self._conversations.popitem(last=False)
