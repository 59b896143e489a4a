"""The load generator of `dflash-jax bench serve`: an async client against a running OpenAI-compatible server.

For each concurrency level it sends `num_prompts` streamed requests with at most `concurrency` in flight and
reports TTFT, TPOT, ITL and end-to-end latency (mean, p50, p90, p99, in ms), request and token throughput,
tokens per SSE chunk, and the server's speculation figures for that level (acceptance length, acceptance
rate, per-position acceptance) from the difference of its /metrics counters before and after the level.
ITL is the gap between content chunks; under speculation a chunk can carry several tokens, so TPOT
(= (e2e - ttft) / (completion_tokens - 1)) is the per-token figure to compare.

Given two URLs (a speculative server and a `--no-spec` baseline, in that order) it runs the same prompts
against each and reports the speedup per concurrency (output tokens/s and TPOT), and plots it.

Entry point: `serve_bench(urls, concurrency=..., num_prompts=..., prompts_file=..., json_out=..., plot=...)`.
"""

from __future__ import annotations

import asyncio
import datetime as _dt
import json
import math
import platform
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from dflash_jax.bench.prompts import interleave_categories, load_prompt_file
from dflash_jax.errors import UserError

RESULT_VERSION = 1

DEFAULT_PROMPTS: list[dict[str, Any]] = [
    {"messages": [{"role": "user", "content": c}]}
    for c in [
        "Explain in a few sentences how a hash table works.",
        "Write a short poem about the sea.",
        "What is the capital of France? Answer and then describe the city briefly.",
        "Give three tips for writing clean Python code.",
        "Solve: a train travels 120 km in 1.5 hours. What is its average speed? Show your steps.",
        "Summarize the plot of Romeo and Juliet in one paragraph.",
        "List five fruits and one fact about each.",
        "How do I reverse a list in Python? Show two ways.",
        "Describe the water cycle for a ten-year-old.",
        "What are the differences between TCP and UDP?",
        "Write a haiku about autumn leaves.",
        "If I have 3 apples and buy 7 more, then eat 2, how many do I have? Explain.",
        "Translate 'good morning, how are you?' into French and Spanish.",
        "What is photosynthesis?",
        "Write a Python function that checks whether a number is prime.",
        "Give a short history of the printing press.",
    ]
]


@dataclass
class RequestResult:
    ok: bool
    ttft: float | None = None
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    chunks: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.completion_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.completion_tokens - 1)


def parse_concurrency(text: str | Sequence[int]) -> list[int]:
    """'1,2,4,8' -> [1, 2, 4, 8] (each >= 1)."""
    if not isinstance(text, str):
        vals = [int(v) for v in text]
    else:
        try:
            vals = [int(v) for v in text.split(",") if v.strip()]
        except ValueError:
            raise UserError(f"--concurrency must be a comma-separated list of integers, got {text!r}") from None
    if not vals or any(v < 1 for v in vals):
        raise UserError(f"--concurrency values must be >= 1, got {text!r}")
    return vals


def load_prompts(path: str | Path | None, category: str | None = None) -> list[dict[str, Any]]:
    """The prompts of a JSON Lines file (`bench.prompts.load_prompt_file`; a line may set `max_tokens`), of the
    held-out workload categories taken in turn (`bench.prompts.interleave_categories`), or a built-in set of short
    chats when neither is given."""
    if category is not None:
        if path is not None:
            raise UserError("--category and --prompts: give one of them", param="--category")
        return interleave_categories(category)
    return list(DEFAULT_PROMPTS) if path is None else load_prompt_file(path)


def percentiles(values: Sequence[float], scale: float = 1000.0) -> dict[str, float | None]:
    """mean/p50/p90/p99 (linear interpolation), scaled (s -> ms by default); None when empty."""
    if not values:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    xs = sorted(values)

    def q(p: float) -> float:
        k = (len(xs) - 1) * p
        lo, hi = math.floor(k), math.ceil(k)
        return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)

    return {
        "mean": scale * sum(xs) / len(xs),
        "p50": scale * q(0.5),
        "p90": scale * q(0.9),
        "p99": scale * q(0.99),
    }


# ----------------------------------------------------------------------------------------- /metrics


_SPEC_COUNTERS = {
    "dflash:spec_decode_num_drafts_total": "num_drafts",
    "dflash:spec_decode_num_draft_tokens_total": "num_draft_tokens",
    "dflash:spec_decode_num_accepted_tokens_total": "num_accepted_tokens",
    "dflash:generation_tokens_total": "generation_tokens",
}


async def scrape_spec(client: httpx.AsyncClient, url: str) -> dict[str, Any] | None:
    """The server's speculation counters (None when /metrics is not there)."""
    try:
        r = await client.get(url.rstrip("/") + "/metrics", timeout=10)
    except httpx.HTTPError:
        return None
    if r.status_code != 200:
        return None
    out: dict[str, Any] = {"per_pos": {}}
    for line in r.text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name_labels, _, value = line.rpartition(" ")
        name, _, labels = name_labels.partition("{")
        if name in _SPEC_COUNTERS:
            out[_SPEC_COUNTERS[name]] = float(value)
        elif name == "dflash:spec_decode_num_accepted_tokens_per_pos_total" and 'position="' in labels:
            pos = int(labels.split('position="')[1].split('"')[0])
            out["per_pos"][pos] = float(value)
    return out


def spec_delta(before: dict[str, Any] | None, after: dict[str, Any] | None) -> dict[str, Any] | None:
    if before is None or after is None:
        return None

    def d(key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    drafts, draft_toks, acc = d("num_drafts"), d("num_draft_tokens"), d("num_accepted_tokens")
    positions = sorted(set(after["per_pos"]) | set(before["per_pos"]))
    per_pos = [
        (after["per_pos"].get(p, 0.0) - before["per_pos"].get(p, 0.0)) / drafts if drafts else None for p in positions
    ]
    return {
        "num_drafts": int(drafts),
        "num_draft_tokens": int(draft_toks),
        "num_accepted_tokens": int(acc),
        "mean_acceptance_length": 1.0 + acc / drafts if drafts else None,
        "acceptance_rate": acc / draft_toks if draft_toks else None,
        "acceptance_by_position": per_pos,
    }


# ------------------------------------------------------------------------------------------ requests


async def _one(
    client: httpx.AsyncClient,
    url: str,
    model: str,
    item: dict[str, Any],
    *,
    max_tokens: int,
    temperature: float,
    ignore_eos: bool,
    headers: dict[str, str],
) -> RequestResult:
    chat = "messages" in item
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": int(item.get("max_tokens", max_tokens)),
        "temperature": temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if ignore_eos:
        body["ignore_eos"] = True
    body["messages" if chat else "prompt"] = item["messages" if chat else "prompt"]
    endpoint = url.rstrip("/") + ("/v1/chat/completions" if chat else "/v1/completions")
    res = RequestResult(ok=False)
    t0 = time.perf_counter()
    last = t0
    try:
        async with client.stream("POST", endpoint, json=body, headers=headers) as r:
            if r.status_code != 200:
                text = (await r.aread()).decode("utf-8", "replace")
                res.error = f"HTTP {r.status_code}: {text[:300]}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    res.ok = res.error is None
                    break
                ev = json.loads(data)
                if "error" in ev:
                    res.error = ev["error"].get("message", "error event")
                    continue
                if ev.get("usage"):
                    res.prompt_tokens = ev["usage"]["prompt_tokens"]
                    res.completion_tokens = ev["usage"]["completion_tokens"]
                for ch in ev.get("choices", []):
                    piece = (ch.get("delta") or {}).get("content") if chat else ch.get("text")
                    if piece:
                        now = time.perf_counter()
                        if res.ttft is None:
                            res.ttft = now - t0
                        else:
                            res.itl.append(now - last)
                        last = now
                        res.chunks += 1
    except (httpx.HTTPError, ValueError) as e:
        res.error = f"{type(e).__name__}: {e}"
    res.e2e = time.perf_counter() - t0
    return res


async def _level(
    client: httpx.AsyncClient,
    url: str,
    model: str,
    prompts: list[dict[str, Any]],
    concurrency: int,
    num_prompts: int,
    **kw: Any,
) -> dict[str, Any]:
    sem = asyncio.Semaphore(concurrency)

    async def run(i: int) -> RequestResult:
        async with sem:
            return await _one(client, url, model, prompts[i % len(prompts)], **kw)

    before = await scrape_spec(client, url)
    t0 = time.perf_counter()
    results = await asyncio.gather(*[run(i) for i in range(num_prompts)])
    duration = time.perf_counter() - t0
    after = await scrape_spec(client, url)
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.completion_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    chunks = sum(r.chunks for r in ok)
    return {
        "concurrency": concurrency,
        "num_prompts": num_prompts,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if r.error})[:5],
        "duration_s": duration,
        "input_tokens": in_tokens,
        "output_tokens": out_tokens,
        "request_throughput": len(ok) / duration if duration else None,
        "output_throughput": out_tokens / duration if duration else None,
        "total_token_throughput": (in_tokens + out_tokens) / duration if duration else None,
        "tokens_per_chunk": out_tokens / chunks if chunks else None,
        "ttft_ms": percentiles([r.ttft for r in ok if r.ttft is not None]),
        "tpot_ms": percentiles([t for r in ok if (t := r.tpot) is not None]),
        "itl_ms": percentiles([x for r in ok for x in r.itl]),
        "e2el_ms": percentiles([r.e2e for r in ok]),
        "spec_decode": spec_delta(before, after),
    }


async def _model_of(client: httpx.AsyncClient, url: str, headers: dict[str, str]) -> str:
    try:
        r = await client.get(url.rstrip("/") + "/v1/models", headers=headers, timeout=30)
        r.raise_for_status()
        return r.json()["data"][0]["id"]
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as e:
        raise UserError(f"could not read the model id from {url}/v1/models ({e}); pass --model") from None


async def _bench_url(
    url: str,
    *,
    levels: list[int],
    num_prompts: int | None,
    prompts: list[dict[str, Any]],
    model: str | None,
    api_key: str | None,
    warmup: int,
    timeout: float,
    **kw: Any,
) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=max(levels) + 4, max_keepalive_connections=max(levels) + 4)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        model_id = model or await _model_of(client, url, headers)
        for i in range(warmup):
            await _one(client, url, model_id, prompts[i % len(prompts)], headers=headers, **kw)
        records = []
        for c in levels:
            n = num_prompts if num_prompts is not None else max(8, 4 * c)
            records.append(await _level(client, url, model_id, prompts, c, n, headers=headers, **kw))
    return {"url": url, "model": model_id, "levels": records}


def _speedups(spec: dict[str, Any], base: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for a, b in zip(spec["levels"], base["levels"], strict=True):
        thr = (
            a["output_throughput"] / b["output_throughput"]
            if a["output_throughput"] and b["output_throughput"]
            else None
        )
        tpot = b["tpot_ms"]["mean"] / a["tpot_ms"]["mean"] if a["tpot_ms"]["mean"] and b["tpot_ms"]["mean"] else None
        out.append({"concurrency": a["concurrency"], "output_throughput_speedup": thr, "tpot_speedup": tpot})
    return out


def _git_sha() -> str | None:
    try:
        return (
            subprocess.run(
                ["git", "rev-parse", "HEAD"],
                capture_output=True,
                text=True,
                timeout=5,
                cwd=Path(__file__).resolve().parent,
            ).stdout.strip()
            or None
        )
    except (OSError, subprocess.SubprocessError):
        return None


def _fmt(v: float | None, nd: int = 1) -> str:
    return "-" if v is None else f"{v:.{nd}f}"


def format_report(result: dict[str, Any]) -> str:
    lines = []
    for run in result["runs"]:
        lines.append(f"== {run['label']}: {run['url']} (model {run['model']})")
        lines.append(
            f"{'conc':>4} {'ok':>4} {'fail':>4} {'req/s':>7} {'out tok/s':>10} {'ttft p50':>9} "
            f"{'ttft p99':>9} {'tpot p50':>9} {'tpot p99':>9} {'itl p50':>8} {'itl p99':>8} "
            f"{'tok/chunk':>9} {'acc len':>7}"
        )
        for lv in run["levels"]:
            sd = lv["spec_decode"] or {}
            lines.append(
                f"{lv['concurrency']:>4} {lv['completed']:>4} {lv['failed']:>4} "
                f"{_fmt(lv['request_throughput'], 2):>7} {_fmt(lv['output_throughput']):>10} "
                f"{_fmt(lv['ttft_ms']['p50']):>9} {_fmt(lv['ttft_ms']['p99']):>9} "
                f"{_fmt(lv['tpot_ms']['p50'], 2):>9} {_fmt(lv['tpot_ms']['p99'], 2):>9} "
                f"{_fmt(lv['itl_ms']['p50'], 2):>8} {_fmt(lv['itl_ms']['p99'], 2):>8} "
                f"{_fmt(lv['tokens_per_chunk'], 2):>9} {_fmt(sd.get('mean_acceptance_length'), 2):>7}"
            )
            if sd.get("acceptance_by_position"):
                per = ", ".join(_fmt(x, 2) for x in sd["acceptance_by_position"])
                lines.append(f"     acceptance rate {_fmt(100 * (sd['acceptance_rate'] or 0))}%, by position: {per}")
            for err in lv["errors"]:
                lines.append(f"     error: {err}")
    if result.get("speedup"):
        lines.append("== speedup (spec vs baseline)")
        lines.append(f"{'conc':>4} {'out tok/s x':>12} {'tpot x':>8}")
        for s in result["speedup"]:
            lines.append(
                f"{s['concurrency']:>4} {_fmt(s['output_throughput_speedup'], 2):>12} {_fmt(s['tpot_speedup'], 2):>8}"
            )
    return "\n".join(lines)


def plot_result(result: dict[str, Any], path: str | Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    two = bool(result.get("speedup"))
    fig, axes = plt.subplots(1, 3 if two else 2, figsize=(15 if two else 10, 4))
    for run in result["runs"]:
        conc = [lv["concurrency"] for lv in run["levels"]]
        axes[0].plot(conc, [lv["output_throughput"] or 0 for lv in run["levels"]], marker="o", label=run["label"])
        axes[1].plot(conc, [lv["tpot_ms"]["mean"] or 0 for lv in run["levels"]], marker="o", label=run["label"])
    axes[0].set(xlabel="concurrency", ylabel="output tokens/s", title="throughput", xscale="log", xticks=conc)
    axes[1].set(xlabel="concurrency", ylabel="ms", title="mean TPOT", xscale="log", xticks=conc)
    if two:
        conc = [s["concurrency"] for s in result["speedup"]]
        axes[2].plot(
            conc,
            [s["output_throughput_speedup"] or 0 for s in result["speedup"]],
            marker="o",
            label="output tok/s",
        )
        axes[2].plot(conc, [s["tpot_speedup"] or 0 for s in result["speedup"]], marker="s", label="TPOT")
        axes[2].axhline(1.0, color="grey", lw=0.8, ls="--")
        axes[2].set(xlabel="concurrency", ylabel="speedup (x)", title="spec vs baseline", xscale="log", xticks=conc)
    for ax in axes:
        ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.get_xaxis().set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def serve_bench(
    urls: str | Sequence[str],
    *,
    concurrency: str | Sequence[int] = (1, 2, 4, 8),
    num_prompts: int | None = None,
    prompts_file: str | Path | None = None,
    category: str | None = None,
    json_out: str | Path | None = None,
    plot: str | Path | None = None,
    max_tokens: int = 128,
    temperature: float = 0.0,
    ignore_eos: bool = False,
    model: str | None = None,
    api_key: str | None = None,
    labels: Sequence[str] | None = None,
    warmup: int = 1,
    timeout: float = 600.0,
    quiet: bool = False,
) -> dict[str, Any]:
    """Run the benchmark; print the report (unless `quiet`), write JSON/PNG if asked; return the result.

    `urls`: one server, or two (speculative first, baseline second) for a speedup report. `num_prompts`:
    requests per concurrency level (default max(8, 4 x concurrency)). `category`: the held-out workload
    categories (`edit,chat`: a mixed workload, the categories' prompts taken in turn) instead of `prompts_file`.
    """
    url_list = [urls] if isinstance(urls, str) else list(urls)
    if not 1 <= len(url_list) <= 2:
        raise UserError("--url takes one server, or two (speculative, then baseline) for a speedup report")
    if max_tokens < 1:
        raise UserError(f"--max-tokens must be >= 1, got {max_tokens}")
    if num_prompts is not None and num_prompts < 1:
        raise UserError(f"--num-prompts must be >= 1, got {num_prompts}")
    levels = parse_concurrency(concurrency)
    prompts = load_prompts(prompts_file, category)
    names = list(labels) if labels else (["spec", "baseline"] if len(url_list) == 2 else ["server"])
    kw = {"max_tokens": max_tokens, "temperature": temperature, "ignore_eos": ignore_eos}
    runs = []
    for label, url in zip(names, url_list, strict=True):
        run = asyncio.run(
            _bench_url(
                url,
                levels=levels,
                num_prompts=num_prompts,
                prompts=prompts,
                model=model,
                api_key=api_key,
                warmup=warmup,
                timeout=timeout,
                **kw,
            )
        )
        runs.append({"label": label, **run})
    result: dict[str, Any] = {
        "version": RESULT_VERSION,
        "timestamp": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "git_sha": _git_sha(),
        "machine": {
            "host": platform.node(),
            "platform": platform.platform(),
            "python": platform.python_version(),
        },
        "config": {
            "concurrency": levels,
            "num_prompts": num_prompts,
            "max_tokens": max_tokens,
            "temperature": temperature,
            "ignore_eos": ignore_eos,
            "warmup": warmup,
            "prompts_file": str(prompts_file) if prompts_file else None,
            "category": category,
            "num_distinct_prompts": len(prompts),
        },
        "runs": runs,
        "speedup": _speedups(runs[0], runs[1]) if len(runs) == 2 else None,
    }
    if not quiet:
        print(format_report(result), flush=True)
    if json_out:
        Path(json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(json_out).write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    if plot:
        plot_result(result, plot)
    return result
