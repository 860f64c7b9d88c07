"""Tool calls through the real `openai` client (non-streamed and streamed) and the Anthropic Messages API through
the real `anthropic` client, on the random tiny checkpoint: with tool_choice required / named (OpenAI) or any /
tool (Anthropic) decoding is constrained to one valid call, so the calls parse and their arguments validate."""

from __future__ import annotations

import json

import anthropic
import jsonschema
import openai
import pytest
from api_server import running_server

pytestmark = pytest.mark.slow
KEY = "test-key"
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "pattern": "^[A-Z][a-z]{2,9}$"},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"]}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                        "b": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["a", "b"]}
OPENAI_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                                   "parameters": WEATHER}},
                {"type": "function", "function": {"name": "add", "description": "Add two numbers", "parameters": ADD}}]
ANTHROPIC_TOOLS = [{"name": t["function"]["name"], "description": t["function"]["description"],
                    "input_schema": t["function"]["parameters"]} for t in OPENAI_TOOLS]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}


@pytest.fixture(scope="module")
def server(checkpoint):
    with running_server(checkpoint("v3"), "--max-model-len", "1024", "--served-model-name", "tiny",
                        api_key=KEY) as s:
        yield s


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=120)


def test_openai_required_tool_call_round_trip(oai):
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    out = oai.chat.completions.create(model="tiny", messages=messages, tools=OPENAI_TOOLS, tool_choice="required",
                                      max_tokens=200, seed=1)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    # the call and its result go back in the history; the model answers again
    messages += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "22 degrees and sunny"}]
    again = oai.chat.completions.create(model="tiny", messages=messages, tools=OPENAI_TOOLS, max_tokens=8, seed=2)
    assert again.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_openai_named_tool_call_streamed(oai):
    stream = oai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Add 2 and 3"}],
                                         tools=OPENAI_TOOLS, max_tokens=200, seed=3, stream=True,
                                         tool_choice={"type": "function", "function": {"name": "add"}})
    name, args, ids, finish = None, "", set(), None
    for chunk in stream:
        delta = chunk.choices[0].delta
        for tc in delta.tool_calls or []:
            assert tc.index == 0
            if tc.id:
                ids.add(tc.id)
                name = tc.function.name
            args += tc.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert name == "add" and len(ids) == 1 and finish == "tool_calls"
    jsonschema.validate(json.loads(args), ADD)


def test_openai_bad_tool_input_is_400(server):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "tools": OPENAI_TOOLS,
            "tool_choice": {"type": "function", "function": {"name": "nope"}}}
    status, err = server.post("/v1/chat/completions", body)
    assert status == 400 and err["error"]["param"] == "tool_choice"
    history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "add", "arguments": "{not json"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "5"}]
    status, err = server.post("/v1/chat/completions", {"model": "tiny", "messages": history, "tools": OPENAI_TOOLS})
    assert status == 400 and err["error"]["param"] == "messages" and "not valid JSON" in err["error"]["message"]


def test_anthropic_text_stream_and_stop_sequence(claude):
    msg = claude.messages.create(model="tiny", max_tokens=12, system="Be brief.",
                                 messages=[{"role": "user", "content": "Hello there"}], extra_body={"temperature": 0.0})
    assert msg.type == "message" and msg.role == "assistant" and msg.stop_reason in ("end_turn", "max_tokens")
    assert msg.usage.output_tokens > 0 and msg.usage.input_tokens > 0
    with claude.messages.stream(model="tiny", max_tokens=12, messages=[{"role": "user", "content": "Hello there"}],
                                system="Be brief.", extra_body={"temperature": 0.0}) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == "".join(b.text for b in msg.content if b.type == "text")
    assert final.stop_reason == msg.stop_reason
    if len(streamed) > 3:  # stop at a piece of the greedy text
        stop = streamed[1:3]
        cut = claude.messages.create(model="tiny", max_tokens=12, messages=[{"role": "user", "content": "Hello there"}],
                                     system="Be brief.", extra_body={"temperature": 0.0}, stop_sequences=[stop])
        assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop


def test_anthropic_tool_use_round_trip(claude):
    msg = claude.messages.create(model="tiny", max_tokens=200, tools=ANTHROPIC_TOOLS,
                                 tool_choice={"type": "tool", "name": "get_weather"},
                                 messages=[{"role": "user", "content": "Weather in Oslo?"}])
    assert msg.stop_reason == "tool_use"
    use = [b for b in msg.content if b.type == "tool_use"][0]
    assert use.name == "get_weather" and use.id.startswith("toolu_")
    jsonschema.validate(use.input, WEATHER)
    follow = claude.messages.create(model="tiny", max_tokens=8, tools=ANTHROPIC_TOOLS, messages=[
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": [b.model_dump() for b in msg.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "cold"}]}])
    assert follow.stop_reason in ("end_turn", "max_tokens", "tool_use")
    with claude.messages.stream(model="tiny", max_tokens=200, tools=ANTHROPIC_TOOLS, tool_choice={"type": "any"},
                                messages=[{"role": "user", "content": "Add 4 and 5"}]) as stream:
        final = stream.get_final_message()
    use = [b for b in final.content if b.type == "tool_use"][0]
    assert final.stop_reason == "tool_use"
    jsonschema.validate(use.input, SCHEMAS[use.name])


def test_anthropic_errors_are_its_own_400(claude):
    with pytest.raises(anthropic.BadRequestError) as err:
        claude.messages.create(model="tiny", max_tokens=8, tools=ANTHROPIC_TOOLS,
                               tool_choice={"type": "tool", "name": "nope"},
                               messages=[{"role": "user", "content": "hi"}])
    assert err.value.body["error"]["type"] == "invalid_request_error" and "nope" in err.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError):
        claude.messages.create(model="tiny", max_tokens=8, messages=[
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "add", "input": "oops"}]}])
