"""The real server (`dflash-jax serve`: a tiny random Llama written to tmp_path, a random drafter, speculative) over
real HTTP: schemathesis over its own /openapi.json, a bounded number of examples per operation, valid (positive)
and schema-violating (negative) bodies; no 5xx, every answer has a documented status, media type and body, and
bodies that violate the schema are refused. Then a short soak on the same process: disconnects, cancellations,
bad bodies, sampled and greedy requests; afterwards no 5xx and every slot free."""

from __future__ import annotations

from collections import Counter

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)

from dflash_jax.testing.waits import stretched
from tests.server.real_server import RealServer
from tests.server.soak_client import SoakPlan, soak, wait_idle
from tests.tinymodels import write_tiny_llama

pytestmark = pytest.mark.slow

MAX_MODEL_LEN = 48
REQUEST_TIMEOUT_S = 180  # a generated request may fill every slot's context (and compile a new shape first)
MAX_BYTES = 65536
POSITIVE_EXAMPLES = 12  # per operation
NEGATIVE_EXAMPLES = 6
CONFORMANCE = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]


@pytest.fixture(scope="module")
def real_server(tmp_path_factory):
    model = write_tiny_llama(tmp_path_factory.mktemp("tiny") / "llama", layers=2)
    args = ["--draft-model", "random:1", "--dflash-gamma", "4", "--served-model-name", "tiny"]
    args += ["--max-num-seqs", "2", "--max-queued-requests", "8", "--max-model-len", str(MAX_MODEL_LEN)]
    args += ["--max-request-bytes", str(MAX_BYTES), "--draft-weight-quantization", "declared"]
    with RealServer(model, *args) as srv:
        yield srv
        log = srv.log()
    assert "Traceback" not in log, log[-4000:]


def _run(op, mode: GenerationMode, examples: int, checks, url: str) -> Counter:
    statuses: Counter = Counter()

    @given(case=op.as_strategy(generation_mode=mode))
    @settings(max_examples=examples, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    def one(case):
        response = case.call_and_validate(base_url=url, checks=checks, timeout=stretched(REQUEST_TIMEOUT_S))
        if 400 <= response.status_code < 500:  # which field the server refused
            statuses[f"{response.status_code} {response.json()['error']['param']}"] += 1
        else:
            statuses[str(response.status_code)] += 1

    one()
    return statuses


def test_real_server_conforms_to_its_openapi_schema(real_server):
    schema = schemathesis.openapi.from_url(real_server.url + "/openapi.json")
    ops = [r.ok() for r in schema.get_all_operations()]
    assert len(ops) == 8, [op.label for op in ops]
    report = {}
    for op in ops:
        positive = _run(op, GenerationMode.POSITIVE, POSITIVE_EXAMPLES, CONFORMANCE, real_server.url)
        negative = Counter()
        if op.method.upper() == "POST":
            checks = [not_a_server_error, negative_data_rejection, content_type_conformance]
            negative = _run(op, GenerationMode.NEGATIVE, NEGATIVE_EXAMPLES, checks, real_server.url)
        report[op.label] = (positive, negative)
    # streams as they end (a short one ends inside the events schemathesis reads): chunks, then [DONE]
    streams = {
        "POST /v1/chat/completions": [
            {"model": "tiny", "messages": [{"role": "assistant"}, {"role": "system"}], "stream": True},
            {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": True, "max_tokens": 3, "n": 2},
        ],
        "POST /v1/completions": [
            {
                "model": "tiny",
                "prompt": "hi",
                "stream": True,
                "max_tokens": 4,
                "stream_options": {"include_usage": True},
            },
            {"model": "tiny", "prompt": ["a", "b"], "stream": True, "max_tokens": 2, "return_token_ids": True},
        ],
    }
    by_label = {op.label: op for op in ops}
    for label, bodies in streams.items():
        for body in bodies:
            case = by_label[label].Case(body=body, media_type="application/json")
            response = case.call_and_validate(
                base_url=real_server.url, checks=CONFORMANCE, timeout=stretched(REQUEST_TIMEOUT_S)
            )
            assert response.status_code == 200 and response.text.endswith("data: [DONE]\n\n"), response.text
            report[label][0]["200 stream"] += 1
    examples = sum(sum(p.values()) + sum(n.values()) for p, n in report.values())
    print(f"schemathesis on the real server: {len(ops)} operations, {examples} examples, 0 failures")
    for label, (p, n) in report.items():
        print(f"  {label}: positive {dict(p)}, negative {dict(n)}")
    for label, (p, _) in report.items():
        assert sum(p.values()) >= 1, label
        assert not any(s.startswith("5") for s in p), (label, p)
    # generation really ran (not only refusals)
    assert report["POST /v1/completions"][0]["200"] + report["POST /v1/chat/completions"][0]["200"] >= 1


def test_real_server_short_soak_frees_every_slot(real_server):
    words = "hello world the sea é ü 🌊 1 2 3".split()
    plan = SoakPlan(
        model="tiny",
        make_prompt=lambda rng: " ".join(rng.choice(words) for _ in range(rng.randint(1, 4))),
        long_prompt="x" * (MAX_MODEL_LEN + 10),  # byte-level tokens: over the context
        max_request_bytes=MAX_BYTES,
        max_tokens=12,
        stop_token_ids=[101, 108, 32],
    )
    try:
        res = soak(real_server.url, plan, requests=80, concurrency=8, seed=5)
    except httpx.TimeoutException as e:
        pytest.fail(f"a soak request got no answer ({e!r}); the server's log ends:\n{real_server.log()[-6000:]}")
    g = wait_idle(real_server.url)
    print(
        f"real soak: {res.sent} requests in {res.seconds:.1f} s (slowest {res.slowest:.1f} s), "
        f"{res.disconnects} disconnects, {res.cancels} "
        f"mid-stream cancels, 5xx {res.server_errors}, statuses {dict(sorted(res.statuses.items(), key=str))}, "
        f"slots in use after {g['dflash:num_slots_in_use']:.0f} (runner {g['dflash:runner_slots_in_use']:.0f})"
    )
    assert res.server_errors == 0 and not res.unexpected(), res.unexpected()
    assert not res.mismatches, res.mismatches[:5]
    assert g["dflash:num_slots_in_use"] == 0 and g["dflash:runner_slots_in_use"] == 0
    assert g["dflash:num_requests_running"] == 0 and g["dflash:num_requests_waiting"] == 0
    assert g["dflash:engine_healthy"] == 1
