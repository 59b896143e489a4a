"""A bounded soak: the real server process (fake runner) over real HTTP, two rounds of requests at concurrency 16
with client disconnects, cancellations mid-stream, malformed and oversize bodies, prompts over the context and
mixed greedy/sampled requests. Afterwards: no 5xx, every status as expected, greedy answers exactly the fake
model's, every slot free (engine and runner), and the server's RSS does not keep growing in round 2."""

from __future__ import annotations

import random

import pytest

from dflash_jax.testing.fake_runner import make_fake
from dflash_jax.testing.server import FakeServer
from tests.server.soak_client import SoakPlan, rss, soak, wait_idle

pytestmark = pytest.mark.slow

MODEL = "soak-model"
MAX_MODEL_LEN = 256
MAX_BYTES = 16384
REQUESTS = 3000  # per round
RSS_GROWTH_BOUND = 8 * 2**20  # round 2 (same load as round 1) may add at most this much resident memory

RUNNER, TOK = make_fake(max_model_len=MAX_MODEL_LEN)
WORDS = "the quick brown fox jumps over a lazy dog café 你好 🚀 and then some more words".split()


def _prompt(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 12)))


def _check(kind: str, body: dict, resp: dict) -> str | None:
    """Greedy, single-prompt completions without stops are the fake model's continuation exactly."""
    if kind != "complete" or body.get("temperature") != 0 or not isinstance(body["prompt"], str):
        return None
    if body.get("stop") or body.get("stop_token_ids"):
        return None
    want = RUNNER.continuation(TOK.encode(body["prompt"]), body["max_tokens"])
    if not body.get("ignore_eos") and TOK.im_end_id in want:
        want = want[: want.index(TOK.im_end_id) + 1]
    got = resp["choices"][0]["token_ids"]
    return None if got == want else f"{body['prompt']!r}: got {got[:8]}..., want {want[:8]}..."


def test_soak_no_5xx_no_leaked_slot_no_growing_memory():
    plan = SoakPlan(
        model=MODEL,
        make_prompt=_prompt,
        long_prompt="the quick brown fox " * 200,  # > MAX_MODEL_LEN tokens, < MAX_BYTES
        max_request_bytes=MAX_BYTES,
        max_tokens=48,
        stop_token_ids=TOK.encode(" the fox dog"),
        check=_check,
    )
    assert len(TOK.encode(plan.long_prompt)) > MAX_MODEL_LEN and len(plan.long_prompt) < MAX_BYTES
    args = ["--served-model-name", MODEL, "--max-num-seqs", "16", "--max-queued-requests", "64"]
    args += ["--max-model-len", str(MAX_MODEL_LEN), "--max-request-bytes", str(MAX_BYTES), "--step-delay", "0.001"]
    with FakeServer(*args) as srv:
        assert srv.proc is not None
        soak(srv.url, plan, requests=60, concurrency=16, seed=99)  # warm-up: imports, caches, pools
        wait_idle(srv.url)
        rss0 = rss(srv.proc.pid)
        rounds = []
        for seed in (1, 2):
            res = soak(srv.url, plan, requests=REQUESTS, concurrency=16, seed=seed)
            after = wait_idle(srv.url)
            rounds.append((res, after, rss(srv.proc.pid)))
    (r1, g1, rss1), (r2, g2, rss2) = rounds
    for res, g in ((r1, g1), (r2, g2)):
        print(
            f"soak: {res.sent} requests in {res.seconds:.1f} s, {res.disconnects} disconnects, {res.cancels} "
            f"mid-stream cancels, 5xx {res.server_errors}, statuses {dict(sorted(res.statuses.items(), key=str))}, "
            f"after: running {g['dflash:num_requests_running']:.0f}, waiting {g['dflash:num_requests_waiting']:.0f}, "
            f"slots in use {g['dflash:num_slots_in_use']:.0f} (runner {g['dflash:runner_slots_in_use']:.0f})"
        )
    mib = [f"{x / 2**20:.1f}" for x in (rss0, rss1, rss2)]
    print(f"soak RSS (MiB): after warm-up {mib[0]}, after round 1 {mib[1]}, after round 2 {mib[2]}")
    for res, g in ((r1, g1), (r2, g2)):
        assert res.sent == REQUESTS and res.server_errors == 0
        assert not res.unexpected(), res.unexpected()
        assert not res.mismatches, res.mismatches[:5]
        assert res.disconnects > 0 and res.cancels > 0
        assert sum(c for (k, s), c in res.statuses.items() if k == "complete" and s == 200) > 50
        for name in ("dflash:num_requests_running", "dflash:num_requests_waiting", "dflash:num_slots_in_use"):
            assert g[name] == 0, (name, g[name])
        assert g["dflash:runner_slots_in_use"] == 0
        assert g["dflash:engine_healthy"] == 1
    assert rss2 - rss1 < RSS_GROWTH_BOUND, (rss0, rss1, rss2)
