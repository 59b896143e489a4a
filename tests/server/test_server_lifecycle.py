"""Server lifecycle over real processes: overload 429, warm-up/fatal /health, SIGTERM drain, bind refusal."""

from __future__ import annotations

import json
import sys
import threading

import httpx
import pytest

from dflash_jax.testing.server import FakeServer, free_port
from dflash_jax.testing.waits import run, stretched, wait_exit, wait_until

MODEL = "fake-model"


def running(client: httpx.Client) -> tuple[float, float]:
    vals = {}
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(("dflash:num_requests_running ", "dflash:num_requests_waiting ")):
            name, v = line.split()
            vals[name] = float(v)
    return vals["dflash:num_requests_running"], vals["dflash:num_requests_waiting"]


class Streamer(threading.Thread):
    """A streaming completion in a background thread; records events and lets the test cut it."""

    def __init__(self, url: str, body: dict, stop_after_first: threading.Event | None = None):
        super().__init__(daemon=True)
        self.url, self.body = url, body
        self.first = threading.Event()
        self.cut = stop_after_first
        self.events: list[str] = []
        self.status: int | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with (
                httpx.Client(timeout=stretched(60)) as c,
                c.stream("POST", self.url + "/v1/completions", json={**self.body, "stream": True}) as r,
            ):
                self.status = r.status_code
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        self.events.append(line[6:])
                        self.first.set()
                        if self.cut is not None and self.cut.is_set():
                            return
        except BaseException as e:  # noqa: BLE001 - reported to the test
            self.error = e
        finally:
            self.first.set()


def test_overload_answers_429_at_once_and_recovers():
    with (
        FakeServer(
            "--max-num-seqs",
            "1",
            "--max-queued-requests",
            "1",
            "--step-delay",
            "0.01",
            "--max-model-len",
            "4096",
        ) as srv,
        httpx.Client(base_url=srv.url, timeout=30) as c,
    ):
        cut = threading.Event()
        body = {"model": MODEL, "prompt": "busy", "max_tokens": 3000, "ignore_eos": True}
        streams = [Streamer(srv.url, body, cut) for _ in range(2)]
        for s in streams:
            s.start()
        assert wait_until(lambda: running(c) == (1.0, 1.0))
        r = c.post("/v1/completions", json={"model": MODEL, "prompt": "one more", "max_tokens": 5})
        assert r.status_code == 429
        assert running(c) == (1.0, 1.0)  # answered while the slot and the queue were still taken: it did not wait
        assert int(r.headers["retry-after"]) >= 1
        err = r.json()["error"]
        assert err["type"] == "rate_limit_error" and err["code"] == "server_overloaded"
        assert c.get("/health").status_code == 200
        assert 'dflash:requests_rejected_total{reason="queue_full"} 1.0' in c.get("/metrics").text
        cut.set()
        for s in streams:
            s.join(10)
        assert wait_until(lambda: running(c) == (0.0, 0.0))
        r = c.post("/v1/completions", json={"model": MODEL, "prompt": "now", "max_tokens": 5})
        assert r.status_code == 200


def test_health_503_during_warmup_then_200_then_503_after_fatal_error():
    srv = FakeServer("--warmup-seconds", "2.5", "--fail-after-steps", "3", wait_healthy=False)
    with srv, httpx.Client(base_url=srv.url, timeout=30) as c:
        r = c.get("/health")
        assert r.status_code == 503 and r.json()["error"]["code"] == "server_starting"
        r = c.post("/v1/completions", json={"model": MODEL, "prompt": "early", "max_tokens": 5})
        assert r.status_code == 503 and "retry-after" in r.headers
        assert wait_until(lambda: c.get("/health").status_code == 200)
        r = c.post("/v1/completions", json={"model": MODEL, "prompt": "boom", "max_tokens": 50, "ignore_eos": True})
        assert r.status_code == 500 and "injected device failure" in r.json()["error"]["message"]
        h = c.get("/health")
        assert h.status_code == 503 and h.json()["error"]["code"] == "server_dead"
        r = c.post("/v1/completions", json={"model": MODEL, "prompt": "after", "max_tokens": 5})
        assert r.status_code == 503
        assert "dflash:engine_healthy 0.0" in c.get("/metrics").text


def test_sigterm_drains_in_flight_requests_and_exits_0():
    srv = FakeServer("--step-delay", "0.01", "--max-model-len", "4096", "--shutdown-timeout", "30")
    with srv:
        body = {"model": MODEL, "prompt": "drain me", "max_tokens": 600, "ignore_eos": True, "temperature": 0}
        st = Streamer(srv.url, body)
        st.start()
        assert wait_until(st.first.is_set)
        srv.terminate()
        # while draining: still listening, but new work and /health get 503
        with httpx.Client(base_url=srv.url, timeout=10) as c:
            assert wait_until(lambda: c.get("/health").status_code == 503)
            r = c.post("/v1/completions", json={"model": MODEL, "prompt": "late", "max_tokens": 5})
            assert r.status_code == 503 and r.json()["error"]["code"] == "server_draining"
        assert wait_until(lambda: not st.is_alive())
        assert st.error is None and st.status == 200
        assert st.events[-1] == "[DONE]"
        final = [json.loads(e) for e in st.events[:-1]][-1]
        assert final["choices"][0]["finish_reason"] == "length"
        assert wait_exit(srv.proc) == 0


def test_sigterm_after_shutdown_timeout_aborts_and_exits_0():
    srv = FakeServer("--step-delay", "0.01", "--max-model-len", "4096", "--shutdown-timeout", "0.5")
    with srv:
        st = Streamer(srv.url, {"model": MODEL, "prompt": "too long", "max_tokens": 4000, "ignore_eos": True})
        st.start()
        assert wait_until(st.first.is_set)
        srv.terminate()
        assert wait_exit(srv.proc) == 0
        assert wait_until(lambda: not st.is_alive())
        events = st.events
        assert events[-1] == "[DONE]"
        # aborted at the shutdown timeout: the 4000 tokens (40 s of steps) were not waited for
        assert json.loads(events[-2])["error"]["code"] == "server_shutting_down"


def test_second_sigterm_forces_exit():
    srv = FakeServer("--step-delay", "0.01", "--max-model-len", "4096", "--shutdown-timeout", "60")
    with srv:
        st = Streamer(srv.url, {"model": MODEL, "prompt": "forever", "max_tokens": 4000, "ignore_eos": True})
        st.start()
        assert wait_until(st.first.is_set)
        srv.terminate()
        with httpx.Client(base_url=srv.url, timeout=10) as c:
            assert wait_until(lambda: c.get("/health").status_code == 503)
        srv.terminate()
        assert wait_exit(srv.proc) == 0
        assert wait_until(lambda: not st.is_alive())
        # it did not wait for the 60 s drain: the stream was cut mid-way (a drain ends it with [DONE])
        assert st.error is not None and "[DONE]" not in st.events


def test_non_loopback_bind_without_api_key_is_refused():
    p = run(
        [
            sys.executable,
            "-m",
            "dflash_jax.testing.server",
            "--fake",
            "--host",
            "0.0.0.0",
            "--port",
            str(free_port()),
        ],
    )
    assert p.returncode == 2
    assert "--api-key" in p.stderr and "--allow-remote" in p.stderr


@pytest.mark.parametrize(
    "host,key,allow,ok",
    [
        ("127.0.0.1", None, False, True),
        ("localhost", None, False, True),
        ("::1", None, False, True),
        ("0.0.0.0", None, False, False),
        ("0.0.0.0", "k", False, True),
        ("10.1.2.3", None, True, True),
        ("example.com", None, False, False),
    ],
)
def test_check_bind(host, key, allow, ok):
    from dflash_jax.errors import UserError
    from dflash_jax.server.config import ServeConfig

    cfg = ServeConfig(host=host, api_key=key, allow_remote=allow)
    if ok:
        cfg.check_bind()
    else:
        with pytest.raises(UserError):
            cfg.check_bind()
