"""Each constrained request's grammar state: the token mask of its next step, filled for the whole batch
in one call into the grammar library (which fills rows in parallel, without the GIL), and the state
advanced by each token sampled."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import llguidance
import numpy as np
import torch

log = logging.getLogger(__name__)

MOST_STEPS_UNCHECKED = 15


class GrammarMatchers:
    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._words = (vocab_size + 31) // 32
        self._matchers: dict[str, llguidance.LLMatcher] = {}
        self._waits: dict[str, list[int]] = {}  # [refusals in a row, steps left before the next check]
        self._executor = llguidance.LLExecutor()

    def __len__(self) -> int:
        return len(self._matchers)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._matchers

    def add(self, request_id: str, matcher: llguidance.LLMatcher) -> None:
        self._matchers[request_id] = matcher

    def remove(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)
        self._waits.pop(request_id, None)

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
        wait = self._waits.get(request_id)
        if wait is None:
            return True
        if wait[1] > 0:
            wait[1] -= 1
            return False
        return True

    def refused(self, sample_ids: Sequence[str], tokens: Sequence[int]) -> list[int]:
        """The positions whose token the request's grammar does not allow next (a microsecond or so a row,
        where its whole mask takes ~100): a draw its grammar allows is a draw from what the mask keeps."""
        matchers, waits = self._matchers, self._waits
        refused = []
        for i, (request_id, token) in enumerate(zip(sample_ids, tokens, strict=True)):
            matcher = matchers.get(request_id)
            if matcher is None:
                continue
            if matcher.validate_tokens([token]) == 1:
                waits.pop(request_id, None)
                continue
            refused.append(i)
            misses = waits[request_id][0] + 1 if request_id in waits else 1
            waits[request_id] = [misses, min(2**misses - 1, MOST_STEPS_UNCHECKED)]
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
