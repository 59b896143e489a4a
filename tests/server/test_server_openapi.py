"""/openapi.json describes every body, and the fake-runner app conforms to it (schemathesis, in-process ASGI)."""

from __future__ import annotations

import json

import pytest
import schemathesis
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from dflash_jax.server import protocol as P
from dflash_jax.server.app import create_app
from dflash_jax.server.config import ServeConfig
from dflash_jax.testing.fake_runner import make_fake

KEY = "sk-schema"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_MODEL_LEN = 96  # short contexts keep generated bodies cheap


def _app():
    runner, tok = make_fake(max_slots=4, max_model_len=MAX_MODEL_LEN)
    return create_app(runner, tok, ServeConfig(api_key=KEY, max_num_seqs=4), model_name="fake-model")


@pytest.fixture(scope="module")
def client():
    with TestClient(_app()) as c:  # runs the lifespan: the engine serves
        yield c


@pytest.fixture(scope="module")
def spec(client):
    return client.get("/openapi.json").json()


def _resolve(spec, schema):
    ref = schema.get("$ref")
    return spec["components"]["schemas"][ref.rsplit("/", 1)[-1]] if ref else schema


ROUTES = {
    ("post", "/v1/completions"): ("CompletionRequest", "CompletionResponse"),
    ("post", "/v1/chat/completions"): ("ChatCompletionRequest", "ChatCompletionResponse"),
    ("post", "/tokenize"): ("TokenizeRequest", "TokenizeResponse"),
    ("post", "/detokenize"): ("DetokenizeRequest", "DetokenizeResponse"),
    ("get", "/v1/models"): (None, "ModelList"),
    ("get", "/health"): (None, "HealthResponse"),
    ("get", "/tokenizer_info"): (None, "TokenizerInfo"),
}


def test_every_post_has_a_request_schema_and_every_route_a_response_schema(spec):
    for path, item in spec["paths"].items():
        for method, op in item.items():
            if method == "post":
                body = op["requestBody"]["content"]["application/json"]["schema"]
                assert body.get("$ref"), (method, path)
            ok = op["responses"]["200"]["content"]
            assert ok, (method, path)
            for media, content in ok.items():
                assert content.get("schema"), (method, path, media)
            assert "422" not in op["responses"], (method, path)  # validation errors are OpenAI 400s
            for code, resp in op["responses"].items():
                if code != "200":
                    assert resp["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorResponse")
    for (method, path), (req, resp) in ROUTES.items():
        op = spec["paths"][path][method]
        if req:
            assert op["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("/" + req)
            assert "400" in op["responses"]
        assert op["responses"]["200"]["content"]["application/json"]["schema"]["$ref"].endswith("/" + resp)
    assert spec["paths"]["/metrics"]["get"]["responses"]["200"]["content"] == {
        "text/plain": {"schema": {"type": "string"}}
    }
    chat = _resolve(spec, {"$ref": "#/components/schemas/ChatCompletionRequest"})
    assert {"model", "messages"} <= set(chat["required"]) and chat["additionalProperties"] is False
    assert {"temperature", "max_completion_tokens", "stream", "stop"} <= set(chat["properties"])
    sse = spec["paths"]["/v1/chat/completions"]["post"]["responses"]["200"]["content"]["text/event-stream"]
    refs = json.dumps(sse["schema"])
    assert "ChatCompletionChunk" in refs and "ChatCompletionChunk" in spec["components"]["schemas"]
    # bearer auth is declared (the app has an API key) on the API routes, not on /health or /metrics
    assert spec["components"]["securitySchemes"]["HTTPBearer"]["scheme"] == "bearer"
    assert spec["paths"]["/v1/chat/completions"]["post"]["security"] == [{"HTTPBearer": []}]
    assert "security" not in spec["paths"]["/health"]["get"]


def test_real_responses_are_the_documented_models(client):
    chat = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6}
    P.ChatCompletionResponse.model_validate(client.post("/v1/chat/completions", json=chat, headers=AUTH).json())
    body = {"model": "fake-model", "prompt": "hi", "max_tokens": 6, "return_token_ids": True}
    r = P.CompletionResponse.model_validate(client.post("/v1/completions", json=body, headers=AUTH).json())
    assert r.choices[0].token_ids and r.choices[0].prompt_token_ids
    stream = {**chat, "stream": True, "stream_options": {"include_usage": True}}
    raw = client.post("/v1/chat/completions", json=stream, headers=AUTH).text
    data = [line[6:] for line in raw.split("\n") if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    chunks = [P.ChatCompletionChunk.model_validate_json(d) for d in data[:-1]]
    assert chunks[-1].usage is not None and chunks[-1].choices == []
    P.ModelList.model_validate(client.get("/v1/models", headers=AUTH).json())
    P.TokenizeResponse.model_validate(client.post("/tokenize", json={"prompt": "hi"}, headers=AUTH).json())
    P.HealthResponse.model_validate(client.get("/health").json())
    err = client.post("/v1/chat/completions", json={**chat, "temperature": "hot"}, headers=AUTH)
    assert err.status_code == 400
    e = P.ErrorResponse.model_validate(err.json()).error
    assert e.param == "temperature" and e.type == "invalid_request_error"
    denied = client.post("/v1/chat/completions", json=chat)
    assert denied.status_code == 401 and P.ErrorResponse.model_validate(denied.json()).error.code == "invalid_api_key"


class _FreshApp:
    """A new fake-runner app for every ASGI lifespan: schemathesis starts and ends one per tested operation, and
    an engine, once stopped, does not start again."""

    def __init__(self):
        self.app = _app()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "lifespan":
            self.app = _app()
        await self.app(scope, receive, send)


schema = schemathesis.openapi.from_asgi("/openapi.json", _FreshApp())


@schema.parametrize()
@settings(max_examples=15, deadline=None, database=None, suppress_health_check=list(HealthCheck))
def test_app_conforms_to_its_openapi_schema(case):
    """Generated requests (valid by the schema) never get a 5xx, and every answer has a documented status,
    media type and body."""
    case.call_and_validate(
        headers=AUTH,
        checks=[not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance],
    )
