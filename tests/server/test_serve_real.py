"""The real server (real runner, tiny random checkpoint) over HTTP: speculative == plain, streaming == not."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import httpx
import pytest

from dflash_jax.testing.server import free_port
from dflash_jax.testing.waits import run, stretched
from tests.server.real_server import RealServer
from tests.tinymodels import write_tiny_llama
from tests.xla_env import xla_flags

pytestmark = pytest.mark.slow


class Server(RealServer):
    """A real server at `--max-num-seqs 2 --max-model-len 200` (flags in `extra` override them), warmed up as
    `dflash-jax serve` is by default (`warmup`), started at once; `close()` stops it and checks it exited 0."""

    def __init__(self, model: Path, *extra: str, warmup: bool = True):
        super().__init__(model, "--max-num-seqs", "2", "--max-model-len", "200", *extra, warmup=warmup)
        self.start()

    def close(self) -> None:
        try:
            code = self.stop()
            assert code == 0, f"server exited with {code}:\n{self.log()}"
        finally:
            self.__exit__(None, None, None)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("tiny") / "llama")


PROMPTS = ["Hello there, how are you today?", "Tell me about the sea é ü 🌊", "1 2 3 4 5"]


def _complete(url: str, prompt: str, **kw) -> dict:
    body = {"model": "m", "prompt": prompt, "max_tokens": 24, "temperature": 0, **kw}
    r = httpx.post(url + "/v1/completions", json=body, timeout=stretched(120))
    assert r.status_code == 200, r.text
    return r.json()


def test_spec_and_plain_servers_agree_and_stream(model_dir):
    results = {}
    for name, extra in (
        ("spec", ("--draft-model", "random:1", "--dflash-gamma", "4", "--served-model-name", "m")),
        ("plain", ("--no-spec", "--served-model-name", "m")),
        (
            "hybrid",
            (
                "--draft-model",
                "random:1",
                "--dflash-gamma",
                "4",
                "--draft-method",
                "hybrid",
                "--served-model-name",
                "m",
            ),
        ),
    ):
        srv = Server(model_dir, *extra)
        try:
            outs = [_complete(srv.url, p, ignore_eos=True) for p in PROMPTS]
            results[name] = [o["choices"][0]["text"] for o in outs]
            assert all(o["usage"]["completion_tokens"] == 24 for o in outs)
            # streamed text equals the non-streamed text; every event is JSON
            with httpx.stream(
                "POST",
                srv.url + "/v1/completions",
                timeout=stretched(120),
                json={
                    "model": "m",
                    "prompt": PROMPTS[1],
                    "max_tokens": 24,
                    "temperature": 0,
                    "stream": True,
                    "ignore_eos": True,
                },
            ) as r:
                chunks = []
                for line in r.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        chunks.append(json.loads(line[6:]))
            assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == results[name][1]
            if name != "plain":
                metrics = httpx.get(srv.url + "/metrics").text
                assert "dflash:spec_decode_num_drafts" in metrics or "num_drafts" in metrics
            assert "dflash-jax serve: warm-up:" in srv.log()
        finally:
            srv.close()
    assert results["spec"] == results["plain"]
    assert results["hybrid"] == results["plain"]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ["--draft-max-model-len", "64"],
            "error: --draft-max-model-len 64 is below the context length 200: the drafter's context always covers",
        ),
        (["--tokenizer", "/nonexistent/tok"], "error: --tokenizer: '/nonexistent/tok' is not a directory"),
        (["--kv-cache-memory", "1kB"], "error: --kv-cache-memory 1000 (1000 B) holds 0 tokens of KV"),
    ],
)
def test_serve_refuses_settings_it_cannot_honour(tmp_path, flags, message):
    """Flags serve cannot honour stop it before it binds a port, with one line naming the flag."""
    model = write_tiny_llama(tmp_path / "tiny")
    cmd = [sys.executable, "-m", "dflash_jax.cli.main", "serve", "--model", str(model), "--draft-model", "random"]
    cmd += ["--port", str(free_port()), "--max-model-len", "200", *flags]
    p = run(cmd, env=dict(os.environ, XLA_FLAGS=xla_flags()))
    assert p.returncode != 0
    assert message in p.stderr
    assert "Traceback" not in p.stderr


def test_serve_uses_the_tokenizer_it_is_given(tmp_path):
    """--tokenizer DIR: the server encodes with that tokenizer (the model's vocabulary, but one that adds a BOS)."""
    import shutil

    from dflash_jax.checkpoints.tokenizer import load_hf_tokenizer

    model = write_tiny_llama(tmp_path / "tiny")
    tok_dir = tmp_path / "tok"
    tok_dir.mkdir()
    shutil.copy(model / "tokenizer.json", tok_dir / "tokenizer.json")
    cfg = json.loads((model / "tokenizer_config.json").read_text())
    (tok_dir / "tokenizer_config.json").write_text(
        json.dumps({**cfg, "bos_token": "<|im_start|>", "add_bos_token": True})
    )
    given, own = load_hf_tokenizer(tok_dir).encode("hello world"), load_hf_tokenizer(model).encode("hello world")
    assert given != own  # the two tokenizers tell apart which one the server uses
    srv = Server(model, "--no-spec", "--tokenizer", str(tok_dir), warmup=False)
    try:
        ids = httpx.post(srv.url + "/tokenize", json={"prompt": "hello world"}, timeout=30).json()["tokens"]
        assert "warm-up" not in srv.log()  # --no-warmup: healthy once loaded
    finally:
        srv.close()
    assert ids == given
