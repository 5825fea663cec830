"""Structured output through `copt serve`: response_format (JSON object / JSON schema) and tools with tool_choice,
constrained by xgrammar on the fixture teacher (whose free text is garbage: the constraint is what makes it JSON)."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.integration.test_serve_helpers import running_server

pytest.importorskip("xgrammar")
pytestmark = pytest.mark.slow

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "ok": {"type": "boolean"},
        "color": {"enum": ["red", "green", "blue"]},
    },
    "required": ["name", "age", "ok", "color"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 10}, "unit": {"enum": ["c", "f"]},
                   "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "unit", "days"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"],
        "additionalProperties": False}}},
]
MESSAGES = [{"role": "user", "content": "def parse(text):\n    return"}]


def validate(instance, schema):
    try:
        import jsonschema
    except ImportError:  # by hand: the keys and types of SCHEMA / WEATHER
        assert set(instance) == set(schema["required"])
        return
    jsonschema.validate(instance, schema)


@pytest.fixture(scope="module")
def server(fixtures):
    with running_server(fixtures.teacher, "--served-model-name", "teacher", "--max-model-len", "512") as (url, _):
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="none", max_retries=0, timeout=120)


def schema_format(schema=SCHEMA):
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": schema}}


def test_json_schema_greedy_and_sampled_outputs_validate(client):
    free = client.chat.completions.create(model="teacher", messages=MESSAGES, max_tokens=40, temperature=0)
    with pytest.raises(ValueError):  # the model alone does not write JSON
        json.loads(free.choices[0].message.content)
    runs = [dict(temperature=0)] + [dict(temperature=1.0, seed=s) for s in range(4)]
    for kw in runs:
        r = client.chat.completions.create(model="teacher", messages=MESSAGES, max_tokens=120,
                                           response_format=schema_format(), **kw)
        assert r.choices[0].finish_reason == "stop", (kw, r.choices[0].message.content)
        validate(json.loads(r.choices[0].message.content), SCHEMA)


def test_json_schema_n_choices_each_follow_the_grammar(client):
    r = client.chat.completions.create(model="teacher", messages=MESSAGES, max_tokens=120, temperature=1.0, seed=9,
                                       n=3, response_format=schema_format())
    assert len(r.choices) == 3
    for choice in r.choices:
        assert choice.finish_reason == "stop"
        validate(json.loads(choice.message.content), SCHEMA)


def test_json_schema_on_completions_and_concurrent_with_free_requests(client):
    from concurrent.futures import ThreadPoolExecutor

    def constrained(seed):
        r = client.completions.create(model="teacher", prompt="import os\n", max_tokens=120, temperature=0.9,
                                      seed=seed, extra_body={"response_format": schema_format()})
        return r.choices[0]

    def free(seed):
        return client.completions.create(model="teacher", prompt="import os\n", max_tokens=30, temperature=0.9,
                                         seed=seed).choices[0]

    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda i: (constrained if i % 2 else free)(i), range(8)))
    for i, choice in enumerate(got):
        if i % 2:
            assert choice.finish_reason == "stop"
            validate(json.loads(choice.text), SCHEMA)


def test_json_object_output_parses(client):
    r = client.chat.completions.create(model="teacher", messages=MESSAGES, max_tokens=200, temperature=0,
                                       response_format={"type": "json_object"})
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content), dict)


@pytest.mark.parametrize("seed", [None, 5])
def test_tool_call_round_trip_required(client, seed):
    kw = dict(temperature=0) if seed is None else dict(temperature=1.0, seed=seed)
    r = client.chat.completions.create(model="teacher", messages=MESSAGES, max_tokens=200, tools=TOOLS,
                                       tool_choice="required", parallel_tool_calls=False, **kw)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice.message
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id
    schema = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}[call.function.name]
    args = json.loads(call.function.arguments)
    validate(args, schema)
    # the answer goes back with the call, as an agent loop does
    follow = client.chat.completions.create(
        model="teacher", max_tokens=8, temperature=0, tools=TOOLS, tool_choice="none",
        messages=MESSAGES + [choice.message.model_dump(exclude_none=True),
                             {"role": "tool", "tool_call_id": call.id, "content": "sunny"}])
    assert follow.choices[0].finish_reason in ("stop", "length") and not follow.choices[0].message.tool_calls


def test_streamed_tool_call_matches_the_whole_one(client):
    kw = dict(model="teacher", messages=MESSAGES, max_tokens=200, temperature=0, tools=TOOLS,
              tool_choice="required", parallel_tool_calls=False)
    whole = client.chat.completions.create(**kw).choices[0]
    calls, reasons, usage = {}, [], None
    for chunk in client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}):
        usage = chunk.usage or usage
        for c in chunk.choices:
            reasons.append(c.finish_reason)
            for d in c.delta.tool_calls or []:  # accumulated by index, as OpenAI clients do
                entry = calls.setdefault(d.index, {"name": "", "arguments": ""})
                entry["name"] += d.function.name or ""
                entry["arguments"] += d.function.arguments or ""
    assert [r for r in reasons if r] == ["tool_calls"] and usage.completion_tokens > 0
    assert [(e["name"], json.loads(e["arguments"])) for e in calls.values()] == [
        (c.function.name, json.loads(c.function.arguments)) for c in whole.message.tool_calls]


def test_tool_call_named_function(client):
    r = client.chat.completions.create(model="teacher", messages=MESSAGES, max_tokens=120, temperature=0,
                                       tools=TOOLS,
                                       tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert [c.function.name for c in choice.message.tool_calls] == ["get_weather"]
    validate(json.loads(choice.message.tool_calls[0].function.arguments), WEATHER)


def test_malformed_schema_and_tools_are_400_naming_the_field(server):
    def post(body):
        return httpx.post(server + "/v1/chat/completions", json={"model": "teacher", "messages": MESSAGES,
                                                                 "max_tokens": 4, **body}, timeout=60)

    bad = post({"response_format": schema_format({"type": "object", "properties": {"a": {"type": "nope"}}})})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "response_format.json_schema.schema"
    bad = post({"response_format": {"type": "yaml"}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "response_format.type"
    tools = [TOOLS[0], {"type": "function", "function": {"name": "f", "parameters": {"type": 3}}}]
    bad = post({"tools": tools, "tool_choice": "required"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tools[1].function.parameters"
    bad = post({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "missing"}}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tool_choice"
    bad = httpx.post(server + "/v1/completions", json={"prompt": "x", "tools": TOOLS}, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tools"  # tools are for chat completions
    assert post({"response_format": {"type": "text"}}).status_code == 200


def test_parse_tool_calls_formats():
    from clusteropt_cli.core.serve.structured import parse_tool_calls

    names = {"get_weather"}
    content, calls = parse_tool_calls('Sure.<tool_call>{"name": "get_weather", "arguments": {"city": "x"}}'
                                      '</tool_call>', "auto", names)
    assert content == "Sure." and json.loads(calls[0]["function"]["arguments"]) == {"city": "x"}
    content, calls = parse_tool_calls(' {"name": "get_weather", "parameters": {"days": 2}}', "auto", names)
    assert content is None and calls[0]["function"]["name"] == "get_weather"
    assert parse_tool_calls('{"name": "rm_rf", "arguments": {}}', "auto", names)[1] == []
    assert parse_tool_calls("plain words", "auto", names) == ("plain words", [])
    assert parse_tool_calls('{"city": "y"}', "get_weather", names)[1][0]["function"]["name"] == "get_weather"
