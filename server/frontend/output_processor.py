"""The front end's view of each engine request: its text, stop strings, logprobs and final output.

The engine core reports token ids, a delta per step (server/core/outputs.py). Here they become text, once and
incrementally (server/frontend/detokenizer.py), for the HTTP front end and the offline `LLM` alike. Stop
strings are matched on that text as it grows: only the part a new token can complete is searched (the last
len(stop) - 1 characters before it and what it added), so a token costs the same at the end of a long
generation as at its start. On a match the text ends there (with the stop string under
`include_stop_str_in_output`), tokens after the one that completed it are dropped, and `RequestState.add`
returns True: the caller aborts the request in the engine, which may already have computed a token or two
more.
"""

from __future__ import annotations

from moe_serve.server.core.outputs import EngineOutput
from moe_serve.server.core.sampling_params import SamplingParams
from moe_serve.server.frontend.detokenizer import IncrementalDetokenizer
from moe_serve.server.frontend.outputs import CompletionOutput, RequestOutput


class RequestState:
    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
                 tokenizer, stream: bool = False):
        self.request_id, self.prompt, self.prompt_token_ids, self.params = request_id, prompt, prompt_token_ids, params
        self.token_ids: list[int] = []
        self.logprobs: list[dict[int, float]] | None = [] if params.logprobs is not None else None
        self.cumulative_logprob = 0.0
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.num_cached_tokens = 0
        self.error: str | None = None
        self.prompt_logprobs: list[dict[int, float] | None] | None = None
        self._tokenizer = tokenizer
        self._stops = list(params.stop or [])
        self._hold = max((len(s) for s in self._stops), default=1) - 1  # chars a stop string could still claim
        self._detok = IncrementalDetokenizer(tokenizer, prompt_token_ids) if stream or self._stops else None
        self._final_text: str | None = None
        self._streamed = 0  # characters of text handed to `stream_delta` callers

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def add(self, out: EngineOutput) -> bool:
        """Take one engine output. True when a stop string has just ended the request while the engine still
        runs it: the caller must abort it there."""
        if self.finished:
            return False  # tokens the engine computed before it saw the abort
        self.num_cached_tokens = out.num_cached_tokens
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = [None, *out.prompt_logprobs]  # the first prompt token has none
        if out.error is not None:
            self.error, self.finish_reason = out.error, "abort"
            return False
        for i, token_id in enumerate(out.new_token_ids):
            self.token_ids.append(token_id)
            if self.logprobs is not None and out.new_logprobs is not None:
                self.logprobs.append(out.new_logprobs[i])
                self.cumulative_logprob += out.new_logprobs[i][token_id]
            if self._detok is not None:
                before = len(self._detok.text)
                self._detok.add([token_id])
                if self._stops and self._match_stop(before):
                    return not (out.finished and i == len(out.new_token_ids) - 1)
        if out.finished:
            self.finish_reason, self.stop_reason = out.finish_reason, out.stop_reason
        return False

    def _match_stop(self, before: int) -> bool:
        text = self._detok.text
        for stop in self._stops:
            at = text.find(stop, max(0, before - len(stop) + 1))
            if at != -1:
                self._final_text = text[:at + (len(stop) if self.params.include_stop_str_in_output else 0)]
                self.finish_reason, self.stop_reason = "stop", stop
                return True
        return False

    @property
    def text(self) -> str:
        """The output text: final once finished (decoded once from all tokens unless a stop string cut it)."""
        if self._final_text is None and self.finished:
            self._final_text = self._tokenizer.decode(self.token_ids, skip_special_tokens=True)
        if self._final_text is not None:
            return self._final_text
        return self._detok.text if self._detok is not None else ""

    def stream_delta(self) -> str:
        """Text not handed out yet that no stop string can still take back (all of the rest once finished)."""
        if self.finished:
            final, shown = self.text, self._detok.text[:self._streamed] if self._detok is not None else ""
            delta = final[len(shown):] if final.startswith(shown) else ""
            self._streamed = max(self._streamed, len(final))
            return delta
        text = self._detok.text
        ready = len(text) - self._hold
        if ready <= self._streamed:
            return ""
        delta, self._streamed = text[self._streamed:ready], ready
        return delta

    def to_output(self) -> RequestOutput:
        completion = CompletionOutput(
            index=0, text=self.text, token_ids=list(self.token_ids),
            cumulative_logprob=self.cumulative_logprob if self.logprobs is not None else None,
            logprobs=self.logprobs, finish_reason=self.finish_reason, stop_reason=self.stop_reason)
        return RequestOutput(self.request_id, self.prompt, list(self.prompt_token_ids), [completion], self.finished,
                             self.num_cached_tokens, self.error, self.prompt_logprobs)
