"""Each constrained request's grammar state: the token mask of its next step, filled for the whole batch
in one call into the grammar library (which fills rows in parallel, without the GIL), or the far cheaper
check of a token drawn without it, and the state advanced by each token sampled."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import llguidance
import numpy as np
import torch

log = logging.getLogger(__name__)

MOST_STEPS_UNCHECKED = 15  # the longest a request whose draws its grammar keeps refusing goes unchecked


@dataclass(slots=True)
class _Refusals:
    """A request whose last draws its grammar refused: how many in a row, and the steps left before the next
    is checked."""

    in_a_row: int = 0
    steps_left: int = 0

    def refused_again(self) -> None:
        self.in_a_row += 1
        self.steps_left = min(2**self.in_a_row - 1, MOST_STEPS_UNCHECKED)


class GrammarMatchers:
    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._words = (vocab_size + 31) // 32
        self._matchers: dict[str, llguidance.LLMatcher] = {}
        self._refusals: dict[str, _Refusals] = {}
        self._executor = llguidance.LLExecutor()

    def __len__(self) -> int:
        return len(self._matchers)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._matchers

    def add(self, request_id: str, matcher: llguidance.LLMatcher) -> None:
        self._matchers[request_id] = matcher

    def remove(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)
        self._refusals.pop(request_id, None)

    def bitmask(
        self, sample_ids: Sequence[str], device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(rows, bitmask) for the sampled rows that have a grammar, or None when none has."""
        if not self._matchers:
            return None
        rows = [i for i, request_id in enumerate(sample_ids) if request_id in self._matchers]
        if not rows:
            return None
        mask = np.full((len(rows), self._words), -1, dtype=np.int32)  # (R, W)
        targets = [(self._matchers[sample_ids[row]], i) for i, row in enumerate(rows)]
        self._executor.unsafe_compute_mask_ptr(targets, mask.ctypes.data, self._words * 4, len(rows))
        bitmask = torch.from_numpy(mask)
        if device.type != "cpu":
            bitmask = bitmask.pin_memory().to(device, non_blocking=True)
        return torch.tensor(rows, device=device), bitmask

    def worth_checking(self, request_id: str) -> bool:
        """Whether to draw the request's next token unmasked and check it (`refused`), rather than take its
        mask at once: after each refusal in a row, the request waits twice as many steps as before it is
        checked again (up to MOST_STEPS_UNCHECKED), since a model that keeps drawing what its grammar
        refuses pays for the unmasked draw and then for its mask."""
        refusals = self._refusals.get(request_id)
        if refusals is None or refusals.steps_left == 0:
            return True
        refusals.steps_left -= 1
        return False

    def refused(self, sample_ids: Sequence[str], tokens: Sequence[int]) -> list[int]:
        """The positions whose token the request's grammar does not allow next (a microsecond or so a row,
        where its whole mask takes ~100): a draw its grammar allows is a draw from what the mask keeps."""
        matchers, refusals = self._matchers, self._refusals
        refused = []
        for i, (request_id, token) in enumerate(zip(sample_ids, tokens, strict=True)):
            matcher = matchers.get(request_id)
            if matcher is None:
                continue
            if matcher.validate_tokens([token]) == 1:
                refusals.pop(request_id, None)
                continue
            refused.append(i)
            refusals.setdefault(request_id, _Refusals()).refused_again()
        return refused

    def accept(self, request_id: str, token: int) -> bool:
        """Advance the request's grammar by its sampled token; True once the grammar is complete."""
        matcher = self._matchers.get(request_id)
        if matcher is None:
            return False
        if not matcher.consume_token(token):
            # Only a token the mask allowed reaches here, so this is the library's own failure: end
            # the request rather than sample on from a state that allows nothing.
            log.warning("grammar of %s refused token %d: %s", request_id, token, matcher.get_error())
            return True
        return matcher.is_stopped()
