"""Function calling through the official SDKs, on the real 135M model: `openai`'s two-step
tool loop (call, tool result, final answer) with the SDK's own message objects sent back,
streamed tool-call deltas, `tool_choice` by name and `parallel_tool_calls`, arguments that
always validate against the tool's schema; and the `cloudflare` SDK's `ai.run` with `tools`,
blocking and streamed."""
import json

import httpx
import jsonschema_rs
import pytest
from cloudflare import Cloudflare
from openai import BadRequestError, OpenAI

from conftest import GEMMA3

TEXT = "@cf/huggingfacetb/smollm2-135m-instruct"

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 24},
                   "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"timezone": {"type": "string", "pattern": "^[A-Z][a-z]{1,12}/[A-Z][a-z]{1,12}$"}},
    "required": ["timezone"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER,
                                      "description": "The current weather in a city"}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME,
                                      "description": "The current time in a time zone"}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}


@pytest.fixture
def openai_client(server):
    return OpenAI(api_key=server["token"], base_url=server["base"] + "/v1", max_retries=0)


def _valid_call(call):
    """The call names a tool and its arguments parse and validate against its schema."""
    assert call.type == "function" and call.id.startswith("call_"), call
    args = json.loads(call.function.arguments)
    errors = [e.message for e in jsonschema_rs.validator_for(SCHEMAS[call.function.name])
              .iter_errors(args)]
    assert not errors, (call, errors)
    return args


def test_a_two_step_tool_loop(openai_client, text_model):
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    # The base Gemma model, allowed several calls, goes on calling tools until max_tokens.
    r = openai_client.chat.completions.create(
        model=text_model, messages=messages, tools=TOOLS, tool_choice="required",
        parallel_tool_calls=text_model != GEMMA3, temperature=0, max_tokens=80)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.content is None and choice.message.tool_calls, choice
    call = choice.message.tool_calls[0]
    args = _valid_call(call)
    # The SDK's own message object goes back into the history, then the tool's result.
    messages.append(choice.message)
    messages.append({"role": "tool", "tool_call_id": call.id,
                     "content": json.dumps({"city": args["city"], "temperature": 18})})
    final = openai_client.chat.completions.create(
        model=text_model, messages=messages, tools=TOOLS, tool_choice="none",
        temperature=0, max_tokens=40)
    answer = final.choices[0]
    assert answer.finish_reason in ("stop", "length"), answer
    assert answer.message.tool_calls is None and answer.message.content, answer


def test_streamed_tool_calls_arrive_as_openai_deltas(openai_client):
    stream = openai_client.chat.completions.create(
        model=TEXT, stream=True, tools=TOOLS, temperature=0, max_tokens=80,
        messages=[{"role": "user", "content": "What time is it in Paris?"}],
        tool_choice={"type": "function", "function": {"name": "get_time"}})
    calls, finish, pieces = {}, None, 0
    for chunk in stream:
        choice = chunk.choices[0]
        for d in choice.delta.tool_calls or []:
            pieces += 1
            if d.id:  # the first delta of a call: its id, type and name
                assert d.index not in calls and d.function.name == "get_time", d
                calls[d.index] = {"id": d.id, "name": d.function.name, "arguments": ""}
            calls[d.index]["arguments"] += d.function.arguments or ""
        assert not choice.delta.content, choice.delta
        finish = choice.finish_reason or finish
    assert finish == "tool_calls"
    assert len(calls) >= 1 and pieces > 2, calls  # the arguments come in pieces
    for c in calls.values():
        args = json.loads(c["arguments"])
        assert not list(jsonschema_rs.validator_for(TIME).iter_errors(args)), c


def test_every_sampled_call_validates_and_parallel_calls_can_be_refused(openai_client):
    for seed in range(6):
        r = openai_client.chat.completions.create(
            model=TEXT, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
            temperature=1.0, seed=seed, max_tokens=100,
            messages=[{"role": "user", "content": "Check the weather and the time in Rome."}])
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        assert len(choice.message.tool_calls) == 1, choice.message
        _valid_call(choice.message.tool_calls[0])


def test_auto_may_answer_in_text_and_bad_tools_are_named(openai_client):
    r = openai_client.chat.completions.create(
        model=TEXT, tools=TOOLS, temperature=0, max_tokens=30,
        messages=[{"role": "user", "content": "Say hello."}])
    choice = r.choices[0]
    # Text or calls, as the model decides; either way a well-formed answer.
    if choice.message.tool_calls:
        assert choice.finish_reason == "tool_calls"
        for c in choice.message.tool_calls:
            _valid_call(c)
    else:
        assert choice.finish_reason in ("stop", "length") and choice.message.content
    for kwargs, param in [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice.function.name"),
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]},
         "tools[0].function.name"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
    ]:
        args = {"model": TEXT, "messages": [{"role": "user", "content": "hi"}], "tools": TOOLS,
                **kwargs}
        with pytest.raises(BadRequestError) as e:
            openai_client.chat.completions.create(**args)
        assert e.value.body["param"] == param, e.value.body


def test_cloudflare_sdk_run_with_tools(server):
    client = Cloudflare(api_token=server["token"], base_url=server["base"] + "/client/v4",
                        max_retries=0)
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    out = client.ai.run(TEXT, account_id=server["account"], messages=messages, temperature=0,
                        max_tokens=80, tools=TOOLS, extra_body={"tool_choice": "required"})
    call = out["tool_calls"][0]
    # Workers AI's legacy shape (name, arguments as an object) and OpenAI's, in one.
    assert call["name"] == call["function"]["name"] == "get_weather", out
    assert call["arguments"] == json.loads(call["function"]["arguments"]), call
    assert not list(jsonschema_rs.validator_for(WEATHER).iter_errors(call["arguments"]))
    # The legacy flat tool shape is taken too.
    flat = [{"name": "get_weather", "description": "Weather", "parameters": WEATHER}]
    out = client.ai.run(TEXT, account_id=server["account"], messages=messages, temperature=0,
                        max_tokens=80, tools=flat, extra_body={"tool_choice": "required"})
    assert out["tool_calls"][0]["name"] == "get_weather", out


def test_workers_ai_streams_each_call_whole(server):
    url = f"{server['base']}/client/v4/accounts/{server['account']}/ai/run/{TEXT}"
    body = {"messages": [{"role": "user", "content": "What is the weather in Paris?"}],
            "tools": TOOLS, "tool_choice": "required", "stream": True, "temperature": 0,
            "max_tokens": 80}
    frames = []
    with httpx.stream("POST", url, json=body, timeout=120,
                      headers={"Authorization": f"Bearer {server['token']}"}) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: "):
                frames.append(line[len("data: "):])
    assert frames[-1] == "[DONE]", frames
    calls = [c for f in frames[:-1] for c in json.loads(f).get("tool_calls", [])]
    assert calls and calls[0]["function"]["name"] == "get_weather", frames
    args = json.loads(calls[0]["function"]["arguments"])
    assert not list(jsonschema_rs.validator_for(WEATHER).iter_errors(args)), calls
    assert "usage" in json.loads(frames[-2]), frames
