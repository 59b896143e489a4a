"""What the clients people point at an OpenAI-compatible server send, against the fake-runner server over real HTTP:
vLLM's `stream_options.continuous_usage_stats` (guidellm's default), `GET /tokenizer_info` (lm-eval's remote
tokenizer, driven by lm-eval's own `RemoteTokenizer` where lm-eval is installed), `response_format: text`, `Allow` on
every 405, and the schemathesis CLI over `/openapi.json` (a schema-valid request is accepted, a schema-violating one
refused, an undeclared method is a 405 naming the allowed ones). The fake runner's continuation of a prompt is the
independent reference for every text and token count."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest
from fastapi.testclient import TestClient

from dflash_jax.checkpoints.tokenizer import load_hf_tokenizer
from dflash_jax.server.app import create_app
from dflash_jax.server.config import ServeConfig
from dflash_jax.testing.fake_runner import make_fake
from dflash_jax.testing.server import FakeServer
from dflash_jax.types import SamplingParams
from tests.tinymodels import write_byte_tokenizer

MODEL = "clients"
MAX_MODEL_LEN = 96  # short contexts keep schemathesis' generated bodies cheap
RUNNER, TOK = make_fake(max_model_len=MAX_MODEL_LEN)
EOS = TOK.im_end_id
HOOKS = "tests.server.schemathesis_hooks"


@pytest.fixture(scope="module")
def server():
    args = ["--served-model-name", MODEL, "--max-num-seqs", "4", "--max-queued-requests", "2048"]
    args += ["--max-model-len", str(MAX_MODEL_LEN), "--gamma", "4", "--seed", "3"]
    with FakeServer(*args) as srv:
        yield srv


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=30) as c:
        yield c


def events(raw: str) -> list[dict]:
    data = [line[6:] for line in raw.split("\n") if line.startswith("data: ")]
    assert data and data[-1] == "[DONE]", raw[-300:]
    return [json.loads(d) for d in data[:-1]]


def chat_ids(messages) -> list[int]:
    return TOK.encode(TOK.apply_chat_template(messages, add_generation_prompt=True), add_special_tokens=False)


# ---------------------------------------------------------------------------------- continuous usage


@pytest.mark.parametrize("include_usage", [True, False])
def test_continuous_usage_counts_each_choice_so_far(http, include_usage):
    """Every chunk carries the usage of its choice so far; the counts end at the choice's length (the fake's
    continuation), and the tokens they add up to are the tokens the chunks carried."""
    prompt = "count as you go"
    ids = TOK.encode(prompt)
    options = {"include_usage": include_usage, "continuous_usage_stats": True}
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 12, "n": 2, "temperature": 0.7, "seed": 11}
    body |= {"stream": True, "stream_options": options, "ignore_eos": True, "return_token_ids": True}
    chunks = events(http.post("/v1/completions", json=body).text)
    seen: dict[int, list[int]] = {0: [], 1: []}
    for ch in chunks:
        u = ch["usage"]
        assert u["prompt_tokens"] == len(ids) and u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
        if not ch["choices"]:
            continue
        (c,) = ch["choices"]
        seen[c["index"]] += c["token_ids"]
        assert u["completion_tokens"] == len(seen[c["index"]]), ch
    for i in (0, 1):
        assert seen[i] == RUNNER.continuation(ids, 12, sampling_for(11 + i))
    last = chunks[-1]
    if include_usage:  # the choice-less last chunk counts both choices
        assert last["choices"] == [] and last["usage"]["completion_tokens"] == 24
    else:
        assert last["choices"] and all(ch["choices"] for ch in chunks)


def sampling_for(seed: int) -> SamplingParams:
    return SamplingParams(temperature=0.7, seed=seed)


def test_chat_continuous_usage_through_the_openai_client(oai):
    messages = [{"role": "user", "content": "usage please"}]
    stream = oai.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_completion_tokens=9,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"stream_options": {"include_usage": True, "continuous_usage_stats": True}, "ignore_eos": True},
    )
    chunks = list(stream)
    prompt = len(chat_ids(messages))
    assert all(ch.usage is not None and ch.usage.prompt_tokens == prompt for ch in chunks)
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].usage.completion_tokens == 0
    counts = [ch.usage.completion_tokens for ch in chunks]
    assert counts == sorted(counts) and counts[-1] == 9 and chunks[-1].choices == []
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == TOK.decode(RUNNER.continuation(chat_ids(messages), 9))


def test_include_usage_alone_is_unchanged(http):
    body = {"model": MODEL, "prompt": "plain", "max_tokens": 5, "stream": True}
    chunks = events(http.post("/v1/completions", json={**body, "stream_options": {"include_usage": True}}).text)
    assert all(ch["usage"] is None for ch in chunks[:-1]) and chunks[-1]["choices"] == []
    assert chunks[-1]["usage"]["completion_tokens"] <= 5
    assert all("usage" not in ch for ch in events(http.post("/v1/completions", json=body).text))


# ------------------------------------------------------------------------------------ tokenizer_info


def test_tokenizer_info_of_the_fake(http):
    info = http.get("/tokenizer_info").json()
    assert info["eos_token"] == "<|im_end|>" and info["model_max_length"] == MAX_MODEL_LEN
    ids = http.post("/tokenize", json={"prompt": info["eos_token"], "add_special_tokens": False}).json()["tokens"]
    assert ids == [EOS]


def test_tokenizer_info_of_a_hugging_face_tokenizer(tmp_path):
    write_byte_tokenizer(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["pad_token"] = {"content": "<|endoftext|>", "special": True}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = load_hf_tokenizer(tmp_path)
    runner, _ = make_fake(max_slots=2, max_model_len=64, vocab_size=tok.vocab_size)
    with TestClient(create_app(runner, tok, ServeConfig(max_num_seqs=2), model_name="m")) as client:
        info = client.get("/tokenizer_info").json()
    assert info == {
        "tokenizer_class": "TextTokenizer",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "add_bos_token": False,
        "model_max_length": 64,
        "chat_template": config["chat_template"],
    }


def test_lm_eval_remote_tokenizer_reads_the_server(server):
    utils = pytest.importorskip("lm_eval.utils", reason="lm-eval is not installed (pip install lm-eval)")
    url = server.url + "/v1/completions"
    assert utils.check_remote_tokenizer_support(url)
    tok = utils.RemoteTokenizer(url)
    assert tok.eos_token_id == EOS and tok.eot_token == EOS
    text = "Grüße, 你好"
    assert tok.encode(text) == TOK.encode(text) and tok.decode(TOK.encode(text)) == text


# ------------------------------------------------------------------------------------ response_format


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_response_format_text_is_plain_generation(http, path):
    body = {"model": MODEL, "max_tokens": 8, "temperature": 0}
    body |= {"prompt": "format"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "f"}]}
    plain = http.post(path, json=body).json()["choices"][0]
    text = http.post(path, json={**body, "response_format": {"type": "text"}}).json()["choices"][0]
    assert text == plain
    r = http.post(path, json={**body, "response_format": {"type": "json_object"}})  # the fake tokenizer: no grammar
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "response_format", r.text
    assert err["code"] == "constrained_decoding_unsupported", r.text


# ------------------------------------------------------------------------------- strictness, schema


def test_integers_sent_as_integral_numbers(http):
    """JSON Schema counts 5.0 as an integer, so the server does: 5.0 is 5; 5.5, "5" and true stay refused."""
    body = {"model": MODEL, "prompt": "five", "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    r = http.post("/v1/completions", json={**body, "max_tokens": 5.0, "n": 1.0, "seed": 3.0})
    assert r.status_code == 200 and len(r.json()["choices"][0]["token_ids"]) == 5
    for bad in (5.5, "5", True, -1.0):
        r = http.post("/v1/completions", json={**body, "max_tokens": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", (bad, r.text)


def test_the_schema_states_what_the_server_refuses(http):
    spec = http.get("/openapi.json").json()["components"]["schemas"]
    chat, comp = spec["ChatCompletionRequest"], spec["CompletionRequest"]
    assert chat["properties"]["messages"]["minItems"] == 1
    branches = comp["properties"]["prompt"]["anyOf"]
    assert all(b.get("minLength") == 1 or b.get("minItems") == 1 for b in branches)
    ids = next(b for b in branches if b.get("items", {}).get("type") == "integer")["items"]
    assert ids == {"type": "integer", "minimum": 0, "maximum": TOK.vocab_size - 1}
    seed = next(b for b in chat["properties"]["seed"]["anyOf"] if b.get("type") == "integer")
    assert (seed["minimum"], seed["maximum"]) == (-(2**63), 2**63 - 1)
    max_tokens = next(b for b in comp["properties"]["max_tokens"]["anyOf"] if b.get("type") == "integer")
    assert (max_tokens["minimum"], max_tokens["maximum"]) == (0, MAX_MODEL_LEN - 1)
    echo_rule = {"if": {"required": ["max_tokens"], "properties": {"max_tokens": {"const": 0}}}}
    assert any(rule.get("if") == echo_rule["if"] for rule in comp["allOf"])
    # and the server refuses exactly that
    for path, body, param in (
        ("/v1/chat/completions", {"messages": []}, "messages"),
        ("/v1/completions", {"prompt": ""}, "prompt"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "seed": 2**63}, "seed"),
        ("/v1/completions", {"prompt": [TOK.vocab_size]}, "prompt"),
    ):
        r = http.post(path, json={"model": MODEL, **body})
        assert r.status_code == 400 and r.json()["error"]["param"].startswith(param), (body, r.text)


def test_every_405_says_which_methods_are_allowed(http):
    spec = http.get("/openapi.json").json()
    for path, item in spec["paths"].items():
        declared = {m.upper() for m in item}
        for method in {"GET", "POST", "PUT", "DELETE", "PATCH"} - declared:
            r = http.request(method, path)
            assert r.status_code == 405 and r.json()["error"]["type"] == "invalid_request_error", (method, path)
            assert set(r.headers["allow"].replace(" ", "").split(",")) == declared, (method, path)


def test_schemathesis_finds_nothing(server, tmp_path):
    """The schemathesis CLI (coverage and fuzzing phases, positive and negative data, every check): schema-valid
    requests accepted (the hooks' check: refused only for a token count the schema cannot state), schema-violating
    ones refused, 405s with `Allow`, every answer as documented."""
    st = Path(sys.executable).with_name("schemathesis")
    cli = (
        [str(st)]
        if st.exists()
        else [sys.executable, "-c", "from schemathesis.cli import schemathesis; schemathesis()"]
    )
    argv = [*cli, "run", server.url + "/openapi.json", "--checks", "all"]
    argv += ["--exclude-checks", "positive_data_acceptance", "--max-examples", "25", "--seed", "29"]
    argv += ["--request-timeout", "60", "--report-dir", str(tmp_path)]
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "SCHEMATHESIS_HOOKS": HOOKS, "PYTHONPATH": str(root)}
    done = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)  # its cache
    out = done.stdout + done.stderr
    assert done.returncode == 0 and "No issues found" in out, out[-6000:]
