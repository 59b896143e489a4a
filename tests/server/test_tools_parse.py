"""Tool calls in the two `--tool-call-parser` formats (Hermes / Qwen3 tags, Llama 3.x JSON): parsing hand-written
model outputs, streamed deltas against the non-streamed message, the parser chosen from chat templates, and the
grammar of a forced call (driven with an llguidance matcher over a byte-level tokenizer: it accepts exactly the
calls of the right tools in the parser's format, and every output it lets through parses back into valid calls,
checked against the tools' schemas with jsonschema_rs)."""

from __future__ import annotations

import json

import jsonschema_rs
import llguidance
import numpy as np
import pytest

from dflash_jax.checkpoints.tokenizer import (
    TOOL_CALL_PARSERS,
    TextTokenizer,
    resolve_tool_call_parser,
    template_tool_format,
)
from dflash_jax.engine.grammar import GrammarCompiler, grammar_from
from dflash_jax.errors import UserError
from dflash_jax.server import protocol as P
from dflash_jax.server.tools import ChoiceTools, forced_grammar, parse_tool_calls
from tests.spec_decode.test_grammar import EOS, _Tok

NAMES = {"get_weather", "get_time"}
WEATHER_PARAMS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 4}},
    "required": ["city"],
    "additionalProperties": False,
}


def _tools() -> list[P.Tool]:
    return [
        P.Tool.model_validate({"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_PARAMS}}),
        P.Tool.model_validate({"type": "function", "function": {"name": "get_time"}}),
    ]


def _named(name: str) -> P.NamedToolChoice:
    return P.NamedToolChoice.model_validate({"type": "function", "function": {"name": name}})


def _calls(calls):
    return [(c.name, json.loads(c.arguments)) for c in calls]


# ------------------------------------------------------------------------------------------------ parsing
def test_hermes_calls_with_content_before_them():
    text = (
        "Let me check.\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    )
    content, calls = parse_tool_calls(text, NAMES, "hermes")
    assert content == "Let me check."
    assert _calls(calls) == [("get_weather", {"city": "Paris"}), ("get_time", {})]


def test_hermes_only_calls_and_unterminated_tag():
    content, calls = parse_tool_calls('<tool_call>\n{"name": "get_time", "arguments": {"z": 1}}', NAMES, "hermes")
    assert content is None and _calls(calls) == [("get_time", {"z": 1})]


@pytest.mark.parametrize("parser", ["hermes", "llama3"])
@pytest.mark.parametrize(
    "text",
    [
        '<tool_call>{"name": "unknown", "arguments": {}}</tool_call>',  # not one of the tools
        '<tool_call>{"name": "get_time", "arguments": {</tool_call>',  # broken JSON (cut by max_tokens)
        '{"name": "unknown", "parameters": {}}',
        '{"name": "get_time", "parameters": {',
        "plain text answer",
        '{"a": 1} and more',
    ],
)
def test_not_calls_stay_content(text, parser):
    assert parse_tool_calls(text, NAMES, parser) == (text, [])


def test_llama3_json_formats():
    content, calls = parse_tool_calls('{"name": "get_weather", "parameters": {"city": "Oslo"}}', NAMES, "llama3")
    assert content is None and _calls(calls) == [("get_weather", {"city": "Oslo"})]
    second = json.dumps({"name": "get_weather", "arguments": json.dumps({"city": "Rome"})})
    text = '<|python_tag|>{"name": "get_time", "parameters": {}}; ' + second
    _, calls = parse_tool_calls(text, NAMES, "llama3")
    assert _calls(calls) == [("get_time", {}), ("get_weather", {"city": "Rome"})]


def test_each_parser_reads_only_its_format():
    hermes = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    llama = '{"name": "get_time", "parameters": {}}'
    assert parse_tool_calls(hermes, NAMES, "llama3") == (hermes, [])
    assert parse_tool_calls(llama, NAMES, "hermes") == (llama, [])
    with pytest.raises(ValueError, match="hermes or llama3"):
        parse_tool_calls(llama, NAMES, "auto")  # auto is resolved before a request is parsed


# ------------------------------------------------------------------------------------------------ streaming
def _stream(ct: ChoiceTools, text: str, reason: str = "stop", step: int = 1):
    deltas = []
    for i in range(0, len(text), step):
        deltas += ct.delta(text[i : i + step])
    more, reason = ct.finish(reason)
    return deltas + more, reason


def _joined(deltas):
    """(content, calls as (name, arguments text)) from streamed deltas, as a client accumulates them."""
    content = "".join(d.get("content") or "" for d in deltas)
    calls: dict[int, list] = {}
    for d in deltas:
        for c in d.get("tool_calls", []):
            entry = calls.setdefault(c["index"], [None, ""])
            fn = c.get("function", {})
            entry[0] = fn.get("name") or entry[0]
            entry[1] += fn.get("arguments", "")
    return content, [(name, args) for name, args in (calls[i] for i in sorted(calls))]


AUTO_CASES = {
    "hermes": (
        'Let me see. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    ),
    "llama3": '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}; '
    '{"name": "get_time", "parameters": {}}',
}


@pytest.mark.parametrize("step", [1, 3, 1000])
@pytest.mark.parametrize("parser", ["hermes", "llama3"])
def test_auto_streamed_deltas_equal_the_message(parser, step):
    text = AUTO_CASES[parser]
    msg, reason = ChoiceTools(_tools(), "auto", parser).message(text, "stop")
    deltas, sreason = _stream(ChoiceTools(_tools(), "auto", parser), text, step=step)
    content, calls = _joined(deltas)
    assert reason == sreason == "tool_calls"
    assert content == (msg["content"] or "") + ("" if parser == "llama3" else " ")  # the space before the tag
    want = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg["tool_calls"]]
    assert want == [("get_weather", {"city": "Oslo"}), ("get_time", {})]
    assert [(n, json.loads(a)) for n, a in calls] == want
    if step == 1:  # each call went out as it closed, before the end
        ct = ChoiceTools(_tools(), "auto", parser)
        before = [d for ch in text for d in ct.delta(ch) if "tool_calls" in d]
        assert len(before) == 4 and ct.finish("stop") == ([], "tool_calls")
    # the other parser's format is plain content, streamed as such
    other = "llama3" if parser == "hermes" else "hermes"
    deltas, sreason = _stream(ChoiceTools(_tools(), "auto", other), text, step=step)
    assert _joined(deltas) == (text, []) and sreason == "stop"


def test_hermes_held_back_tag_prefix_is_content_when_no_tag_follows():
    deltas, reason = _stream(ChoiceTools(_tools(), None, "hermes"), "a <b")
    assert _joined(deltas) == ("a <b", []) and reason == "stop"
    deltas, reason = _stream(ChoiceTools(_tools(), None, "hermes"), "Hi there <tool", step=1)
    # nothing past "Hi there " was sent before the end: "<tool" might have started a tag
    assert "".join(d["content"] for d in deltas[:-1]) == "Hi there " and reason == "stop"


def _forced_text(parser: str, calls: list[tuple[str, dict]]) -> str:
    """The compact text the forced grammar generates for `calls` (checked against the grammar below)."""
    key = "arguments" if parser == "hermes" else "parameters"
    bodies = [json.dumps({"name": n, key: a}, separators=(",", ":")) for n, a in calls]
    if parser == "hermes":
        return "\n".join(f"<tool_call>\n{b}\n</tool_call>" for b in bodies)
    return "; ".join(bodies)


def _streamed_equals_message(choice, parser: str, text: str, reason: str, step: int):
    """Streams `text` and checks the deltas against the non-streamed message: the same calls (names, parsed
    arguments, in order, each opened by one delta with its index, id and name), the same content (whitespace around
    it aside when there are calls) and finish reason. Returns the message and the deltas."""
    msg, mreason = ChoiceTools(_tools(), choice, parser).message(text, reason)
    deltas, sreason = _stream(ChoiceTools(_tools(), choice, parser), text, reason, step)
    content, calls = _joined(deltas)
    assert sreason == mreason, (text, reason)
    want = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg.get("tool_calls", [])]
    assert [(n, json.loads(a)) for n, a in calls] == want, (text, reason)
    if want:
        assert content.strip() == (msg["content"] or ""), (text, reason)
    else:
        assert content == msg["content"], (text, reason)
    opening = [c for d in deltas for c in d.get("tool_calls", []) if "id" in c]
    assert [c["index"] for c in opening] == list(range(len(want)))
    for c, (name, _) in zip(opening, want, strict=True):
        assert c["id"].startswith("call_") and c["type"] == "function"
        assert c["function"] == {"name": name, "arguments": ""}
    assert all(d for d in deltas)  # no empty delta
    return msg, deltas


@pytest.mark.parametrize("step", [1, 5, 1000])
@pytest.mark.parametrize("parser", ["hermes", "llama3"])
def test_named_deltas_stream_the_arguments(parser, step):
    text = _forced_text(parser, [("get_weather", {"city": "Oslo"})])
    ct = ChoiceTools(_tools(), _named("get_weather"), parser)
    msg, reason = ct.message(text, "stop")
    assert reason == "tool_calls" and msg["content"] is None
    assert json.loads(msg["tool_calls"][0]["function"]["arguments"]) == {"city": "Oslo"}
    deltas, sreason = _stream(ChoiceTools(_tools(), _named("get_weather"), parser), text, step=step)
    first = deltas[0]["tool_calls"][0]
    assert first["function"] == {"name": "get_weather", "arguments": ""} and first["id"]
    assert _joined(deltas) == ("", [("get_weather", '{"city":"Oslo"}')]) and sreason == "tool_calls"
    if step == 1:  # the arguments went out as they were generated, before the end
        streamed = [d for d in deltas if d["tool_calls"][0].get("function", {}).get("arguments")]
        assert len(streamed) > 5
    # cut by max_tokens: no call, the finish reason stays
    cut = text[: len(text) // 2]
    _, reason = _stream(ChoiceTools(_tools(), _named("get_weather"), parser), cut, "length")
    assert reason == "length"
    msg, reason = ChoiceTools(_tools(), _named("get_weather"), parser).message(cut, "length")
    assert msg == {"role": "assistant", "content": cut} and reason == "length"


REQUIRED_CALLS = [("get_time", {}), ("get_weather", {"city": "a;}"}), ("get_time", {"z": [1, {"y": "</"}]})]


@pytest.mark.parametrize("step", [1, 3, 1000])
@pytest.mark.parametrize("parser", ["hermes", "llama3"])
def test_required_calls_stream_as_each_closes(parser, step):
    text = _forced_text(parser, REQUIRED_CALLS)
    msg, deltas = _streamed_equals_message("required", parser, text, "stop", step)
    assert msg["content"] is None and len(deltas) == 2 * len(REQUIRED_CALLS)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg["tool_calls"]] == (
        REQUIRED_CALLS
    )
    if step == 1:  # each call's two deltas go out as its text closes, before the next call's text
        ct, sent = ChoiceTools(_tools(), "required", parser), []
        for i, ch in enumerate(text):
            sent.append((i, ct.delta(ch)))
        first_call = _forced_text(parser, REQUIRED_CALLS[:1])
        assert [len(d) for i, d in sent if i < len(first_call)] == [0] * (len(first_call) - 1) + [2]
        assert sum(len(d) for _, d in sent) == 2 * len(REQUIRED_CALLS)  # all of them before the end
        more, reason = ct.finish("stop")
        assert more == [] and reason == "tool_calls"


@pytest.mark.parametrize("parser", ["hermes", "llama3"])
def test_required_output_cut_anywhere(parser):
    """Cut by max_tokens at every character: the calls closed before the cut stream and stay calls, the rest is
    content, finish `length`; with no closed call, all of it is content (the message's rule)."""
    text = _forced_text(parser, REQUIRED_CALLS[:2])
    first_end = len(_forced_text(parser, REQUIRED_CALLS[:1]))
    for n in range(len(text) + 1):
        for step in (1, 3):
            msg, _ = _streamed_equals_message("required", parser, text[:n], "length", step)
        calls = msg.get("tool_calls", [])
        if n < first_end:
            assert msg == {"role": "assistant", "content": text[:n]}
        elif n < len(text):
            assert [c["function"]["name"] for c in calls] == ["get_time"]
            # after the closed call: a partial next call is content (hermes: once its tag is there)
            tail = text[first_end:n]
            if parser == "hermes":
                assert msg["content"] == (tail.strip() if "<tool_call>" in tail else None)
            else:
                assert msg["content"] == (tail.lstrip("; ") or None)
        else:
            assert len(calls) == 2 and msg["content"] is None
    _, reason = ChoiceTools(_tools(), "required", parser).message(text[: first_end + 20], "length")
    assert reason == "length"
    _, reason = ChoiceTools(_tools(), "required", parser).message(text, "length")  # cut right at the end
    assert reason == "tool_calls"


AUTO_VARIANTS = {
    "hermes": [
        # whitespace variants, the closing tag missing at the end
        '<tool_call>{ "name" : "get_time" ,\n  "arguments" : { } }</tool_call><tool_call>\n\n{"name": "get_weather",'
        ' "arguments": {"city": "N}"}}',
        # a call of an unknown function after a good one: content from there
        'Sure. <tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call> and\n<tool_call>\n'
        '{"name": "nope", "arguments": {}}\n</tool_call> done',
        # broken JSON first: all content
        '<tool_call>{"name": "get_time", "arguments": }</tool_call><tool_call>{"name": "get_time", "arguments": {}}'
        "</tool_call>",
        # text after the calls outside any tag is neither content nor a call
        '<tool_call>{"name": "get_time", "arguments": {}}</tool_call> That is all.',
        "no call at all <tool but a tag prefix",
    ],
    "llama3": [
        '  <|python_tag|>{ "name": "get_time",\n "parameters": {} } ;{"name": "get_weather", "arguments": '
        '"{\\"city\\": \\"R\\"}"}',
        '{"name": "get_time", "parameters": {}} I called the clock.',
        '{"name": "get_time", "parameters": {}}; {"name": "nope", "parameters": {}}',
        '{"name": "get_time", "parameters": {"x": "}"}}; {"name": "get_time", "parameters": {',
        '{"name": "nope", "parameters": {}}; {"name": "get_time", "parameters": {}}',
        "<|python_tag|> plain",
        "{} is an empty object",
    ],
}


@pytest.mark.parametrize("step", [1, 3, 1000])
@pytest.mark.parametrize("parser", ["hermes", "llama3"])
def test_auto_outputs_stream_into_their_message(parser, step):
    """Every prefix of model-written outputs (right and wrong calls, whitespace variants), as a finished output and
    as one cut by max_tokens: the stream adds up to the message."""
    for text in [AUTO_CASES[parser], *AUTO_VARIANTS[parser]]:
        cuts = range(0, len(text) + 1, 4 if step == 1 else 1)  # step 1: every fourth, the others: every cut
        for n in [*cuts, len(text)]:
            for reason in ("stop", "length"):
                _streamed_equals_message("auto", parser, text[:n], reason, step)


def test_auto_messages_of_the_variants():
    """The hand-worked messages of some of the variants above."""

    def message(parser, text):
        msg, reason = ChoiceTools(_tools(), "auto", parser).message(text, "stop")
        calls = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg.get("tool_calls", [])]
        return msg["content"], calls, reason

    h, ll = AUTO_VARIANTS["hermes"], AUTO_VARIANTS["llama3"]
    assert message("hermes", h[0]) == (None, [("get_time", {}), ("get_weather", {"city": "N}"})], "tool_calls")
    assert message("hermes", h[1]) == (
        'Sure.  and\n<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call> done',
        [("get_time", {})],
        "tool_calls",
    )
    assert message("hermes", h[2]) == (h[2], [], "stop")
    assert message("hermes", h[3]) == (None, [("get_time", {})], "tool_calls")
    assert message("llama3", ll[0]) == (None, [("get_time", {}), ("get_weather", {"city": "R"})], "tool_calls")
    assert message("llama3", ll[1]) == ("I called the clock.", [("get_time", {})], "tool_calls")
    assert message("llama3", ll[2]) == ('{"name": "nope", "parameters": {}}', [("get_time", {})], "tool_calls")
    assert message("llama3", ll[3]) == (
        '{"name": "get_time", "parameters": {',
        [("get_time", {"x": "}"})],
        "tool_calls",
    )
    assert message("llama3", ll[4]) == (ll[4], [], "stop")
    # cut by max_tokens: an unterminated hermes tag is not a call then; text left after calls gives `length`
    cut = '<tool_call>{"name": "get_time", "arguments": {}}'
    msg, reason = ChoiceTools(_tools(), "auto", "hermes").message(cut, "length")
    assert msg == {"role": "assistant", "content": cut} and reason == "length"
    msg, reason = ChoiceTools(_tools(), "auto", "llama3").message(ll[3], "length")
    assert len(msg["tool_calls"]) == 1 and reason == "length"


def test_none_is_content():
    msg, reason = ChoiceTools(_tools(), "none", "hermes").message('<tool_call>{"name": "get_time"}</tool_call>', "stop")
    assert "tool_calls" not in msg and reason == "stop"


# ------------------------------------------------------------------------------------------------ forced grammar
@pytest.fixture(scope="module")
def compiler():
    return GrammarCompiler.from_tokenizer(_Tok(), 128)


def _accepts(compiler, grammar: str, text: str) -> bool:
    m = llguidance.LLMatcher(compiler.tokenizer, grammar, log_level=0)
    for b in text.encode():
        if b >= EOS or not m.consume_token(b):
            return False
    return m.is_accepting()


def _grammar(choice, parser, parallel=None) -> str:
    kind, value = forced_grammar(_tools(), choice, parallel, parser)
    return grammar_from(kind, value)


@pytest.mark.parametrize("parser", ["hermes", "llama3"])
def test_forced_grammar_accepts_exactly_the_calls(compiler, parser):
    g = _grammar(_named("get_weather"), parser)
    compiler.check(g, "tool_choice")
    assert _accepts(compiler, g, _forced_text(parser, [("get_weather", {"city": "x"})]))
    assert not _accepts(compiler, g, _forced_text(parser, [("get_time", {})]))  # another function
    assert not _accepts(compiler, g, _forced_text(parser, [("get_weather", {"town": "x"})]))  # against the schema
    assert not _accepts(compiler, g, _forced_text(parser, [("get_weather", {"city": "x"})] * 2))  # one call
    assert not _accepts(compiler, g, '{"city":"x"}')  # the bare arguments are not a call in either format
    other = "llama3" if parser == "hermes" else "hermes"
    assert not _accepts(compiler, g, _forced_text(other, [("get_weather", {"city": "x"})]))
    req = _grammar("required", parser)
    two = [("get_time", {}), ("get_weather", {"city": "ab"})]
    assert _accepts(compiler, req, _forced_text(parser, two))
    assert _accepts(compiler, req, _forced_text(parser, two[:1]))
    assert not _accepts(compiler, req, "")
    assert not _accepts(compiler, req, _forced_text(parser, [("other", {})]))
    single = _grammar("required", parser, parallel=False)
    assert _accepts(compiler, single, _forced_text(parser, two[:1]))
    assert not _accepts(compiler, single, _forced_text(parser, two))
    assert forced_grammar(_tools(), "auto", None, parser) is None
    assert forced_grammar(_tools(), "none", None, parser) is None
    with pytest.raises(KeyError):
        forced_grammar(_tools(), _named("nope"), None, parser)


@pytest.mark.parametrize("parser", ["hermes", "llama3"])
@pytest.mark.parametrize("choice", ["named", "required"])
def test_random_outputs_of_the_forced_grammar_parse_into_valid_calls(compiler, parser, choice):
    """Random walks of the matcher (every step a random token its mask allows, a closing one (quote, brace,
    end-of-sequence) half the time it is allowed, so that the walk ends): each output parses, streamed and not, into
    calls of the tools whose arguments follow their schemas."""
    rng = np.random.default_rng(0)
    tc = _named("get_weather") if choice == "named" else "required"
    g = _grammar(tc, parser)
    schemas = {"get_weather": WEATHER_PARAMS, "get_time": {"type": "object"}}
    for _ in range(12):
        m = llguidance.LLMatcher(compiler.tokenizer, g, log_level=0)
        out = []
        while not m.is_stopped() and len(out) < 2000:
            bits = np.unpackbits(np.frombuffer(m.compute_bitmask(), np.uint8), bitorder="little")[:128]
            ok = np.flatnonzero(bits)
            closing = [t for t in (EOS, ord('"'), ord("}")) if bits[t]]
            t = int(rng.choice(closing if closing and rng.random() < 0.5 else ok))
            if t == EOS:
                break
            out.append(t)
            assert m.consume_token(t)
        text = bytes(out).decode()
        assert m.is_accepting(), text
        msg, reason = ChoiceTools(_tools(), tc, parser).message(text, "stop")
        assert reason == "tool_calls" and msg["content"] is None, text
        calls = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg["tool_calls"]]
        for name, args in calls:
            assert jsonschema_rs.is_valid(schemas[name], args), (name, args)
        if choice == "named":
            assert [n for n, _ in calls] == ["get_weather"]
        deltas, sreason = _stream(ChoiceTools(_tools(), tc, parser), text, step=2)
        assert sreason == "tool_calls"
        assert [(n, json.loads(a)) for n, a in _joined(deltas)[1]] == calls


# ------------------------------------------------------------------------------------------------ the parser
# Chat templates in the shape of the real ones: the Hermes / Qwen2.5 / Qwen3 templates list the tools in <tools> and
# ask for <tool_call> tags; the Llama 3.1-3.3 ones render calls as JSON after <|python_tag|> and results as ipython.
QWEN_STYLE = (
    "{%- if tools %}{{- '<|im_start|>system\\n# Tools\\n\\n<tools>' }}{%- for tool in tools %}{{- '\\n' }}"
    "{{- tool | tojson }}{%- endfor %}{{- '\\n</tools>\\n\\nFor each function call, return a json object with "
    'function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": '
    '<function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n\' }}{%- endif %}'
    "{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
LLAMA_STYLE = (
    "{{- bos_token }}{%- if tools %}{{- '<|start_header_id|>user<|end_header_id|>\\n\\nRespond with a JSON for a "
    'function call as {\\"name\\": function name, \\"parameters\\": dictionary of argument name and its value}.\\n\''
    " }}{%- for t in tools %}{{- t | tojson }}{%- endfor %}{{- '<|eot_id|>' }}{%- endif %}"
    "{%- for message in messages %}{%- if message.role == 'ipython' %}{{- '<|start_header_id|>ipython<|end_header_id|>"
    "\\n\\n' + message.content + '<|eot_id|>' }}{%- elif message.tool_calls is defined %}{{- '<|start_header_id|>"
    "assistant<|end_header_id|>\\n\\n<|python_tag|>' + message.tool_calls[0].function | tojson + '<|eom_id|>' }}"
    "{%- else %}{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' + message.content + '<|eot_id|>'"
    " }}{%- endif %}{%- endfor %}{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>"
    "\\n\\n' }}{%- endif %}"
)


def _render(template: str) -> str:
    tok = TextTokenizer(_Tok().tk, chat_template=template, bos_token=None, eos_token=None)
    tools = [t.model_dump(by_alias=True, exclude_none=True) for t in _tools()]
    return tok.apply_chat_template([{"role": "user", "content": "hi"}], chat_template_kwargs={"tools": tools})


def test_templates_of_each_format_render_the_tools_and_are_detected():
    assert "<tool_call>" in _render(QWEN_STYLE) and "get_weather" in _render(QWEN_STYLE)
    assert '"parameters"' in _render(LLAMA_STYLE) and "get_weather" in _render(LLAMA_STYLE)
    assert template_tool_format(QWEN_STYLE) == "hermes"
    assert template_tool_format(LLAMA_STYLE) == "llama3"
    assert resolve_tool_call_parser("auto", QWEN_STYLE) == "hermes"
    assert resolve_tool_call_parser("auto", LLAMA_STYLE) == "llama3"


def test_the_default_models_template_shows_no_tool_format():
    """SmolLM2's real chat template (from the default model's GGUF) renders no tools: auto gives hermes, and either
    parser may be chosen explicitly."""
    from gguf import GGUFReader

    from dflash_jax.checkpoints.gguf_loader import read_fields
    from dflash_jax.checkpoints.loader import default_model_path

    template = read_fields(GGUFReader(default_model_path()))["tokenizer.chat_template"]
    assert "<|im_start|>" in template
    assert template_tool_format(template) is None
    assert resolve_tool_call_parser("auto", template) == "hermes"
    assert resolve_tool_call_parser("llama3", template) == "llama3"
    assert resolve_tool_call_parser("auto", None) == "hermes"


@pytest.mark.parametrize(
    ("asked", "template", "shown"), [("llama3", QWEN_STYLE, "hermes"), ("hermes", LLAMA_STYLE, "llama3")]
)
def test_a_parser_the_template_contradicts_is_refused(asked, template, shown):
    with pytest.raises(UserError) as e:
        resolve_tool_call_parser(asked, template)
    msg = str(e.value)
    assert msg.startswith(f"--tool-call-parser {asked}: the chat template renders {shown} tool calls")
    assert f"--tool-call-parser {shown}" in msg and e.value.param == "--tool-call-parser"
    assert resolve_tool_call_parser(shown, template) == shown
    with pytest.raises(UserError, match=r"^--tool-call-parser: must be one of auto, hermes, llama3, got 'xml'"):
        resolve_tool_call_parser("xml", template)
    assert TOOL_CALL_PARSERS == ("auto", "hermes", "llama3")
