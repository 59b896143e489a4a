"""Prometheus metrics (names follow vLLM's with a `dflash:` prefix so dashboards port).

Speculation (per sequence per step, vLLM's definitions): `dflash:spec_decode_num_drafts_total` (speculative
steps), `..._num_draft_tokens_total`, `..._num_accepted_tokens_total`,
`..._num_accepted_tokens_per_pos_total{position}`; mean acceptance length = 1 + accepted / drafts is also
exported as the gauge `dflash:spec_decode_mean_acceptance_length` (over the server's life) and per step as
the histogram `dflash:spec_decode_acceptance_length`.

KV page pool, read at scrape time from the runner's `pages` (a `kv.pages.PagePool`) and the engine's
`stats`: `dflash:kv_cache_usage_perc` (pages used / pages total, 0..1), `dflash:kv_pages_total`,
`dflash:kv_pages_used`, `dflash:prefix_cache_queries_total` / `dflash:prefix_cache_hits_total` (prompt tokens
looked up in the prefix cache / found there) and `dflash:num_preemptions_total`. Without a pool the gauges are
NaN and the prefix-cache counters absent; without an engine preemption count that counter is absent.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from dflash_jax.engine.engine import Engine
from dflash_jax.engine.types import EngineObserver, RequestRecord, accepted_positions
from dflash_jax.types import StepResult

_LATENCY_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
_TPOT_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.0075,
    0.01,
    0.015,
    0.02,
    0.03,
    0.04,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
)


class ServerMetrics(EngineObserver):
    """All server metrics in a private registry; also the engine's observer."""

    def __init__(self, model_name: str, speculative: bool):
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.running = Gauge("dflash:num_requests_running", "Requests in a runner slot.", registry=r)
        self.waiting = Gauge("dflash:num_requests_waiting", "Requests queued for a slot.", registry=r)
        self.slots_in_use = Gauge(
            "dflash:num_slots_in_use", "Engine slots taken (a slot is free again once its request ends).", registry=r
        )
        self.runner_slots_in_use = Gauge(
            "dflash:runner_slots_in_use", "Slots the runner holds state for (not yet released).", registry=r
        )
        self.healthy = Gauge("dflash:engine_healthy", "1 when serving normally, 0 otherwise.", registry=r)
        self.spec_enabled = Gauge("dflash:spec_decode_enabled", "1 when speculative decoding is on.", registry=r)
        self.spec_enabled.set(1 if speculative else 0)
        self.info = Gauge("dflash:model_info", "Served model (label).", ["model_name"], registry=r)
        self.info.labels(model_name=model_name).set(1)

        self.success = Counter(
            "dflash:request_success", "Finished requests by finish reason.", ["finished_reason"], registry=r
        )
        self.rejected = Counter("dflash:requests_rejected", "Requests refused before queueing.", ["reason"], registry=r)
        self.prompt_tokens = Counter("dflash:prompt_tokens", "Prompt tokens of finished requests.", registry=r)
        self.generation_tokens = Counter(
            "dflash:generation_tokens",
            "Generated tokens of finished requests (usage.completion_tokens).",
            registry=r,
        )
        self.ttft = Histogram(
            "dflash:time_to_first_token_seconds",
            "Arrival to first generated token.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "dflash:time_per_output_token_seconds",
            "Mean time per output token after the first.",
            buckets=_TPOT_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "dflash:e2e_request_latency_seconds", "Arrival to finish.", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.step_time = Histogram(
            "dflash:engine_step_seconds", "Duration of one runner.step.", buckets=_TPOT_BUCKETS, registry=r
        )
        self.prefill_time = Histogram(
            "dflash:engine_prefill_seconds",
            "Duration of one batched prefill (runner.add_many: the requests admitted together).",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.prefill_batch = Histogram(
            "dflash:engine_prefill_batch_size",
            "Requests admitted together in one batched prefill.",
            buckets=(1, 2, 4, 8, 16, 32, 64, 128),
            registry=r,
        )

        self.num_drafts = Counter("dflash:spec_decode_num_drafts", "Speculative steps (per sequence).", registry=r)
        self.num_draft_tokens = Counter("dflash:spec_decode_num_draft_tokens", "Draft tokens verified.", registry=r)
        self.num_accepted = Counter("dflash:spec_decode_num_accepted_tokens", "Draft tokens accepted.", registry=r)
        self.accepted_per_pos = Counter(
            "dflash:spec_decode_num_accepted_tokens_per_pos",
            "Accepted draft tokens by position (0-based).",
            ["position"],
            registry=r,
        )
        self.acceptance_length = Histogram(
            "dflash:spec_decode_acceptance_length",
            "Tokens committed per speculative step (accepted + 1).",
            buckets=tuple(float(i) for i in range(1, 18)),
            registry=r,
        )
        self.mean_acceptance_length = Gauge(
            "dflash:spec_decode_mean_acceptance_length",
            "1 + accepted / drafts over the server's life.",
            registry=r,
        )
        self._drafts = 0
        self._accepted = 0

    def bind(self, engine: Engine) -> None:
        self.running.set_function(lambda: engine.num_running)
        self.waiting.set_function(lambda: engine.num_waiting)
        self.slots_in_use.set_function(lambda: engine.num_slots_in_use)
        self.runner_slots_in_use.set_function(lambda: _runner_slots(engine))
        self.healthy.set_function(lambda: 1.0 if engine.ready else 0.0)
        self.registry.register(KVPoolCollector(engine))

    # EngineObserver -------------------------------------------------------------------------------------

    def request_finished(self, rec: RequestRecord) -> None:
        self.success.labels(finished_reason=rec.finish_reason).inc()
        self.prompt_tokens.inc(rec.num_prompt_tokens)
        self.generation_tokens.inc(rec.num_completion_tokens)
        if rec.ttft is not None:
            self.ttft.observe(rec.ttft)
        if rec.tpot is not None:
            self.tpot.observe(rec.tpot)
        self.e2e.observe(rec.e2e)

    def spec_step(self, res: StepResult) -> None:
        self.num_drafts.inc()
        self.num_draft_tokens.inc(res.num_drafts)
        self.num_accepted.inc(res.num_accepted)
        for i in accepted_positions(res):
            self.accepted_per_pos.labels(position=str(i)).inc()
        self.acceptance_length.observe(res.num_accepted + 1)
        self._drafts += 1
        self._accepted += res.num_accepted
        self.mean_acceptance_length.set(1.0 + self._accepted / self._drafts)

    def step_done(self, num_running: int, seconds: float) -> None:
        self.step_time.observe(seconds)

    def prefill_done(self, prompt_lens: Sequence[int], seconds: float) -> None:
        self.prefill_time.observe(seconds)
        self.prefill_batch.observe(len(prompt_lens))

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _runner_slots(engine: Engine) -> float:
    """The number of slots with state in the runner (its `slots` mapping), NaN for a runner without one."""
    held = getattr(engine.runner, "slots", None)
    return float(len(held)) if held is not None else float("nan")


class KVPoolCollector:
    """The KV page pool's gauges and counters, read from `engine.runner.pages` and `engine.stats` at each scrape."""

    def __init__(self, engine: Engine):
        self.engine = engine

    def describe(self) -> list[Metric]:
        return [*self._gauges(None), *self._counters(None, None, describe=True)]

    def collect(self) -> Iterator[Metric]:
        pages = getattr(self.engine.runner, "pages", None)
        yield from self._gauges(pages)
        yield from self._counters(pages, getattr(self.engine.stats, "preemptions", None))

    @staticmethod
    def _gauges(pages: object) -> list[Metric]:
        total = getattr(pages, "total", None)
        used = getattr(pages, "used", None)
        nan = float("nan")
        usage = nan if total is None or used is None else (used / total if total else 0.0)
        values = (
            ("dflash:kv_cache_usage_perc", "KV page pool usage: pages used / pages total (0..1).", usage),
            ("dflash:kv_pages_total", "Pages of the KV pool sequences can use (the null page excluded).", total),
            ("dflash:kv_pages_used", "KV pool pages referenced by at least one sequence.", used),
        )
        out: list[Metric] = []
        for name, doc, v in values:
            g = GaugeMetricFamily(name, doc)
            g.add_metric([], nan if v is None else float(v))
            out.append(g)
        return out

    @staticmethod
    def _counters(pages: object, preemptions: int | None, *, describe: bool = False) -> list[Metric]:
        stats = getattr(pages, "stats", None)
        values = (
            (
                "dflash:prefix_cache_queries",
                "Prompt tokens looked up in the prefix cache.",
                getattr(stats, "prefix_queries", None),
            ),
            (
                "dflash:prefix_cache_hits",
                "Prompt tokens found in the prefix cache (of those looked up).",
                getattr(stats, "prefix_hits", None),
            ),
            (
                "dflash:num_preemptions",
                "Sequences preempted (their KV pages freed, to be recomputed) for want of KV pages.",
                preemptions,
            ),
        )
        out: list[Metric] = []
        for name, doc, v in values:
            c = CounterMetricFamily(name, doc)
            if v is not None:
                c.add_metric([], float(v))
            if v is not None or describe:
                out.append(c)
        return out
