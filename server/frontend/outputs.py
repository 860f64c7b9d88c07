"""What `LLM.generate` returns, in the shape vLLM users know."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, float]] | None  # per generated token: {token id: logprob}, chosen token included
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    num_cached_tokens: int = 0
    error: str | None = None  # the engine failed this request alone (finish_reason "abort"); others went on
    # with SamplingParams(prompt_logprobs=k): per prompt token {token id: logprob} (None for the first), as vLLM
    prompt_logprobs: list[dict[int, float] | None] | None = None
