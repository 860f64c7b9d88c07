"""OpenAI-compatible request bodies (pydantic) and the error body every failure is answered with.

Requests map onto `SamplingParams` field by field (`to_sampling_params`); `response_format` and vLLM's
`guided_*` / `structured_outputs` become one structured_output constraint (compiled here first, so a bad
schema is a 400 naming its field). Fields OpenAI defines that the engine cannot honour (penalties,
logit_bias, best_of, suffix) are rejected with a 400 naming the field rather than silently ignored. Tools and
tool_choice map onto DeepSeek-V3's tool-call format (server/frontend/tools.py). Unknown extra fields are ignored, as vLLM does.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt

from moe_serve.server.core.sampling_params import SamplingParams
from moe_serve.server.core.structured import grammar_of
from moe_serve.server.frontend.tools import Function
from moe_serve.server.frontend.tools import constraint as tool_constraint

Prompt = str | list[StrictInt] | list[str] | list[list[StrictInt]]


class APIError(Exception):
    """An error answered as `{"error": {"message", "type", "param", "code"}}` with HTTP `status`."""

    TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError", 405: "MethodNotAllowedError",
             500: "InternalServerError", 503: "ServiceUnavailableError"}

    def __init__(self, message: str, status: int = 400, param: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.message, self.status, self.param, self.headers = message, status, param, headers

    def body(self) -> dict:
        return error_body(self.message, self.status, self.param)


def error_body(message: str, status: int = 400, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": APIError.TYPES.get(status, "APIError"), "param": param,
                      "code": status}}


class StreamOptions(BaseModel):
    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str | None = None
    description: str | None = None
    schema_: dict | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's response_format: "text" (no constraint), "json_object" (any JSON object) or "json_schema"."""
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _SamplingRequest(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions (OpenAI's, then vLLM's extras)."""
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM extras
    top_k: int | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    response_format: ResponseFormat | None = None
    # vLLM's structured-output extras (one constraint per request, response_format included)
    guided_json: str | dict | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: dict | None = None

    def _structured_output(self) -> dict | None:
        """The request's one output constraint as a structured_output spec (server/core/structured.py), checked
        by compiling its grammar; a 400 naming the field if it does not compile or if two are given."""
        given: list[tuple[str, dict]] = []
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            given.append(("response_format", {"json_object": True}))
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None or rf.json_schema.schema_ is None:
                raise APIError("response_format json_schema needs json_schema.schema", param="response_format")
            given.append(("response_format", {"json": rf.json_schema.schema_}))
        for name, kind in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                           ("guided_grammar", "grammar")):
            if getattr(self, name) is not None:
                given.append((name, {kind: getattr(self, name)}))
        if self.structured_outputs:
            set_keys = {k: v for k, v in self.structured_outputs.items() if v not in (None, False)}
            given.append(("structured_outputs", set_keys))
        if not given:
            return None
        if len(given) > 1:
            raise APIError(f"give one output constraint, not {len(given)} ({', '.join(n for n, _ in given)})",
                           param=given[1][0])
        param, spec = given[0]
        try:
            grammar_of(spec)
        except ValueError as exc:
            raise APIError(f"{param}: {exc}", param=param) from None
        return spec

    def _check_unsupported(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise APIError(f"{name} is not supported (only 0)", param=name)
        if self.logit_bias:
            raise APIError("logit_bias is not supported", param="logit_bias")

    def _sampling_params(self, max_tokens: int | None, logprobs: int | None, logprobs_param: str) -> SamplingParams:
        self._check_unsupported()
        kw: dict[str, Any] = dict(
            n=self.n, max_tokens=max_tokens, temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p, top_k=-1 if self.top_k is None else self.top_k,
            min_tokens=self.min_tokens, seed=self.seed, stop=self.stop, stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos, logprobs=logprobs, include_stop_str_in_output=self.include_stop_str_in_output,
            structured_output=self._structured_output())
        try:
            return SamplingParams(**kw)
        except ValueError as exc:  # SamplingParams names the field first: "max_tokens must be ..."
            field = str(exc).split(" ", 1)[0]
            raise APIError(str(exc), param=logprobs_param if field == "logprobs" else
                           field if field in type(self).model_fields else None) from None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingRequest):
    prompt: Prompt
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def to_sampling_params(self) -> SamplingParams:
        if self.suffix:
            raise APIError("suffix is not supported", param="suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise APIError("best_of is not supported (leave it unset or equal to n)", param="best_of")
        if self.echo and self.logprobs is not None:
            raise APIError("echo together with logprobs is not supported: prompt logprobs are not computed",
                           param="echo")
        return self._sampling_params(self.max_tokens, self.logprobs, "logprobs")


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class CalledFunction(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="ignore")

    id: str | None = None
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant turn's calls
    tool_call_id: str | None = None  # a "tool" message: the call it answers

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str
    description: str | None = None
    parameters: dict | None = None


class ToolDef(BaseModel):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: NamedFunction


def tool_functions(tools: list[ToolDef] | None) -> list[Function]:
    return [Function(t.function.name, t.function.description or "", t.function.parameters or {"type": "object"})
            for t in tools or []]


def check_history(messages: list[ChatMessage]) -> None:
    """Tool calls in the history must carry JSON arguments; a 400 naming the message otherwise."""
    for i, m in enumerate(messages):
        for call in m.tool_calls or []:
            try:
                json.loads(call.function.arguments)
            except json.JSONDecodeError as exc:
                raise APIError(f"messages[{i}].tool_calls: arguments of {call.function.name!r} are not valid JSON "
                               f"({exc.msg})", param="messages") from None


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    add_generation_prompt: bool = True  # vLLM extra

    def tool_mode(self) -> tuple[str, list[Function]]:
        """("none" | "auto" | "required", the functions offered); a named choice is "required" of that one."""
        functions = tool_functions(self.tools)
        choice = self.tool_choice
        if not functions:
            if choice not in (None, "none"):
                raise APIError("tool_choice needs tools", param="tool_choice")
            return "none", []
        if isinstance(choice, NamedToolChoice):
            chosen = [f for f in functions if f.name == choice.function.name]
            if not chosen:
                raise APIError(f"tool_choice names {choice.function.name!r}, which is not among the tools "
                               f"{[f.name for f in functions]}", param="tool_choice")
            return "required", chosen
        return choice or "auto", functions

    def to_sampling_params(self) -> SamplingParams:
        check_history(self.messages)
        mode, functions = self.tool_mode()
        if mode == "required" and (self.response_format is not None and self.response_format.type != "text"):
            raise APIError("response_format cannot be combined with a required tool call", param="response_format")
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError("top_logprobs needs logprobs: true", param="top_logprobs")
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        param = "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        try:
            params = self._sampling_params(max_tokens, logprobs, "top_logprobs")
        except APIError as exc:
            if exc.param == "max_tokens":
                exc.param = param
            raise
        if mode == "required":  # decoding is constrained to one valid call of the chosen function(s)
            params = dataclasses.replace(params, structured_output=tool_constraint(functions))
        return params


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: a completion prompt or chat messages (through the chat template), not both."""
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool | None = None  # default: True for a prompt; the chat template adds its own
    return_token_strs: bool = False

    def checked(self) -> "TokenizeRequest":
        if (self.prompt is None) == (self.messages is None):
            raise APIError("give exactly one of prompt and messages", param="prompt" if self.prompt else "messages")
        return self


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[StrictInt]
