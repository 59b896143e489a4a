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


def _stand_in_pool(total: int, used: int, queries: int, hits: int):
    """The attributes /metrics reads of a `spec_decode.pages.PagePool`."""
    stats = types.SimpleNamespace(prefix_queries=queries, prefix_hits=hits, evictions=0)
    return types.SimpleNamespace(total=total, used=used, free=total - used, page_size=16, stats=stats)


def test_pool_metrics_follow_the_pool_at_each_scrape():
    runner, tok = make_fake(max_slots=2, max_model_len=256, record=False)
    app = create_app(runner, tok, ServeConfig(max_num_seqs=2), model_name="m")
    runner.pages = _stand_in_pool(total=200, used=50, queries=640, hits=320)
    with TestClient(app) as c:
        engine = app.state.engine
        engine.stats.preemptions = 3
        m = _scrape(c)
        assert m["dflash:kv_cache_usage_perc"] == 0.25  # 50 / 200
        assert (m["dflash:kv_pages_total"], m["dflash:kv_pages_used"]) == (200, 50)
        assert (m["dflash:prefix_cache_queries_total"], m["dflash:prefix_cache_hits_total"]) == (640, 320)
        assert m["dflash:num_preemptions_total"] == 3
        runner.pages.used, runner.pages.stats.prefix_hits, engine.stats.preemptions = 150, 336, 4
        m = _scrape(c)
        assert m["dflash:kv_cache_usage_perc"] == 0.75 and m["dflash:kv_pages_used"] == 150
        assert m["dflash:prefix_cache_hits_total"] == 336 and m["dflash:num_preemptions_total"] == 4
        r = c.post("/v1/completions", json={"model": "m", "prompt": "hello", "max_tokens": 3, "temperature": 0})
        assert r.status_code == 200  # a request with a stand-in pool in place: serving is unaffected


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
    engine.runner.pages = _stand_in_pool(total=0, used=0, queries=0, hits=0)  # an empty pool: usage 0, not NaN
    m = {
        s.name: s.value
        for fam in text_string_to_metric_families(generate_latest(registry).decode())
        for s in fam.samples
    }
    assert m["dflash:kv_cache_usage_perc"] == 0.0 and m["dflash:prefix_cache_queries_total"] == 0
