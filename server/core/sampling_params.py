"""How one request's tokens are sampled and when its generation stops.

One flat dataclass, validated in `__post_init__`, built by field name (`SamplingParams(**body)`), so the
API layer can map an OpenAI request onto it field by field. Errors name the field and the bad value.

Worked examples:
    SamplingParams()                      -> 16 tokens, temperature 1, no top-p/top-k filtering
    SamplingParams(temperature=0)         -> greedy (so is top_k=1 at any temperature)
    SamplingParams(stop="\\n")             -> stop == ["\\n"]
    SamplingParams(max_tokens=-3)         -> ValueError("max_tokens must be at least 1, got -3")
    SamplingParams(top_p=1.5)             -> ValueError("top_p must be in (0, 1], got 1.5")
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from moe_serve.server.core.structured import check_spec

MAX_LOGPROBS = 20  # most top logprobs a request may ask for (OpenAI's limit)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


_GREEDY_EPS = 1e-5


@dataclass
class SamplingParams:
    n: int = 1                               # completions per prompt
    max_tokens: int | None = 16              # None = until max_model_len
    temperature: float = 1.0                 # 0 = greedy
    top_p: float = 1.0                       # nucleus mass, in (0, 1]; 1 = disabled
    top_k: int = -1                          # -1 or 0 = disabled
    min_tokens: int = 0                      # EOS and stop_token_ids are ignored before this many outputs
    seed: int | None = None                  # per-request generator seed; None = engine's generator
    stop: list[str] | str | None = None      # normalised to list[str]
    stop_token_ids: list[int] | None = None  # normalised to list[int]; stop on any of these (besides EOS)
    ignore_eos: bool = False
    logprobs: int | None = None              # top logprobs returned besides the chosen token's
    include_stop_str_in_output: bool = False
    prompt_logprobs: int | None = None       # logprob of each prompt token (after the first), + this many top
    structured_output: dict | None = None    # constrained decoding: {json | json_object | regex | choice | grammar}

    def __post_init__(self) -> None:
        for name in ("n", "max_tokens", "top_k", "min_tokens", "seed"):
            value = getattr(self, name)
            if _is_int(value) and not -2**63 <= value < 2**63:
                raise ValueError(f"{name} must fit in a signed 64-bit integer, got {value}")
        if not _is_int(self.n) or self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n!r}")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens!r}")
        if not isinstance(self.temperature, (int, float)) or not math.isfinite(self.temperature) \
                or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k must be -1 or 0 (disabled) or at least 1, got {self.top_k!r}")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be at least 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be at most max_tokens ({self.max_tokens}), "
                             f"got {self.min_tokens}")
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        if self.logprobs is not None and (not _is_int(self.logprobs)
                                          or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        if self.prompt_logprobs is not None and (not _is_int(self.prompt_logprobs)
                                                 or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS):
            raise ValueError(f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs!r}")

        if self.structured_output is not None:
            check_spec(self.structured_output)

        stop = [] if self.stop is None else [self.stop] if isinstance(self.stop, str) else list(self.stop)
        for s in stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop strings must be non-empty strings, got {s!r}")
        self.stop = stop

        stop_ids = [] if self.stop_token_ids is None else list(self.stop_token_ids)
        for t in stop_ids:
            if not _is_int(t) or not 0 <= t < 2**63:
                raise ValueError(f"stop_token_ids must be non-negative integers, got {t!r} (below 2**63)")
        self.stop_token_ids = stop_ids

    @property
    def greedy(self) -> bool:
        """True when sampling reduces to argmax: temperature 0 (below 1e-5, as vLLM: dividing by it would
        overflow), or only the top token is kept."""
        return self.temperature < _GREEDY_EPS or self.top_k == 1
