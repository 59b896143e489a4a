"""The real server (uvicorn subprocess, fake runner) over HTTP: OpenAI client, SSE, metrics, errors, fuzz."""

from __future__ import annotations

import asyncio
import json
import socket

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from dflash_jax.testing.fake_runner import make_fake
from dflash_jax.testing.server import FakeServer
from dflash_jax.testing.waits import wait_until

KEY = "sk-test-key"
MODEL = "fake-model"
MAX_MODEL_LEN = 4096
AUTH = {"Authorization": f"Bearer {KEY}"}

RUNNER, TOK = make_fake(max_model_len=MAX_MODEL_LEN)  # same script as the server's: the expected outputs


@pytest.fixture(scope="module")
def server():
    with FakeServer(
        "--api-key",
        KEY,
        "--max-num-seqs",
        "4",
        "--max-queued-requests",
        "16",
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--step-delay",
        "0.002",
        "--max-request-bytes",
        "262144",
        "--gamma",
        "4",
        "--acceptance",
        "0.7",
    ) as srv:
        yield srv


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=30) as c:
        yield c


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)


def expected_text(prompt_ids: list[int], n: int) -> tuple[str, list[int]]:
    toks = RUNNER.continuation(prompt_ids, n)
    eos = [i for i, t in enumerate(toks) if t in TOK.eos_token_ids]
    if eos:
        toks = toks[: eos[0] + 1]
        return TOK.decode(toks[:-1]), toks
    return TOK.decode(toks), toks


def chat_ids(messages) -> list[int]:
    return TOK.encode(TOK.apply_chat_template(messages, add_generation_prompt=True), add_special_tokens=False)


def scrape(http) -> dict[tuple[str, tuple], float]:
    text = http.get("/metrics").text
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def metric(m, name, **labels) -> float:
    return m.get((name, tuple(sorted(labels.items()))), 0.0)


def sse_events(raw: str) -> list[object]:
    """Parse an SSE body: every `data:` payload must be JSON except the final [DONE]."""
    payloads = [line[len("data: ") :] for line in raw.split("\n") if line.startswith("data: ")]
    assert payloads and payloads[-1] == "[DONE]", raw[-300:]
    assert raw.endswith("data: [DONE]\n\n")
    return [json.loads(p) for p in payloads[:-1]]


# ------------------------------------------------------------------------------------- openai client


PROMPTS = ["Hello", "Tell me about rockets", "Köln und Grüße", "x", "What is 2+2?"]


@pytest.mark.parametrize("prompt", PROMPTS)
def test_openai_completions_stream_equals_non_stream_and_expected(oai, prompt):
    ids = TOK.encode(prompt)
    want, want_toks = expected_text(ids, 40)
    r = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=0)
    c = r.choices[0]
    assert c.text == want
    assert c.finish_reason == ("stop" if want_toks[-1] in TOK.eos_token_ids else "length")
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == len(want_toks)
    assert r.usage.total_tokens == len(ids) + len(want_toks)
    spec = r.model_extra["metrics"]["speculative_decoding"]
    assert spec["num_drafts"] >= 1 and 1 <= spec["mean_acceptance_length"] <= 4

    chunks = list(
        oai.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=40,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert text == c.text
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == c.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    assert all(ch.usage is None for ch in chunks[:-1])


@pytest.mark.parametrize("content", ["Hi there", "你好，世界", "Emoji 🚀 please"])
def test_openai_chat_stream_equals_non_stream_and_utf8_intact(oai, content):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": content}]
    want, want_toks = expected_text(chat_ids(messages), 60)
    r = oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=60, temperature=0)
    msg = r.choices[0].message
    assert msg.role == "assistant" and msg.content == want
    assert r.usage.prompt_tokens == len(chat_ids(messages))
    stream = oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=60, temperature=0, stream=True)
    chunks = list(stream)
    deltas = [ch.choices[0].delta.content or "" for ch in chunks]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(deltas) == msg.content
    assert chunks[-1].choices[0].finish_reason == r.choices[0].finish_reason
    # a delta never carries half a character (the final one may end in U+FFFD only if cut by max_tokens)
    assert all("\ufffd" not in d for d in deltas[:-1])


def test_multibyte_text_survives_streaming(http):
    # find prompts whose continuation is rich in multi-byte characters and check byte-exact streaming
    checked = 0
    for i in range(40):
        p = f"utf8 probe {i}"
        want, toks = expected_text(TOK.encode(p), 30)
        if sum(ord(ch) > 127 for ch in want) < 4 or "\ufffd" in want:
            continue
        body = {"model": MODEL, "prompt": p, "max_tokens": 30, "temperature": 0, "stream": True}
        r = http.post("/v1/completions", json=body)
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r.content.decode("utf-8"))
        assert "".join(e["choices"][0]["text"] for e in events) == want
        checked += 1
        if checked == 3:
            break
    assert checked == 3


def test_raw_sse_shape_and_usage_only_when_asked(http):
    base = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hey"}],
        "max_tokens": 12,
        "stream": True,
        "temperature": 0,
    }
    ev = sse_events(http.post("/v1/chat/completions", json=base).text)
    assert all(e["object"] == "chat.completion.chunk" and "usage" not in e for e in ev)
    assert len({e["id"] for e in ev}) == 1 and ev[0]["id"].startswith("chatcmpl-")
    ev = sse_events(http.post("/v1/chat/completions", json={**base, "stream_options": {"include_usage": True}}).text)
    assert all(e["usage"] is None for e in ev[:-1])
    assert ev[-1]["choices"] == [] and ev[-1]["usage"]["completion_tokens"] >= 1


def test_concurrent_requests_each_get_their_own_output(server):
    prompts = [f"concurrent {i} 🚀" for i in range(10)]

    async def one(client, p):
        r = await client.post("/v1/completions", json={"model": MODEL, "prompt": p, "max_tokens": 25, "temperature": 0})
        return r.json()["choices"][0]["text"]

    async def main():
        async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=30) as c:
            return await asyncio.gather(*[one(c, p) for p in prompts])

    texts = asyncio.run(main())
    assert texts == [expected_text(TOK.encode(p), 25)[0] for p in prompts]


def test_stop_strings_and_ignore_eos_over_http(http):
    p = "stop test"
    full, _ = expected_text(TOK.encode(p), 50)
    stop = full[20:24]
    r = http.post(
        "/v1/completions",
        json={
            "model": MODEL,
            "prompt": p,
            "max_tokens": 50,
            "temperature": 0,
            "stop": [stop, "zzzz-not-there"],
        },
    ).json()
    assert r["choices"][0]["text"] == full[: full.find(stop)]
    assert r["choices"][0]["finish_reason"] == "stop"
    ev = sse_events(
        http.post(
            "/v1/completions",
            json={
                "model": MODEL,
                "prompt": p,
                "max_tokens": 50,
                "temperature": 0,
                "stop": stop,
                "stream": True,
            },
        ).text
    )
    assert "".join(e["choices"][0]["text"] for e in ev) == r["choices"][0]["text"]


def test_seed_makes_sampling_reproducible(http):
    body = {"model": MODEL, "prompt": "sample", "max_tokens": 15, "temperature": 0.9, "seed": 1234}
    a = http.post("/v1/completions", json=body).json()["choices"][0]["text"]
    b = http.post("/v1/completions", json=body).json()["choices"][0]["text"]
    assert a == b


# ------------------------------------------------------------------------------ models, tokenize, metrics


def test_models_tokenize_detokenize(http):
    m = http.get("/v1/models").json()
    assert m["object"] == "list" and m["data"][0]["id"] == MODEL and m["data"][0]["max_model_len"] == MAX_MODEL_LEN
    t = http.post("/tokenize", json={"prompt": "Grüße 🚀"}).json()
    assert t["tokens"] == TOK.encode("Grüße 🚀") and t["count"] == len(t["tokens"])
    assert http.post("/detokenize", json={"tokens": t["tokens"]}).json()["prompt"] == "Grüße 🚀"
    msgs = [{"role": "user", "content": "hi"}]
    assert http.post("/tokenize", json={"messages": msgs}).json()["tokens"] == chat_ids(msgs)
    r = http.post("/detokenize", json={"tokens": [TOK.vocab_size]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"


def test_metrics_match_per_request_usage_and_spec_stats(http):
    before = scrape(http)
    usages, specs = [], []
    for i in range(6):
        body = {"model": MODEL, "prompt": f"metrics {i}", "max_tokens": 10 + 7 * i, "temperature": 0}
        if i % 2:
            ev = sse_events(
                http.post(
                    "/v1/completions",
                    json={**body, "stream": True, "stream_options": {"include_usage": True}},
                ).text
            )
            usages.append(ev[-1]["usage"])
            specs.append(next(e for e in ev if e.get("metrics"))["metrics"]["speculative_decoding"])
        else:
            r = http.post("/v1/completions", json=body).json()
            usages.append(r["usage"])
            specs.append(r["metrics"]["speculative_decoding"])
    after = scrape(http)

    def d(name, **labels):
        return metric(after, name, **labels) - metric(before, name, **labels)

    assert d("dflash:generation_tokens_total") == sum(u["completion_tokens"] for u in usages)
    assert d("dflash:prompt_tokens_total") == sum(u["prompt_tokens"] for u in usages)
    assert sum(d("dflash:request_success_total", finished_reason=r) for r in ("stop", "length")) == 6
    assert d("dflash:time_to_first_token_seconds_count") == 6
    assert d("dflash:spec_decode_num_drafts_total") == sum(s["num_drafts"] for s in specs) > 0
    assert d("dflash:spec_decode_num_draft_tokens_total") == sum(s["num_draft_tokens"] for s in specs)
    assert d("dflash:spec_decode_num_accepted_tokens_total") == sum(s["num_accepted_tokens"] for s in specs)
    for pos in range(3):
        assert d("dflash:spec_decode_num_accepted_tokens_per_pos_total", position=str(pos)) == sum(
            s["accepted_per_position"][pos] for s in specs
        )
    mal = metric(after, "dflash:spec_decode_mean_acceptance_length")
    assert 1.0 <= mal <= 4.0
    assert metric(after, "dflash:num_requests_running") == 0 and metric(after, "dflash:spec_decode_enabled") == 1
    for name in ("dflash:kv_cache_usage_perc", "dflash:kv_pages_total", "dflash:kv_pages_used"):
        assert (name, ()) in after, name  # a number with the runner's page pool, NaN without one
    used, total = after[("dflash:kv_pages_used", ())], after[("dflash:kv_pages_total", ())]
    assert used != used or 0 <= used <= total  # NaN != NaN


# ----------------------------------------------------------------------------------------- bad input

LONG = "The quick brown fox jumps. " * 1000  # > 4096 tokens

BAD = [
    # (endpoint, body, status, param, code)
    ("/v1/completions", {"model": MODEL, "prompt": 5}, 400, "prompt", None),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": "10"}, 400, "max_tokens", None),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 1.5}, 400, "max_tokens", None),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "temperature": "hot"}, 400, "temperature", None),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "stream": "yes"}, 400, "stream", None),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "foo": 1}, 400, "foo", None),
    (
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": "x", "bar": 2}]},
        400,
        "messages[0].bar",
        None,
    ),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": -1}, 400, "max_tokens", None),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 0}, 400, "max_tokens", None),
    (
        "/v1/completions",
        {"model": MODEL, "prompt": "x", "max_tokens": 10**30},
        400,
        "prompt",
        "context_length_exceeded",
    ),
    (
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 10**6},
        400,
        "messages",
        "context_length_exceeded",
    ),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "temperature": -0.1}, 400, "temperature", None),
    (
        "/v1/completions",
        '{"model": "fake-model", "prompt": "x", "temperature": 1e999}',
        400,
        "temperature",
        None,
    ),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "top_p": 0}, 400, "top_p", None),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "top_p": 1.5}, 400, "top_p", None),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "top_k": -7}, 400, "top_k", None),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "n": 2.5}, 400, "n", None),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "seed": 2**70}, 400, "seed", None),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "stop": [""]}, 400, "stop", None),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "stop": ["a"] * 17}, 400, "stop", None),
    (
        "/v1/completions",
        {"model": MODEL, "prompt": "x", "stream_options": {"include_usage": True}},
        400,
        "stream_options",
        None,
    ),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "logprobs": 21}, 400, "logprobs", None),
    ("/v1/completions", {"model": MODEL, "prompt": ["a", ""]}, 400, "prompt[1]", None),
    ("/v1/completions", {"model": MODEL, "prompt": [1, 2, 10**6]}, 400, "prompt", None),
    ("/v1/completions", {"model": MODEL, "prompt": ""}, 400, "prompt", None),
    ("/v1/completions", {"model": MODEL, "prompt": LONG}, 400, "prompt", "context_length_exceeded"),
    (
        "/v1/completions",
        {"model": MODEL, "prompt": LONG, "max_tokens": 5},
        400,
        "prompt",
        "context_length_exceeded",
    ),
    ("/v1/completions", {"prompt": "x"}, 400, "model", None),
    ("/v1/completions", {"model": "gpt-5", "prompt": "x"}, 404, "model", "model_not_found"),
    ("/v1/chat/completions", {"model": MODEL, "messages": []}, 400, "messages", None),
    ("/v1/chat/completions", {"model": MODEL, "messages": "hello"}, 400, "messages", None),
    (
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "robot", "content": "x"}]},
        400,
        "messages[0].role",
        None,
    ),
    (
        "/v1/chat/completions",
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}],
        },
        400,
        "messages[0].content[0]",
        None,
    ),
    (
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
        400,
        "top_logprobs",
        None,
    ),
    (
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": LONG}]},
        400,
        "messages",
        "context_length_exceeded",
    ),
]


@pytest.mark.parametrize("endpoint,body,status,param,code", BAD, ids=[f"{i}" for i in range(len(BAD))])
def test_bad_requests_get_openai_errors(http, endpoint, body, status, param, code):
    raw = body if isinstance(body, str) else json.dumps(body)
    r = http.post(endpoint, content=raw, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert err["param"] is not None and err["param"].startswith(param), err
    if code is not None:
        assert err["code"] == code
    if code == "context_length_exceeded":
        assert f"maximum context length is {MAX_MODEL_LEN} tokens" in err["message"]
    if param == "foo":
        assert "foo" in err["message"]


@pytest.mark.parametrize(
    "raw",
    [
        b'{"model": ',
        b"[1, 2]",
        b"null",
        b"\xff\xfe",
        b"",
        b'{"model": "fake-model", "prompt": "x", "temperature": NaN}',
    ],
)
def test_malformed_json_is_400(http, raw):
    r = http.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


# Bodies drawn by the fuzz tests below: an unknown field whose name is also a name pydantic gives a union member
# in error locations ("str", "float", "null") or contains "[" is an unknown field like any other, not an error
# about the body as a whole.
FUZZ_FOUND = [
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2, "str": None}, "str"),
    (
        "/v1/completions",
        {"model": MODEL, "max_tokens": 4, "prompt": [22, 7, 4, 32, 221, 96], "top_p": 0.4, "float": [270891, 0.0]},
        "float",
    ),
    (
        "/v1/chat/completions",
        {"model": MODEL, "max_tokens": 3, "messages": [{"role": "assistant", "content": "Q\u00c2!\u0019"}], "null": {}},
        "null",
    ),
    (
        "/v1/chat/completions",
        {
            "model": MODEL,
            "max_tokens": 7,
            "messages": [{"role": "assistant", "content": [{"text": "\u00df", "type": "text"}]}],
            "n\u0007[\u00cc\u00eaW\u0087]": [{}, [None, None]],
        },
        "n\u0007[\u00cc\u00eaW\u0087]",
    ),
    (
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "text", "text": "x", "list[int]": 1}]}]},
        "messages[0].content[0].list[int]",
    ),
]


@pytest.mark.parametrize("endpoint,body,param", FUZZ_FOUND, ids=[f"{i}" for i in range(len(FUZZ_FOUND))])
def test_unknown_field_named_like_a_type_is_named(http, endpoint, body, param):
    r = http.post(endpoint, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"] == f"Unrecognized request argument supplied: {param}", err


def test_union_member_name_as_a_key_of_a_bad_value_names_the_field(http):
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": {"str": 1}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text


@pytest.mark.parametrize(
    "raw,what",
    [(b"", "an empty body"), (b"null", "null"), (b"[1, 2]", "an array"), (b'"x"', "a string"), (b"3", "a number")],
)
def test_non_object_body_says_what_it_got(http, raw, what):
    r = http.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert r.json()["error"] == {
        "message": f"The request body must be a JSON object, got {what}.",
        "type": "invalid_request_error",
        "param": None,
        "code": "invalid_type",
    }


def test_oversize_body_is_413(http):
    body = json.dumps({"model": MODEL, "prompt": "x" * 300_000}).encode()
    r = http.post("/v1/completions", content=body)
    assert r.status_code == 413 and "262144" in r.json()["error"]["message"]


def test_auth_required_but_not_on_health_and_metrics(server):
    with httpx.Client(base_url=server.url, timeout=10) as c:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
            r = c.post("/v1/completions", json={"model": MODEL, "prompt": "x"}, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
            assert c.get("/v1/models", headers=headers).status_code == 401
        assert c.get("/health").status_code == 200
        assert c.get("/metrics").status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0).models.list()


def test_unknown_route_and_method_are_openai_errors(http):
    r = http.get("/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()
    r = http.get("/v1/completions")
    assert r.status_code == 405 and "error" in r.json()


def _error_ok(r: httpx.Response) -> None:
    assert r.status_code < 500, (r.status_code, r.text[:500])
    if r.status_code >= 400:
        err = r.json()["error"]
        assert isinstance(err["message"], str) and "type" in err and "param" in err and "code" in err
        assert err["param"], err  # a JSON body that parsed: the error names the parameter
    elif r.headers["content-type"].startswith("text/event-stream"):
        sse_events(r.text)
    else:
        assert r.json()["choices"]


_scalar = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=12),
)
_json = st.recursive(
    _scalar,
    lambda c: st.one_of(st.lists(c, max_size=3), st.dictionaries(st.text(max_size=6), c, max_size=3)),
    max_leaves=6,
)
_VALID = {  # valid values; the fuzz then breaks at most one field (or adds an unknown one)
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.01, 1),
    "top_k": st.integers(-1, 400),
    "stop": st.one_of(st.text(min_size=1, max_size=4), st.lists(st.text(min_size=1, max_size=4), max_size=4)),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "seed": st.integers(0, 2**63 - 1),
    "n": st.just(1),
    "ignore_eos": st.booleans(),
    "presence_penalty": st.just(0.0),
    "user": st.text(max_size=8),
}
_INVALID = {  # values that are wrong for the field but plausible from a buggy client
    "max_tokens": st.one_of(st.integers(-3, 0), st.integers(10**4, 10**25), _json),
    "temperature": st.one_of(st.floats(-5, -0.001), st.floats(2.001, 1e6), _json),
    "top_p": st.one_of(st.floats(-1, 0), st.floats(1.0001, 10), _json),
    "top_k": st.one_of(st.integers(-(2**40), -2), _json),
    "stop": st.one_of(st.just(""), st.lists(st.text(max_size=3), min_size=17, max_size=20), _json),
    "seed": st.one_of(st.integers(2**63, 2**80), _json),
    "n": st.one_of(st.integers(2, 5), st.integers(-3, 0), _json),
    "model": st.one_of(st.text(max_size=10), _json),
}
_message = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["system", "user", "assistant", "developer"]),
        "content": st.one_of(
            st.text(max_size=20),
            st.lists(
                st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=8)}),
                min_size=1,
                max_size=2,
            ),
        ),
    },
)
_bad_message = st.fixed_dictionaries(
    {"role": st.sampled_from(["tool", "robot", "user"])},
    optional={
        "content": st.one_of(
            st.lists(st.fixed_dictionaries({"type": st.sampled_from(["image", "text"])}), max_size=2), _json
        ),
        "extra": _json,
    },
)


@st.composite
def _request(draw, chat: bool) -> dict:
    body = {"model": MODEL, "max_tokens": draw(st.integers(1, 12))}
    if chat:
        body["messages"] = draw(st.lists(_message, min_size=1, max_size=3))
    else:
        body["prompt"] = draw(
            st.one_of(st.text(max_size=30), st.lists(st.integers(0, TOK.vocab_size - 1), min_size=1, max_size=8))
        )
    for key in draw(st.lists(st.sampled_from(sorted(_VALID)), unique=True, max_size=6)):
        body[key] = draw(_VALID[key])
    mutation = draw(st.sampled_from(["none", "none", "field", "unknown", "drop", "messages"]))
    if mutation == "field":
        key = draw(st.sampled_from(sorted(_INVALID)))
        body[key] = draw(_INVALID[key])
    elif mutation == "unknown":
        body[draw(st.text(min_size=1, max_size=8))] = draw(_json)
    elif mutation == "drop":
        body.pop(draw(st.sampled_from(sorted(body))))
        body.setdefault("max_tokens", 5)  # never an unbounded generation
    elif mutation == "messages":
        if chat:
            body["messages"] = draw(st.one_of(st.lists(_bad_message, max_size=2), _json))
        else:
            body["prompt"] = draw(st.one_of(st.lists(st.integers(-5, 10**6), max_size=4), _json))
    return body


_fuzz = settings(
    max_examples=50,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@_fuzz
@given(body=_request(chat=False))
def test_fuzz_completions_never_5xx(http, body):
    _error_ok(http.post("/v1/completions", json=body))


@_fuzz
@given(body=_request(chat=True))
def test_fuzz_chat_never_5xx(http, body):
    _error_ok(http.post("/v1/chat/completions", json=body))


@settings(
    max_examples=25,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    raw=st.binary(max_size=80),
    path=st.sampled_from(["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"]),
)
def test_fuzz_raw_bodies_never_5xx(http, raw, path):
    r = http.post(path, content=raw)
    assert 400 <= r.status_code < 500 and "error" in r.json()


def test_server_still_healthy_after_bad_input(http):
    assert http.get("/health").status_code == 200
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "still fine", "max_tokens": 5, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    assert metric(scrape(http), "dflash:num_requests_running") == 0


# --------------------------------------------------------------------------------------- disconnects


def test_stream_disconnect_after_first_chunk_frees_the_slot(server, http):
    aborted0 = metric(scrape(http), "dflash:request_success_total", finished_reason="abort")
    body = {
        "model": MODEL,
        "prompt": "a very long story",
        "max_tokens": 4000,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=30) as c:
        with c.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: "):
                    json.loads(line[6:])
                    break
            assert metric(scrape(http), "dflash:num_requests_running") == 1  # still generating
        # leaving the block closes the connection after the first chunk
    assert wait_until(lambda: metric(scrape(http), "dflash:num_requests_running") == 0)
    m = scrape(http)
    assert metric(m, "dflash:request_success_total", finished_reason="abort") == aborted0 + 1


def test_non_stream_disconnect_frees_the_slot(server, http):
    aborted0 = metric(scrape(http), "dflash:request_success_total", finished_reason="abort")
    body = json.dumps({"model": MODEL, "prompt": "long again", "max_tokens": 4000, "ignore_eos": True}).encode()
    req = (
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    s = socket.create_connection(("127.0.0.1", server.port))
    s.sendall(req)
    assert wait_until(lambda: metric(scrape(http), "dflash:num_requests_running") == 1)
    s.close()
    assert wait_until(lambda: metric(scrape(http), "dflash:num_requests_running") == 0)
    assert metric(scrape(http), "dflash:request_success_total", finished_reason="abort") == aborted0 + 1
