"""Per-request sampling settings, checked once, when they are made: an engine never holds a bad one."""

from dataclasses import dataclass
from functools import cached_property

MAX_LOGPROBS = 20  # top alternatives per token, as OpenAI allows
MAX_LOGIT_BIAS = 100.0


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 0.7  # 0 means greedy
    top_p: float = 1.0  # nucleus mass kept; 1.0 = off
    top_k: int = 0  # 0 = off
    seed: int | None = None  # set: this request's draws repeat exactly
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()  # besides the model's end-of-sequence tokens
    ignore_eos: bool = False  # generate on past end-of-sequence, up to max_tokens
    min_tokens: int = 0  # no end (EOS, stop token ids) before this many tokens
    # Penalties as OpenAI and vLLM define them: frequency and presence over the output so far,
    # repetition (divide a positive logit, multiply a negative one) over prompt and output.
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit)
    logprobs: int | None = None  # None: none; k: each token's log-probability and its top k alternatives

    def __post_init__(self) -> None:
        """ValueError naming the first field that is out of range."""
        if not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not self.temperature >= 0:  # also refuses NaN
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        if not isinstance(self.stop, tuple) or not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be a tuple of non-empty strings, got {self.stop!r}")
        if not all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be token ids >= 0, got {self.stop_token_ids!r}")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be an integer in [0, max_tokens], got {self.min_tokens!r}")
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)!r}")
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise ValueError(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty!r}")
        if not all(t >= 0 and -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS for t, b in self.logit_bias):
            raise ValueError(f"logit_bias must map token ids >= 0 to biases in [-100, 100], got {self.logit_bias!r}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")

    # Read for every sampled row of every step: computed once, kept in the instance's __dict__.
    @cached_property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @cached_property
    def penalised(self) -> bool:
        """Whether this request's logits depend on the tokens it has seen."""
        return bool(self.frequency_penalty or self.presence_penalty) or self.repetition_penalty != 1.0

    @cached_property
    def processes_logits(self) -> bool:
        return self.penalised or bool(self.logit_bias) or self.min_tokens > 0
