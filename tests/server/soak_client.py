"""A fault-injecting load client for soak tests: many requests at a fixed concurrency over real HTTP, a seeded
mix of good requests (greedy and sampled, streamed and not, several choices and prompts), client disconnects,
cancellations mid-stream, malformed and oversize bodies, prompts over the context and unsupported fields. Every
answer's status is recorded by kind; `check(...)` callbacks may verify the bodies of good ones."""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import httpx
import psutil
from prometheus_client.parser import text_string_to_metric_families

from dflash_jax.testing.waits import COMPILE_GUARD_S, GUARD_S, stretched, wait_until

# kind -> the statuses it may get (429 is back-pressure, allowed for good requests; never a 5xx)
EXPECTED = {
    "complete": {200, 429},
    "chat": {200, 429},
    "stream": {200, 429},
    "stream_cancel": {200, 429},
    "disconnect": {None},  # the client leaves before an answer
    "malformed": {400},
    "oversize": {413},
    "over_context": {400},
    "unsupported": {400},
}


@dataclass
class SoakResult:
    sent: int = 0
    statuses: Counter = field(default_factory=Counter)  # (kind, status)
    disconnects: int = 0  # non-streamed requests abandoned before the answer
    cancels: int = 0  # streams closed after a few chunks
    mismatches: list[str] = field(default_factory=list)  # good answers whose body failed a check
    seconds: float = 0.0
    slowest: float = 0.0  # seconds of the longest single request

    @property
    def server_errors(self) -> int:
        return sum(c for (_, s), c in self.statuses.items() if s is not None and s >= 500)

    def unexpected(self) -> dict[tuple[str, int | None], int]:
        return {(k, s): c for (k, s), c in self.statuses.items() if s not in EXPECTED[k]}


@dataclass
class SoakPlan:
    """What to send. `make_prompt(rng)` gives a prompt (text); `long_prompt` overflows the context;
    `check(kind, body, response_json)` returns an error string for a wrong good answer (None when right)."""

    model: str
    make_prompt: Callable[[random.Random], str]
    long_prompt: str
    max_request_bytes: int
    max_tokens: int = 48
    stop_token_ids: list[int] = field(default_factory=list)
    check: Callable[[str, dict, dict], str | None] | None = None
    weights: dict[str, float] = field(
        default_factory=lambda: {
            "complete": 5,
            "chat": 2,
            "stream": 2,
            "stream_cancel": 2,
            "disconnect": 2,
            "malformed": 1,
            "oversize": 1,
            "over_context": 1,
            "unsupported": 1,
        }
    )


def _sampling(rng: random.Random) -> dict:
    if rng.random() < 0.5:
        return {"temperature": 0}
    body: dict = {"temperature": round(rng.uniform(0.3, 1.2), 2), "n": rng.choice([1, 1, 2, 3])}
    if rng.random() < 0.5:
        body["seed"] = rng.randrange(2**31)
    if rng.random() < 0.3:
        body["top_p"] = 0.9
    return body


def _body(plan: SoakPlan, rng: random.Random, chat: bool) -> dict:
    body: dict = {"model": plan.model, "max_tokens": rng.randint(1, plan.max_tokens), **_sampling(rng)}
    if chat:
        body["messages"] = [{"role": "user", "content": plan.make_prompt(rng)}]
    else:
        body["prompt"] = plan.make_prompt(rng) if rng.random() < 0.8 else [plan.make_prompt(rng) for _ in range(2)]
        body["return_token_ids"] = True
    if rng.random() < 0.3:
        body["ignore_eos"] = True
    if rng.random() < 0.15:
        body["stop"] = ["the", "."]
    if plan.stop_token_ids and rng.random() < 0.15:
        body["stop_token_ids"] = [rng.choice(plan.stop_token_ids)]
        if rng.random() < 0.5:
            body["min_tokens"] = rng.randint(0, body["max_tokens"])
    return body


_MALFORMED = [
    b'{"model": ',
    b"[1, 2, 3]",
    b"null",
    b"\xff\xfe\x00garbage",
    b"",
    b'{"model": "%s", "prompt": "x", "temperature": NaN}',
    b'{"model": "%s", "prompt": {"nested": true}}',
    b'{"model": "%s", "messages": [{"role": "robot", "content": "x"}]}',
]


async def _raw_disconnect(url: str, path: str, body: bytes, after_s: float) -> None:
    """Send a request on a raw connection and close it after `after_s` without reading the answer."""
    u = urlsplit(url)
    reader, writer = await asyncio.open_connection(u.hostname, u.port)
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {u.hostname}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    writer.write(head + body)
    await writer.drain()
    await asyncio.sleep(after_s)
    writer.close()
    try:
        await writer.wait_closed()
    except OSError:
        pass


async def _one(client: httpx.AsyncClient, url: str, plan: SoakPlan, rng: random.Random, res: SoakResult) -> None:
    t0 = time.monotonic()
    kind = rng.choices(list(plan.weights), weights=list(plan.weights.values()))[0]
    status: int | None = None
    if kind in ("complete", "chat"):
        chat = kind == "chat"
        body = _body(plan, rng, chat)
        r = await client.post("/v1/chat/completions" if chat else "/v1/completions", json=body)
        status = r.status_code
        if status == 200 and plan.check is not None and (err := plan.check(kind, body, r.json())):
            res.mismatches.append(err)
    elif kind in ("stream", "stream_cancel"):
        chat = rng.random() < 0.5
        body = {**_body(plan, rng, chat), "stream": True}
        body["max_tokens"] = max(body["max_tokens"], 8)
        if kind == "stream_cancel":
            body["ignore_eos"] = True  # long enough to be cut mid-stream
        keep = rng.randint(1, 3)
        async with client.stream("POST", "/v1/chat/completions" if chat else "/v1/completions", json=body) as r:
            status = r.status_code
            seen = 0
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    break
                event = json.loads(line[6:])
                if "error" in event:
                    res.mismatches.append(f"error event in a stream: {event}")
                    break
                seen += 1
                if kind == "stream_cancel" and seen >= keep:
                    res.cancels += 1
                    break  # leaving the block closes the connection mid-stream
    elif kind == "disconnect":
        body = {**_body(plan, rng, False), "max_tokens": plan.max_tokens, "ignore_eos": True}
        await _raw_disconnect(url, "/v1/completions", json.dumps(body).encode(), rng.uniform(0.0, 0.05))
        res.disconnects += 1
    elif kind == "malformed":
        raw = rng.choice(_MALFORMED)
        raw = raw.replace(b"%s", plan.model.encode()) if b"%s" in raw else raw
        r = await client.post(rng.choice(["/v1/completions", "/v1/chat/completions"]), content=raw)
        status = r.status_code
    elif kind == "oversize":
        big = "x" * (plan.max_request_bytes + rng.randint(1, 4096))
        r = await client.post("/v1/completions", json={"model": plan.model, "prompt": big})
        status = r.status_code
    elif kind == "over_context":
        r = await client.post(
            "/v1/completions", json={"model": plan.model, "prompt": plan.long_prompt, "max_tokens": 4}
        )
        status = r.status_code
    else:  # unsupported
        extra = rng.choice([{"presence_penalty": 1.0}, {"logit_bias": {"3": 1.0}}, {"best_of": 3}, {"functions": []}])
        r = await client.post("/v1/completions", json={"model": plan.model, "prompt": "x", **extra})
        status = r.status_code
    res.sent += 1
    res.statuses[(kind, status)] += 1
    res.slowest = max(res.slowest, time.monotonic() - t0)


async def _soak(url: str, plan: SoakPlan, requests: int, concurrency: int, seed: int) -> SoakResult:
    res = SoakResult()
    rng = random.Random(seed)
    seeds = [rng.randrange(2**32) for _ in range(requests)]
    queue: asyncio.Queue[int] = asyncio.Queue()
    for s in seeds:
        queue.put_nowait(s)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    # A server without warm-up compiles each new shape while its queue waits: a request's ceiling is that of a
    # compile-heavy wait, stretched by the machine's load (a hang still ends the soak).
    timeout = httpx.Timeout(stretched(COMPILE_GUARD_S), connect=GUARD_S)
    t0 = time.monotonic()
    async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits) as client:

        async def worker() -> None:
            while not queue.empty():
                await _one(client, url, plan, random.Random(queue.get_nowait()), res)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    res.seconds = time.monotonic() - t0
    return res


def soak(url: str, plan: SoakPlan, *, requests: int, concurrency: int = 16, seed: int = 0) -> SoakResult:
    return asyncio.run(_soak(url, plan, requests, concurrency, seed))


def gauges(url: str) -> dict[str, float]:
    """The server's unlabelled gauges and counters from /metrics."""
    text = httpx.get(url + "/metrics", timeout=10).text
    return {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples if not s.labels}


IDLE = ("dflash:num_requests_running", "dflash:num_requests_waiting", "dflash:num_slots_in_use")


def wait_idle(url: str, guard_s: float = GUARD_S) -> dict[str, float]:
    """Wait until nothing runs, waits or holds a slot (engine and runner); return the last gauges (those of a busy
    server only once the load-stretched `guard_s` is spent)."""
    idle = lambda g: all(g.get(k) == 0 for k in IDLE) and g.get("dflash:runner_slots_in_use") == 0  # noqa: E731
    wait_until(lambda: idle(gauges(url)), guard_s, interval=0.1)
    return gauges(url)


def rss(pid: int) -> int:
    return psutil.Process(pid).memory_info().rss
