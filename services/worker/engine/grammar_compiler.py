"""Compiles a request's grammar against the model's tokenizer, off the engine thread, once per grammar:
a bounded cache keeps each compiled grammar's fresh matcher, and a request gets its own copy.
`GrammarQueue` holds requests until their grammar is ready (as vLLM's waiting-for-FSM state)."""

from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import llguidance

from services.worker.engine.types import Constraint, EngineRequest
from shared.models.structured import CACHE_SIZE, InvalidGrammar, grammar_text
from shared.models.tokenizer import Tokenizer


class GrammarCompiler:
    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...], workers: int = 2) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._eos = list(eos_token_ids)
        self._ll_tokenizer: llguidance.LLTokenizer | None = None  # built on first use: it takes ~0.5 s
        self._cache: OrderedDict[tuple[str, str], llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="grammar")

    def submit(self, constraint: Constraint) -> Future[llguidance.LLMatcher]:
        """A matcher for this constraint, soon; the future fails with InvalidGrammar if it cannot compile."""
        return self._pool.submit(self.matcher, constraint)

    def matcher(self, constraint: Constraint) -> llguidance.LLMatcher:
        key = (constraint.kind, constraint.spec)
        with self._lock:
            fresh = self._cache.get(key)
            if fresh is not None:
                self._cache.move_to_end(key)
                return fresh.deep_copy()
        fresh = llguidance.LLMatcher(self._ll(), grammar_text(constraint), log_level=0)
        if fresh.is_error():
            raise InvalidGrammar(fresh.get_error())
        with self._lock:
            self._cache[key] = fresh
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return fresh.deep_copy()

    @property
    def num_cached(self) -> int:
        return len(self._cache)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _ll(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._ll_tokenizer is None:
                self._ll_tokenizer = llguidance.LLTokenizer(
                    self._tokenizer.backend.to_str(), n_vocab=self._vocab_size, eos_token=self._eos
                )
            return self._ll_tokenizer


@dataclass
class Compiling:
    request: EngineRequest
    prompt_token_ids: list[int]
    future: Future[llguidance.LLMatcher]


class GrammarQueue:
    """Requests whose grammar is compiling; each joins the engine once its grammar is ready."""

    def __init__(self, compiler: GrammarCompiler) -> None:
        self.compiler = compiler
        self._compiling: dict[str, Compiling] = {}

    def __len__(self) -> int:
        return len(self._compiling)

    def ids(self) -> list[str]:
        return list(self._compiling)

    def add(self, request: EngineRequest, prompt_token_ids: list[int]) -> None:
        assert request.constraint is not None
        future = self.compiler.submit(request.constraint)
        self._compiling[request.request_id] = Compiling(request, prompt_token_ids, future)

    def remove(self, request_id: str) -> bool:
        compiling = self._compiling.pop(request_id, None)
        if compiling is not None:
            compiling.future.cancel()
        return compiling is not None

    def ready(self, wait_s: float = 0.0) -> list[tuple[Compiling, llguidance.LLMatcher | Exception]]:
        """The requests whose compile ended (waiting up to wait_s for one), in arrival order, with the
        matcher or the reason it failed."""
        if wait_s > 0 and self._compiling:
            futures.wait([c.future for c in self._compiling.values()], wait_s, futures.FIRST_COMPLETED)
        done = [c for c in self._compiling.values() if c.future.done()]
        results: list[tuple[Compiling, llguidance.LLMatcher | Exception]] = []
        for compiling in done:
            del self._compiling[compiling.request.request_id]
            error = compiling.future.exception()
            results.append((compiling, error if error is not None else compiling.future.result()))
        return results
