"""A real server (tiny random checkpoint, random drafter) over a KV page pool far smaller than dense slots would
need: 32 concurrent requests at --max-model-len 8192 are answered, and no page stays in use afterwards, also when
clients disconnect mid-stream."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from dflash_jax.testing.waits import wait_until
from tests.server.test_serve_real import Server
from tests.tinymodels import write_tiny_llama

pytestmark = pytest.mark.slow

BYTES_PER_TOKEN = 1280  # K and V of the tiny target (4 layers x 2 KV heads x 16 x f32) + the 1-layer drafter


def _metrics(url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("dflash:") and "{" not in line:
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def _settled(url: str) -> dict[str, float]:
    """The metrics once no request is running or waiting (the engine frees a request's pages as it ends)."""
    idle = lambda m: m["dflash:num_requests_running"] == 0 and m["dflash:num_requests_waiting"] == 0  # noqa: E731
    assert wait_until(lambda: idle(_metrics(url)), interval=0.2), _metrics(url)
    return _metrics(url)


def test_32_concurrent_requests_in_a_small_pool_and_no_leaked_pages(tmp_path):
    model = write_tiny_llama(tmp_path / "tiny", max_positions=8192)
    dense = 33 * (8192 + 4 + 1) * BYTES_PER_TOKEN  # what 32 dense slots (+ scratch) would reserve: ~336 MB
    budget = 12_000_000
    assert budget * 25 < dense
    srv = Server(
        model,
        "--draft-model",
        "random:1",
        "--dflash-gamma",
        "4",
        "--served-model-name",
        "m",
        "--max-num-seqs",
        "32",
        "--max-model-len",
        "8192",
        "--kv-cache-memory",
        str(budget),
        warmup=False,  # a warm-up of six batch sizes: the requests compile the shapes they run
    )
    try:
        m = _metrics(srv.url)
        assert m["dflash:kv_pages_total"] == budget // (16 * BYTES_PER_TOKEN) - 1 and m["dflash:kv_pages_used"] == 0

        def complete(i: int) -> dict:
            body = {"model": "m", "prompt": f"request {i}: " + "abc " * (i % 7), "max_tokens": 12, "temperature": 0}
            r = httpx.post(srv.url + "/v1/completions", json={**body, "ignore_eos": True}, timeout=300)
            assert r.status_code == 200, r.text
            return r.json()

        with ThreadPoolExecutor(32) as pool:
            outs = list(pool.map(complete, range(32)))
        assert all(o["usage"]["completion_tokens"] == 12 for o in outs)
        m = _settled(srv.url)
        assert m["dflash:kv_pages_used"] == 0 and m["dflash:kv_cache_usage_perc"] == 0

        def disconnect(i: int) -> int:
            body = {"model": "m", "prompt": f"stream {i}", "max_tokens": 400, "stream": True, "ignore_eos": True}
            with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=300) as r:
                for n, _ in enumerate(r.iter_lines()):
                    if n >= 4:
                        return n  # leave mid-stream: the connection closes here
            return -1

        with ThreadPoolExecutor(8) as pool:
            assert all(n == 4 for n in pool.map(disconnect, range(8)))
        m = _settled(srv.url)
        assert m["dflash:kv_pages_used"] == 0
        assert m["dflash:prefix_cache_queries_total"] > 0
    finally:
        srv.close()
