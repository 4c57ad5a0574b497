"""One generation request as the engine tracks it: its tokens, its progress and its status."""

from __future__ import annotations

import enum

from services.worker.engine.block_pool import BlockHash, salted_root
from services.worker.engine.sampling_params import SamplingParams
from services.worker.engine.types import FinishReason


class RequestStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()  # waiting again after losing its blocks; will recompute
    FINISHED_STOPPED = enum.auto()  # EOS or a stop string
    FINISHED_LENGTH = enum.auto()  # max_tokens or max_model_len reached
    FINISHED_ABORTED = enum.auto()  # the client went away or cancelled
    FINISHED_ERROR = enum.auto()  # computing it raised

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED

    @property
    def finish_reason(self) -> FinishReason | None:
        """How a request in this status ended; None while it runs, and for a failure."""
        return _FINISH_REASONS.get(self)

    @classmethod
    def finished_with(cls, reason: FinishReason) -> RequestStatus:
        return next(status for status, r in _FINISH_REASONS.items() if r is reason)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.CANCELLED,
}
_FINISHED = frozenset({*_FINISH_REASONS, RequestStatus.FINISHED_ERROR})


class Request:
    """Prompt plus generated tokens; the KV of the first `num_computed_tokens` exists in cache.

    Tokens are append-only, which is what lets `block_hashes` be computed once per
    full block and kept for the request's whole life (across preemptions too).
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        tenant: str = "default",
        cache_salt: str = "",
        weight: float = 1.0,
        priority: int = 0,
        handoff: bool = False,
    ) -> None:
        self.request_id = request_id
        self.sampling = sampling
        self.tenant = tenant
        self.weight = weight  # the tenant's fair-share weight, from its tier
        self.priority = priority  # within its tenant's queue: lower is admitted first
        self.handoff = handoff  # parked once its first token is sampled, for another engine to decode
        self.status = RequestStatus.WAITING
        self.num_prompt_tokens = len(prompt_token_ids)
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0  # advanced when a step is scheduled, not when it ends
        # Tokens drawn by scheduled steps that are not back yet (appended by update_from_output):
        # at most one, while the step that draws it runs on the device and the next is scheduled.
        self.num_pending_tokens = 0
        # Prompt tokens served from the prefix cache at first admission (usage reporting).
        self.num_cached_tokens = 0
        self.num_preemptions = 0
        # Upper bound on num_tokens: prompt + max_tokens, capped by the model length.
        self.max_num_tokens = self.num_prompt_tokens + sampling.max_tokens
        self.block_hashes: list[BlockHash] = []
        # Prefix-cache hits only among requests of the same salt (see EngineSettings.cache_salt).
        self.cache_root = salted_root(cache_salt)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.all_token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens :]

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def reached_max_num_tokens(self) -> bool:
        """True once the request may not grow: the engine finishes it with LENGTH."""
        return len(self.all_token_ids) >= self.max_num_tokens  # read per request per step: no nested property

    def append_output_token(self, token_id: int) -> None:
        self.all_token_ids.append(token_id)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, "
            f"tokens={self.num_tokens}, computed={self.num_computed_tokens})"
        )
