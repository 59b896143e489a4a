"""Structured outputs and tool calls through the real openai SDK against `dflash-jax serve` (a tiny random Llama with
a random drafter, speculative): whatever a random model would write, the grammar makes the output follow the
schema, so the SDK's `parse` gets its pydantic object and a forced tool call's arguments validate against the tool's
schema (checked with jsonschema_rs, an independent validator). Bad constraints are 400s naming their field; a small
hypothesis fuzz of schemas never gets a 5xx, and every schema-constrained answer that stopped validates."""

from __future__ import annotations

import json
from typing import Literal

import httpx
import jsonschema_rs
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, Field

from tests.server.real_server import RealServer
from tests.tinymodels import write_tiny_llama

pytestmark = pytest.mark.slow

MODEL = "tiny"
TIMEOUT_S = 300


class Pet(BaseModel):
    kind: Literal["cat", "dog"]
    age: int = Field(ge=0, le=30)
    vaccinated: bool
    name: str = Field(max_length=6)


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "the weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"enum": ["Paris", "Oslo"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "maxLength": 5}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
MESSAGES = [{"role": "user", "content": "weather?"}]


@pytest.fixture(scope="module")
def real_server(tmp_path_factory):
    model = write_tiny_llama(tmp_path_factory.mktemp("tiny") / "llama", layers=2)
    args = ["--draft-model", "random:1", "--dflash-gamma", "4", "--served-model-name", MODEL]
    args += ["--max-num-seqs", "2", "--max-model-len", "256"]
    with RealServer(model, *args) as srv:
        yield srv
        log = srv.log()
    assert "Traceback" not in log, log[-4000:]


@pytest.fixture(scope="module")
def client(real_server):
    return openai.OpenAI(base_url=real_server.url + "/v1", api_key="none", timeout=TIMEOUT_S, max_retries=0)


def _args_valid(tool: dict, arguments: str) -> bool:
    return jsonschema_rs.is_valid(tool["function"]["parameters"], json.loads(arguments))


def test_parse_returns_the_pydantic_object(client):
    for temperature in (0.0, 1.0):
        done = client.beta.chat.completions.parse(
            model=MODEL, messages=MESSAGES, response_format=Pet, max_tokens=120, temperature=temperature, seed=3
        )
        choice = done.choices[0]
        assert choice.finish_reason == "stop", choice
        assert isinstance(choice.message.parsed, Pet)
        assert Pet.model_validate_json(choice.message.content) == choice.message.parsed


def test_json_object_and_vllm_fields(client):
    done = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, response_format={"type": "json_object"}, max_tokens=60
    )
    c = done.choices[0]
    if c.finish_reason == "stop":
        assert isinstance(json.loads(c.message.content), dict)
    else:
        assert c.finish_reason == "length"
    done = client.completions.create(
        model=MODEL, prompt="pick:", max_tokens=20, extra_body={"guided_choice": ["yes", "no"]}
    )
    assert done.choices[0].text in ("yes", "no")
    done = client.completions.create(
        model=MODEL, prompt="n:", max_tokens=20, extra_body={"guided_regex": "[0-9]{3}-[a-c]{2}"}
    )
    text = done.choices[0].text
    assert len(text) == 6 and text[:3].isdigit() and text[3] == "-" and set(text[4:]) <= set("abc")
    done = client.completions.create(
        model=MODEL,
        prompt="g:",
        max_tokens=20,
        extra_body={"structured_outputs": {"grammar": 'start: "ab" ("c" | "d")'}},
    )
    assert done.choices[0].text in ("abc", "abd")


def test_a_schema_cut_by_max_tokens_ends_with_length(client):
    schema = {"type": "object", "properties": {"s": {"type": "string", "minLength": 50}}, "required": ["s"]}
    done = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=5,
        response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}},
    )
    assert done.choices[0].finish_reason == "length"


def test_named_and_required_tool_choice_return_valid_calls(client):
    _named_and_required(client)


def _named_and_required(client):
    # a forced call is its whole format: `<tool_call>\n{"name":...,"arguments":{...}}\n</tool_call>` (hermes, this
    # server's template shows no tool format) or `{"name":...,"parameters":{...}}` (llama3), one token per byte here
    done = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        tools=[WEATHER, TIME],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=160,
    )
    c = done.choices[0]
    assert c.finish_reason == "tool_calls", c
    (call,) = c.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id
    assert _args_valid(WEATHER, call.function.arguments)
    done = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        tools=[WEATHER, TIME],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=160,
        temperature=1.0,
    )
    c = done.choices[0]
    assert c.finish_reason == "tool_calls", c
    tools = {"get_weather": WEATHER, "get_time": TIME}
    assert c.message.tool_calls
    for call in c.message.tool_calls:
        assert _args_valid(tools[call.function.name], call.function.arguments)


def test_streamed_named_tool_call(client):
    _streamed_named(client)


def _streamed_named(client):
    stream = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=160,
        stream=True,
    )
    name, args, reasons, ids = None, "", [], set()
    for chunk in stream:
        for ch in chunk.choices:
            for tc in ch.delta.tool_calls or []:
                assert tc.index == 0
                if tc.id:
                    ids.add(tc.id)
                if tc.function and tc.function.name:
                    name = tc.function.name
                if tc.function and tc.function.arguments:
                    args += tc.function.arguments
            if ch.finish_reason:
                reasons.append(ch.finish_reason)
    assert name == "get_weather" and len(ids) == 1 and reasons == ["tool_calls"]
    assert _args_valid(WEATHER, args)


def test_llama3_tool_call_parser(tmp_path_factory):
    """`--tool-call-parser llama3` (plain decoding): forced calls are generated as Llama 3.x JSON and come back as
    the same valid `tool_calls`, streamed and not."""
    model = write_tiny_llama(tmp_path_factory.mktemp("tiny3") / "llama", layers=2)
    args = ["--no-spec", "--served-model-name", MODEL, "--max-num-seqs", "2", "--max-model-len", "256"]
    with RealServer(model, *args, "--tool-call-parser", "llama3") as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", timeout=TIMEOUT_S, max_retries=0)
        _named_and_required(client)
        _streamed_named(client)
        log = srv.log()
    assert "tool_call_parser llama3" in log and "Traceback" not in log, log[-4000:]


def test_tool_messages_are_accepted_back(client):
    history = [
        {"role": "user", "content": "weather in Oslo?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "days": 1}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    done = client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER], max_tokens=8)
    assert done.choices[0].finish_reason in ("stop", "length", "tool_calls")


def _status(fn) -> tuple[int, str | None]:
    try:
        fn()
    except openai.BadRequestError as e:
        return 400, e.body.get("param") if isinstance(e.body, dict) else None
    return 200, None


def test_bad_constraints_are_400s_naming_the_field(client):
    chat = client.chat.completions.create
    cases = {
        "tool_choice": lambda: chat(
            model=MODEL,
            messages=MESSAGES,
            tools=[WEATHER],
            tool_choice={"type": "function", "function": {"name": "nope"}},
        ),
        "guided_regex": lambda: chat(model=MODEL, messages=MESSAGES, extra_body={"guided_regex": "a(("}),
        "guided_grammar": lambda: chat(model=MODEL, messages=MESSAGES, extra_body={"guided_grammar": "start: foo"}),
        "guided_json": lambda: chat(model=MODEL, messages=MESSAGES, extra_body={"guided_json": "{not json"}),
        "response_format.json_schema.schema": lambda: chat(
            model=MODEL,
            messages=MESSAGES,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}},
        ),
        "guided_choice": lambda: chat(
            model=MODEL, messages=MESSAGES, response_format={"type": "json_object"}, extra_body={"guided_choice": ["a"]}
        ),
    }
    for param, fn in cases.items():
        assert _status(fn) == (400, param), param


_LEAF = st.one_of(
    st.just({"type": "boolean"}),
    st.just({"type": "integer", "minimum": 0, "maximum": 99}),
    st.just({"type": "string", "maxLength": 4}),
    st.lists(st.sampled_from(["a", "b", "cd", 1, None]), min_size=1, max_size=3, unique=True).map(
        lambda v: {"enum": v}
    ),
    st.just({"type": "nonsense"}),
    st.just({"pattern": "(("}),
)
_SCHEMA = st.recursive(
    _LEAF,
    lambda inner: st.one_of(
        st.dictionaries(st.sampled_from(["a", "b", "c"]), inner, min_size=1, max_size=3).map(
            lambda p: {"type": "object", "properties": p, "required": sorted(p), "additionalProperties": False}
        ),
        inner.map(lambda i: {"type": "array", "items": i, "maxItems": 2}),
        st.lists(inner, min_size=1, max_size=2).map(lambda xs: {"anyOf": xs}),
    ),
    max_leaves=5,
)


def test_fuzzed_schemas_never_5xx(real_server):
    http = httpx.Client(base_url=real_server.url, timeout=TIMEOUT_S)

    @given(schema=_SCHEMA, stream=st.booleans())
    @settings(max_examples=12, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    def one(schema, stream):
        body = {
            "model": MODEL,
            "messages": MESSAGES,
            "max_tokens": 40,
            "stream": stream,
            "response_format": {"type": "json_schema", "json_schema": {"name": "f", "schema": schema}},
        }
        r = http.post("/v1/chat/completions", json=body)
        assert r.status_code in (200, 400), r.text
        if r.status_code == 400:
            assert r.json()["error"]["param"].startswith("response_format"), r.text
            return
        if stream:
            assert r.text.rstrip().endswith("data: [DONE]"), r.text
            return
        c = r.json()["choices"][0]
        if c["finish_reason"] == "stop":
            assert jsonschema_rs.is_valid(schema, json.loads(c["message"]["content"])), (schema, c)

    one()


_TOOL = st.fixed_dictionaries(
    {
        "name": st.sampled_from(["get_weather", "get_time", "lookup", "bad name!", ""]),
        "parameters": st.one_of(
            _SCHEMA.map(lambda s: {"type": "object", "properties": {"x": s}, "required": ["x"]}),
            _SCHEMA,
            st.just({"type": "object", "properties": {}}),
        ),
    }
).map(lambda f: {"type": "function", "function": f})


def test_fuzzed_tool_lists_never_5xx(real_server):
    """Random tool lists (names valid, invalid or repeated; parameters valid or not) with every kind of tool_choice:
    a 200 or a 400 naming `tools` or `tool_choice`; a forced call that finished has arguments valid for its tool."""
    http = httpx.Client(base_url=real_server.url, timeout=TIMEOUT_S)

    @given(
        tools=st.lists(_TOOL, min_size=1, max_size=3),
        choice=st.sampled_from(["auto", "none", "required", "first", "missing"]),
        stream=st.booleans(),
    )
    @settings(max_examples=12, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    def one(tools, choice, stream):
        named = {"first": tools[0]["function"]["name"], "missing": "no_such_tool"}.get(choice)
        tool_choice = {"type": "function", "function": {"name": named}} if named is not None else choice
        body = {
            "model": MODEL,
            "messages": MESSAGES,
            "max_tokens": 60,
            "stream": stream,
            "tools": tools,
            "tool_choice": tool_choice,
        }
        r = http.post("/v1/chat/completions", json=body)
        assert r.status_code in (200, 400), r.text
        if r.status_code == 400:
            assert r.json()["error"]["param"].startswith(("tools", "tool_choice")), r.text
            return
        assert choice != "missing", r.text
        if stream:
            assert r.text.rstrip().endswith("data: [DONE]"), r.text
            return
        c = r.json()["choices"][0]
        if c["finish_reason"] == "tool_calls" and choice in ("required", "first"):
            by_name = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
            for call in c["message"]["tool_calls"]:
                schema = by_name[call["function"]["name"]]
                assert jsonschema_rs.is_valid(schema, json.loads(call["function"]["arguments"])), (schema, call)

    one()
