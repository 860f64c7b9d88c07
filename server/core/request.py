"""One generation request as the scheduler and engine see it: token ids and progress, no tensors.

Progress is one number. `num_computed_tokens` counts the tokens whose KV is in the cache; the request
still needs `num_tokens - num_computed_tokens` tokens computed. Worked example, a 5-token prompt with a
budget of 3 tokens per step:
    step 1: computes tokens 0..2   num_computed 0 -> 3, num_tokens 5   (chunk of the prompt, no sample)
    step 2: computes tokens 3..4   num_computed 3 -> 5, num_tokens 5   -> sample t5, num_tokens 6
    step 3: computes token 5       num_computed 5 -> 6, num_tokens 6   -> sample t6, num_tokens 7 (decode)
Preemption (recompute) frees the blocks and resets num_computed_tokens to 0; on resume the prompt and
the outputs so far are computed again (the prefix cache may serve part of them).

A request re-submitted after its engine job was lost (server/frontend/engine_client.py) arrives with the
tokens it had already produced at the end of its prompt and `num_prior_outputs` = how many: they count as
outputs for max_tokens, min_tokens and the seeded draws, so it goes on as if nothing had happened.
"""

from __future__ import annotations

import enum
import time

import torch

from moe_serve.server.core.sampling_params import SamplingParams
from moe_serve.server.core.structured import Matcher


class RequestStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()   # EOS, a stop token id or a stop string
    FINISHED_LENGTH = enum.auto()    # max_tokens or max_model_len reached
    FINISHED_ABORTED = enum.auto()   # client went away or the request was rejected

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        return status in _FINISH_REASONS

    @property
    def finish_reason(self) -> str | None:
        """OpenAI's finish_reason for a finished status ("stop", "length", "abort"); None otherwise."""
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


class Request:
    def __init__(self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams,
                 arrival_time: float | None = None, eos_token_id: int | None = None, num_prior_outputs: int = 0) -> None:
        if not prompt_token_ids:
            raise ValueError(f"request {request_id!r} has an empty prompt; send at least one token")
        if not 0 <= num_prior_outputs < len(prompt_token_ids):
            raise ValueError(f"request {request_id!r}: num_prior_outputs must be in [0, {len(prompt_token_ids)}) "
                             f"(outputs already produced, at the end of the prompt), got {num_prior_outputs}")
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.num_prior_outputs = num_prior_outputs  # outputs produced by an earlier engine job (end of the prompt)
        self._all_token_ids = list(prompt_token_ids)   # prompt + outputs, kept in step with both
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time

        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0    # tokens whose KV is in the cache
        self.num_cached_tokens = 0      # prompt tokens served by the prefix cache at first schedule
        self.block_ids: list[int] = []  # this request's KV blocks, in token order
        self.finish_reason: str | None = None   # "stop" / "length" / "abort", set when finished
        self.stop_reason: int | None = None     # the stop token id that matched (stop strings: the front end)
        self.prompt_logprobs: list[dict[int, float]] = []  # per prompt position p >= 1, when asked for
        self.grammar: Matcher | None = None  # the structured_output grammar's state (server/core/structured.py)
        # the request's own generator when it set a seed (its draws then do not depend on the batch)
        seed = sampling_params.seed
        self.generator = torch.Generator().manual_seed(seed) if seed is not None else None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Outputs so far, those of an earlier engine job included (what max_tokens and min_tokens count)."""
        return self.num_prior_outputs + len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt + outputs. The live list, not a copy: read it, don't mutate it."""
        return self._all_token_ids

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self._all_token_ids.append(token_id)

    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.status.name}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, blocks={len(self.block_ids)})")
