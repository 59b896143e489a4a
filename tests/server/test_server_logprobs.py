"""Log-probabilities over the API (fake runner, in-process app): OpenAI's shapes, parsed by the `openai` client,
streamed and not, `echo` (with `max_tokens: 0`, as lm-eval-harness scores prompts), the same JSON with and without
speculation, and bad values refused with a 400 naming the field."""

from __future__ import annotations

import json

import openai
import pytest
from fastapi.testclient import TestClient

from dflash_jax.server.app import create_app
from dflash_jax.server.config import ServeConfig
from dflash_jax.testing.fake_runner import fake_logprob, fake_prompt_logprobs, make_fake

MODEL = "fake-model"
KEY = "sk-lp"
AUTH = {"Authorization": f"Bearer {KEY}"}


def _app(gamma: int):
    runner, tok = make_fake(max_slots=4, max_model_len=512, gamma=gamma, acceptance=0.8)
    return create_app(runner, tok, ServeConfig(api_key=KEY, max_num_seqs=4), model_name=MODEL), runner, tok


@pytest.fixture(scope="module")
def served():
    """{gamma: (http client, openai client)} for a speculative (γ=4) and a plain (γ=1) fake server."""
    out, ctx = {}, []
    for gamma in (4, 1):
        app, runner, tok = _app(gamma)
        c = TestClient(app, headers=AUTH)
        ctx.append(c.__enter__())
        oai = openai.OpenAI(base_url="http://testserver/v1", api_key=KEY, http_client=c, max_retries=0)
        out[gamma] = (c, oai, runner, tok)
    yield out
    for c in ctx:
        c.__exit__(None, None, None)


def expected(runner, prompt_ids, n, top):
    off = runner.offset_for(prompt_ids)
    toks = [runner.script[(off + i) % len(runner.script)] for i in range(n)]
    return toks, [fake_logprob(off + i, t, top, runner.vocab_size) for i, t in enumerate(toks)]


def chat_prompt(tok, content):
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": content}]), add_special_tokens=False)


def test_chat_logprobs_parsed_by_the_openai_client(served):
    _, oai, runner, tok = served[4]
    r = oai.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Tell me about rockets"}],
        max_tokens=12,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        extra_body={"ignore_eos": True},
    )
    toks, lps = expected(runner, chat_prompt(tok, "Tell me about rockets"), 12, 3)
    content = r.choices[0].logprobs.content
    assert len(content) == 12
    for entry, t, lp in zip(content, toks, lps, strict=True):
        raw = tok.token_bytes(t)
        assert entry.bytes == list(raw) and entry.token == raw.decode("utf-8", errors="replace")
        assert entry.logprob == pytest.approx(lp.logprob)
        assert [(a.token, a.logprob, a.bytes) for a in entry.top_logprobs] == [
            (tok.token_bytes(i).decode("utf-8", errors="replace"), pytest.approx(v), list(tok.token_bytes(i)))
            for i, v in lp.top
        ]
    text_bytes = [b for t, e in zip(toks, content, strict=True) if t not in tok.eos_token_ids for b in e.bytes]
    assert bytes(text_bytes).decode() == r.choices[0].message.content

    # streamed: every chunk carries its own tokens' entries; together the same as above
    chunks = list(
        oai.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Tell me about rockets"}],
            max_tokens=12,
            temperature=0,
            logprobs=True,
            top_logprobs=3,
            stream=True,
            extra_body={"ignore_eos": True},
        )
    )
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.model_dump() for e in streamed] == [e.model_dump() for e in content]


def test_chat_logprobs_without_top_logprobs_have_empty_alternatives(served):
    _, oai, _, _ = served[4]
    r = oai.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0, logprobs=True
    )
    assert all(e.top_logprobs == [] for e in r.choices[0].logprobs.content)
    plain = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
    assert plain.choices[0].logprobs is None


def test_completions_logprobs_parsed_by_the_openai_client(served):
    _, oai, runner, tok = served[4]
    prompt = "Crème brûlée"
    r = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0, logprobs=2)
    toks, lps = expected(runner, tok.encode(prompt), 10, 2)
    lp = r.choices[0].logprobs
    assert lp.tokens == [tok.token_bytes(t).decode("utf-8", errors="replace") for t in toks]
    assert lp.token_logprobs == [pytest.approx(x.logprob) for x in lps]
    for top, text, x in zip(lp.top_logprobs, lp.tokens, lps, strict=True):
        assert len(top) <= 3 and top[text] == pytest.approx(x.logprob)  # the chosen token is included
        assert max(top.values()) == pytest.approx(x.logprob)
    text = r.choices[0].text
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    for off, t in zip(lp.text_offset, toks, strict=True):  # each whole-character token starts where it says
        piece = tok.token_bytes(t).decode("utf-8", errors="ignore")
        if piece and piece == tok.token_bytes(t).decode("utf-8", errors="replace"):
            assert text[off : off + len(piece)] == piece

    stream = list(
        oai.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0, logprobs=2, stream=True)
    )
    joined = {
        k: [x for c in stream if c.choices and c.choices[0].logprobs for x in getattr(c.choices[0].logprobs, k)]
        for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")
    }
    assert joined == lp.model_dump()


def test_echo_with_max_tokens_zero_scores_the_prompt(served):
    """lm-eval-harness's local-completions loglikelihood request: echo, max_tokens 0, logprobs N."""
    _, oai, runner, tok = served[4]
    prompt = "The cat sat on the mat."
    ids = tok.encode(prompt)
    r = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=1, temperature=0)
    c = r.choices[0]
    assert c.text == prompt and c.finish_reason == "length"
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 0
    want = fake_prompt_logprobs(ids, 1, runner.vocab_size)
    assert c.logprobs.tokens == [tok.token_bytes(t).decode("utf-8", errors="replace") for t in ids]
    assert c.logprobs.token_logprobs == [None] + [pytest.approx(w.logprob) for w in want]
    assert c.logprobs.top_logprobs[0] is None and all(len(d) == 1 for d in c.logprobs.top_logprobs[1:])
    assert "".join(c.logprobs.tokens) == prompt
    assert c.logprobs.text_offset == [len("".join(c.logprobs.tokens[:i])) for i in range(len(ids))]
    # token ids as the prompt, streamed: the same answer in one chunk of prompt plus a finishing chunk
    chunks = list(oai.completions.create(model=MODEL, prompt=ids, max_tokens=0, echo=True, logprobs=1, stream=True))
    assert "".join(ch.choices[0].text for ch in chunks) == prompt
    assert [x for ch in chunks if ch.choices[0].logprobs for x in ch.choices[0].logprobs.token_logprobs] == (
        c.logprobs.token_logprobs
    )
    assert chunks[-1].choices[0].finish_reason == "length"


def test_echo_with_a_completion_returns_prompt_then_completion(served):
    _, oai, runner, tok = served[4]
    prompt = "Hello world"
    ids = tok.encode(prompt)
    r = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=6, echo=True, logprobs=0, temperature=0)
    toks, lps = expected(runner, ids, 6, 0)
    c = r.choices[0]
    assert c.text == prompt + tok.decode(toks)
    assert len(c.logprobs.tokens) == len(ids) + 6
    assert c.logprobs.token_logprobs[len(ids) :] == [pytest.approx(x.logprob) for x in lps]
    assert c.logprobs.text_offset[len(ids)] == len(prompt)
    # echo without logprobs: just the text
    r2 = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=6, echo=True, temperature=0)
    assert r2.choices[0].text == c.text and r2.choices[0].logprobs is None


def _strip(body: dict) -> dict:
    body = dict(body)
    for k in ("id", "created", "metrics"):
        body.pop(k, None)
    return body


BODIES = [
    (
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "Grüße aus Köln"}],
            "logprobs": True,
            "top_logprobs": 5,
            "max_tokens": 20,
            "temperature": 0,
        },
    ),
    ("/v1/completions", {"prompt": "Emoji time", "logprobs": 4, "max_tokens": 20, "temperature": 0, "echo": True}),
]


@pytest.mark.parametrize("path,body", BODIES)
def test_same_json_with_and_without_speculation(served, path, body):
    spec, plain = served[4][0], served[1][0]
    a = spec.post(path, json={"model": MODEL, **body})
    b = plain.post(path, json={"model": MODEL, **body})
    assert a.status_code == b.status_code == 200, a.text
    assert _strip(a.json()) == _strip(b.json())
    assert a.json()["metrics"]["speculative_decoding"]["num_drafts"] > 0  # the first did speculate


BAD = [
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, "logprobs"),
    ("/v1/completions", {"prompt": "x", "logprobs": -1}, "logprobs"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0, "logprobs": 1}, "max_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21},
        "top_logprobs",
    ),
]


@pytest.mark.parametrize("path,body,param", BAD)
def test_bad_logprobs_values_are_400_naming_the_field(served, path, body, param):
    r = served[4][0].post(path, json={"model": MODEL, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_openapi_describes_the_logprobs(served):
    spec = served[4][0].get("/openapi.json").json()
    schemas = spec["components"]["schemas"]
    for name in ("CompletionLogprobs", "ChatLogprobs", "ChatTokenLogprob", "TopLogprob"):
        assert name in schemas, name
    assert set(schemas["CompletionLogprobs"]["properties"]) == {
        "tokens",
        "token_logprobs",
        "top_logprobs",
        "text_offset",
    }
    assert set(schemas["ChatTokenLogprob"]["properties"]) == {"token", "logprob", "bytes", "top_logprobs"}
    refs = json.dumps(schemas["CompletionChoice"]["properties"]["logprobs"])
    assert "CompletionLogprobs" in refs
    assert "ChatLogprobs" in json.dumps(schemas["ChatChunkChoice"]["properties"]["logprobs"])
    req = schemas["CompletionRequest"]["properties"]
    assert "echo" in req and req["max_tokens"]["anyOf"][0]["minimum"] == 0
