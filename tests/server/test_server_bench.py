"""Speculative vs --no-spec servers: greedy parity over HTTP, and `bench serve` against both."""

from __future__ import annotations

import json

import httpx
import pytest

from dflash_jax.bench.prompts import load_category
from dflash_jax.bench.serve_load import load_prompts, parse_concurrency, percentiles, serve_bench
from dflash_jax.errors import UserError
from dflash_jax.testing.server import FakeServer

MODEL = "fake-model"
COMMON = ("--max-model-len", "2048", "--step-delay", "0.004", "--max-num-seqs", "4")


@pytest.fixture(scope="module")
def servers():
    with (
        FakeServer(*COMMON, "--gamma", "4", "--acceptance", "0.8") as spec,
        FakeServer(*COMMON, "--no-spec") as base,
    ):
        yield spec, base


def test_greedy_output_identical_with_and_without_speculation(servers):
    spec, base = servers
    outs = []
    for srv in servers:
        with httpx.Client(base_url=srv.url, timeout=30) as c:
            texts = []
            for i in range(6):
                body = {"model": MODEL, "prompt": f"parity {i} ünï", "max_tokens": 40, "temperature": 0}
                texts.append(c.post("/v1/completions", json=body).json()["choices"][0]["text"])
                chat = {
                    "model": MODEL,
                    "messages": [{"role": "user", "content": f"chat {i}"}],
                    "max_tokens": 30,
                    "temperature": 0,
                    "stream": True,
                }
                raw = c.post("/v1/chat/completions", json=chat).text
                events = [
                    json.loads(line[6:])
                    for line in raw.splitlines()
                    if line.startswith("data: ") and line != "data: [DONE]"
                ]
                texts.append("".join(e["choices"][0]["delta"].get("content", "") for e in events))
            metrics = c.get("/metrics").text
            outs.append(texts)
            enabled = "dflash:spec_decode_enabled 1.0" in metrics
            assert enabled == (srv is spec)
            if srv is base:
                assert "dflash:spec_decode_num_drafts_total 0.0" in metrics
    assert outs[0] == outs[1]
    assert all(outs[0])


def test_bench_serve_two_urls_reports_and_writes_json_and_png(servers, tmp_path, capsys):
    spec, base = servers
    out_json, out_png = tmp_path / "bench.json", tmp_path / "bench.png"
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "bench one"}\n{"messages": [{"role": "user", "content": "bench two"}]}\n')
    res = serve_bench(
        [spec.url, base.url],
        concurrency="1,3",
        num_prompts=6,
        prompts_file=prompts,
        max_tokens=20,
        ignore_eos=True,
        json_out=out_json,
        plot=out_png,
    )
    printed = capsys.readouterr().out
    assert "speedup" in printed and "acc len" in printed
    assert json.loads(out_json.read_text()) == json.loads(json.dumps(res))
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    s_run, b_run = res["runs"]
    assert [lv["concurrency"] for lv in s_run["levels"]] == [1, 3]
    for run in (s_run, b_run):
        for lv in run["levels"]:
            assert lv["completed"] == 6 and lv["failed"] == 0
            assert lv["output_tokens"] == 6 * 20
            for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
                st = lv[key]
                assert 0 < st["p50"] <= st["p90"] <= st["p99"]
    for lv in s_run["levels"]:
        sd = lv["spec_decode"]
        assert 1.0 < sd["mean_acceptance_length"] <= 4.0 and sd["num_drafts"] > 0
        assert lv["tokens_per_chunk"] > 1.2  # several tokens per SSE chunk under speculation
        assert len(sd["acceptance_by_position"]) == 3
    for lv in b_run["levels"]:
        assert lv["spec_decode"]["num_drafts"] == 0 and lv["spec_decode"]["mean_acceptance_length"] is None
        assert lv["tokens_per_chunk"] == pytest.approx(1.0, abs=0.2)
    assert [s["concurrency"] for s in res["speedup"]] == [1, 3]
    assert all(s["output_throughput_speedup"] > 0 and s["tpot_speedup"] > 0 for s in res["speedup"])


def test_bench_helpers(tmp_path):
    assert parse_concurrency("1,2, 8") == [1, 2, 8]
    for bad in ("", "a,b", "0,1"):
        with pytest.raises(UserError):
            parse_concurrency(bad)
    p = percentiles([1.0, 2.0, 3.0, 4.0], scale=1.0)
    assert p == {"mean": 2.5, "p50": 2.5, "p90": pytest.approx(3.7), "p99": pytest.approx(3.97)}
    assert percentiles([])["p50"] is None
    f = tmp_path / "x.jsonl"
    f.write_text('{"prompt": "a"}\n{"nothing": 1}\n')
    with pytest.raises(UserError, match="x.jsonl:2"):
        load_prompts(f)
    with pytest.raises(UserError):
        load_prompts(tmp_path / "missing.jsonl")
    assert load_prompts(None)
    mixed = load_prompts(None, "edit,chat")
    edit, chat = load_category("edit"), load_category("chat")
    n = min(len(edit), len(chat))
    assert [r["category"] for r in mixed[: 2 * n]] == ["edit", "chat"] * n
    assert mixed[0]["messages"] == edit[0]["messages"] and mixed[1]["messages"] == chat[0]["messages"]
    assert len(mixed) == len(edit) + len(chat)
    with pytest.raises(UserError, match="--category"):
        load_prompts(f, "edit")
    with pytest.raises(UserError, match="prose"):
        load_prompts(None, "edit,prose")
