"""Log-probabilities over the API with the real runner (tiny random target, random drafter), in-process:
the same JSON with and without speculation at T = 0, logprobs matching a plain forward of the target, `echo` +
`max_tokens: 0` returning the prompt's, and every field parsed by the `openai` client."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import openai
import pytest
from fastapi.testclient import TestClient
from flax import nnx

from dflash_jax.models.target import contiguous_kv_cache, target_forward
from dflash_jax.server.app import create_app
from dflash_jax.server.config import ServeConfig
from dflash_jax.spec_decode.runner import SpecRunner
from dflash_jax.testing.fake_runner import ByteBPETokenizer
from tests.conftest import TINY_LLAMA, make_drafter, make_target, tiny_drafter_config

MODEL = "tiny"
TOK = ByteBPETokenizer()
CFG = dataclasses.replace(TINY_LLAMA, vocab_size=TOK.vocab_size)


@pytest.fixture(scope="module")
def target():
    return make_target(CFG, seed=0)


@pytest.fixture(scope="module")
def served(target):
    drafter = make_drafter(tiny_drafter_config(CFG), CFG.hidden_size, seed=1)
    out, ctx = {}, []
    for name, d in (("spec", drafter), ("plain", None)):
        runner = SpecRunner(target, d, max_slots=1, max_model_len=128)
        app = create_app(runner, TOK, ServeConfig(max_num_seqs=1), model_name=MODEL)
        c = TestClient(app).__enter__()
        ctx.append(c)
        out[name] = (c, openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=c, max_retries=0))
    yield out
    for c in ctx:
        c.__exit__(None, None, None)


def ref_logprobs(model, seq: list[int]) -> np.ndarray:
    """log_softmax (float64) of a plain full-sequence forward's logits: row t predicts seq[t+1]."""
    graphdef, state = nnx.split(model)
    t = len(seq)
    out = target_forward(
        graphdef,
        state,
        jnp.asarray([seq], jnp.int32),
        jnp.arange(t, dtype=jnp.int32)[None, :],
        *contiguous_kv_cache(model.cfg, 1, t),
        kv_len=t,
    )
    z = np.asarray(out.logits[0], np.float64)
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def _strip(body: dict) -> dict:
    return {k: v for k, v in body.items() if k not in ("id", "created", "metrics")}


CHAT = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "Crème brûlée 🚀"}],
    "max_tokens": 16,
    "temperature": 0,
    "logprobs": True,
    "top_logprobs": 5,
    "ignore_eos": True,
    "return_token_ids": True,
}
COMPLETION = {
    "model": MODEL,
    "prompt": "The quick brown fox",
    "max_tokens": 12,
    "temperature": 0,
    "logprobs": 5,
    "echo": True,
    "ignore_eos": True,
    "return_token_ids": True,
}


@pytest.mark.parametrize("path,body", [("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)])
def test_same_json_with_and_without_speculation_and_equal_to_a_plain_forward(served, target, path, body):
    a = served["spec"][0].post(path, json=body)
    b = served["plain"][0].post(path, json=body)
    assert a.status_code == b.status_code == 200, a.text
    assert _strip(a.json()) == _strip(b.json())  # every log-probability included, bit for bit
    assert a.json()["metrics"]["speculative_decoding"]["num_drafts"] > 0
    choice = a.json()["choices"][0]
    prompt_ids, gen = choice["prompt_token_ids"], choice["token_ids"]
    ref = ref_logprobs(target, prompt_ids + gen)
    n = len(prompt_ids)
    if path == "/v1/chat/completions":
        got = [e["logprob"] for e in choice["logprobs"]["content"]]
        tops = [[t["token"] for t in e["top_logprobs"]] for e in choice["logprobs"]["content"]]
    else:
        got = choice["logprobs"]["token_logprobs"][n:]
        tops = [list(d) for d in choice["logprobs"]["top_logprobs"][n:]]
        want_prompt = [None] + [ref[t - 1, prompt_ids[t]] for t in range(1, n)]
        assert choice["logprobs"]["token_logprobs"][0] is None
        np.testing.assert_allclose(choice["logprobs"]["token_logprobs"][1:n], want_prompt[1:], atol=2e-5)
    want = [ref[n - 1 + j, t] for j, t in enumerate(gen)]
    np.testing.assert_allclose(got, want, atol=2e-5)
    for j, t in enumerate(gen):  # greedy: the chosen token is the argmax, and the first alternative
        assert t == int(np.argmax(ref[n - 1 + j]))
        assert tops[j][0] == TOK.token_bytes(t).decode("utf-8", errors="replace")


def test_echo_max_tokens_zero_with_the_openai_client(served, target):
    """lm-eval-harness's local-completions scoring: echo, max_tokens 0, logprobs N; read token_logprobs,
    top_logprobs, tokens and text_offset."""
    prompt = "Hello there, how are you"
    ids = TOK.encode(prompt)
    ref = ref_logprobs(target, ids)
    answers = []
    for name in ("spec", "plain"):
        oai = served[name][1]
        r = oai.completions.create(model=MODEL, prompt=prompt, echo=True, max_tokens=0, logprobs=3, temperature=0)
        lp = r.choices[0].logprobs
        assert r.choices[0].text == prompt and r.choices[0].finish_reason == "length"
        assert r.usage.completion_tokens == 0
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == len(ids)
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        np.testing.assert_allclose(lp.token_logprobs[1:], [ref[t - 1, ids[t]] for t in range(1, len(ids))], atol=2e-5)
        for t in range(1, len(ids)):
            want: dict[str, float] = {}  # the 3 most likely by text (two partial-character tokens share "\ufffd")
            for i in [*np.argsort(-ref[t - 1])[:3], ids[t]]:  # ... and the chosen token
                want.setdefault(TOK.token_bytes(int(i)).decode("utf-8", errors="replace"), ref[t - 1, i])
            assert list(lp.top_logprobs[t]) == list(want)
            np.testing.assert_allclose(list(lp.top_logprobs[t].values()), list(want.values()), atol=2e-5)
            assert lp.top_logprobs[t][lp.tokens[t]] == lp.token_logprobs[t]  # the very number of the chosen token
        assert "".join(lp.tokens) == prompt and lp.text_offset[0] == 0
        answers.append(r.model_dump(exclude={"id", "created"}))
    assert answers[0] == answers[1]


def test_streamed_chat_logprobs_with_the_openai_client(served):
    oai = served["spec"][1]
    body = {k: v for k, v in CHAT.items() if k not in ("model", "messages", "ignore_eos", "return_token_ids")}
    whole = oai.chat.completions.create(model=MODEL, messages=CHAT["messages"], extra_body={"ignore_eos": True}, **body)
    chunks = list(
        oai.chat.completions.create(
            model=MODEL, messages=CHAT["messages"], stream=True, extra_body={"ignore_eos": True}, **body
        )
    )
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.model_dump() for e in streamed] == [e.model_dump() for e in whole.choices[0].logprobs.content]
    assert len(streamed) == 16 and all(len(e.top_logprobs) == 5 and e.bytes for e in streamed)
