"""/metrics for the KV page pool: read at scrape time from the runner's `pages` and the engine's `stats`."""

from __future__ import annotations

import math
import types

from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from dflash_jax.server.app import create_app
from dflash_jax.server.config import ServeConfig
from dflash_jax.server.metrics import KVPoolCollector
from dflash_jax.testing.fake_runner import make_fake

POOL_METRICS = ("dflash:kv_cache_usage_perc", "dflash:kv_pages_total", "dflash:kv_pages_used")
COUNTERS = ("dflash:prefix_cache_queries_total", "dflash:prefix_cache_hits_total", "dflash:num_preemptions_total")


def _scrape(c: TestClient) -> dict[str, float]:
    r = c.get("/metrics")
    assert r.status_code == 200
    return {s.name: s.value for fam in text_string_to_metric_families(r.text) for s in fam.samples if not s.labels}


def test_pool_metrics_follow_the_pool_at_each_scrape():
    runner, tok = make_fake(max_slots=2, max_model_len=256, record=False, num_pages=201)
    app = create_app(runner, tok, ServeConfig(max_num_seqs=2), model_name="m")
    pool = runner.pages
    with TestClient(app) as c:
        engine = app.state.engine
        m = _scrape(c)
        assert (m["dflash:kv_pages_total"], m["dflash:kv_pages_used"], m["dflash:kv_cache_usage_perc"]) == (200, 0, 0)
        prompt = list(range(1, 41))
        pool.allocate("a", prompt, 800)  # 50 pages
        pool.commit("a", prompt, 40)
        pool.allocate("b", prompt, 40)  # 2 cached pages (32 tokens) + 1 fresh
        engine.stats.preemptions = 3
        m = _scrape(c)
        assert m["dflash:kv_cache_usage_perc"] == 0.255  # 51 / 200
        assert (m["dflash:kv_pages_total"], m["dflash:kv_pages_used"]) == (200, 51)
        assert (m["dflash:prefix_cache_queries_total"], m["dflash:prefix_cache_hits_total"]) == (80, 32)
        assert m["dflash:num_preemptions_total"] == 3
        pool.free_seq("a"), pool.free_seq("b")
        engine.stats.preemptions = 4
        m = _scrape(c)
        assert m["dflash:kv_cache_usage_perc"] == 0 and m["dflash:kv_pages_used"] == 0
        assert m["dflash:num_preemptions_total"] == 4
        r = c.post("/v1/completions", json={"model": "m", "prompt": "hello", "max_tokens": 3, "temperature": 0})
        assert r.status_code == 200
        assert _scrape(c)["dflash:kv_pages_used"] == 0  # the finished request's pages went back


def test_without_a_pool_the_gauges_are_nan_and_the_counters_absent():
    registry = CollectorRegistry()
    engine = types.SimpleNamespace(runner=types.SimpleNamespace(), stats=types.SimpleNamespace())  # neither
    registry.register(KVPoolCollector(engine))
    m = {
        s.name: s.value
        for fam in text_string_to_metric_families(generate_latest(registry).decode())
        for s in fam.samples
    }
    assert set(m) == set(POOL_METRICS) and all(math.isnan(v) for v in m.values())
    engine.stats.preemptions = 2  # an engine that counts preemptions, a runner without a pool
    m = {
        s.name: s.value
        for fam in text_string_to_metric_families(generate_latest(registry).decode())
        for s in fam.samples
    }
    assert m["dflash:num_preemptions_total"] == 2 and "dflash:prefix_cache_hits_total" not in m
