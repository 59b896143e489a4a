"""Multi-host serving end to end: `dflash-jax serve` as 2 processes on localhost (CPU, gloo, 2 devices each: one
4-device mesh, target and drafter TP 4). Rank 0 serves HTTP and schedules; rank 1 replays its device steps and opens
no port. A real completion request to rank 0 returns the greedy tokens of a one-process run, and SIGTERM to rank 0
drains it and stops both processes cleanly (exit status 0)."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx

from dflash_jax.testing.server import wait_healthy
from dflash_jax.testing.waits import COMPILE_GUARD_S, communicate, stretched
from tests.tinymodels import write_tiny_llama
from tests.xla_env import xla_flags

PROMPTS = ([40, 72, 101, 108, 108, 111, 44], [80, 33, 90, 91, 92])
MAX_TOKENS = 24
MAX_MODEL_LEN = 64
GAMMA = 4


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _write_model(path: Path) -> Path:
    """The tiny random Llama (4 heads, 4 KV heads: TP 4), its embedding nudged so greedy output varies a little
    (unnudged it repeats one token)."""
    from safetensors.numpy import load_file, save_file

    write_tiny_llama(path, hidden=64, layers=2, heads=4, kv_heads=4, inter=128)
    t = load_file(str(path / "model.safetensors"))
    t["model.embed_tokens.weight"][:, 0] += 0.15
    t["model.embed_tokens.weight"][[72, 101, 33], 0] += 0.3
    save_file(t, str(path / "model.safetensors"))
    return path


def _reference_tokens(model_dir: Path) -> list[list[int]]:
    """The same models in this process, one device, no mesh: greedy speculative decoding of each prompt."""
    from dflash_jax.builder import build_runner, load_models
    from dflash_jax.types import SamplingParams

    models = load_models(str(model_dir), "random:1", quant="fp8")
    runner = build_runner(models, max_slots=2, max_model_len=MAX_MODEL_LEN, gamma=GAMMA)
    out = []
    for prompt in PROMPTS:
        toks = list(runner.add(0, prompt, SamplingParams()).tokens)
        while len(toks) < MAX_TOKENS:
            toks += runner.step([0], {0: MAX_TOKENS - len(toks)})[0].tokens
        runner.release(0)
        out.append(toks[:MAX_TOKENS])
    return out


async def _complete_all(url: str) -> list[dict]:
    """Both prompts at once (continuous batching on rank 0)."""
    async with httpx.AsyncClient(timeout=stretched(120)) as client:
        bodies = [
            {
                "model": "m",
                "prompt": p,
                "max_tokens": MAX_TOKENS,
                "temperature": 0,
                "ignore_eos": True,
                "return_token_ids": True,
            }
            for p in PROMPTS
        ]
        rs = await asyncio.gather(*(client.post(url + "/v1/completions", json=b) for b in bodies))
    for r in rs:
        assert r.status_code == 200, r.text
    return [r.json() for r in rs]


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.communicate()


def test_two_process_server_matches_one_process_and_shuts_down(tmp_path):
    model_dir = _write_model(tmp_path / "llama")
    coord, ports = _free_port(), [_free_port(), _free_port()]
    procs = []
    for rank in range(2):
        env = dict(
            os.environ,
            XLA_FLAGS=xla_flags(devices=2),
            JAX_PLATFORMS="cpu",
            TF_CPP_MIN_LOG_LEVEL="3",
            DFLASH_JAX_COMPILATION_CACHE_DIR=str(tmp_path / f"jax-cache-{rank}"),
        )
        cmd = [
            sys.executable,
            "-m",
            "dflash_jax.cli.main",
            "serve",
            "--model",
            str(model_dir),
            "--draft-model",
            "random:1",
            "--dflash-gamma",
            str(GAMMA),
            "--tp-size",
            "4",
            "--coordinator-address",
            f"127.0.0.1:{coord}",
            "--num-processes",
            "2",
            "--process-id",
            str(rank),
            "--port",
            str(ports[rank]),
            "--max-num-seqs",
            "2",
            "--max-model-len",
            str(MAX_MODEL_LEN),
            "--served-model-name",
            "m",
            "--shutdown-timeout",
            "10",
        ]
        procs.append(
            subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True, cwd=tmp_path)
        )
    try:
        ref = _reference_tokens(model_dir)  # computed while the two processes load and warm up
        url = f"http://127.0.0.1:{ports[0]}"
        wait_healthy(url, procs, COMPILE_GUARD_S)
        assert not _listening(ports[1])  # the follower never opens its port

        bodies = asyncio.run(_complete_all(url))
        for prompt, body, want in zip(PROMPTS, bodies, ref, strict=True):
            choice = body["choices"][0]
            assert choice["prompt_token_ids"] == list(prompt)
            assert choice["token_ids"] == want
            assert body["metrics"]["speculative_decoding"]["num_drafts"] > 0
        assert len({tuple(r) for r in ref}) == 2 and any(len(set(r)) > 2 for r in ref)  # not one repeated token

        procs[0].send_signal(signal.SIGTERM)  # drain rank 0; it tells rank 1 to stop
        outs = [communicate(p)[0] for p in procs]
    finally:
        _stop(procs)
    for rank, (p, out) in enumerate(zip(procs, outs, strict=True)):
        assert p.returncode == 0, f"rank {rank} exited {p.returncode}:\n{out[-4000:]}"
    assert "serves HTTP" in outs[0] and "followers told to shut down" in outs[0]
    assert "follows process 0" in outs[1] and "replayed" in outs[1] and "Uvicorn running" not in outs[1]
