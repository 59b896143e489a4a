"""Multi-host liveness: the followers' heartbeats and rank 0's watch over them (an in-memory key-value store
and a hand-driven clock), and `dflash-jax serve` as 2 processes on localhost where the follower is killed
mid-request: rank 0 fails the request, /health stops answering 200, and rank 0 exits non-zero naming the lost
process."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading

import httpx
import pytest

from dflash_jax.spec_decode.multihost import FollowerWatch, Heartbeat, heartbeat_key
from dflash_jax.testing.server import wait_healthy
from dflash_jax.testing.waits import COMPILE_GUARD_S, communicate, stretched, wait_exit, wait_until
from tests.tinymodels import write_tiny_llama
from tests.xla_env import xla_flags


class KV:
    """The two calls of the coordination service's client that liveness uses."""

    def __init__(self):
        self.data: dict[str, str] = {}
        self.lock = threading.Lock()

    def key_value_set(self, key: str, value: str, allow_overwrite: bool = False) -> None:
        with self.lock:
            if key in self.data and not allow_overwrite:
                raise RuntimeError(f"ALREADY_EXISTS: {key}")
            self.data[key] = value

    def key_value_try_get(self, key: str) -> str:
        with self.lock:
            if key not in self.data:
                raise RuntimeError(f"NOT_FOUND: {key}")
            return self.data[key]


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_watch_reports_the_follower_whose_heartbeat_stops():
    kv, clock, lost = KV(), Clock(), []
    watch = FollowerWatch([1, 2], lambda r, s: lost.append((r, s)), kv, lost_after_s=10, startup_s=60, clock=clock)
    watch.begin()
    for step in range(5):
        kv.key_value_set(heartbeat_key(1), str(step), allow_overwrite=True)
        kv.key_value_set(heartbeat_key(2), str(step), allow_overwrite=True)
        clock.t += 1
        assert watch.check() is None
    clock.t += 9.5  # rank 2 keeps beating, rank 1 stopped: 9.5 s silent
    kv.key_value_set(heartbeat_key(2), "5", allow_overwrite=True)
    assert watch.check() is None and not lost
    clock.t += 0.5  # 10 s silent
    assert watch.check() == 1 and lost == [(1, 10.0)]


def test_watch_gives_a_follower_that_never_beat_the_startup_bound():
    kv, clock, lost = KV(), Clock(), []
    watch = FollowerWatch([1], lambda r, s: lost.append(r), kv, lost_after_s=2, startup_s=30, clock=clock).begin()
    clock.t += 29
    assert watch.check() is None  # still loading its model, longer than lost_after_s: not lost
    clock.t += 1
    assert watch.check() == 1 and lost == [1]


def test_heartbeat_thread_bumps_its_counter():
    kv = KV()
    beat = Heartbeat(3, kv, interval_s=0.01).start()
    wait_until(lambda: int(kv.data.get(heartbeat_key(3), "0")) >= 3, interval=0.01)
    beat.stop()
    assert int(kv.data[heartbeat_key(3)]) >= 3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_killed_follower_fails_requests_and_rank_0_exits_naming_it(tmp_path):
    model_dir = write_tiny_llama(tmp_path / "llama", hidden=64, layers=2, heads=4, kv_heads=4, inter=128)
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
        cmd = [sys.executable, "-m", "dflash_jax.cli.main", "serve", "--model", str(model_dir), "--no-spec"]
        cmd += ["--tp-size", "4", "--coordinator-address", f"127.0.0.1:{coord}", "--num-processes", "2"]
        cmd += ["--process-id", str(rank), "--port", str(ports[rank]), "--max-num-seqs", "2"]
        cmd += ["--max-model-len", "1024", "--served-model-name", "m"]
        procs.append(
            subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True, cwd=tmp_path)
        )
    url = f"http://127.0.0.1:{ports[0]}"
    try:
        wait_healthy(url, procs, COMPILE_GUARD_S)
        body = {"model": "m", "prompt": "a long one", "max_tokens": 900, "ignore_eos": True, "stream": True}
        events: list[dict] = []
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=stretched(120)) as r:
            assert r.status_code == 200
            try:
                for line in r.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    events.append(json.loads(line[6:]))
                    if len(events) == 3:
                        procs[1].send_signal(signal.SIGKILL)  # the follower dies mid-request
                    if "error" in events[-1]:
                        break
            except httpx.HTTPError:
                pass  # rank 0 went away before the error event reached us
        try:
            health: int | None = httpx.get(url + "/health", timeout=5).status_code
        except httpx.HTTPError:
            health = None  # already exited
        out0 = communicate(procs[0])[0]
        wait_exit(procs[1])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    lost_lines = [line for line in out0.splitlines() if "lost process" in line]
    print(f"lost follower: {len(events)} events, last {events[-1]}, /health then {health}, rank 0 exit")
    print(f"  {procs[0].returncode}; {lost_lines[:2]}")
    finished = [e for e in events if "choices" in e and e["choices"] and e["choices"][0].get("finish_reason")]
    assert not finished, "the request must not complete normally once its follower died"
    assert "error" in events[-1] or len(events) < 900, events[-1]
    if "error" in events[-1]:  # the engine was failed while rank 0 still served: /health said so
        assert health in (503, None), health
    assert procs[0].returncode == 3, f"rank 0 exited {procs[0].returncode}:\n{out0[-4000:]}"
    assert "lost process 1 of 2" in out0, out0[-4000:]
