"""Sampling parameters: how to pick tokens and when to stop. Plain Python, no torch.

This is where a request's parameters are validated, once: every check raises `ParamError`
naming the field, which the server turns into an OpenAI-shaped 400.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from scheduler.structured_output import StructuredOutput

MAX_TOP_LOGPROBS = 20


class ParamError(ValueError):
    """An invalid request parameter; `param` names the offending field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param
        self.message = message


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop. Validated once, at construction."""

    n: int = 1
    max_tokens: int | None = 16  # None: up to the context length
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None: no logprobs; 0..20 top alternatives besides the sampled token
    # None: none; 0..20: each prompt token's logprob (the first has none) with that many alternatives
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    structured: StructuredOutput | None = None  # what the output must match (a JSON schema, ...)

    def __post_init__(self) -> None:
        # normalize list-typed inputs so the object stays hashable and immutable
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop or ()))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in (self.stop_token_ids or ())))
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        self._validate()

    def _validate(self) -> None:
        def check(ok: bool, param: str, message: str) -> None:
            if not ok:
                raise ParamError(param, message)

        check(isinstance(self.n, int) and self.n >= 1, "n", f"n must be an integer >= 1, got {self.n!r}")
        # max_tokens=0 scores a prompt without generating: only with prompt_logprobs
        lowest = 0 if self.prompt_logprobs is not None else 1
        check(self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= lowest),
              "max_tokens", f"max_tokens must be an integer >= 1 (0 only with prompt logprobs), "
                            f"got {self.max_tokens!r}")
        check(isinstance(self.min_tokens, int) and self.min_tokens >= 0,
              "min_tokens", f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        check(self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
              f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        check(_finite(self.temperature) and self.temperature >= 0, "temperature",
              f"temperature must be >= 0, got {self.temperature!r}")
        check(_finite(self.top_p) and 0 < self.top_p <= 1, "top_p", f"top_p must be in (0, 1], got {self.top_p!r}")
        check(isinstance(self.top_k, int) and self.top_k >= 0, "top_k",
              f"top_k must be -1, 0 (disabled) or a positive integer, got {self.top_k!r}")
        check(_finite(self.min_p) and 0 <= self.min_p <= 1, "min_p", f"min_p must be in [0, 1], got {self.min_p!r}")
        check(self.seed is None or isinstance(self.seed, int), "seed", f"seed must be an integer, got {self.seed!r}")
        check(_finite(self.repetition_penalty) and self.repetition_penalty > 0, "repetition_penalty",
              f"repetition_penalty must be > 0, got {self.repetition_penalty!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            check(_finite(value) and -2 <= value <= 2, name, f"{name} must be in [-2, 2], got {value!r}")
        if self.logit_bias:
            for token, bias in self.logit_bias.items():
                check(isinstance(token, int) and token >= 0, "logit_bias", f"logit_bias key {token!r} is not a token id")
                check(_finite(bias) and -100 <= bias <= 100, "logit_bias",
                      f"logit_bias value for token {token} must be in [-100, 100], got {bias!r}")
        check(all(isinstance(s, str) and s for s in self.stop), "stop", "stop strings must be non-empty strings")
        check(all(t >= 0 for t in self.stop_token_ids), "stop_token_ids", "stop_token_ids must be >= 0")
        check(self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= MAX_TOP_LOGPROBS),
              "logprobs", f"logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {self.logprobs!r}")
        check(self.prompt_logprobs is None or (isinstance(self.prompt_logprobs, int)
                                               and 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS),
              "prompt_logprobs", f"prompt_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], "
                                 f"got {self.prompt_logprobs!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


def _finite(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
