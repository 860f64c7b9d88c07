"""`POST /v1/messages`: the Anthropic Messages API over the same engine requests as the OpenAI routes.

Requests: `model`, `max_tokens`, `messages` (user / assistant turns of text, `tool_use` and `tool_result`
blocks), `system`, `stop_sequences`, `temperature`, `top_p`, `top_k`, `stream`, `tools` (name, description,
input_schema) and `tool_choice` (auto, any, tool, none). They become chat messages for the model's chat
template (tool calls and results in DeepSeek-V3's format: server/frontend/tools.py) and one engine request;
`any` and `tool` constrain decoding to one valid call. Answers: a `message` with text and `tool_use` content
blocks and `stop_reason` end_turn | max_tokens | stop_sequence | tool_use, or, streaming, the event sequence
message_start, content_block_start / content_block_delta (text_delta, input_json_delta) /
content_block_stop per block, message_delta (stop reason, output tokens) and message_stop. Errors are
Anthropic's body, `{"type": "error", "error": {"type": "invalid_request_error", "message": ...}}`.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Literal

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict

from moe_serve.server.core.sampling_params import SamplingParams
from moe_serve.server.frontend import tools
from moe_serve.server.frontend.protocol import APIError

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               500: "api_error", 503: "overloaded_error"}


def error_body(message: str, status: int) -> dict:
    return {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": message}}


class Block(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: str
    text: str | None = None
    id: str | None = None  # tool_use
    name: str | None = None
    input: Any = None
    tool_use_id: str | None = None  # tool_result
    content: str | list[dict] | None = None
    is_error: bool | None = None


class Message(BaseModel):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class Tool(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str
    description: str | None = None
    input_schema: dict


class ToolChoice(BaseModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None


class MessagesRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int
    messages: list[Message]
    system: str | list[Block] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    metadata: dict | None = None

    def functions(self) -> tuple[str, list[tools.Function]]:
        """("none" | "auto" | "required", the functions offered) from tools and tool_choice."""
        offered = [tools.Function(t.name, t.description or "", t.input_schema) for t in self.tools or []]
        choice = self.tool_choice.type if self.tool_choice else "auto"
        if not offered or choice == "none":
            if choice in ("any", "tool"):
                raise APIError("tool_choice needs tools", param="tool_choice")
            return "none", []
        if choice == "tool":
            chosen = [f for f in offered if f.name == self.tool_choice.name]
            if not chosen:
                raise APIError(f"tool_choice names {self.tool_choice.name!r}, which is not among the tools "
                               f"{[f.name for f in offered]}", param="tool_choice")
            return "required", chosen
        return ("required" if choice == "any" else "auto"), offered

    def chat_messages(self, functions: list[tools.Function]) -> list[dict]:
        """The conversation as chat-template messages (tool calls and results in DeepSeek-V3's format)."""
        out: list[dict] = []
        system = self.system if isinstance(self.system, str) else "".join(b.text or "" for b in self.system or [])
        if system or functions:
            out.append({"role": "system", "content": "\n\n".join(
                p for p in (system, tools.system_prompt(functions) if functions else "") if p)})
        for i, m in enumerate(self.messages):
            blocks = [Block(type="text", text=m.content)] if isinstance(m.content, str) else m.content
            text, calls, results = "", [], []
            for b in blocks:
                if b.type == "text":
                    text += b.text or ""
                elif b.type == "tool_use" and m.role == "assistant":
                    if not isinstance(b.input, dict):
                        raise APIError(f"messages[{i}]: tool_use {b.name!r} input must be an object", param="messages")
                    calls.append((b.name or "", json.dumps(b.input)))
                elif b.type == "tool_result" and m.role == "user":
                    content = b.content if isinstance(b.content, str) else \
                        "".join(c.get("text", "") for c in b.content or [] if c.get("type") == "text")
                    results.append(content)
                else:
                    raise APIError(f"messages[{i}]: {b.type} content is not supported in a {m.role} turn",
                                   param="messages")
            if results:
                out.append({"role": "tool", "content": tools.results_text(results)})
            if text or calls or not results:
                out.append({"role": m.role, "content": text + (tools.calls_text(calls) if calls else "")})
        return out

    def sampling_params(self, mode: str, functions: list[tools.Function]) -> SamplingParams:
        try:
            return SamplingParams(
                max_tokens=self.max_tokens, temperature=1.0 if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p, top_k=-1 if self.top_k is None else self.top_k,
                stop=self.stop_sequences,
                structured_output=tools.constraint(functions) if mode == "required" else None)
        except ValueError as exc:
            field = str(exc).split(" ", 1)[0]
            raise APIError(str(exc), param={"stop": "stop_sequences"}.get(field, field)) from None


def _stop_reason(finish: str | None, stop: Any, calls: list) -> tuple[str, str | None]:
    if calls:
        return "tool_use", None
    if finish == "length":
        return "max_tokens", None
    if isinstance(stop, str):
        return "stop_sequence", stop
    return "end_turn", None


def _event(kind: str, data: dict) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, ensure_ascii=False)}\n\n"


async def messages(serving, body: MessagesRequest, raw: Request):
    model = serving.check_model(body.model)
    mode, functions = body.functions()
    params = body.sampling_params(mode, functions)
    prompts = [serving.chat_prompt_ids(body.chat_messages(functions))]
    serving.check_fits(prompts, params, "max_tokens")
    _, choices, queue = serving.start(prompts, params, "msg", body.stream)
    message_id = f"msg_{uuid.uuid4().hex[:24]}"
    input_tokens = len(prompts[0][1])
    head = {"id": message_id, "type": "message", "role": "assistant", "model": model}

    if body.stream:
        async def gen():
            yield _event("message_start", {"message": {**head, "content": [], "stop_reason": None,
                                                       "stop_sequence": None,
                                                       "usage": {"input_tokens": input_tokens, "output_tokens": 0}}})
            parser = tools.StreamParser() if mode != "none" else None
            block, text_open = 0, False
            c = choices[0]
            async for c, _ in serving.events(choices, queue):
                text = c.stream_delta()
                events = parser.feed(text, final=c.finished) if parser else ([("content", text)] if text else [])
                for ev in events:
                    if ev[0] == "content" and ev[1]:
                        if not text_open:
                            yield _event("content_block_start", {"index": block,
                                                                 "content_block": {"type": "text", "text": ""}})
                            text_open = True
                        yield _event("content_block_delta", {"index": block,
                                                             "delta": {"type": "text_delta", "text": ev[1]}})
                    elif ev[0] == "call":
                        if text_open or block:
                            yield _event("content_block_stop", {"index": block})
                            block += 1
                        text_open = False
                        yield _event("content_block_start", {"index": block, "content_block": {
                            "type": "tool_use", "id": ev[2].replace("call_", "toolu_"), "name": ev[3], "input": {}}})
                    elif ev[0] == "args":
                        yield _event("content_block_delta", {"index": block, "delta": {
                            "type": "input_json_delta", "partial_json": ev[2]}})
            if text_open or (parser and parser.calls):
                yield _event("content_block_stop", {"index": block})
            reason, sequence = _stop_reason(c.finish_reason, c.stop_reason, parser.calls if parser else [])
            yield _event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": sequence},
                                           "usage": {"output_tokens": len(c.token_ids)}})
            yield _event("message_stop", {})

        async def guarded():
            try:
                async for chunk in gen():
                    yield chunk
            except APIError as exc:
                yield _event("error", {"error": error_body(exc.message, exc.status)["error"]})
        return serving.stream(guarded(), choices)

    if not await serving.collect(raw, choices, queue):
        return JSONResponse(error_body("client disconnected", 400), status_code=400)
    c = choices[0]
    content, calls = tools.parse(c.text) if mode != "none" else (c.text, [])
    blocks = [{"type": "text", "text": content}] if content or not calls else []
    for call in calls:
        try:
            args = json.loads(call.arguments)
        except json.JSONDecodeError:
            args = {"_unparsed": call.arguments}  # "auto" mode: the model's own text, not constrained
        blocks.append({"type": "tool_use", "id": call.id.replace("call_", "toolu_"), "name": call.name, "input": args})
    reason, sequence = _stop_reason(c.finish_reason, c.stop_reason, calls)
    return JSONResponse({**head, "content": blocks, "stop_reason": reason, "stop_sequence": sequence,
                         "usage": {"input_tokens": input_tokens, "output_tokens": len(c.token_ids)}})
