"""The real server (real runner, tiny random checkpoint) over HTTP: speculative == plain, streaming == not."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.tinymodels import write_tiny_llama

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, model: Path, *extra: str):
        self.port = _free_port()
        cmd = [
            sys.executable,
            "-m",
            "dflash_jax.cli.main",
            "serve",
            "--model",
            str(model),
            "--port",
            str(self.port),
            "--max-num-seqs",
            "2",
            "--max-model-len",
            "200",
            *extra,
        ]
        env = dict(os.environ, XLA_FLAGS="")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True)
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.time() + 240
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError("server exited: " + self.proc.stdout.read())
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.proc.kill()
        raise RuntimeError("server did not become healthy")

    def close(self):
        self.proc.terminate()
        try:
            assert self.proc.wait(timeout=60) == 0
        finally:
            if self.proc.poll() is None:
                self.proc.kill()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("tiny") / "llama")


PROMPTS = ["Hello there, how are you today?", "Tell me about the sea é ü 🌊", "1 2 3 4 5"]


def _complete(url: str, prompt: str, **kw) -> dict:
    body = {"model": "m", "prompt": prompt, "max_tokens": 24, "temperature": 0, **kw}
    r = httpx.post(url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_spec_and_plain_servers_agree_and_stream(model_dir):
    results = {}
    for name, extra in (
        ("spec", ("--draft-model", "random:1", "--dflash-gamma", "4", "--served-model-name", "m")),
        ("plain", ("--no-spec", "--served-model-name", "m")),
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
                timeout=120,
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
            if name == "spec":
                metrics = httpx.get(srv.url + "/metrics").text
                assert "dflash:spec_decode_num_drafts" in metrics or "num_drafts" in metrics
        finally:
            srv.close()
    assert results["spec"] == results["plain"]


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
    cmd += ["--port", str(_free_port()), "--max-model-len", "200", *flags]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=dict(os.environ, XLA_FLAGS=""))
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
    srv = Server(model, "--no-spec", "--tokenizer", str(tok_dir))
    try:
        ids = httpx.post(srv.url + "/tokenize", json={"prompt": "hello world"}, timeout=30).json()["tokens"]
    finally:
        srv.close()
    assert ids == given
