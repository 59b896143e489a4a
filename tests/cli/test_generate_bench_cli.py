"""`generate` and `bench decode|plain` end to end on a tiny random target (written as an HF directory) with a
random drafter: both commands run the offline engine; speculative greedy output equals plain greedy output."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from dflash_jax.cli.main import app
from dflash_jax.compilation import release_programs
from tests.checkpoints.test_loading_errors import write_model


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return str(write_model(tmp_path_factory.mktemp("tiny") / "target"))


def invoke(args: list[str]):
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, f"{res.output}\n{res.exception!r}"
    return res


def test_generate_streams_the_same_text_with_and_without_a_drafter(tiny_model):
    args = ["generate", "--model", tiny_model, "--prompt", "w3 w4 w5 w6", "--max-tokens", "12", "--ignore-eos"]
    plain = invoke(args)
    spec = invoke([*args, "--draft-model", "random:1", "--dflash-gamma", "4"])
    words = plain.stdout.split()
    assert len(words) == 12 and all(w.startswith("w") for w in words), plain.stdout
    assert spec.stdout == plain.stdout
    assert "[12 tokens" in plain.stderr and "τ" not in plain.stderr
    assert "[12 tokens" in spec.stderr and "τ" in spec.stderr and "drafts)" in spec.stderr


def test_bench_decode_reports_tau_acceptance_and_parity(tiny_model, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"w{i} w{i + 1} w{i + 2}"}) + "\n" for i in range(3, 6)))
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    args = ["bench", "decode", "--model", tiny_model, "--draft-model", "random:1", "--prompts", str(prompts)]
    invoke([*args, "--max-tokens", "10", "--dflash-gamma", "4", "--json-out", str(out), "--plot", str(png)])
    r = json.loads(out.read_text())
    assert r["outputs_identical"] is True and r["outputs_sha256"] == r["plain_outputs_sha256"]
    assert r["gamma"] == 4 and r["num_prompts"] == 3 and r["batch_size"] == 1 and r["max_running"] == 1
    assert len(r["acceptance_by_position"]) == 3
    hist = r["tau_histogram"]
    n = sum(hist.values())
    assert n > 0 and r["tau_mean"] == pytest.approx(sum(int(k) * v for k, v in hist.items()) / n)
    assert r["spec_tokens_per_s"] > 0 and r["plain_tokens_per_s"] > 0
    assert r["speedup"] == pytest.approx(r["spec_tokens_per_s"] / r["plain_tokens_per_s"])
    assert png.stat().st_size > 0
    out2 = tmp_path / "r2.json"
    invoke([*args, "--max-tokens", "10", "--dflash-gamma", "4", "--batch-size", "2", "--json-out", str(out2)])
    r2 = json.loads(out2.read_text())
    assert r2["max_running"] == 2 and r2["outputs_identical"] is True
    assert r2["outputs_sha256"] == r["outputs_sha256"]  # the same greedy outputs at batch 2


def test_bench_decode_timed_pass_compiles_nothing_after_its_warm_up(tiny_model, tmp_path):
    # batch 2 over 3 prompts: the first call (a prefill of 2) recurs only in the timed pass, which must find it
    # compiled (the runner's state arrays have the same placement before the first call as after it). The programs
    # an earlier test in this process compiled are dropped first, so the warm-up has its own to compile.
    release_programs()
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"w{i} w{i + 1} w{i + 2}"}) + "\n" for i in range(3, 6)))
    out = tmp_path / "r.json"
    args = ["bench", "decode", "--model", tiny_model, "--draft-model", "random:1", "--prompts", str(prompts)]
    invoke([*args, "--max-tokens", "8", "--dflash-gamma", "4", "--batch-size", "2", "--json-out", str(out)])
    r = json.loads(out.read_text())
    assert r["outputs_identical"] is True
    for run in ("plain", "spec"):
        assert r["compile"][run]["warmup"]["programs_compiled"] > 0
        assert r["compile"][run]["timed"]["programs_compiled"] == 0, (run, r["compile"][run])


def test_bench_plain_rows_per_batch_size(tiny_model, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "w3 w4"}) + "\n")
    out = tmp_path / "plain.json"
    invoke(["bench", "plain", "--model", tiny_model, "--batch-sizes", "1,2", "--max-tokens", "4"]
           + ["--prompts", str(prompts), "--json-out", str(out)])  # fmt: skip
    r = json.loads(out.read_text())
    rows = r["results"]
    assert [x["batch_size"] for x in rows] == [1, 2]
    assert all(x["tokens_per_s"] > 0 and x["ms_per_token"] == pytest.approx(1e3 / x["tokens_per_s"]) for x in rows)
    assert "lm_head" in r["floor"] and "attention" in r["floor"] and "lm_head" in r["matmul_floor"]
    for x in rows:
        assert x["floor_ms"] > 0 and x["matmul_floor_ms"] > 0 and x["decode_ms"] == x["ms_per_step"]
        assert x["decode_over_floor"] == pytest.approx(x["decode_ms"] / x["floor_ms"])
        # 2 x batch requests over `batch` slots, admitted a batch at a time: two rounds of 3 full-width steps
        assert [(s["batch"], s["steps"]) for s in x["step_shapes"]] == [(x["batch_size"], 6)]


def test_bench_decode_category_refuses_unknown_names_and_a_prompt_file(tiny_model, tmp_path):
    args = ["bench", "decode", "--model", tiny_model, "--draft-model", "random:1", "--max-tokens", "4"]
    res = CliRunner().invoke(app, [*args, "--category", "edit,poetry"])
    assert res.exit_code != 0 and "--category" in res.output and "poetry" in res.output and "structured" in res.output
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "w3 w4"}) + "\n")
    res = CliRunner().invoke(app, [*args, "--category", "edit", "--prompts", str(prompts)])
    assert res.exit_code != 0 and "--category and --prompts" in res.output


def test_bench_decode_ngram_drafts_are_lossless_and_match_their_replay(tiny_model, tmp_path):
    prompts = tmp_path / "p.jsonl"
    rows = [" ".join(f"w{3 + (j % 5)}" for j in range(12 + i)) for i in range(3)]  # repetitive prompts
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in rows))
    out = tmp_path / "r.json"
    args = ["bench", "decode", "--model", tiny_model, "--draft-model", "random:1", "--prompts", str(prompts)]
    invoke([*args, "--max-tokens", "16", "--dflash-gamma", "4", "--draft-method", "ngram", "--json-out", str(out)])
    r = json.loads(out.read_text())
    assert r["draft_method"] == "ngram" and r["outputs_identical"] is True  # greedy output equals plain
    # the measured run verified the same drafts the replay on the plain outputs proposes
    assert r["tau_mean"] == pytest.approx(r["ngram"]["tau_mean"])
    assert r["acceptance_by_position"] == pytest.approx(r["ngram"]["acceptance_by_position"])
    res = CliRunner().invoke(app, [*args, "--draft-method", "eagle"])
    assert res.exit_code != 0 and "--draft-method" in res.output


def test_bench_decode_hybrid_verifies_ngram_drafts_where_a_suffix_recurs(tiny_model):
    # With a random drafter (whose drafts the tiny target does not take) the hybrid's steps accept only n-gram
    # drafts, so its τ and acceptance are exactly those of n-gram drafting from suffixes of 2..4 tokens, replayed
    # on the plain greedy outputs (one accepted drafter draft would break the equality); and its greedy output is
    # the plain one.
    from dflash_jax.bench.decode import bench_decode
    from dflash_jax.bench.ngram import HYBRID_MIN_N, simulate
    from dflash_jax.bench.prompts import encode_prompts
    from dflash_jax.builder import build_offline_engine, load_models
    from dflash_jax.types import SamplingParams

    models = load_models(tiny_model, "random:1")
    rows = [{"prompt": " ".join(f"w{3 + (j % (4 + i))}" for j in range(10 + 3 * i))} for i in range(3)]
    kw = dict(batch_size=2, max_tokens=16, gamma=4, log=lambda *a: None)
    r = bench_decode(models, rows, draft_method="hybrid", **kw)
    assert r["draft_method"] == "hybrid" and r["outputs_identical"] is True
    prompts = encode_prompts(models.target.tokenizer, rows)
    plain = models._replace(drafter=None, draft_lm_head=None)
    with build_offline_engine(plain, max_num_seqs=2, max_model_len=64) as llm:
        outs = [list(o.token_ids) for o in llm.generate(prompts, SamplingParams(), max_tokens=16)]
    replay = simulate(prompts, outs, 4, min_n=HYBRID_MIN_N)
    assert replay["tau_mean"] > 1.5  # the prompts repeat: n-gram drafts are taken
    assert r["tau_mean"] == pytest.approx(replay["tau_mean"])
    assert r["acceptance_by_position"] == pytest.approx(replay["acceptance_by_position"])


def test_hybrid_under_adaptive_k_verifies_lookup_drafts_while_the_drafter_is_suspended(tiny_model, monkeypatch):
    # A random drafter's drafts are never taken: the adaptive controller suspends it. The rows whose last tokens
    # recur in their context still verify their n-gram drafts (priced by their own acceptance), those steps run no
    # drafter block when every drafting row has n-gram drafts, and the greedy output is the plain one.
    from dflash_jax.bench.prompts import encode_prompts
    from dflash_jax.builder import build_offline_engine, build_runner, load_models
    from dflash_jax.engine.offline import OfflineEngine
    from dflash_jax.spec_decode import ngram
    from dflash_jax.spec_decode.control.controller import Controller
    from dflash_jax.types import SamplingParams

    models = load_models(tiny_model, "random:1")
    rows = [{"prompt": " ".join(f"w{3 + (j % (4 + i))}" for j in range(10 + 3 * i))} for i in range(3)]
    tok = models.target.tokenizer
    prompts = encode_prompts(tok, rows)
    plain = models._replace(drafter=None, draft_lm_head=None)
    with build_offline_engine(plain, max_num_seqs=2, max_model_len=64) as llm:
        want = [list(o.token_ids) for o in llm.generate(prompts, SamplingParams(), max_tokens=24)]

    class Recorded(Controller):
        def decide(self, ids, lookup=()):
            out = super().decide(ids, lookup)
            self.log += [(self.is_suspended(s), s in lookup, out[s]) for s in ids]
            return out

    ctl = Recorded.from_flags(adaptive_k="0:10,1:13,2:15,3:17", gamma=4, block_size=models.drafter.cfg.block_size)
    ctl.log = []
    sources = []
    program = ngram.step_program
    monkeypatch.setattr(ngram, "step_program", lambda model, fn: sources.append(fn) or program(model, fn))
    runner = build_runner(models, runner_cls=ngram.HybridRunner, max_slots=2, max_model_len=64, gamma=4)
    with OfflineEngine(runner, tok, max_num_seqs=2, controller=ctl) as llm:
        got = [list(o.token_ids) for o in llm.generate(prompts, SamplingParams(), max_tokens=24)]
        results = llm.stats.spec_results
    assert got == want
    assert any(suspended and looked and k > 0 for suspended, looked, k in ctl.log)
    assert sum(r.num_accepted for r in results if r.lookup) > 0
    assert sum(r.num_accepted for r in results if not r.lookup) == 0  # the random drafter's
    for r in results:
        assert r.num_accepted <= r.num_drafts == len(r.accepted_mask)
    assert ngram.lookup_drafts in sources


def test_bench_decode_under_a_controller_compiles_every_verify_width_before_the_timed_pass(tiny_model, monkeypatch):
    # The timed pass may choose draft counts the warm-up pass never chose (here 1 draft, then 3): the run compiles
    # every verify width first, as `serve`'s warm-up does, so the timed pass compiles nothing and measures steps.
    from dflash_jax.bench import decode
    from dflash_jax.builder import load_models
    from dflash_jax.spec_decode.control.controller import Controller

    release_programs()  # no program compiled by an earlier test in this process
    models = load_models(tiny_model, "random:1")
    passes, chosen = [], []
    run_pass = decode.run_pass
    monkeypatch.setattr(decode, "run_pass", lambda *a, **k: passes.append(1) or run_pass(*a, **k))

    class Switching(Controller):
        def decide(self, ids, lookup=()):
            depth = 1 if len(passes) == 1 else 3
            chosen.append((len(passes), depth))
            return {s: depth for s in ids}

    def make():
        return Switching.from_flags(adaptive_k="0:10,1:13,2:15,3:17", gamma=4, block_size=models.drafter.cfg.block_size)

    rows = [{"prompt": f"w{i} w{i + 1} w{i + 2}"} for i in range(3, 6)]
    r = decode.bench_decode(
        models, rows, batch_size=2, max_tokens=16, make_controller=make, plain=False, ignore_eos=True, log=lambda _: 0
    )
    warm, timed = r["compile"]["spec"]["warmup"], r["compile"]["spec"]["timed"]
    assert set(chosen) == {(1, 1), (2, 3)}
    assert r["speculative_steps"] > 0
    assert warm["programs_compiled"] > 0 and timed["programs_compiled"] == 0, r["compile"]
