"""The OpenAI/vLLM request fields clients send, through the `openai` client against the fake-runner server over real
HTTP: `n` (sampled choices, seed + i per choice), a list of prompts, `max_completion_tokens`, `stop_token_ids`,
`min_tokens`, `chat_template_kwargs`, `--served-model-name` and `max_model_len` in /v1/models. The fake runner's
continuation of a prompt (and of a seed, when sampling) is the independent reference for every text."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from fastapi.testclient import TestClient

from dflash_jax.server.app import create_app
from dflash_jax.server.config import ServeConfig
from dflash_jax.testing.fake_runner import make_fake
from dflash_jax.testing.server import FakeServer
from dflash_jax.types import SamplingParams

MODEL = "my-served"
MAX_MODEL_LEN = 2048
RUNNER, TOK = make_fake(max_model_len=MAX_MODEL_LEN)  # the server's script: the expected outputs
EOS = TOK.im_end_id


@pytest.fixture(scope="module")
def server():
    args = ["--served-model-name", MODEL, "--max-num-seqs", "4", "--max-queued-requests", "16"]
    args += ["--max-model-len", str(MAX_MODEL_LEN), "--step-delay", "0.001", "--gamma", "4", "--seed", "7"]
    with FakeServer(*args) as srv:
        yield srv


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=30) as c:
        yield c


def cont(ids: list[int], n: int, seed: int | None = None) -> list[int]:
    """The fake runner's first n tokens for a prompt: greedy without a seed, else sampled with that seed."""
    sp = None if seed is None else SamplingParams(temperature=0.8, seed=seed)
    return RUNNER.continuation(ids, n, sp)


def chat_ids(messages, **kwargs) -> list[int]:
    text = TOK.apply_chat_template(messages, add_generation_prompt=True, chat_template_kwargs=kwargs or None)
    return TOK.encode(text, add_special_tokens=False)


IGNORE_EOS = {"ignore_eos": True, "return_token_ids": True}


# ----------------------------------------------------------------------------------------------------- n


def test_n_choices_sample_with_seed_plus_index(oai):
    p = "sample several"
    r = oai.completions.create(
        model=MODEL, prompt=p, n=3, seed=77, temperature=0.8, max_tokens=12, extra_body=IGNORE_EOS
    )
    assert [c.index for c in r.choices] == [0, 1, 2]
    ids = TOK.encode(p)
    for i, c in enumerate(r.choices):
        assert c.model_extra["token_ids"] == cont(ids, 12, seed=77 + i)
        assert c.text == TOK.decode(cont(ids, 12, seed=77 + i)) and c.finish_reason == "length"
        one = oai.completions.create(
            model=MODEL, prompt=p, seed=77 + i, temperature=0.8, max_tokens=12, extra_body=IGNORE_EOS
        )
        assert one.choices[0].text == c.text
    assert len({c.text for c in r.choices}) >= 2  # distinct streams
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 36
    again = oai.completions.create(
        model=MODEL, prompt=p, n=3, seed=77, temperature=0.8, max_tokens=12, extra_body=IGNORE_EOS
    )
    assert [c.text for c in again.choices] == [c.text for c in r.choices]


def test_n_without_seed_gives_different_choices_and_requests(oai):
    texts = [
        c.text
        for c in oai.completions.create(
            model=MODEL, prompt="unseeded", n=4, max_tokens=10, extra_body={"ignore_eos": True}
        ).choices
    ]
    assert len(set(texts)) >= 2
    singles = {
        oai.completions.create(model=MODEL, prompt="unseeded", max_tokens=10, extra_body={"ignore_eos": True})
        .choices[0]
        .text
        for _ in range(4)
    }
    assert len(singles) >= 2  # a sampled request without a seed is not pinned to one stream


def test_n_greater_than_1_at_temperature_0_gives_identical_greedy_choices(oai, http):
    p = "greedy copies"
    r = oai.completions.create(model=MODEL, prompt=p, n=3, temperature=0, max_tokens=9, extra_body=IGNORE_EOS)
    want = cont(TOK.encode(p), 9)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.model_extra["token_ids"] for c in r.choices] == [want] * 3
    assert {c.text for c in r.choices} == {TOK.decode(want)} and r.usage.completion_tokens == 27
    messages = [{"role": "user", "content": "copies"}]
    kw = dict(model=MODEL, messages=messages, n=2, temperature=0, max_completion_tokens=7)
    chat = oai.chat.completions.create(**kw, extra_body={"ignore_eos": True})
    text = TOK.decode(cont(chat_ids(messages), 7))
    assert [c.message.content for c in chat.choices] == [text, text]
    streamed: dict[int, str] = {0: "", 1: ""}
    for ch in oai.chat.completions.create(**kw, stream=True, extra_body={"ignore_eos": True}):
        for c in ch.choices:
            streamed[c.index] += c.delta.content or ""
    assert streamed == {0: text, 1: text}
    for bad in (0, 129, "2", 2.5):
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "n": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text


def test_chat_n_streamed_equals_non_streamed_per_index(oai):
    messages = [{"role": "user", "content": "tell me things"}]
    kw = dict(model=MODEL, messages=messages, n=3, seed=5, temperature=0.8, max_completion_tokens=20)
    r = oai.chat.completions.create(**kw)
    ids = chat_ids(messages)
    for i, c in enumerate(r.choices):
        want = cont(ids, 20, seed=5 + i)
        want = want[: want.index(EOS)] if EOS in want else want
        assert c.index == i and c.message.content == TOK.decode(want)
    chunks = list(oai.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    roles = [ch.choices[0].index for ch in chunks if ch.choices and ch.choices[0].delta.role == "assistant"]
    assert sorted(roles) == [0, 1, 2]
    text: dict[int, str] = {0: "", 1: "", 2: ""}
    finish: dict[int, str] = {}
    for ch in chunks:
        for c in ch.choices:
            text[c.index] += c.delta.content or ""
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    assert text == {c.index: c.message.content for c in r.choices}
    assert finish == {c.index: c.finish_reason for c in r.choices}
    assert chunks[-1].choices == [] and chunks[-1].usage.prompt_tokens == len(ids)
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens


# -------------------------------------------------------------------------------------------- prompt lists


def test_a_list_of_prompts_answers_choices_in_order(oai):
    prompts = ["Hello", "Köln und Grüße", "x"]
    r = oai.completions.create(
        model=MODEL, prompt=prompts, n=2, seed=3, temperature=0.8, max_tokens=8, extra_body=IGNORE_EOS
    )
    assert [c.index for c in r.choices] == list(range(6))
    for c in r.choices:
        p, i = divmod(c.index, 2)
        ids = TOK.encode(prompts[p])
        assert c.model_extra["prompt_token_ids"] == ids
        assert c.model_extra["token_ids"] == cont(ids, 8, seed=3 + i)
    assert r.usage.prompt_tokens == sum(len(TOK.encode(p)) for p in prompts)
    assert r.usage.completion_tokens == 6 * 8
    token_prompts = [TOK.encode("alpha"), TOK.encode("beta gamma")]
    g = oai.completions.create(model=MODEL, prompt=token_prompts, temperature=0, max_tokens=9, extra_body=IGNORE_EOS)
    assert [c.model_extra["token_ids"] for c in g.choices] == [cont(ids, 9) for ids in token_prompts]
    streamed: dict[int, str] = {}
    for ch in oai.completions.create(model=MODEL, prompt=prompts, temperature=0, max_tokens=8, stream=True):
        for c in ch.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
    assert streamed == {
        k: oai.completions.create(model=MODEL, prompt=p, temperature=0, max_tokens=8).choices[0].text
        for k, p in enumerate(prompts)
    }


def test_prompt_list_errors_name_the_prompt(http):
    cases = [
        ({"prompt": []}, "prompt"),
        ({"prompt": ["ok", ""]}, "prompt[1]"),
        ({"prompt": [[1, 2], [3, 10**6]]}, "prompt[1]"),
        ({"prompt": ["a", 5]}, "prompt*"),  # a list mixing texts and ids fits no branch of the union
        ({"prompt": ["ok"] * 30, "n": 1}, "prompt"),  # 30 choices > 4 slots + 16 queued
        ({"prompt": "ok", "n": 21, "temperature": 1.0}, "n"),
    ]
    for extra, param in cases:
        r = http.post("/v1/completions", json={"model": MODEL, "max_tokens": 3, **extra})
        assert r.status_code == 400, (extra, r.text)
        got = r.json()["error"]["param"]
        assert got == param or (param.endswith("*") and got.startswith(param[:-1])), (extra, r.json())


def test_prompts_of_one_request_are_prefilled_before_the_first_step():
    """Batched by the engine: all choices are submitted together, so they share the first step."""
    runner, tok = make_fake(max_slots=4, max_model_len=128)
    with TestClient(create_app(runner, tok, ServeConfig(max_num_seqs=4), model_name="m")) as c:
        body = {"model": "m", "prompt": ["one", "two", "three"], "n": 1, "max_tokens": 5, "temperature": 0}
        r = c.post("/v1/completions", json={**body, "ignore_eos": True})
        assert r.status_code == 200 and len(r.json()["choices"]) == 3
    assert runner.num_adds == 3 and runner.add_log == [[0, 1, 2]] and runner.step_log[0][0] == [0, 1, 2]


def test_max_num_batched_tokens_splits_the_prefill_and_metrics_count_each_batch():
    runner, tok = make_fake(max_slots=4, max_model_len=128)
    prompts = [[5 + i] * 6 for i in range(3)]  # 6 tokens each: 12 fit in a budget of 13, 18 do not
    cfg = ServeConfig(max_num_seqs=4, max_num_batched_tokens=13)
    with TestClient(create_app(runner, tok, cfg, model_name="m")) as c:
        body = {"model": "m", "prompt": prompts, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
        r = c.post("/v1/completions", json=body)
        assert r.status_code == 200 and len(r.json()["choices"]) == 3
        text = c.get("/metrics").text
    assert [len(b) for b in runner.add_log] == [2, 1]
    assert "dflash:engine_prefill_seconds_count 2.0" in text
    assert 'dflash:engine_prefill_batch_size_bucket{le="1.0"} 1.0' in text
    assert 'dflash:engine_prefill_batch_size_bucket{le="2.0"} 2.0' in text
    assert "dflash:engine_prefill_batch_size_sum 3.0" in text


# ------------------------------------------------------------------------------ lengths and stop conditions


def test_max_completion_tokens_is_max_tokens(oai):
    messages = [{"role": "user", "content": "count"}]
    a = oai.chat.completions.create(
        model=MODEL, messages=messages, max_completion_tokens=7, temperature=0, extra_body={"ignore_eos": True}
    )
    assert a.usage.completion_tokens == 7 and a.choices[0].finish_reason == "length"
    b = oai.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=7, temperature=0, extra_body={"ignore_eos": True}
    )
    assert b.choices[0].message.content == a.choices[0].message.content
    for both in (8, 7):  # the same setting twice is refused, as the schema states (`not` both given)
        with pytest.raises(openai.BadRequestError) as e:
            oai.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=7, max_tokens=both)
        assert e.value.body["param"] == "max_completion_tokens"
    r = oai.chat.completions.create(
        model=MODEL, messages=messages, max_completion_tokens=7, temperature=0, extra_body={"max_tokens": None}
    )
    assert r.usage.completion_tokens <= 7


def test_stop_token_ids_end_the_choice_and_stay_in_token_ids(oai):
    p = "stop on a token"
    ids = TOK.encode(p)
    ref = cont(ids, 80)
    k = next(i for i in range(4, 80) if ref[i] not in ref[:i] and ref[i] != EOS)
    r = oai.completions.create(
        model=MODEL,
        prompt=p,
        max_tokens=80,
        temperature=0,
        extra_body={"stop_token_ids": [ref[k], TOK.vocab_size - 1], **IGNORE_EOS},
    )
    c = r.choices[0]
    assert c.model_extra["token_ids"] == ref[: k + 1] and c.finish_reason == "stop"
    assert c.text == TOK.decode(ref[:k]) and r.usage.completion_tokens == k + 1
    streamed = oai.completions.create(
        model=MODEL, prompt=p, max_tokens=80, temperature=0, stream=True, extra_body={"stop_token_ids": [ref[k]]}
    )
    assert "".join(ch.choices[0].text for ch in streamed if ch.choices) == c.text
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model=MODEL, prompt=p, extra_body={"stop_token_ids": [TOK.vocab_size]})
    assert e.value.body["param"].startswith("stop_token_ids")


def _early_eos_prompt() -> tuple[str, list[int], int]:
    for i in range(2000):
        p = f"eos probe {i}"
        ref = cont(TOK.encode(p), 40)
        if EOS in ref[2:25]:
            return p, ref, ref.index(EOS)
    raise AssertionError("no prompt with an early EOS in the fake script")


def test_min_tokens_keeps_generating_past_an_early_eos(oai, http):
    p, ref, e = _early_eos_prompt()
    ids = TOK.encode(p)
    plain = oai.completions.create(
        model=MODEL, prompt=p, max_tokens=40, temperature=0, extra_body={"return_token_ids": True}
    )
    assert plain.choices[0].model_extra["token_ids"] == ref[: e + 1] and plain.choices[0].finish_reason == "stop"
    m = e + 6
    r = oai.completions.create(
        model=MODEL,
        prompt=p,
        max_tokens=m + 3,
        temperature=0,
        extra_body={"min_tokens": m, "return_token_ids": True},
    )
    c = r.choices[0]
    want = cont(ids, m + 3)  # the script wraps around after its EOS; the next EOS is a whole script later
    assert EOS not in want[e + 1 :]
    assert c.model_extra["token_ids"] == want and c.finish_reason == "length"
    assert c.text == TOK.decode(want)  # the deferred EOS is a special token: no text
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": p, "max_tokens": 5, "min_tokens": 6})
    assert r.status_code == 400 and r.json()["error"]["param"] == "min_tokens"
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": p, "min_tokens": -1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "min_tokens"


# ------------------------------------------------------------------------- chat template, models, refusals


def test_chat_template_kwargs_reach_the_template(oai, http):
    messages = [{"role": "user", "content": "think?"}]
    r = oai.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=10,
        temperature=0,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}, "return_token_ids": True},
    )
    with_block = chat_ids(messages, enable_thinking=False)
    assert with_block != chat_ids(messages)
    assert r.choices[0].model_extra["prompt_token_ids"] == with_block
    want = cont(with_block, 10)
    want = want[: want.index(EOS)] if EOS in want else want
    assert r.choices[0].message.content == TOK.decode(want)
    t = http.post("/tokenize", json={"messages": messages, "chat_template_kwargs": {"enable_thinking": False}})
    assert t.json()["tokens"] == with_block
    for path, body in (
        ("/v1/chat/completions", {"model": MODEL, "messages": messages}),
        ("/tokenize", {"messages": messages}),
    ):
        r = http.post(path, json={**body, "chat_template_kwargs": {"add_generation_prompt": False}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs", r.text


def test_served_model_name_and_max_model_len(oai):
    models = oai.models.list().data
    assert [m.id for m in models] == [MODEL] and models[0].model_extra["max_model_len"] == MAX_MODEL_LEN
    r = oai.completions.create(model=MODEL, prompt="hi", max_tokens=2)
    assert r.model == MODEL
    with pytest.raises(openai.NotFoundError) as e:
        oai.completions.create(model="some-other-model", prompt="hi", max_tokens=2)
    assert e.value.body["param"] == "model" and MODEL in e.value.body["message"]


@pytest.mark.parametrize(
    "extra,param",
    [
        ({"presence_penalty": 0.5}, "presence_penalty"),
        ({"frequency_penalty": -1.0}, "frequency_penalty"),
        ({"logit_bias": {"5": 1.0}}, "logit_bias"),
        ({"best_of": 2}, "best_of"),
        ({"suffix": "tail"}, "suffix"),
        ({"response_format": {"type": "xml"}}, "response_format"),
    ],
)
def test_what_stays_unsupported_is_a_400_naming_the_field(http, extra, param):
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2, **extra})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


@pytest.mark.parametrize(
    "extra,param",
    [
        # two constraints at once: the second one named
        ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
        ({"response_format": {"type": "json_object"}, "guided_json": {}}, "guided_json"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
        ({"structured_outputs": {}}, "structured_outputs"),
        ({"tools": [TOOL], "tool_choice": "required", "guided_regex": "a"}, "tool_choice"),
        # tools
        ({"tool_choice": "auto"}, "tool_choice"),
        ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
        ({"tools": [TOOL, TOOL]}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools[0].function.name"),
        ({"tools": []}, "tools"),
        ({"guided_choice": []}, "guided_choice"),
        # messages
        ({"messages": [{"role": "tool", "content": "r"}]}, "messages"),
        ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "messages"),
        (
            {
                "messages": [
                    {
                        "role": "assistant",
                        "tool_calls": [{"id": "1", "type": "function", "function": {"name": "f", "arguments": "{"}}],
                    }
                ]
            },
            "messages[0].tool_calls[0].function.arguments",
        ),
        # the fake runner has no grammar support: a valid constraint names its field
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"guided_regex": "[a-z]+"}, "guided_regex"),
        ({"tools": [TOOL], "tool_choice": "required"}, "tool_choice"),
    ],
)
def test_constraint_and_tool_fields_are_checked(http, extra, param):
    r = http.post("/v1/chat/completions", json={**CHAT, **extra})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"].startswith(param), r.text


def test_tools_and_tool_messages_render_and_auto_is_plain_text(http):
    history = [
        {"role": "user", "content": "x"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "done"},
    ]
    for choice in (None, "auto", "none"):
        body = {**CHAT, "messages": history, "tools": [TOOL]} | ({} if choice is None else {"tool_choice": choice})
        r = http.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        c = r.json()["choices"][0]
        assert c["finish_reason"] in ("stop", "length") and isinstance(c["message"]["content"], str)


def test_openapi_describes_the_fields():
    runner, tok = make_fake(max_slots=2, max_model_len=64)
    spec = create_app(runner, tok, ServeConfig(max_num_seqs=2), model_name="m").openapi()
    schemas = spec["components"]["schemas"]
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        props = schemas[name]["properties"]
        assert {"n", "stop_token_ids", "min_tokens", "ignore_eos", "max_tokens"} <= set(props), name
        n = next(b for b in props["n"]["anyOf"] if b.get("type") == "integer")
        assert n["minimum"] == 1 and n["maximum"] == 128
    chat = schemas["ChatCompletionRequest"]["properties"]
    assert {"max_completion_tokens", "chat_template_kwargs"} <= set(chat)
    assert "chat_template_kwargs" in schemas["TokenizeRequest"]["properties"]
    prompt = json.dumps(schemas["CompletionRequest"]["properties"]["prompt"])
    assert '"array"' in prompt
    assert {"tools", "tool_choice", "parallel_tool_calls", "response_format", "guided_json"} <= set(chat)
    formats = json.dumps(chat["response_format"])
    assert all(t in formats for t in ("ResponseFormatText", "ResponseFormatJsonObject", "ResponseFormatJsonSchema"))
    assert schemas["StructuredOutputs"]["maxProperties"] == 1
    assert "At most one of" in json.dumps(chat["guided_regex"])  # the constraints exclude each other
    rules = json.dumps(schemas["ChatCompletionRequest"]["allOf"])
    assert '"tool_choice"' in rules and '"tools"' in rules  # tool_choice needs tools
