"""Moving a request between engines after its prefill (disaggregated prefill and decode).

The sending engine *parks* a request marked for handoff once its first token is sampled: it
computes nothing more for it and holds its blocks until their KV has been read out (`release`),
or takes it back to decode itself (`resume`). The receiving engine *reserves* blocks for the
prompt, reusing the leading ones its prefix cache already holds, takes the rest layer by layer,
and on `commit` runs the request on as if it had computed the prompt itself: its full blocks
enter the prefix cache under the same chained hashes. A failed handoff frees what either side
holds (`release`, `cancel`), so no block leaks.

Everything but `read_layer` and `write_layer` runs on the engine's thread. Those two touch only
blocks a parked or reserved request holds, which no step reads or writes, so a transfer can
copy them while the engine steps.
"""

from __future__ import annotations

import torch

from services.worker.engine.kv_cache_manager import KVCacheManager
from services.worker.engine.model import KVCache
from services.worker.engine.request import Request
from services.worker.engine.scheduler import Scheduler
from services.worker.engine.types import (
    FailureCode,
    HandoffReady,
    KVLayout,
    RequestRejected,
)


def layout_of(kv_caches: list[KVCache], dtype: torch.dtype) -> KVLayout:
    _, block_size, num_kv_heads, head_dim = kv_caches[0][0].shape
    return KVLayout(len(kv_caches), block_size, num_kv_heads, head_dim, str(dtype).removeprefix("torch."))


class KVHandoffs:
    def __init__(self, scheduler: Scheduler, kv_cache_manager: KVCacheManager, kv_caches: list[KVCache], dtype: torch.dtype) -> None:
        self.scheduler = scheduler
        self.kv = kv_cache_manager
        self.kv_caches = kv_caches
        self.dtype = dtype
        self.layout = layout_of(kv_caches, dtype)
        self.parked: dict[str, Request] = {}
        self.importing: dict[str, Request] = {}
        self._first_received: dict[str, int] = {}  # importing request -> its first block to receive

    # The sending side ---------------------------------------------------------------------------
    def park(self, request: Request) -> HandoffReady:
        self.scheduler.park(request.request_id)
        self.parked[request.request_id] = request
        return HandoffReady(
            request.request_id, tuple(request.prompt_token_ids), tuple(request.output_token_ids),
            request.num_cached_tokens, tuple(self.kv.get_block_ids(request)), self.layout,
        )  # fmt: skip

    def read_layer(self, request_id: str, layer: int, first_block: int) -> tuple[bytes, bytes]:
        """K and V of a parked request's blocks from `first_block` on, in one layer, as raw bytes."""
        ids = self._ids(self.parked[request_id], first_block)
        k_cache, v_cache = self.kv_caches[layer]
        return _raw(k_cache.index_select(0, ids)), _raw(v_cache.index_select(0, ids))

    def release(self, request_id: str) -> bool:
        """The parked request's KV went elsewhere (or nowhere): free its blocks."""
        request = self.parked.pop(request_id, None)
        if request is None:
            return False
        self.kv.free(request)
        self.scheduler.forget(request_id)
        return True

    def resume(self, request_id: str) -> bool:
        """Decode the parked request here after all (no other engine took it)."""
        request = self.parked.pop(request_id, None)
        if request is None:
            return False
        request.handoff = False
        self.scheduler.add_running(request)
        return True

    # The receiving side -------------------------------------------------------------------------
    def reserve(self, request: Request) -> int | None:
        """Blocks for the prompt of a request whose first token is sampled elsewhere: how many
        leading blocks this prefix cache already holds (the rest are to be received), or None
        when the pool has no room now. RequestRejected if it can never run here."""
        if request.request_id in self.scheduler.requests or request.request_id in self.importing:
            raise RequestRejected(FailureCode.INVALID_REQUEST, f"request id {request.request_id} is already in use")
        if (failure := self.scheduler.check_request(request)) is not None:
            raise RequestRejected(failure.code, failure.message)
        request.max_num_tokens = min(request.max_num_tokens, self.scheduler.config.max_model_len)
        # Its last known token is the sampled one, so every full block of the prompt may be a hit.
        hits, num_hit_tokens = self.kv.get_computed_blocks(request)
        if self.kv.allocate_slots(request, request.num_prompt_tokens - num_hit_tokens, hits) is None:
            return None
        self.importing[request.request_id] = request
        self._first_received[request.request_id] = len(hits)
        return len(hits)

    def write_layer(self, request_id: str, layer: int, k: bytes, v: bytes) -> None:
        """One layer's K and V for the reserved blocks still to receive; ValueError if they do not fit."""
        request = self.importing[request_id]
        ids = self._ids(request, self._first_received[request_id])
        if ids.numel() == 0:
            return
        k_cache, v_cache = self.kv_caches[layer]
        shape = (len(ids), *k_cache.shape[1:])
        k_cache.index_copy_(0, ids, self._tensor(k, shape))
        v_cache.index_copy_(0, ids, self._tensor(v, shape))

    def commit(self, request_id: str, cached_tokens: int) -> Request:
        """Every layer is in: the request runs here from the next step, its prompt's full blocks cached."""
        request = self.importing.pop(request_id)
        del self._first_received[request_id]
        request.num_computed_tokens = request.num_prompt_tokens
        request.num_cached_tokens = cached_tokens
        self.scheduler.add_running(request)
        self.kv.cache_blocks(request)
        return request

    def cancel(self, request_id: str) -> bool:
        """The transfer failed: free the reserved blocks."""
        request = self.importing.pop(request_id, None)
        if request is None:
            return False
        del self._first_received[request_id]
        self.kv.free(request)
        return True

    def _ids(self, request: Request, first_block: int) -> torch.Tensor:
        ids = self.kv.get_block_ids(request)[first_block:]
        return torch.tensor(ids, dtype=torch.int64, device=self.kv_caches[0][0].device)

    def _tensor(self, data: bytes, shape: tuple[int, ...]) -> torch.Tensor:
        expected = self.layout.block_bytes * shape[0]
        if len(data) != expected:
            raise ValueError(f"a layer of {shape[0]} blocks is {expected} bytes, got {len(data)}")
        host = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(self.dtype).view(shape)
        return host.to(self.kv_caches[0][0].device)


def _raw(blocks: torch.Tensor) -> bytes:
    return blocks.contiguous().view(torch.uint8).cpu().numpy().tobytes()
