"""/v1/completions and /v1/chat/completions: prompts -> engine requests -> OpenAI responses (SSE or JSON).

One API call becomes one engine request per (prompt, sample): choice index = prompt index * n + sample,
sample j gets seed + j (as the offline `LLM` does). Their outputs (token deltas) share one queue; each choice
turns them into text through the output processor (server/frontend/output_processor.py), which matches stop
strings (the engine request is then aborted) and, while streaming, holds back the last (longest stop - 1)
characters, so text a stop string later removes is never sent. A client that goes away aborts the engine
requests still running (their KV blocks are freed).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from moe_serve.server.core.sampling_params import SamplingParams
from moe_serve.server.frontend import tools
from moe_serve.server.frontend.engine_client import EngineClient, EngineFailure, Sink
from moe_serve.server.frontend.output_processor import RequestState
from moe_serve.server.frontend.protocol import (APIError, ChatCompletionRequest, ChatMessage, CompletionRequest,
                                                DetokenizeRequest, TokenizeRequest, error_body)


class Choice(RequestState):
    """One engine request of an API call; choice `index` = prompt index * n + sample."""

    def __init__(self, index: int, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.index = index


class SSEResponse(StreamingResponse):
    """A streaming response that runs `on_close` however the stream ends (finished or client gone)."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]):
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()
            await self.body_iterator.aclose()


_TICK, _END = object(), object()  # _keep_alive's queue: the keep-alive timer fired; the stream's last chunk went


def _sse(obj: dict | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)}\n\n"


class OpenAIServing:
    RETRY_AFTER_S = 1
    KEEP_ALIVE_S = 5.0  # a stream's keep-alive comment interval while no engine is attached

    def __init__(self, client: EngineClient, tokenizer, served_names: list[str], max_model_len: int, vocab_size: int,
                 max_in_flight: int = 1 << 30):
        self.client, self.tokenizer, self.served_names = client, tokenizer, served_names
        self.max_model_len, self.vocab_size, self.max_in_flight = max_model_len, vocab_size, max_in_flight
        self._token_text: dict[int, str] = {}

    # ---- shared steps ---------------------------------------------------------------------------------
    def check_model(self, model: str | None) -> str:
        if model is not None and model not in self.served_names:
            raise APIError(f"model {model!r} does not exist; this server serves {self.served_names}", param="model")
        return model or self.served_names[0]

    def check_prompt(self, ids: list[int], param: str) -> None:
        if not ids:
            raise APIError("prompt is empty: give a non-empty string or at least one token id", param=param)
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise APIError(f"prompt token id {bad} is outside the vocabulary [0, {self.vocab_size})", param=param)
        if len(ids) >= self.max_model_len:
            raise APIError(f"prompt has {len(ids)} tokens; the maximum is {self.max_model_len - 1} (max_model_len "
                           f"{self.max_model_len} leaves room for at least one generated token)", param=param)

    def check_fits(self, prompts: list[tuple[str | None, list[int]]], params: SamplingParams, param: str) -> None:
        """400 for a prompt whose length plus max_tokens cannot fit in max_model_len."""
        if params.max_tokens is None:
            return
        longest = max(len(ids) for _, ids in prompts)
        if longest + params.max_tokens > self.max_model_len:
            raise APIError(f"prompt has {longest} tokens and max_tokens is {params.max_tokens}: together "
                           f"{longest + params.max_tokens}, more than max_model_len {self.max_model_len}; lower "
                           f"{param} to at most {self.max_model_len - longest}", param=param)

    def admit(self, num_requests: int) -> None:
        """503 + Retry-After when `num_requests` more engine requests would exceed the bound."""
        if num_requests > self.max_in_flight:
            raise APIError(f"this call needs {num_requests} engine requests (prompts x n); the server admits at "
                           f"most {self.max_in_flight} at a time", param="n")
        in_flight = len(self.client.sinks)
        if in_flight + num_requests > self.max_in_flight:
            raise APIError(f"the server is overloaded ({in_flight} requests in flight, at most {self.max_in_flight}); "
                           f"retry after {self.RETRY_AFTER_S} s", status=503,
                           headers={"Retry-After": str(self.RETRY_AFTER_S)})

    def start(self, prompts: list[tuple[str | None, list[int]]], params: SamplingParams, prefix: str,
              stream: bool) -> tuple[str, list[Choice], asyncio.Queue]:
        self.admit(len(prompts) * params.n)
        request_id = f"{prefix}-{uuid.uuid4().hex}"
        queue: asyncio.Queue = asyncio.Queue()
        choices = []
        for i, (text, ids) in enumerate(prompts):
            for j in range(params.n):
                pj = dataclasses.replace(params, n=1, seed=None if params.seed is None else params.seed + j)
                choices.append(Choice(i * params.n + j, f"{request_id}-{i}-{j}", text, ids, pj, self.tokenizer, stream))
        try:
            for c in choices:
                self.client.add(c.request_id, c.prompt_token_ids, c.params, Sink(queue, c.index, len(c.prompt_token_ids)))
        except Exception as exc:
            self.abort(choices)
            raise APIError(f"the engine is not available: {exc}", status=503) from None
        return request_id, choices, queue

    def abort(self, choices: list[Choice]) -> None:
        self.client.abort([c.request_id for c in choices if not c.finished])

    async def events(self, choices: list[Choice], queue: asyncio.Queue) -> AsyncIterator[tuple[Choice, int]]:
        """(choice, new tokens) per engine output until every choice has finished; raises APIError on an error."""
        remaining = len(choices)
        while remaining:
            index, out = await queue.get()
            c = choices[index]
            if c.finished:
                continue  # computed before the engine saw the abort that a stop string sent
            if isinstance(out, EngineFailure):
                c.finish_reason = "abort"
                raise APIError(out.message, status=out.status)
            before = len(c.token_ids)
            if c.add(out):  # a stop string matched: the engine stops computing it
                self.client.abort([c.request_id], reason="stop")
            remaining -= c.finished
            yield c, len(c.token_ids) - before

    def token_text(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.tokenizer.decode([token_id])
        return text

    @staticmethod
    def usage(prompts, choices) -> dict:
        prompt_tokens = sum(len(ids) for _, ids in prompts)
        completion_tokens = sum(len(c.token_ids) for c in choices)
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens}

    async def collect(self, raw: Request, choices: list[Choice], queue: asyncio.Queue) -> bool:
        """Wait for every choice to finish; False (after aborting) if the client disconnected first."""
        async def drain():
            async for _ in self.events(choices, queue):
                pass

        task = asyncio.create_task(drain())
        try:
            while not task.done():
                await asyncio.wait({task}, timeout=0.25)
                if not task.done() and await raw.is_disconnected():
                    task.cancel()
                    self.abort(choices)
                    return False
            task.result()  # re-raise an engine error
            return True
        finally:
            if not task.done():
                task.cancel()
            self.abort(choices)

    def stream_end(self, head: dict, prompts, choices: list[Choice], include_usage: bool) -> list[str]:
        """A stream's last chunks: the usage (when asked for, with empty choices), then [DONE]."""
        usage = [_sse({**head, "choices": [], "usage": self.usage(prompts, choices)})] if include_usage else []
        return [*usage, _sse("[DONE]")]

    def stream(self, gen: AsyncIterator[str], choices: list[Choice]) -> SSEResponse:
        return SSEResponse(self._keep_alive(gen), on_close=lambda: self.abort(choices))

    async def _keep_alive(self, gen: AsyncIterator[str]) -> AsyncIterator[str]:
        """The stream's chunks; an APIError becomes an error chunk and [DONE]. While no engine is attached (its
        job lost, the next one starting: engine_link.py), an SSE comment every KEEP_ALIVE_S keeps the stream
        open through proxies and client read timeouts; clients ignore comments.

        One task pumps `gen` into a queue for the stream's life, and a wait on that queue arms a timer: a task
        and an asyncio.wait per chunk cost about 20 us of the front end's CPU a token, which at saturation is
        taken from the engine's cores."""
        loop = asyncio.get_running_loop()
        chunks: asyncio.Queue = asyncio.Queue()

        async def pump() -> None:
            try:
                async for chunk in gen:
                    chunks.put_nowait(chunk)
            except Exception as exc:  # noqa: BLE001 - handed to the reader, which raises it (or answers an APIError)
                chunks.put_nowait(exc)
            else:
                chunks.put_nowait(_END)

        task = loop.create_task(pump())
        try:
            while True:
                if chunks.empty():
                    timer = loop.call_later(self.KEEP_ALIVE_S, chunks.put_nowait, _TICK)
                    try:
                        item = await chunks.get()
                    finally:
                        timer.cancel()
                else:
                    item = chunks.get_nowait()
                if item is _TICK:
                    if not self.client.alive:
                        yield ": waiting for the engine job to re-attach\n\n"
                elif item is _END:
                    return
                elif isinstance(item, APIError):
                    yield _sse(item.body())
                    yield _sse("[DONE]")
                    return
                elif isinstance(item, Exception):
                    raise item
                else:
                    yield item
        finally:
            task.cancel()

    # ---- /v1/completions ------------------------------------------------------------------------------
    def _completion_prompts(self, prompt) -> list[tuple[str | None, list[int]]]:
        if isinstance(prompt, str):
            items = [prompt]
        elif prompt and isinstance(prompt[0], int):
            items = [prompt]
        else:
            items = list(prompt)
        if not items:
            raise APIError("prompt is empty: give a string, a list of token ids, or a list of either", param="prompt")
        out = []
        for p in items:
            if isinstance(p, str):
                out.append((p, self.tokenizer.encode(p) if p else []))
            else:
                out.append((None, list(p)))
        for _, ids in out:
            self.check_prompt(ids, "prompt")
        return out

    def _completion_logprobs(self, c: Choice, start: int, offset: int) -> dict:
        tokens, token_lps, tops, offsets = [], [], [], []
        for tid, entries in zip(c.token_ids[start:], c.logprobs[start:]):  # entries: {token id: logprob}
            text = self.token_text(tid)
            tokens.append(text)
            token_lps.append(entries.get(tid))
            tops.append({self.token_text(t): lp for t, lp in sorted(entries.items(), key=lambda e: -e[1])})
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}

    async def completions(self, body: CompletionRequest, raw: Request):
        model = self.check_model(body.model)
        params = body.to_sampling_params()
        prompts = self._completion_prompts(body.prompt)
        self.check_fits(prompts, params, "max_tokens")
        request_id, choices, queue = self.start(prompts, params, "cmpl", body.stream)
        created = int(time.time())
        head = {"id": request_id, "object": "text_completion", "created": created, "model": model}
        want_lp = params.logprobs is not None

        def echo_text(c: Choice) -> str:
            return c.prompt if c.prompt is not None else self.tokenizer.decode(c.prompt_token_ids)

        if body.stream:
            async def gen():
                usage_null = {"usage": None} if body.include_usage else {}
                if body.echo:
                    for c in choices:
                        yield _sse({**head, "choices": [{"index": c.index, "text": echo_text(c), "logprobs": None,
                                                         "finish_reason": None}], **usage_null})
                text_offsets = {c.index: 0 for c in choices}
                async for c, n_new in self.events(choices, queue):
                    delta = c.stream_delta()
                    if not n_new and not delta and not c.finished:
                        continue  # a chunk for every new token, also one whose text is held back (part of a
                        # character, a possible stop string): as vLLM streams, so a client times every token
                    lp = None
                    if want_lp:
                        lp = self._completion_logprobs(c, len(c.token_ids) - n_new, text_offsets[c.index])
                        text_offsets[c.index] += sum(len(t) for t in lp["tokens"])
                    yield _sse({**head, "choices": [{"index": c.index, "text": delta, "logprobs": lp,
                                                     "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}],
                                **usage_null})
                for chunk in self.stream_end(head, prompts, choices, body.include_usage):
                    yield chunk
            return self.stream(gen(), choices)

        if not await self.collect(raw, choices, queue):
            return JSONResponse(error_body("client disconnected", 400), status_code=400)
        out = []
        for c in choices:
            prefix = echo_text(c) if body.echo else ""
            out.append({"index": c.index, "text": prefix + c.text,
                        "logprobs": self._completion_logprobs(c, 0, 0) if want_lp else None,
                        "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
        return JSONResponse({**head, "choices": out, "usage": self.usage(prompts, choices)})

    # ---- /v1/chat/completions -------------------------------------------------------------------------
    @staticmethod
    def chat_dicts(messages: list[ChatMessage], functions: list[tools.Function]) -> list[dict]:
        """Messages for the chat template: earlier tool calls and results in DeepSeek-V3's format, and the offered
        functions described in the (first) system message."""
        out = []
        for m in messages:
            content = m.text()
            if m.role == "tool":
                content = tools.results_text([content])
            elif m.tool_calls:
                content += tools.calls_text([(c.function.name, c.function.arguments) for c in m.tool_calls])
            out.append({"role": m.role, "content": content})
        if functions:
            described = tools.system_prompt(functions)
            if out and out[0]["role"] == "system":
                out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + described}
            else:
                out.insert(0, {"role": "system", "content": described})
        return out

    def _render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        try:
            return self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                      tokenize=False)
        except Exception as exc:  # noqa: BLE001 - a template that rejects the messages
            raise APIError(f"the chat template rejected the messages: {exc}", param="messages") from None

    def chat_prompt_ids(self, messages: list[dict], add_generation_prompt: bool = True) -> tuple[str, list[int]]:
        if not messages:
            raise APIError("messages is empty: give at least one message", param="messages")
        text = self._render(messages, add_generation_prompt)
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        self.check_prompt(ids, "messages")
        return text, ids

    def _chat_text(self, messages: list[ChatMessage], add_generation_prompt: bool) -> str:
        return self._render(self.chat_dicts(messages, []), add_generation_prompt)

    def _chat_prompt(self, body: ChatCompletionRequest, functions: list[tools.Function]) -> tuple[str, list[int]]:
        return self.chat_prompt_ids(self.chat_dicts(body.messages, functions), body.add_generation_prompt)

    # ---- /tokenize, /detokenize (vLLM's) ---------------------------------------------------------------
    def tokenize(self, body: TokenizeRequest) -> dict:
        self.check_model(body.model)
        body.checked()
        if body.messages is not None:
            text = self._chat_text(body.messages, body.add_generation_prompt)
            ids = self.tokenizer.encode(text, add_special_tokens=bool(body.add_special_tokens))
        else:
            ids = self.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens is not False)
        strs = self.tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
        return {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids, "token_strs": strs}

    def detokenize(self, body: DetokenizeRequest) -> dict:
        self.check_model(body.model)
        bad = next((t for t in body.tokens if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise APIError(f"token id {bad} is outside the vocabulary [0, {self.vocab_size})", param="tokens")
        return {"prompt": self.tokenizer.decode(body.tokens)}

    def _chat_logprobs(self, c: Choice, start: int, top_n: int) -> dict:
        content = []
        for tid, entries in zip(c.token_ids[start:], c.logprobs[start:]):  # entries: {token id: logprob}
            text = self.token_text(tid)
            top = sorted(entries.items(), key=lambda e: -e[1])[:top_n]
            content.append({"token": text, "logprob": entries.get(tid), "bytes": list(text.encode()),
                            "top_logprobs": [{"token": self.token_text(t), "logprob": lp,
                                              "bytes": list(self.token_text(t).encode())} for t, lp in top]})
        return {"content": content}

    async def chat(self, body: ChatCompletionRequest, raw: Request):
        model = self.check_model(body.model)
        params = body.to_sampling_params()
        mode, functions = body.tool_mode()
        prompts = [self._chat_prompt(body, functions if mode != "none" else [])]
        self.check_fits(prompts, params, "max_completion_tokens" if body.max_completion_tokens is not None
                        else "max_tokens")
        request_id, choices, queue = self.start(prompts, params, "chatcmpl", body.stream)
        created = int(time.time())
        head = {"id": request_id, "object": "chat.completion", "created": created, "model": model}
        top_n = params.logprobs or 0

        if body.stream:
            head["object"] = "chat.completion.chunk"

            async def gen():
                usage_null = {"usage": None} if body.include_usage else {}
                for c in choices:
                    yield _sse({**head, "choices": [{"index": c.index, "delta": {"role": "assistant", "content": ""},
                                                     "logprobs": None, "finish_reason": None}], **usage_null})
                parsers = {c.index: tools.StreamParser() for c in choices} if mode != "none" else {}
                async for c, n_new in self.events(choices, queue):
                    delta = self._chat_delta(c.stream_delta(), parsers.get(c.index), c.finished)
                    if not delta and n_new and not c.finished and c.index not in parsers:
                        delta = {"content": ""}  # a chunk for every new token, as for completions (a tool-call
                        # parser's held text is not sent, as in vLLM)
                    if not delta and not c.finished and not (body.logprobs and n_new):
                        continue
                    lp = self._chat_logprobs(c, len(c.token_ids) - n_new, top_n) if body.logprobs else None
                    finish = "tool_calls" if c.finished and c.index in parsers and parsers[c.index].calls \
                        else c.finish_reason
                    yield _sse({**head, "choices": [{"index": c.index, "delta": delta, "logprobs": lp,
                                                     "finish_reason": finish, "stop_reason": c.stop_reason}],
                                **usage_null})
                for chunk in self.stream_end(head, prompts, choices, body.include_usage):
                    yield chunk
            return self.stream(gen(), choices)

        if not await self.collect(raw, choices, queue):
            return JSONResponse(error_body("client disconnected", 400), status_code=400)
        out = []
        for c in choices:
            content, calls = tools.parse(c.text) if mode != "none" else (c.text, [])
            message = {"role": "assistant", "content": content or (None if calls else "")}
            if calls:
                message["tool_calls"] = [{"id": k.id, "type": "function", "function": {"name": k.name,
                                                                                   "arguments": k.arguments}}
                                         for k in calls]
            out.append({"index": c.index, "message": message,
                        "logprobs": self._chat_logprobs(c, 0, top_n) if body.logprobs else None,
                        "finish_reason": "tool_calls" if calls else c.finish_reason, "stop_reason": c.stop_reason})
        return JSONResponse({**head, "choices": out, "usage": self.usage(prompts, choices)})

    @staticmethod
    def _chat_delta(text: str, parser: tools.StreamParser | None, finished: bool) -> dict:
        """A chat chunk's delta: the text, or with tools offered, its content and tool-call pieces (OpenAI's
        streamed tool_calls: id, name and empty arguments first, then the arguments as they are generated)."""
        if parser is None:
            return {"content": text} if text else {}
        delta: dict = {}
        for event in parser.feed(text, final=finished):
            if event[0] == "content":
                delta["content"] = delta.get("content", "") + event[1]
            elif event[0] == "call":
                delta.setdefault("tool_calls", []).append(
                    {"index": event[1], "id": event[2], "type": "function",
                     "function": {"name": event[3], "arguments": ""}})
            else:
                delta.setdefault("tool_calls", []).append({"index": event[1], "function": {"arguments": event[2]}})
        return delta
