"""Tool-call parsing and deltas on hand-written model outputs (Hermes / Qwen3 tags, Llama 3.x JSON), and the schema
of a forced call (checked against hand-written instances with jsonschema_rs)."""

from __future__ import annotations

import json

import jsonschema_rs
import pytest

from dflash_jax.server import protocol as P
from dflash_jax.server.tools import ChoiceTools, forced_calls, forced_schema, parse_tool_calls

NAMES = {"get_weather", "get_time"}


def _tools() -> list[P.Tool]:
    params = {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
        "additionalProperties": False,
    }
    return [
        P.Tool.model_validate({"type": "function", "function": {"name": "get_weather", "parameters": params}}),
        P.Tool.model_validate({"type": "function", "function": {"name": "get_time"}}),
    ]


def _named(name: str) -> P.NamedToolChoice:
    return P.NamedToolChoice.model_validate({"type": "function", "function": {"name": name}})


def _calls(calls):
    return [(c.name, json.loads(c.arguments)) for c in calls]


def test_hermes_calls_with_content_before_them():
    text = (
        "Let me check.\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    )
    content, calls = parse_tool_calls(text, NAMES)
    assert content == "Let me check."
    assert _calls(calls) == [("get_weather", {"city": "Paris"}), ("get_time", {})]


def test_hermes_only_calls_and_unterminated_tag():
    content, calls = parse_tool_calls('<tool_call>\n{"name": "get_time", "arguments": {"z": 1}}', NAMES)
    assert content is None and _calls(calls) == [("get_time", {"z": 1})]


@pytest.mark.parametrize(
    "text",
    [
        '<tool_call>{"name": "unknown", "arguments": {}}</tool_call>',  # not one of the tools
        '<tool_call>{"name": "get_time", "arguments": {</tool_call>',  # broken JSON (cut by max_tokens)
        "plain text answer",
        '{"a": 1} and more',
    ],
)
def test_not_calls_stay_content(text):
    assert parse_tool_calls(text, NAMES) == (text, [])


def test_llama3_json_formats():
    content, calls = parse_tool_calls('{"name": "get_weather", "parameters": {"city": "Oslo"}}', NAMES)
    assert content is None and _calls(calls) == [("get_weather", {"city": "Oslo"})]
    second = json.dumps({"name": "get_weather", "arguments": json.dumps({"city": "Rome"})})
    text = '<|python_tag|>{"name": "get_time", "parameters": {}}; ' + second
    _, calls = parse_tool_calls(text, NAMES)
    assert _calls(calls) == [("get_time", {}), ("get_weather", {"city": "Rome"})]


def test_forced_schemas_accept_exactly_the_calls():
    tools = _tools()
    named = forced_schema(tools, _named("get_weather"), None)
    assert jsonschema_rs.is_valid(named, {"city": "x"})
    assert not jsonschema_rs.is_valid(named, {"town": "x"})
    required = forced_schema(tools, "required", None)
    assert jsonschema_rs.is_valid(
        required, [{"name": "get_time", "parameters": {}}, {"name": "get_weather", "parameters": {"city": "a"}}]
    )
    assert not jsonschema_rs.is_valid(required, [])
    assert not jsonschema_rs.is_valid(required, [{"name": "other", "parameters": {}}])
    single = forced_schema(tools, "required", False)
    assert not jsonschema_rs.is_valid(single, [{"name": "get_time", "parameters": {}}] * 2)
    assert forced_schema(tools, "auto", None) is None and forced_schema(tools, "none", None) is None
    with pytest.raises(KeyError):
        forced_schema(tools, _named("nope"), None)
    assert _calls(forced_calls('{"city": "a"}', _named("get_weather"))) == [("get_weather", {"city": "a"})]
    assert _calls(forced_calls('[{"name": "get_time", "parameters": {}}]', "required")) == [("get_time", {})]
    assert forced_calls('{"city": ', _named("get_weather")) is None


def _stream(ct: ChoiceTools, pieces: list[str], reason: str = "stop"):
    deltas = []
    for p in pieces:
        deltas += ct.delta(p)
    more, reason = ct.finish(reason)
    return deltas + more, reason


def test_auto_deltas_stream_content_and_hold_back_calls():
    pieces = ["Hi", " there <tool", '_call>{"name": "get_time", ', '"arguments": {}}</tool_call>']
    deltas, reason = _stream(ChoiceTools(_tools(), "auto"), pieces)
    content = "".join(d.get("content", "") for d in deltas)
    assert content == "Hi there "
    (call,) = [c for d in deltas for c in d.get("tool_calls", [])]
    assert call["index"] == 0 and call["function"]["name"] == "get_time" and reason == "tool_calls"
    # a "<" that does not start a tag is content after all
    deltas, reason = _stream(ChoiceTools(_tools(), None), ["a <", "b"])
    assert "".join(d["content"] for d in deltas) == "a <b" and reason == "stop"
    # a Llama JSON call: held from its first brace
    deltas, reason = _stream(ChoiceTools(_tools(), "auto"), ['{"name": "get_time",', ' "parameters": {}}'])
    assert [list(d) for d in deltas] == [["tool_calls"]] and reason == "tool_calls"


def test_named_deltas_stream_the_arguments():
    deltas, reason = _stream(ChoiceTools(_tools(), _named("get_weather")), ['{"city"', ': "Oslo"}'])
    first = deltas[0]["tool_calls"][0]
    assert first["function"] == {"name": "get_weather", "arguments": ""} and first["id"]
    args = "".join(d["tool_calls"][0]["function"].get("arguments", "") for d in deltas)
    assert json.loads(args) == {"city": "Oslo"} and reason == "tool_calls"
    _, reason = _stream(ChoiceTools(_tools(), _named("get_weather")), ['{"city"'], "length")
    assert reason == "length"


def test_messages_non_streamed():
    ct = ChoiceTools(_tools(), "auto")
    msg, reason = ct.message('<tool_call>{"name": "get_time", "arguments": {}}</tool_call>', "stop")
    assert msg["content"] is None and msg["tool_calls"][0]["function"]["name"] == "get_time" and reason == "tool_calls"
    msg, reason = ChoiceTools(_tools(), "none").message('<tool_call>{"name": "get_time"}</tool_call>', "stop")
    assert "tool_calls" not in msg and reason == "stop"
    msg, reason = ChoiceTools(_tools(), "required").message('[{"name": "get_ti', "length")
    assert msg["content"] == '[{"name": "get_ti' and reason == "length"
