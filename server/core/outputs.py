"""What the engine core reports each step: only what is new for each request (token ids, not text)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EngineOutput:
    request_id: str
    new_token_ids: list[int]
    # per new token {token id: logprob}, the sampled token included; None unless the request asked for logprobs
    new_logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort", once, in the request's last output
    stop_reason: int | None = None  # the stop token id that ended it (stop strings are the front end's)
    num_cached_tokens: int = 0  # prompt tokens the prefix cache served
    error: str | None = None  # the engine failed this request alone (finish_reason "abort"); others went on
    # in a request's first output, when it asked for them: per prompt position p >= 1, {token id: logprob} of
    # prompt token p (and the top alternatives)
    prompt_logprobs: list[dict[int, float]] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
