"""The GPU proof kit (`benchmarks/gpu/run.sh --out DIR [--budget-s N] [--steps ...] [--dry-run]`): its driver, the
files it writes and the fields each must hold, the time boxes, the summary table, and the lease plan that runs it
on a GPU host in three commands (`LEASE_CALLS`, `benchmarks/gpu/lease.sh`).

Five steps, each time-boxed, each but the first in its own Python process (a step that overruns its box is killed;
the JSON it last wrote stays):
  tests       the GPU test subset (pytest): passed/failed counts
  attention   the paged attention's XLA path and Pallas kernel on bf16 decode, verify and prefill cases of the 8B
              shape: the largest error against the f32 reference over its bound, wall and on-device time per call;
              then `paged_attention_bench.check_paths` (every path and tiling against the reference)
  decode      plain vs speculative decoding of the default model on the held-out prompts by batch size, and at one
              batch size with the Pallas kernel (tok/s, and whether its greedy output equals the XLA path's)
  cost        the Qwen3-8B-shaped random-weight cost table (`dflash_jax.bench.cost_table`)
  data_train  target-generated training data for as long as its share allows, continued training of the default
              drafter, the candidate exported, teacher-forced τ on held-out greedy responses for both drafters

Files (at most `MAX_FILES` in the output directory; those of the steps that ran):
  summary.json       — the machine, the run's settings, per step: status, wall time, `timed_out`, `error`, `compile`
                       (programs compiled and compile seconds); the GPU test subset's counts; the paged attention
                       step's results (`attention`); the headline figures
  decode.json        — plain vs speculative decoding of the default model by batch size (`runs`, attention backend
                       xla) and the same at one batch size with the Pallas paged attention kernel (`pallas_runs`)
  cost8b.json        — the 8B-shaped cost table (`dflash_jax.bench.cost_table`)
  data_train.json    — data generation rate, the drafter's continued training, the candidate's held-out τ
  cost.png           — t_step(γ)/t_decode by γ per batch size, from cost8b.json
  run.log            — every step's console output
  candidate_drafter.tar.NN — the exported candidate drafter (a tar split into parts of at most `--part-mib`)

A time box cuts measurements, never fields: a measurement the box left no time for is present, its figures None,
with `"timed_out": true`. The dry run (`--dry-run`: tiny models and sizes, a few minutes on a CPU) has no soft time
boxes, so what it writes does not depend on the machine's load; only each step's hard limit (the whole budget)
stands. The run exits 0 whatever a step did; a failure is recorded in summary.json with its error.
"""

from __future__ import annotations

import argparse
import functools
import io
import json
import os
import re
import shlex
import subprocess
import sys
import tarfile
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

MAX_FILES = 8
STEPS = ("tests", "attention", "decode", "cost", "data_train")
# Each step's JSON: in the output directory, except those of `SUMMARY_STEPS` (kept in the scratch directory and
# copied into summary.json under the step's name, so the run stays within `MAX_FILES` with a two-part candidate).
STEP_FILES = {
    "tests": None,
    "attention": "attention.json",
    "decode": "decode.json",
    "cost": "cost8b.json",
    "data_train": "data_train.json",
}
SUMMARY_STEPS = ("attention",)
FILES = ("summary.json", "decode.json", "cost8b.json", "data_train.json", "cost.png", "run.log")
# The files each step adds to summary.json and run.log.
STEP_OUTPUTS = {
    "tests": (),
    "attention": (),
    "decode": ("decode.json",),
    "cost": ("cost8b.json", "cost.png"),
    "data_train": ("data_train.json",),
}
CANDIDATE_PREFIX = "candidate_drafter.tar."
# Share of the whole budget each step may take, all five steps run (the rest, ~6%, is start-up and the summary);
# a run of some steps splits its budget between them in these proportions.
BUDGET_SHARES = {"tests": 0.14, "attention": 0.14, "decode": 0.19, "cost": 0.17, "data_train": 0.30}
STEP_SHARE_TOTAL = 0.94
# The paged attention step's cases (B, T, kv_len), bf16, in the order they run: decode at batch 1/8/32 over 2K and
# 8K keys, a verify of 16 positions at batch 8, one 2048-token prefill chunk over 8K keys.
ATTENTION_CASES = ((1, 1, 2048), (8, 1, 2048), (32, 1, 2048), (1, 1, 8192), (8, 1, 8192), (32, 1, 8192))
ATTENTION_CASES += ((8, 16, 2048), (1, 2048, 8192))
DRY_ATTENTION_CASES = ((2, 4, 64),)
# The cost step's mixed steps: (batch sizes, prompt chunk lengths), on a GPU and in the dry run.
COST_MIXED = ((1, 8), (256, 2048))
DRY_COST_MIXED = ((1,), (16, 32))

# Dotted paths every file must hold after a run where every step finished (`*` = every key of that mapping,
# `[]` = every item of that list).
REQUIRED: dict[str, tuple[str, ...]] = {
    "summary.json": (
        "machine.backend",
        "machine.devices",
        "dry_run",
        "budget_s",
        "dtype",
        "wall_s",
        "steps.*.status",
        "steps.*.wall_s",
        "steps.*.budget_s",
        "steps.*.timed_out",
        "steps.*.error",
        "steps.*.compile.programs_compiled",
        "steps.*.compile.compile_s",
        "tests.passed",
        "tests.failed",
        "tests.errors",
        "tests.skipped",
        "tests.command",
        "attention.platform",
        "attention.shape",
        "attention.timed_out",
        "attention.cases.[].b",
        "attention.cases.[].t",
        "attention.cases.[].kv_len",
        "attention.cases.[].dtype",
        "attention.cases.[].ok",
        "attention.cases.[].xla_ok",
        "attention.cases.[].pallas_ok",
        "attention.cases.[].xla_max_abs_err",
        "attention.cases.[].pallas_max_abs_err",
        "attention.cases.[].xla_err_over_bound",
        "attention.cases.[].pallas_err_over_bound",
        "attention.cases.[].xla_ms",
        "attention.cases.[].pallas_ms",
        "attention.cases.[].pallas_over_xla",
        "attention.cases.[].xla_dev_us",
        "attention.cases.[].pallas_dev_us",
        "attention.check.[].ok",
        "attention.check_disagreements",
        "headline.attention_cases_failed",
        "headline.attention_check_disagreements",
        "headline.pallas_decode_outputs_equal_xla",
        "headline.speedup_batch1",
        "headline.outputs_identical_batch1",
        "headline.tau_batch1",
        "headline.t_step_max_over_t_decode_batch1",
        "headline.t_verify_max_over_t_decode_batch1",
        "headline.hbm_roofline_fraction_batch1",
        "headline.sequences_per_minute",
        "headline.candidate_tau",
        "headline.committed_tau",
    ),
    "decode.json": (
        "model",
        "draft_model",
        "dtype",
        "timed_out",
        "compile.programs_compiled",
        "compile.compile_s",
        "runs.[].batch_size",
        "runs.[].num_prompts",
        "runs.[].plain_tokens_per_s",
        "runs.[].spec_tokens_per_s",
        "runs.[].speedup",
        "runs.[].tau_mean",
        "runs.[].outputs_identical",
        "runs.[].t_decode_ms",
        "runs.[].t_spec_step_ms",
        "runs.[].device_calls_per_step",
        "runs.[].acceptance_by_position",
        "runs.[].gamma",
        "runs.[].attention_backend",
        "pallas_runs.[].attention_backend",
        "pallas_runs.[].batch_size",
        "pallas_runs.[].plain_tokens_per_s",
        "pallas_runs.[].spec_tokens_per_s",
        "pallas_runs.[].speedup",
        "pallas_runs.[].outputs_identical",
        "pallas_runs.[].plain_outputs_equal_xla",
        "pallas_runs.[].spec_outputs_equal_xla",
        "pallas_runs.[].outputs_equal_xla",
        "pallas_runs.[].plain_tokens_per_s_xla",
        "pallas_runs.[].spec_tokens_per_s_xla",
    ),
    "cost8b.json": (
        "target.params",
        "target.dtype",
        "drafter.layers",
        "drafter.block_size",
        "kv_len",
        "gamma_max",
        "hbm_bytes_per_s",
        "kernel_backend",
        "timed_out",
        "compile.programs_compiled",
        "compile.compile_s",
        "by_batch.*.t_decode_ms",
        "by_batch.*.t_step_ms",
        "by_batch.*.t_verify_ms",
        "by_batch.*.t_propose_ms",
        "by_batch.*.decode_bytes.total",
        "by_batch.*.roofline_ms",
        "by_batch.*.hbm_roofline_fraction",
        "by_batch.*.t_step_over_t_decode",
        "by_batch.*.t_step_max_over_t_decode",
        "by_batch.*.t_verify_max_over_t_decode",
        "by_batch.*.projected_speedup.*.gamma",
        "by_batch.*.projected_speedup.*.speedup",
        "mixed.t_prefill_ms",
        "mixed.by_batch.*.t_step_ms",
        "mixed.by_batch.*.t_mixed_ms",
        "mixed.by_batch.*.mixed_over_separate",
        "propose_by_tier.*.t_propose_ms",
        "propose_by_tier.*.prepare_s",
    ),
    "data_train.json": (
        "timed_out",
        "compile.programs_compiled",
        "compile.compile_s",
        "data.sequences",
        "data.response_tokens",
        "data.shards",
        "data.seconds",
        "data.sequences_per_minute",
        "data.response_tokens_per_s",
        "data.config",
        "train.steps",
        "train.seconds",
        "train.s_per_step",
        "train.final_loss",
        "train.final_tau_train",
        "train.config",
        "candidate.files",
        "candidate.bytes",
        "eval.method",
        "eval.rows",
        "eval.committed_tau",
        "eval.candidate_tau",
        "eval.committed_acceptance_by_position",
        "eval.candidate_acceptance_by_position",
    ),
}


# The fields of one decode run (`runs` and `pallas_runs` items).
DECODE_RUN_FIELDS = tuple(
    dict.fromkeys(p.split(".", 2)[2] for p in REQUIRED["decode.json"] if p.startswith(("runs.[].", "pallas_runs.[].")))
)


def files_for(steps) -> tuple[str, ...]:
    """The files (less the candidate's parts) a run of `steps` writes."""
    return ("summary.json", "run.log", *(f for s in STEPS if s in steps for f in STEP_OUTPUTS[s]))


def required_for(steps) -> dict[str, tuple[str, ...]]:
    """`REQUIRED` for a run of `steps`: the files they write; summary.json's `tests` and `attention` sections only
    where that step ran."""
    out = {f: REQUIRED[f] for f in files_for(steps) if f in REQUIRED}
    out["summary.json"] = tuple(
        p for p in REQUIRED["summary.json"] if p.split(".")[0] not in ("tests", "attention") or p.split(".")[0] in steps
    )
    return out


def complete_fields(obj: dict, paths: tuple[str, ...]) -> dict:
    """Give `obj` every field of `paths` it lacks, as None (a missing mapping on the way is created; a `*` or `[]`
    reaches only the keys and items already there). In place; returns `obj`."""
    for path in paths:
        _complete(obj, path.split("."))
    return obj


def _complete(obj: Any, parts: list[str]) -> None:
    head, rest = parts[0], parts[1:]
    if head in ("*", "[]"):
        items = obj.values() if isinstance(obj, dict) and head == "*" else obj if isinstance(obj, list) else ()
        for v in items:
            if rest:
                _complete(v, rest)
        return
    if not isinstance(obj, dict):
        return
    if not rest:
        obj.setdefault(head, None)
        return
    if obj.get(head) is None:
        obj[head] = [] if rest[0] == "[]" else {}
    _complete(obj[head], rest)


def missing_fields(obj: Any, paths: tuple[str, ...]) -> list[str]:
    """The dotted paths of `paths` that `obj` lacks (a `*` or `[]` over an empty mapping or list is missing)."""
    out = []
    for path in paths:
        if not _has(obj, path.split(".")):
            out.append(path)
    return out


def _has(obj: Any, parts: list[str]) -> bool:
    if not parts:
        return True
    head, rest = parts[0], parts[1:]
    if head == "*":
        return isinstance(obj, dict) and bool(obj) and all(_has(v, rest) for v in obj.values())
    if head == "[]":
        return isinstance(obj, list) and bool(obj) and all(_has(v, rest) for v in obj)
    return isinstance(obj, dict) and head in obj and _has(obj[head], rest)


def write_json(path: Path, obj: Any) -> None:
    """Atomic write (a killed step leaves the last complete version)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as f:
        json.dump(obj, f, indent=1, default=_jsonable)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


def _jsonable(x):
    try:
        return float(x)
    except (TypeError, ValueError):
        return str(x)


def read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def step_budgets(total: float, steps=STEPS) -> dict[str, float]:
    """Each step's soft time box: its share of `total`, the shares of `steps` scaled to `STEP_SHARE_TOTAL`."""
    scale = STEP_SHARE_TOTAL / sum(BUDGET_SHARES[s] for s in steps)
    return {s: total * BUDGET_SHARES[s] * scale for s in steps}


def grace_s(budget: float) -> float:
    """How long past its soft box a step may run before it is killed."""
    return min(30.0, max(10.0, 0.1 * budget))


def headline(decode: dict | None, cost: dict | None, data: dict | None, attention: dict | None = None) -> dict:
    """The figures the summary table shows (None where the step did not produce them)."""
    b1 = next((r for r in (decode or {}).get("runs", []) if r.get("batch_size") == 1), {})
    c1 = (cost or {}).get("by_batch", {}).get("1", {})
    ev = (data or {}).get("eval", {})
    pallas = (decode or {}).get("pallas_runs") or [{}]
    cases = (attention or {}).get("cases")
    return {
        "attention_cases_failed": None if cases is None else sum(not c.get("ok") for c in cases),
        "attention_check_disagreements": (attention or {}).get("check_disagreements"),
        "pallas_decode_outputs_equal_xla": pallas[0].get("outputs_equal_xla"),
        "speedup_batch1": b1.get("speedup"),
        "outputs_identical_batch1": b1.get("outputs_identical"),
        "tau_batch1": b1.get("tau_mean"),
        "t_step_max_over_t_decode_batch1": c1.get("t_step_max_over_t_decode"),
        "t_verify_max_over_t_decode_batch1": c1.get("t_verify_max_over_t_decode"),
        "hbm_roofline_fraction_batch1": c1.get("hbm_roofline_fraction"),
        "sequences_per_minute": (data or {}).get("data", {}).get("sequences_per_minute"),
        "candidate_tau": ev.get("candidate_tau"),
        "committed_tau": ev.get("committed_tau"),
    }


def _f(x, fmt="{:.2f}") -> str:
    if x is None:
        return "–"
    if isinstance(x, bool):
        return "yes" if x else "NO"
    if isinstance(x, int):
        return str(x)
    return fmt.format(x) if isinstance(x, int | float) else str(x)


def print_summary(summary: dict, decode: dict | None, cost: dict | None, console=None) -> None:
    """Rich tables: the steps, plain vs speculative decode by batch, the cost table by batch, the headline."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    t = Table(title="GPU proof kit: steps")
    for c in ("step", "status", "wall s", "budget s", "note"):
        t.add_column(c)
    for name, st in summary.get("steps", {}).items():
        note = (st.get("error") or "")[:80]
        if name == "tests" and "tests" in summary:
            ts = summary["tests"]
            note = f"{ts.get('passed')} passed, {ts.get('failed')} failed, {ts.get('errors')} errors " + note
        t.add_row(name, st.get("status", "?"), _f(st.get("wall_s"), "{:.0f}"), _f(st.get("budget_s"), "{:.0f}"), note)
    console.print(t)
    att = summary.get("attention") or {}
    if att.get("cases"):
        t = Table(title=f"paged attention ({att.get('platform')}, {att.get('device')}): max error / bound, ms")
        for c in ("B x T x kv", "dtype", "xla err/bound", "pallas err/bound", "xla ms", "pallas ms", "pallas/xla"):
            t.add_column(c)
        t.add_column("xla us (device)")
        t.add_column("pallas us (device)")
        for r in att["cases"]:
            t.add_row(
                f"{r.get('b')} x {r.get('t')} x {r.get('kv_len')}",
                str(r.get("dtype")),
                _ok(r, "xla"),
                _ok(r, "pallas"),
                _f(r.get("xla_ms"), "{:.3f}"),
                _f(r.get("pallas_ms"), "{:.3f}"),
                _f(r.get("pallas_over_xla")),
                _f(r.get("xla_dev_us"), "{:.1f}"),
                _f(r.get("pallas_dev_us"), "{:.1f}"),
            )
        console.print(t)
        if att.get("check") is not None:
            console.print(
                f"paged attention path check: {len(att['check'])} paths vs the reference, "
                f"{att.get('check_disagreements')} disagreements"
            )
    if decode and decode.get("runs"):
        t = Table(title=f"decode: {decode.get('model')} + {decode.get('draft_model')} ({decode.get('dtype')})")
        for c in ("batch", "plain tok/s", "spec tok/s", "speedup", "τ", "identical", "t_decode ms", "t_spec ms"):
            t.add_column(c)
        t.add_column("= xla output")
        runs = [*decode["runs"], *decode.get("pallas_runs", [])]
        for r in runs:
            pallas = r.get("attention_backend") == "pallas"
            t.add_row(
                f"{r.get('batch_size')}{' pallas' if pallas else ''}",
                _f(r.get("plain_tokens_per_s"), "{:.0f}"),
                _f(r.get("spec_tokens_per_s"), "{:.0f}"),
                _f(r.get("speedup")),
                _f(r.get("tau_mean")),
                _f(r.get("outputs_identical")),
                _f(r.get("t_decode_ms")),
                _f(r.get("t_spec_step_ms")),
                ("ERROR " + r["error"][:40] if r.get("error") else _f(r.get("outputs_equal_xla"))) if pallas else "",
            )
        console.print(t)
    if cost and cost.get("by_batch"):
        g = str(cost.get("gamma_max"))
        t = Table(
            title=f"cost: {cost['target'].get('name')} ({cost['target'].get('dtype')}), kv_len {cost.get('kv_len')}"
        )
        for c in ("batch", "t_decode ms", "roofline", f"t_step({g})/t_dec", f"t_verify({g})/t_dec", "t_propose ms"):
            t.add_column(c)
        t.add_column("speedup at τ " + "/".join(str(x) for x in _taus(cost)))
        for b, r in cost["by_batch"].items():
            ps = r.get("projected_speedup", {})
            t.add_row(
                b,
                _f(r.get("t_decode_ms")),
                _f(r.get("hbm_roofline_fraction"), "{:.0%}"),
                _f(r.get("t_step_max_over_t_decode")),
                _f(r.get("t_verify_max_over_t_decode")),
                _f(r.get("t_propose_ms")),
                " / ".join(_f(v.get("speedup")) for v in ps.values()),
            )
        console.print(t)
        tiers = cost.get("propose_by_tier", {})
        if tiers:
            t = Table(title="propose ms by --draft-weight-quantization tier")
            t.add_column("tier")
            batches = sorted({b for v in tiers.values() for b in v.get("t_propose_ms", {})}, key=int)
            for b in batches:
                t.add_column(f"batch {b}")
            for tier, v in tiers.items():
                t.add_row(tier, *(_f(v.get("t_propose_ms", {}).get(b)) for b in batches))
            console.print(t)
    h = summary.get("headline", {})
    t = Table(title="headline")
    t.add_column("figure")
    t.add_column("value")
    for k, v in h.items():
        t.add_row(k, _f(v, "{:.3f}"))
    console.print(t)


def _ok(r: dict, backend: str) -> str:
    """`ok 0.12` / `FAIL 3.4` (the largest error over its bound), or the backend's error."""
    err = r.get(f"{backend}_error") or r.get("error")
    if err:
        return "ERROR " + err[:40]
    ratio = r.get(f"{backend}_err_over_bound")
    if ratio is None:
        return "–"
    return f"{'ok' if r.get(f'{backend}_ok') else 'FAIL'} {ratio:.2f}"


def _taus(cost: dict) -> list[str]:
    for r in cost.get("by_batch", {}).values():
        if r.get("projected_speedup"):
            return list(r["projected_speedup"])
    return []


def plot_cost(cost: dict, path: Path) -> None:
    """t_step(γ)/t_decode (solid) and t_verify(γ)/t_decode (dashed) by γ, one line per batch size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for b, r in cost.get("by_batch", {}).items():
        td = r.get("t_decode_ms")
        if not td:
            continue
        for key, style in (("t_step_ms", "-o"), ("t_verify_ms", "--x")):
            pts = sorted((int(g), t / td) for g, t in r.get(key, {}).items())
            if pts:
                ax.plot(*zip(*pts, strict=True), style, label=f"batch {b} {key[2:-3]}", markersize=3)
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xlabel("verify width γ (anchor + drafts)")
    ax.set_ylabel("cost / plain decode step")
    ax.set_title(f"{cost.get('target', {}).get('name', '')}: step cost by γ")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


GPU_TESTS = (
    "tests/kernels/test_matmul_kernels.py tests/quant/test_quant_linear.py tests/spec_decode/test_spec_parity.py "
    "tests/train/test_fast_generate.py tests/kernels/test_paged_attention.py tests/spec_decode/test_paged_runner.py"
)
DRY_TESTS = (
    "tests/train/test_fast_generate.py tests/kernels/test_paged_attention.py "
    "-k 'test_length_bucket or test_causal_bounds'"
)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="benchmarks/gpu/run.sh",
        description="The GPU proof kit: the GPU test subset, the paged attention kernel, plain vs speculative decode, "
        "the 8B-shaped cost table, drafter data and training, each time-boxed; at most 8 files in --out and a summary "
        "table.",
    )
    p.add_argument("--out", type=Path, required=True, help="output directory (at most 8 files are written)")
    p.add_argument("--budget-s", type=float, default=None, help="whole-run time budget (default 420; dry run 600)")
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="tiny models and sizes, no soft time boxes (any CPU, a few minutes)",
    )
    p.add_argument(
        "--steps", default=",".join(STEPS), help=f"the steps to run, in this order (default {','.join(STEPS)})"
    )
    p.add_argument("--lease-info", type=Path, default=None, help="a JSON file put into summary.json as `lease`")
    p.add_argument(
        "--lease-call",
        type=int,
        default=None,
        help=f"run command N (1-{len(LEASE_CALLS)}) of the lease plan (docs/gpu.md): its steps and budget, what it "
        "carried kept on the host, and in the last one the model joined from the parts and the wheels installed",
    )
    p.add_argument("--dtype", default="auto", help="auto (bf16 on GPU, f32 on CPU) | bfloat16 | float16 | float32")
    p.add_argument("--model", default="default", help="target of the decode and data steps (a .gguf, HF dir)")
    p.add_argument("--draft-model", default=None, help="drafter directory (default: the committed default drafter)")
    p.add_argument("--tests", default=None, help=f"pytest arguments of the test step (default: {GPU_TESTS})")
    p.add_argument("--decode-batches", default=None, help="batch sizes of the decode step (default 1,8,32)")
    p.add_argument(
        "--pallas-decode-batches",
        default=None,
        help="decode-step batch sizes also run with --attention-backend pallas, each one of --decode-batches "
        "(default 8 where --decode-batches has it)",
    )
    p.add_argument(
        "--attention-cases",
        default=None,
        help="BxTxKVLEN cases of the paged attention step (default "
        + ",".join("x".join(map(str, c)) for c in ATTENTION_CASES)
        + ")",
    )
    p.add_argument(
        "--decode-prompts",
        type=int,
        default=None,
        help="held-out prompts per batch size, at least the batch (default 12)",
    )
    p.add_argument("--max-tokens", type=int, default=None, help="tokens per request in the decode step (128)")
    p.add_argument("--cost-batches", default=None, help="batch sizes of the cost table (default 1,8,32,64)")
    p.add_argument("--gammas", default=None, help="verify widths of the cost table, e.g. 2-16 or 2,4,8,16")
    p.add_argument("--hbm-bandwidth", type=float, default=4.8e12, help="device memory bandwidth, B/s (H200)")
    p.add_argument("--kernel-backend", default="auto", help="quantized drafter matmuls: auto | xla | pallas")
    p.add_argument("--rows-per-shard", type=int, default=None, help="rows per generated data shard (1024)")
    p.add_argument("--self-prompt-fraction", type=float, default=0.75, help="share of prompts the target writes")
    p.add_argument(
        "--work",
        type=Path,
        default=None,
        help="scratch directory (data, checkpoints; default: OUT/../dflash-gpu-kit-work)",
    )
    p.add_argument("--part-mib", type=float, default=15.0, help="the candidate drafter's tar parts, MiB each")
    p.add_argument("--run-step", default=None, help=argparse.SUPPRESS)
    p.add_argument("--ctx", type=Path, default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.lease_call is not None:
        if not 1 <= a.lease_call <= len(LEASE_CALLS):
            raise SystemExit(f"--lease-call: expected 1..{len(LEASE_CALLS)}, got {a.lease_call}")
        a.steps = ",".join(LEASE_CALLS[a.lease_call - 1]["steps"])
        if a.budget_s is None and not a.dry_run:
            a.budget_s = LEASE_CALLS[a.lease_call - 1]["budget_s"]
    if a.budget_s is None:
        a.budget_s = 600.0 if a.dry_run else 420.0
    steps = tuple(x.strip() for x in a.steps.split(",") if x.strip())
    unknown = [x for x in steps if x not in STEPS]
    if unknown or not steps or len(set(steps)) != len(steps):
        raise SystemExit(f"--steps: expected distinct names from {','.join(STEPS)}, got {a.steps!r}")
    a.steps = tuple(x for x in STEPS if x in steps)
    return a


def parse_ints(s: str, flag: str) -> tuple[int, ...]:
    out: list[int] = []
    try:
        for part in s.split(","):
            lo, _, hi = part.partition("-")
            out += list(range(int(lo), int(hi) + 1)) if hi else [int(lo)]
    except ValueError:
        raise SystemExit(f"{flag}: expected integers like 1,8,32 or 2-16, got {s!r}") from None
    if not out or min(out) < 1:
        raise SystemExit(f"{flag}: expected positive integers, got {s!r}")
    return tuple(out)


def parse_cases(s: str, flag: str) -> tuple[tuple[int, int, int], ...]:
    try:
        cases = tuple(tuple(int(x) for x in c.lower().split("x")) for c in s.split(",") if c.strip())
    except ValueError:
        raise SystemExit(f"{flag}: expected BxTxKVLEN items like 8x1x2048, got {s!r}") from None
    if not cases or any(len(c) != 3 or min(c) < 1 or c[2] % 16 for c in cases):
        raise SystemExit(f"{flag}: expected BxTxKVLEN items of positive integers, KVLEN a multiple of 16, got {s!r}")
    return cases


# ---------------------------------------------------------------------------------------------------- lease plan
# A GPU host is lent for `LEASE_S` of device time, its start included; each command on it gets the tracked tree
# plus what it carries, `CARRY_LIMIT` bytes in all, runs at most `CALL_LIMIT_S`, and the host goes back 30 s after a
# command ends (with everything on it). The plan: three commands back to back, each carrying a third of the default
# model (compressed) while it measures; the last joins the parts, installs the wheels the host lacks and runs the
# model. `benchmarks/gpu/pack.sh` writes what each carries into `.lease/N/`; docs/gpu.md gives the three calls.
MIB = 2**20
LEASE_S = 900
HOST_START_S = 120  # a fresh host's start (1-2 min)
TRANSFER_S = 25  # per command: the tree and its carry there, the files back, the next call issued
CALL_LIMIT_S = 600
CARRY_LIMIT = 64 * MIB
CALL_OVERHEAD_S = 30  # per command: Python and JAX start-up, the parts joined, the wheels installed, the summary
MAX_OUT_FILES = 8
LEASE_DIR = ".lease"  # in the checkout (ignored): `.lease/N/` is what command N carries
LEASE_STASH = "/tmp/dflash-lease"  # on the host: the carried files kept between commands ($DFLASH_LEASE_STASH)
MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
LEASE_WHEELS = ("gguf==0.19.0",)  # the host lacks it; its own needs (numpy, pyyaml, requests, tqdm) are there
LEASE_CALLS = (
    {"name": "no-model", "steps": ("tests", "attention"), "budget_s": 160.0},
    {"name": "cost8b", "steps": ("cost",), "budget_s": 120.0},
    {"name": "model", "steps": ("decode", "data_train"), "budget_s": 290.0, "wheels": True},
)


def call_limit_s(call: dict) -> float:
    """The longest command `call` can be: every step to its hard limit, plus the start-up and the summary."""
    budgets = step_budgets(call["budget_s"], call["steps"])
    return sum(b + grace_s(b) for b in budgets.values()) + CALL_OVERHEAD_S


def call_timeout_s(call: dict) -> int:
    """The `timeout_s` of the call: its longest run and a margin."""
    return int(call_limit_s(call) + 30)


def lease_seconds() -> float:
    """The lease's device time with every command at its longest."""
    return HOST_START_S + sum(call_limit_s(c) + TRANSFER_S for c in LEASE_CALLS)


def call_command(n: int) -> str:
    """The shell command of lease call `n` (1-based), run in the tree's root on the host."""
    return f"bash benchmarks/gpu/run.sh --lease-call {n} --out $OUT"


def call_carry(n: int) -> list[str]:
    return [f"{LEASE_DIR}/{n}"]


def sha256_file(path: Path) -> str:
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def pack(dest: Path, gguf: Path, wheels_dir: Path, cache: Path | None = None, log=print) -> dict:
    """Write `dest/N/` (N = 1..len(LEASE_CALLS)): part N of the xz-compressed `gguf`, the manifest, and in the
    calls with `wheels` the wheels of `wheels_dir`. The compressed model is cached under `cache` by its checksum
    (xz of 94 MiB takes a minute or more). Returns the manifest."""
    import lzma
    import shutil

    model_sha = sha256_file(gguf)
    n = len(LEASE_CALLS)
    blob_path = (cache or dest) / f"{model_sha[:16]}.gguf.xz"
    if not blob_path.is_file():
        blob_path.parent.mkdir(parents=True, exist_ok=True)
        log(f"pack: compressing {gguf} ({gguf.stat().st_size} bytes, xz -6)")
        tmp = blob_path.with_suffix(".tmp")
        if shutil.which("xz"):
            with open(tmp, "wb") as f:
                subprocess.run(["xz", "-6", "-T1", "-c", str(gguf)], stdout=f, check=True)
        else:
            with open(gguf, "rb") as src, lzma.open(tmp, "wb", preset=6) as f:
                shutil.copyfileobj(src, f, 1 << 20)
        os.replace(tmp, blob_path)
    blob = blob_path.read_bytes()
    size = -(-len(blob) // n)
    if dest.exists():
        shutil.rmtree(dest)
    manifest: dict = {
        "model": {"file": MODEL_FILE, "bytes": gguf.stat().st_size, "sha256": model_sha},
        "compression": "xz",
        "compressed": {"bytes": len(blob), "sha256": _sha256(blob)},
        "parts": [],
        "wheels": [],
    }
    for i in range(n):
        d = dest / str(i + 1)
        d.mkdir(parents=True)
        chunk = blob[i * size : (i + 1) * size]
        name = f"model.xz.part{i + 1}"
        (d / name).write_bytes(chunk)
        manifest["parts"].append({"call": i + 1, "file": name, "bytes": len(chunk), "sha256": _sha256(chunk)})
        if LEASE_CALLS[i].get("wheels"):
            for w in lease_wheels(wheels_dir):
                shutil.copy2(w, d / w.name)
                manifest["wheels"].append({"call": i + 1, "file": w.name, "bytes": w.stat().st_size})
    for i in range(n):
        write_json(dest / str(i + 1) / "manifest.json", manifest)
    write_json(dest / "manifest.json", manifest)
    return manifest


def lease_wheels(wheels_dir: Path) -> list[Path]:
    """The wheel of each of `LEASE_WHEELS` in `wheels_dir` (one each; a clear error where one is missing)."""
    out = []
    for spec in LEASE_WHEELS:
        name, _, version = spec.partition("==")
        found = sorted(wheels_dir.glob(f"{name.replace('-', '_')}-{version}-*.whl"))
        if not found:
            raise SystemExit(f"pack: no wheel of {spec} in {wheels_dir} (pip download --no-deps {spec})")
        out.append(found[-1])
    return out


def _sha256(b: bytes) -> str:
    import hashlib

    return hashlib.sha256(b).hexdigest()


def lease_prepare(n: int, stash: Path, log=print) -> dict:
    """On the host, at the start of lease call `n`: keep what this call carried in `stash` (the next calls find it
    there while the host stays warm); in the call that runs the model, verify every part against the manifest, join
    and decompress them into `stash/model/MODEL_FILE` (checked against its checksum), and install the carried wheels
    into `stash/site` (`pip install --no-index --no-deps --target`). Returns the report that goes into
    summary.json as `lease`: `model` is the model's path, or None with `error` saying which part is missing."""
    import lzma
    import shutil

    call = LEASE_CALLS[n - 1]
    carried = ROOT / LEASE_DIR / str(n)
    stash.mkdir(parents=True, exist_ok=True)
    rep: dict = {"call": n, "name": call["name"], "steps": list(call["steps"]), "carried": [], "error": None}
    if not carried.is_dir():
        rep["error"] = f"{LEASE_DIR}/{n} was not carried: name it in this call's carry (docs/gpu.md)"
    else:
        for f in sorted(carried.iterdir()):
            shutil.copy2(f, stash / f.name)
            rep["carried"].append({"file": f.name, "bytes": f.stat().st_size})
    manifest = read_json(stash / "manifest.json")
    last = n == len(LEASE_CALLS)
    if not last:
        return rep
    rep["model"] = None
    if manifest is None:
        rep["error"] = rep["error"] or "no manifest.json on the host: run benchmarks/gpu/pack.sh and carry its output"
        return rep
    missing, bad = [], []
    for p in manifest["parts"]:
        f = stash / p["file"]
        if not f.is_file():
            missing.append(p["call"])
        elif f.stat().st_size != p["bytes"] or sha256_file(f) != p["sha256"]:
            bad.append(p["call"])
    rep["parts"] = {"missing": missing, "bad_checksum": bad, "of": len(manifest["parts"])}
    if missing or bad:
        rep["error"] = (
            f"model parts missing here: {missing} (of 1..{len(manifest['parts'])}): the host was given back between "
            f"calls (each call must follow the last within 30 s; run the three calls again, back to back)"
            if missing
            else f"model parts {bad} do not match the manifest's checksums: pack again and carry the new parts"
        )
        log(f"lease: {rep['error']}")
    else:
        model_dir = stash / "model"
        model_dir.mkdir(exist_ok=True)
        dst = model_dir / manifest["model"]["file"]
        if not dst.is_file() or sha256_file(dst) != manifest["model"]["sha256"]:
            t0 = time.time()
            dec = lzma.LZMADecompressor()
            with open(dst, "wb") as out:
                for p in manifest["parts"]:
                    with open(stash / p["file"], "rb") as f:
                        for block in iter(lambda f=f: f.read(1 << 20), b""):
                            out.write(dec.decompress(block))
            rep["join_s"] = time.time() - t0
        if sha256_file(dst) != manifest["model"]["sha256"]:
            rep["error"] = f"the joined model {dst} does not match the manifest's checksum"
        else:
            rep["model"] = str(dst)
            log(f"lease: model joined and verified: {dst}")
    wheels = [stash / w["file"] for w in manifest.get("wheels", []) if (stash / w["file"]).is_file()]
    site = stash / "site"
    if wheels:
        cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile"]
        cmd += ["--no-cache-dir", "--upgrade", "--target", str(site), *map(str, wheels)]
        p = subprocess.run(cmd, capture_output=True, text=True)
        rep["wheels"] = {"installed": [w.name for w in wheels], "target": str(site), "returncode": p.returncode}
        if p.returncode:
            rep["wheels"]["stderr"] = p.stderr[-2000:]
    rep["site"] = str(site)
    if rep["model"]:  # the joined file opens with the carried gguf: what the decode and data steps will load
        sys.path.insert(0, str(site))
        try:
            import gguf

            reader = gguf.GGUFReader(rep["model"])
            rep["model_check"] = {"gguf": getattr(gguf, "__file__", None), "tensors": len(reader.tensors)}
        except Exception as e:  # noqa: BLE001 - recorded; the steps report their own errors
            rep["model_check"] = {"error": f"{type(e).__name__}: {e}"[:1000]}
    return rep


# ---------------------------------------------------------------------------------------------------- driver
def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["pack"]:
        return pack_main(argv[1:])
    a = parse_args(argv)
    if a.run_step:
        return run_step(a.run_step, json.loads(a.ctx.read_text()))
    if a.lease_call is not None:
        lease_call_setup(a)
    decode_batches = parse_ints(a.decode_batches or ("1,2" if a.dry_run else "1,8,32"), "--decode-batches")
    if a.pallas_decode_batches is None:  # 8 (the dry run: 2) where the decode step runs it
        pallas_batches = tuple(b for b in ((2,) if a.dry_run else (8,)) if b in decode_batches)
    else:
        pallas_batches = parse_ints(a.pallas_decode_batches, "--pallas-decode-batches")
    if not set(pallas_batches) <= set(decode_batches):
        raise SystemExit(
            f"--pallas-decode-batches: each must be one of --decode-batches {decode_batches}, got {pallas_batches}"
        )
    attention_cases = DRY_ATTENTION_CASES if a.dry_run else ATTENTION_CASES
    if a.attention_cases:
        attention_cases = parse_cases(a.attention_cases, "--attention-cases")
    out: Path = a.out
    out.mkdir(parents=True, exist_ok=True)
    for old in [*FILES, *(p.name for p in out.glob(CANDIDATE_PREFIX + "*"))]:  # one run's files only
        (out / old).unlink(missing_ok=True)
    work = a.work or out.resolve().parent / "dflash-gpu-kit-work"
    work.mkdir(parents=True, exist_ok=True)
    t_start = time.time()
    log_path = out / "run.log"
    log_f = log_path.open("a", buffering=1)

    def log(msg: str) -> None:
        line = f"[kit {time.time() - t_start:6.1f}s] {msg}"
        print(line, flush=True)
        log_f.write(line + "\n")

    budgets = step_budgets(a.budget_s, a.steps)
    ctx = {
        "dry_run": a.dry_run,
        "dtype": a.dtype,
        "model": a.model,
        "draft_model": a.draft_model,
        "decode_batches": decode_batches,
        "pallas_decode_batches": pallas_batches,
        "attention_cases": attention_cases,
        "decode_prompts": a.decode_prompts or (2 if a.dry_run else 12),
        "max_tokens": a.max_tokens or (8 if a.dry_run else 128),
        "cost_batches": parse_ints(a.cost_batches or ("1,2" if a.dry_run else "1,8,32,64"), "--cost-batches"),
        "gammas": parse_ints(a.gammas or ("2,16" if a.dry_run else "2-16"), "--gammas"),
        "hbm_bandwidth": a.hbm_bandwidth,
        "kernel_backend": a.kernel_backend,
        "rows_per_shard": a.rows_per_shard or (4 if a.dry_run else 1024),
        "self_prompt_fraction": a.self_prompt_fraction,
        "work": str(work),
        "out": str(out),
        "part_mib": a.part_mib,
        # sizes of the data and training step
        "data_shards": 2 if a.dry_run else 64,
        "max_prompt": 192 if a.dry_run else 128,  # the dry run's byte-level tokenizer spends one token per byte
        "max_new": 8 if a.dry_run else 256,
        "self_prompt_max": 8 if a.dry_run else 64,
        "train_batch": 4 if a.dry_run else 128,
        "train_anchors": 4 if a.dry_run else 64,
        "train_steps": 6 if a.dry_run else None,  # None: fitted to the time left
        "eval_max_new": 8 if a.dry_run else 128,
    }
    summary: dict = {
        "dry_run": a.dry_run,
        "steps_run": list(a.steps),
        "budget_s": a.budget_s,
        "dtype": a.dtype,
        "settings": {k: v for k, v in ctx.items() if k not in ("work", "out")},
        "command": " ".join(shlex.quote(x) for x in sys.argv),
        "machine": {},
        "steps": {},
    }
    if a.lease_info is not None:
        summary["lease"] = read_json(a.lease_info) or {"error": f"{a.lease_info} is missing or not JSON"}
    log(
        f"GPU proof kit: out {out}, work {work}, steps {','.join(a.steps)}, budget {a.budget_s:.0f} s "
        f"({'dry run: no soft time boxes' if a.dry_run else 'full'})"
    )
    for name in a.steps:
        t0 = time.time()
        # the dry run has no soft box (its output must not depend on the machine's load), only the hard limit
        soft = 1e6 if a.dry_run else budgets[name]
        hard = a.budget_s if a.dry_run else budgets[name] + grace_s(budgets[name])
        if name == "tests":  # the GPU test subset, in a child pytest
            tests_args = a.tests or (DRY_TESTS if a.dry_run else GPU_TESTS)
            summary["tests"], st = run_tests(tests_args, hard, work, log_f, log)
        else:  # one process per step
            st = run_child(name, ctx, soft, hard, work, log_f, log)
            cut_fields(name, ctx, st)
        summary["steps"][name] = {**st, "wall_s": time.time() - t0, "budget_s": budgets[name]}
        m = (read_json(work / "machine.json") or {}) if not summary["machine"] else summary["machine"]
        summary["machine"] = m
        if name in SUMMARY_STEPS:
            summary[name] = read_json(step_path(name, ctx))

    decode = read_json(out / "decode.json")
    cost = read_json(out / "cost8b.json")
    data = read_json(out / "data_train.json")
    if cost and cost.get("by_batch"):
        try:
            plot_cost(cost, out / "cost.png")
        except Exception as e:  # noqa: BLE001 - the figure is optional; the JSON holds the numbers
            log(f"cost.png not written: {e!r}")
    summary["headline"] = headline(decode, cost, data, summary.get("attention"))
    summary["wall_s"] = time.time() - t_start
    write_json(out / "summary.json", summary)
    from rich.console import Console

    print_summary(summary, decode, cost, Console(width=max(Console().width, 120)))
    with log_path.open("a") as f:  # the table in the log too
        print_summary(summary, decode, cost, Console(file=f, width=140))
    log(f"done in {summary['wall_s']:.0f} s: {', '.join(sorted(p.name for p in out.iterdir()))}")
    log_f.close()
    return 0


def lease_call_setup(a: argparse.Namespace) -> None:
    """`--lease-call N`: prepare the host (`lease_prepare`), put the report into summary.json, keep the scratch
    directory beside the stash (its compilation cache serves the later calls); in the model call, the joined model
    and the installed wheels. Where the model could not be joined, the decode and data steps still run, on the dry
    run's tiny random target and sizes (their figures then say nothing of the default model: the report says why)."""
    stash = Path(os.environ.get("DFLASH_LEASE_STASH", LEASE_STASH))
    rep = lease_prepare(a.lease_call, stash, log=lambda m: print(m, flush=True))
    if "site" in rep:
        os.environ["PYTHONPATH"] = os.pathsep.join(x for x in (rep["site"], os.environ.get("PYTHONPATH")) if x)
    if a.lease_call == len(LEASE_CALLS):
        if rep.get("model"):
            if a.model == "default":
                a.model = rep["model"]
        elif not a.dry_run:
            a.dry_run = True
            a.budget_s = a.budget_s / len(a.steps)  # the dry run's hard limit is per step
            rep["fallback"] = "decode and data_train ran on the dry run's tiny random target: no default model here"
            print(f"lease: {rep['error']}; {rep['fallback']}", flush=True)
    a.work = a.work or stash / "work"
    a.lease_info = stash / f"lease_{a.lease_call}.json"
    write_json(a.lease_info, rep)


def pack_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="benchmarks/gpu/pack.sh",
        description="Write what each command of the lease plan carries: DIR/N/ with part N of the compressed "
        "default model, the manifest (sizes and sha256 checksums), and the wheels the host lacks.",
    )
    p.add_argument("dir", type=Path)
    p.add_argument("--gguf", type=Path, required=True, help="the default model's GGUF file")
    p.add_argument("--wheels", type=Path, required=True, help="a directory holding the wheels of LEASE_WHEELS")
    p.add_argument("--cache", type=Path, default=None, help="where the compressed model is kept between packs")
    a = p.parse_args(argv)
    m = pack(a.dir, a.gguf, a.wheels, a.cache)
    for i, part in enumerate(m["parts"], 1):
        n = sum(f.stat().st_size for f in (a.dir / str(i)).iterdir())
        print(f"{a.dir}/{i}: {n} bytes (model part {part['bytes']} bytes)")
    print(f"model {m['model']['bytes']} bytes, xz {m['compressed']['bytes']} bytes; wheels {m['wheels']}")
    return 0


def run_tests(args: str, budget: float, work: Path, log_f, log) -> tuple[dict, dict]:
    """pytest with `args` (verbose, so a killed run still shows what passed); counts from its per-test lines; the
    run's compile cost from `compile_plugin` (None where pytest was killed)."""
    cmd = [sys.executable, "-m", "pytest", "-o", "addopts=", "-v", "-p", "no:cacheprovider", "-p", "compile_plugin"]
    cmd += shlex.split(args)
    log(f"tests: {' '.join(cmd[1:])} (killed after {budget:.0f} s)")
    compile_file = work / "tests_compile.json"
    compile_file.unlink(missing_ok=True)
    path = os.pathsep.join(x for x in (str(ROOT), str(Path(__file__).parent), os.environ.get("PYTHONPATH")) if x)
    env = {**os.environ, "PYTHONPATH": path, "KIT_COMPILE_FILE": str(compile_file)}
    env.setdefault("JAX_DEFAULT_MATMUL_PRECISION", "highest")  # f32 tests compare against f32 references
    timed_out, err = False, None
    try:
        p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=budget)
        text, rc = p.stdout + p.stderr, p.returncode
    except subprocess.TimeoutExpired as e:
        text = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        timed_out, rc = True, None
    except OSError as e:
        text, rc, err = "", None, repr(e)
    log_f.write(text)
    counts = {k: len(re.findall(rf"^\S+::\S.* {k.upper()}", text, re.M)) for k in ("passed", "failed", "skipped")}
    counts["errors"] = len(re.findall(r"^\S+::\S.* ERROR", text, re.M))
    if rc not in (0, 1, None) and err is None:  # 0: all passed, 1: some failed; else pytest itself broke
        err = f"pytest exited {rc}: " + text.strip().splitlines()[-1] if text.strip() else f"pytest exited {rc}"
    failed = [m for m in re.findall(r"^(\S+::\S+).* FAILED", text, re.M)]
    res = {**counts, "failed_tests": failed, "command": " ".join(cmd[1:]), "returncode": rc, "timed_out": timed_out}
    compiled = read_json(compile_file) or {"programs_compiled": None, "compile_s": None}
    log(
        f"tests: {counts['passed']} passed, {counts['failed']} failed, {counts['errors']} errors; "
        f"{compiled['programs_compiled']} programs compiled in {compiled['compile_s']} s"
    )
    status = "timed_out" if timed_out else ("failed" if err or counts["failed"] or counts["errors"] else "ok")
    return res, {"status": status, "timed_out": timed_out, "error": err, "compile": compiled}


def run_child(name: str, ctx: dict, budget: float, hard_s: float, work: Path, log_f, log) -> dict:
    """Run step `name` in a child process with a soft deadline `budget` seconds from now (the step's own) and a hard
    one `hard_s` from now (killed)."""
    cpath = work / f"ctx_{name}.json"
    if STEP_FILES[name]:
        step_path(name, ctx).unlink(missing_ok=True)
    deadline = time.time() + budget
    write_json(cpath, {**ctx, "deadline": deadline, "budget_s": budget})
    result_path = work / f"step_{name}.json"
    result_path.unlink(missing_ok=True)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--out", ctx["out"], "--run-step", name, "--ctx", str(cpath)]
    log(f"{name}: budget {min(budget, hard_s):.0f} s (killed after {hard_s:.0f} s)")
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    killed = False
    log_f.flush()
    with subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as p:
        import threading

        def pump():
            for line in p.stdout:
                sys.stdout.write(line)
                log_f.write(line)

        th = threading.Thread(target=pump, daemon=True)
        th.start()
        try:
            p.wait(timeout=hard_s)
        except subprocess.TimeoutExpired:
            killed = True
            p.kill()
            p.wait()
        th.join(timeout=5)
    res = read_json(result_path) or {}
    if killed:
        log(f"{name}: killed at its hard limit; the output it last wrote is kept")
        return {
            "status": "timed_out",
            "timed_out": True,
            "error": f"killed after {hard_s:.0f} s",
            "compile": {"programs_compiled": None, "compile_s": None},
        }
    if not res:
        return {
            "status": "failed",
            "timed_out": False,
            "error": f"the step process exited {p.returncode} without a result (see run.log)",
            "compile": {"programs_compiled": None, "compile_s": None},
        }
    return res


# ---------------------------------------------------------------------------------------------------- steps
def step_path(name: str, ctx: dict) -> Path:
    """Where step `name` writes its JSON: the output directory, or the scratch one for `SUMMARY_STEPS`."""
    return Path(ctx["work"] if name in SUMMARY_STEPS else ctx["out"]) / (STEP_FILES[name] or "")


def run_step(name: str, ctx: dict) -> int:
    """In the child: run one step; record ok / timed_out / failed (with the error) and its compile cost (programs
    compiled and compile seconds, `dflash_jax.compilation.CompileMeter`) for the driver and in the step's JSON."""
    from dflash_jax.compilation import CompileMeter

    work = Path(ctx["work"])
    res: dict = {"status": "ok", "timed_out": False, "error": None}
    meter = CompileMeter()
    try:
        _setup_jax(work)
        with meter:
            out = STEP_FUNCS[name](ctx)
        res["timed_out"] = bool(out.get("timed_out"))
        res["status"] = "timed_out" if res["timed_out"] else "ok"
    except Exception as e:  # noqa: BLE001 - recorded, the run goes on
        traceback.print_exc()
        res.update(status="failed", error=f"{type(e).__name__}: {e}"[:2000])
    res["compile"] = meter.as_dict()
    _log(f"{name}: {meter.summary()}")
    path = step_path(name, ctx)
    partial = read_json(path) if STEP_FILES[name] else None
    if partial is not None:  # what it measured stays, with the error and the compile cost
        if res["error"]:
            partial["error"] = res["error"]
        partial["compile"] = res["compile"]
        write_json(path, partial)
    write_json(work / f"step_{name}.json", res)
    return 0


def cut_fields(name: str, ctx: dict, st: dict) -> None:
    """After step `name` ended (or was killed): every measurement it planned and did not finish is present in its
    JSON with None figures, marked `"timed_out": true` where time ran out (else with the step's error), and every
    field `REQUIRED` lists is there. A step killed before it wrote anything still leaves its file."""
    fname = STEP_FILES[name]
    if not fname:
        return
    path = step_path(name, ctx)
    obj = read_json(path) or {}
    mark = {"timed_out": True} if st["status"] == "timed_out" else {"error": st.get("error") or "not run"}
    if st["status"] != "ok":
        obj["timed_out"] = bool(obj.get("timed_out")) or st["status"] == "timed_out"
        obj.setdefault("error", st.get("error"))
    obj.setdefault("compile", st.get("compile") or {})
    if name == "decode":
        done = {(r.get("batch_size"), r.get("attention_backend")) for r in obj.get("runs", [])}
        done |= {(r.get("batch_size"), r.get("attention_backend")) for r in obj.get("pallas_runs", [])}
        for b, be in decode_plan(ctx):
            if (b, be) not in done:
                obj.setdefault("runs" if be == "xla" else "pallas_runs", []).append(
                    {"batch_size": b, "attention_backend": be, **mark}
                )
    elif name == "cost":
        from dflash_jax.bench.cost_table import TAUS, TIERS

        by_batch = obj.setdefault("by_batch", {})
        for b in ctx["cost_batches"]:
            if str(b) not in by_batch:
                by_batch[str(b)] = {"projected_speedup": {str(t): {} for t in TAUS}, **mark}
        tiers = obj.setdefault("propose_by_tier", {})
        for t in TIERS:
            tiers.setdefault(t, dict(mark))
        batches, chunks = DRY_COST_MIXED if ctx.get("dry_run") else COST_MIXED
        mixed = obj.setdefault("mixed", {}).setdefault("by_batch", {})
        for b in batches:
            mixed.setdefault(str(b), {"t_mixed_ms": {str(c): None for c in chunks}, **mark})
    elif name == "attention":
        done = {(c.get("b"), c.get("t"), c.get("kv_len")) for c in obj.get("cases", [])}
        for b, t, kv_len in ctx["attention_cases"]:
            if (b, t, kv_len) not in done:
                obj.setdefault("cases", []).append({"b": b, "t": t, "kv_len": kv_len, "ok": False, **mark})
        if obj.get("check") is None:
            obj["check"] = [{"ok": None, **mark}]
    paths = REQUIRED.get(fname) or tuple(
        p.split(".", 1)[1] for p in REQUIRED["summary.json"] if p.startswith(name + ".")
    )
    complete_fields(obj, paths)
    write_json(path, obj)


def decode_plan(ctx: dict) -> list[tuple[int, str]]:
    """The decode step's runs in order: every batch with the XLA attention, right after one of
    `pallas_decode_batches` the same with Pallas."""
    plan = [(b, be) for b in ctx["decode_batches"] for be in ATTENTION_BACKENDS]
    return [(b, be) for b, be in plan if be == "xla" or b in ctx["pallas_decode_batches"]]


def _setup_jax(work: Path) -> None:
    import jax

    jax.config.update("jax_compilation_cache_dir", str(work / "jax_cache"))  # a second run compiles less
    from dflash_jax.bench.decode import machine_info

    if not (work / "machine.json").exists():
        info = machine_info()
        try:
            info["device_kind"] = jax.devices()[0].device_kind
        except Exception:  # noqa: BLE001
            pass
        write_json(work / "machine.json", info)


def _log(msg: str) -> None:
    print(msg, flush=True)


def _dtype(ctx):
    from dflash_jax.builder import resolve_dtype

    return resolve_dtype(ctx["dtype"])


def _tiny_target(work: Path) -> Path:
    """The dry run's target: a tiny random Llama checkpoint with a byte-level tokenizer."""
    from tests.tinymodels import write_tiny_llama

    d = work / "tiny_target"
    if not (d / "config.json").exists():
        write_tiny_llama(d, hidden=64, layers=4, heads=4, kv_heads=2, inter=128)
    return d


def _target_spec(ctx) -> str:
    return str(_tiny_target(Path(ctx["work"]))) if ctx["dry_run"] else ctx["model"]


def _committed_drafter(ctx, lt) -> Path:
    """The drafter the data step continues: the committed default (dry run: a tiny random DFlash2 drafter)."""
    from dflash_jax.builder import DEFAULT_DRAFTER_DIR

    if not ctx["dry_run"]:
        return Path(ctx["draft_model"]) if ctx["draft_model"] else DEFAULT_DRAFTER_DIR
    import numpy as np

    from dflash_jax.checkpoints.export import export_drafter
    from dflash_jax.train.trainer import TrainConfig, init_drafter

    d = Path(ctx["work"]) / "tiny_committed_drafter"
    if not (d / "config.json").exists():
        tc = TrainConfig(
            num_layers=1, block_size=4, target_layer_ids=(1, 2), mask_token_id=3, arch="dflash2", selector_rank=8
        )
        export_drafter(init_drafter(lt.cfg, tc), d, lt.cfg.num_layers, dtype=np.float32)
    return d


ATTENTION_SHAPE = {"heads": 32, "kv_heads": 8, "head_dim": 128, "page_size": 16}  # Qwen3-8B's attention
DRY_ATTENTION_SHAPE = {"heads": 4, "kv_heads": 2, "head_dim": 16, "page_size": 16}
ATTENTION_BACKENDS = ("xla", "pallas")


def step_attention(ctx: dict) -> dict:
    """The paged attention (`kernels.paged_attention`) in bf16 on each case of `ctx["attention_cases"]`: a shuffled
    page pool of standard normal keys and values drawn on the device (`paged_case`), queries at the last T
    positions of each row (causal).

    Per case and backend: the largest |out - ref| against the f32 reference on the same bf16 inputs, and its
    ratio to the elementwise bound 2^-8 (|ref| + Σ p |v|) (Σ p |v|: the reference over |v|). The scores are
    exact products summed in f32 on every path; rounding the probabilities to bf16 moves the output by at most
    2^-9 Σ p |v| and rounding the output by 2^-9 |ref|, so a correct kernel stays within half the bound, while a
    wrong page, mask or normalisation is off by about |ref|. `ok`: ratio <= 1. Then
    `paged_attention_bench.check_paths` (both backends, three Pallas tilings, ragged rows, a sliding window, the
    lse; the dry run: one case, bf16, the table's tiling), then per case the on-device microseconds per call
    (`*_dev_us`: chained calls in one jitted loop). The Pallas kernel is compiled on a GPU and interpreted
    elsewhere (where its times mean nothing). A failure is recorded in its case; the step goes on."""
    import jax
    import jax.numpy as jnp

    from dflash_jax.kernels import paged_attention_bench as pab
    from dflash_jax.kernels.bench import device_time_us
    from dflash_jax.kernels.paged_attention import paged_attention

    path = step_path("attention", ctx)
    dry = ctx["dry_run"]
    interpret = jax.default_backend() != "gpu"
    shape = DRY_ATTENTION_SHAPE if dry else ATTENTION_SHAPE
    repeats, iters = (2, 2) if dry else (20, 50)
    res: dict = {
        "platform": jax.default_backend(),
        "device": str(jax.devices()[0].device_kind),
        "jax": jax.__version__,
        "shape": shape,
        "dtype": "bfloat16",
        "pallas_interpret": interpret,
        "bound": "2^-8 (|ref| + Σ p |v|) elementwise, ref = the f32 reference on the same bf16 inputs",
        "repeats": repeats,
        "device_iters": iters,
        "cases": [],
        "check": None,
        "check_disagreements": None,
        "timed_out": False,
    }
    write_json(path, res)
    deadline = ctx["deadline"] - 2
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    kept = []  # (record, q, paged operands, backends that ran) for the on-device pass
    for b, t, kv_len in ctx["attention_cases"]:
        if time.time() > deadline:
            res["timed_out"] = True
            break
        rec: dict = {"b": b, "t": t, "kv_len": kv_len, "dtype": "bfloat16", "ok": False}
        for be in ATTENTION_BACKENDS:
            rec |= {f"{be}_{k}": None for k in ("ok", "max_abs_err", "err_over_bound", "ms", "median_ms", "dev_us")}
        rec["pallas_over_xla"] = None
        res["cases"].append(rec)
        try:
            q, kp, vp, table, lo, hi = paged_case(b, t, kv_len, **shape, seed=b + t)
            ops = (kp, vp, table, lo, hi)
            ref = paged_attention(f32(q), f32(kp), f32(vp), table, lo, hi, kv_len=kv_len, backend="reference")
            mag = paged_attention(f32(q), f32(kp), jnp.abs(f32(vp)), table, lo, hi, kv_len=kv_len, backend="reference")
            bound = jnp.maximum(2.0**-8 * (jnp.abs(ref) + mag), jnp.finfo(jnp.float32).tiny)
            rec["max_abs_ref"] = float(jnp.max(jnp.abs(ref)))
            del mag
            fns, ran = [], []
            for be in ATTENTION_BACKENDS:
                fn = functools.partial(
                    paged_attention, kv_len=kv_len, backend=be, interpret=interpret and be == "pallas"
                )
                try:
                    err = jnp.abs(f32(fn(q, *ops)) - ref)
                    rec[f"{be}_max_abs_err"] = float(jnp.max(err))
                    rec[f"{be}_err_over_bound"] = ratio = float(jnp.max(err / bound))
                    rec[f"{be}_ok"] = bool(ratio <= 1.0)  # False for NaN
                    fns.append((be, fn))
                except Exception as e:  # noqa: BLE001 - recorded; the other backend and cases go on
                    rec[f"{be}_error"] = f"{type(e).__name__}: {e}"[:2000]
                    rec[f"{be}_ok"] = False
            del ref, bound
            times = pab.time_all([(fn, (q, *ops)) for _, fn in fns], repeats)
            for (be, _), (t_min, t_med) in zip(fns, times, strict=True):
                rec[f"{be}_ms"], rec[f"{be}_median_ms"] = t_min, t_med
                ran.append(be)
            if rec["xla_ms"] and rec["pallas_ms"]:
                rec["pallas_over_xla"] = rec["pallas_ms"] / rec["xla_ms"]
            rec["ok"] = all(rec[f"{be}_ok"] for be in ATTENTION_BACKENDS)
            kept.append((rec, q, ops, ran))
        except Exception as e:  # noqa: BLE001 - the case's error is recorded, the next case runs
            rec["error"] = f"{type(e).__name__}: {e}"[:2000]
        _log(f"attention: {_attention_line(rec)}")
        write_json(path, res)
    if time.time() < deadline:
        narrow = {"cases": ((2, 5, 64, 24),), "dtypes": (jnp.bfloat16,), "tiles": (None,)} if dry else {}
        res["check"] = pab.check_paths(interpret=interpret, **narrow)
        res["check_disagreements"] = sum(not r["ok"] for r in res["check"])
        _log(f"attention: path check, {len(res['check'])} paths, {res['check_disagreements']} disagreements")
        for r in res["check"]:
            if not r["ok"]:
                _log(f"attention: path check disagreement {json.dumps(r)[:600]}")
        write_json(path, res)
    else:
        res["timed_out"] = True
    for rec, q, ops, ran in kept:
        if time.time() > deadline:
            res["timed_out"] = True
            break
        for be in ran:
            fn = lambda q, rest, kv_len=rec["kv_len"], be=be: paged_attention(  # noqa: E731
                q, *rest, kv_len=kv_len, backend=be, interpret=interpret and be == "pallas"
            )
            try:
                rec[f"{be}_dev_us"] = device_time_us(fn, q, ops, iters=iters, repeats=min(repeats, 5), touch_w=False)
            except Exception as e:  # noqa: BLE001
                rec[f"{be}_dev_error"] = f"{type(e).__name__}: {e}"[:2000]
        _log(
            f"attention: B={rec['b']} T={rec['t']} kv_len={rec['kv_len']} on device: "
            + ", ".join(f"{be} {_f1(rec[f'{be}_dev_us'])} us" for be in ran)
        )
        write_json(path, res)
    write_json(path, res)
    return res


def paged_case(b: int, t: int, kv_len: int, *, heads: int, kv_heads: int, head_dim: int, page_size: int, seed: int):
    """bf16 (q, k_pages, v_pages, table, lo, hi) as `paged_attention_bench.make_case` lays them out (physical
    pages 1..B*n in a random order, page 0 the null page), drawn on the device: seconds less per case on the host
    at 32 x 8K keys."""
    import jax
    import jax.numpy as jnp

    @functools.partial(jax.jit, static_argnums=(0, 1, 2, 3, 4, 5, 6))
    def draw(b, t, kv_len, heads, kv_heads, head_dim, page_size, key):
        n = kv_len // page_size
        kt, kk, kv, kq = jax.random.split(key, 4)
        table = (jax.random.permutation(kt, b * n) + 1).reshape(b, n).astype(jnp.int32)
        pool = (b * n + 1, kv_heads, page_size, head_dim)
        k_pages = jax.random.normal(kk, pool, jnp.bfloat16).at[0].set(0)
        v_pages = jax.random.normal(kv, pool, jnp.bfloat16).at[0].set(0)
        q = jax.random.normal(kq, (b, t, heads, head_dim), jnp.bfloat16)
        hi = jnp.broadcast_to(kv_len - t + 1 + jnp.arange(t, dtype=jnp.int32), (b, t))
        return q, k_pages, v_pages, table, jnp.zeros_like(hi), hi

    return draw(b, t, kv_len, heads, kv_heads, head_dim, page_size, jax.random.key(seed))


def _f1(x) -> str:
    return "–" if x is None else f"{x:.1f}"


def _attention_line(r: dict) -> str:
    if "error" in r:
        return f"B={r['b']} T={r['t']} kv_len={r['kv_len']}: {r['error'][:300]}"
    parts = [f"B={r['b']} T={r['t']} kv_len={r['kv_len']} {r['dtype']}"]
    for be in ATTENTION_BACKENDS:
        if r.get(f"{be}_error"):
            parts.append(f"{be} ERROR {r[f'{be}_error'][:300]}")
        else:
            parts.append(
                f"{be} {'ok' if r[f'{be}_ok'] else 'FAIL'} (err {r[f'{be}_max_abs_err']:.2e}, "
                f"{r[f'{be}_err_over_bound']:.2f} of its bound) {r[f'{be}_ms']:.3f} ms"
            )
    return ", ".join(parts)


def step_decode(ctx: dict) -> dict:
    from dflash_jax.bench.decode import bench_decode
    from dflash_jax.bench.prompts import load_prompt_file
    from dflash_jax.builder import DEFAULT_DRAFTER_DIR, load_models, make_controller
    from dflash_jax.compilation import CompileMeter

    path = Path(ctx["out"]) / "decode.json"
    dtype = _dtype(ctx)
    draft = "random:1" if ctx["dry_run"] else (ctx["draft_model"] or str(DEFAULT_DRAFTER_DIR))
    models = load_models(_target_spec(ctx), draft, dtype, "declared", ctx["kernel_backend"])
    res = {
        "model": models.target.model_id,
        "draft_model": draft,
        "dtype": str(models.target.model.embed[...].dtype),
        "max_tokens": ctx["max_tokens"],
        "runs": [],
        "pallas_runs": [],
        "timed_out": False,
    }
    write_json(path, res)
    heldout = load_prompt_file(None)
    last = 0.0
    xla_runs: dict[int, dict] = {}
    for b, backend in decode_plan(ctx):
        if time.time() + last > ctx["deadline"]:  # a larger batch takes at least as long as the last one did
            res["timed_out"] = True
            (res["runs"] if backend == "xla" else res["pallas_runs"]).append(
                complete_fields({"batch_size": b, "attention_backend": backend, "timed_out": True}, DECODE_RUN_FIELDS)
            )
            continue
        t0 = time.time()
        n = max(b, ctx["decode_prompts"])
        prompts = (heldout * (n // len(heldout) + 1))[:n]
        _log(f"decode: batch {b}, {n} prompts, {ctx['max_tokens']} tokens, attention {backend}")
        meter = CompileMeter()
        try:
            with meter:
                r = bench_decode(
                    models,
                    prompts,
                    batch_size=b,
                    max_tokens=ctx["max_tokens"],
                    make_controller=lambda: make_controller(models.drafter),
                    draft_model_id=draft,
                    log=_log,
                    runner_kwargs={"attention_backend": backend},
                )
        except Exception as e:
            if backend == "xla":
                raise
            traceback.print_exc()  # a Pallas failure is a finding of its own: recorded, the XLA runs go on
            failed = {"batch_size": b, "attention_backend": backend, "error": repr(e)[:2000]}
            res["pallas_runs"].append(complete_fields(failed, DECODE_RUN_FIELDS))
            write_json(path, res)
            last = time.time() - t0
            continue
        r.pop("machine", None)  # every other field of the bench run is kept as it came
        r["num_prompts"] = n
        r["compile"] = meter.as_dict()
        r["attention_backend"] = backend
        if backend == "xla":
            xla_runs[b] = r
            res["runs"].append(r)
        else:
            x = xla_runs[b]
            r["plain_outputs_equal_xla"] = r["plain_outputs_sha256"] == x["plain_outputs_sha256"]
            r["spec_outputs_equal_xla"] = r["outputs_sha256"] == x["outputs_sha256"]
            r["outputs_equal_xla"] = r["plain_outputs_equal_xla"] and r["spec_outputs_equal_xla"]
            r["plain_tokens_per_s_xla"] = x["plain_tokens_per_s"]
            r["spec_tokens_per_s_xla"] = x["spec_tokens_per_s"]
            res["pallas_runs"].append(r)
        last = time.time() - t0
        same = f", equal to the xla run {r['outputs_equal_xla']}" if backend != "xla" else ""
        _log(
            f"decode batch {b} ({backend}): plain {r['plain_tokens_per_s']:.1f} tok/s, spec "
            f"{r['spec_tokens_per_s']:.1f} tok/s, speedup {r['speedup']:.2f}, τ {r['tau_mean']:.2f}, identical "
            f"{r['outputs_identical']}{same}"
        )
        write_json(path, res)
    write_json(path, res)
    return res


def step_cost(ctx: dict) -> dict:
    from dflash_jax.bench.cost_table import QWEN3_8B, TINY_QWEN3, measure_cost_table
    from dflash_jax.quant import resolve_kernel_backend

    path = Path(ctx["out"]) / "cost8b.json"
    dry = ctx["dry_run"]
    return measure_cost_table(
        TINY_QWEN3 if dry else QWEN3_8B,
        dtype=_dtype(ctx),
        batches=tuple(ctx["cost_batches"]),
        gammas=tuple(ctx["gammas"]),
        draft_layers=5,
        block_size=16,
        prompt_len=64,
        steps=2 if dry else 8,
        tier_batches=(1,) if dry else (1, 8),
        chunks=(DRY_COST_MIXED if dry else COST_MIXED)[1],
        chunk_batches=(DRY_COST_MIXED if dry else COST_MIXED)[0],
        kernel_backend=resolve_kernel_backend(ctx["kernel_backend"]),
        hbm_bytes_per_s=ctx["hbm_bandwidth"],
        deadline=ctx["deadline"] - 5,
        on_update=lambda r: write_json(path, r),
        log=_log,
    )


def step_data_train(ctx: dict) -> dict:
    import numpy as np

    from dflash_jax.bench.prompts import heldout_user_messages
    from dflash_jax.checkpoints.drafter import load_drafter
    from dflash_jax.checkpoints.export import export_drafter
    from dflash_jax.checkpoints.hub import resolve_model_dir
    from dflash_jax.checkpoints.loader import load_target
    from dflash_jax.train.data import DataConfig, build_dataset, load_shards
    from dflash_jax.train.trainer import ShardData, TrainConfig, train

    t_begin = time.time()
    work = Path(ctx["work"])
    path = Path(ctx["out"]) / "data_train.json"
    budget = ctx["deadline"] - t_begin
    res: dict = {"timed_out": False}
    write_json(path, res)
    src = resolve_model_dir(_target_spec(ctx), "--model")
    lt = load_target(src, _dtype(ctx))  # generation: the target in the run's dtype
    lt32 = load_target(src)  # training and evaluation: f32, as `train drafter` runs
    committed = _committed_drafter(ctx, lt32)
    dcfg = load_drafter(committed, lt32.cfg).cfg
    # --- data
    data_dir = work / "data"
    if data_dir.exists():
        import shutil

        shutil.rmtree(data_dir)
    cfg = DataConfig(
        taps=tuple(dcfg.target_layer_ids),
        num_shards=ctx["data_shards"],
        rows_per_shard=ctx["rows_per_shard"],
        max_prompt=ctx["max_prompt"],
        max_new=ctx["max_new"],
        sampled_fraction=0.25,
        seed=11,
        store_taps=False,
        self_prompt_fraction=ctx["self_prompt_fraction"],
        self_prompt_max=ctx["self_prompt_max"],
    )
    gen_s = 0.45 * budget
    shard_t: list[float] = []
    total = [0]
    t0 = time.time()

    def progress(s, n, skipped, tokens=0):
        total[0] += tokens
        shard_t.append(time.time() - t0)
        _log(f"data: shard {s + 1}/{n}, {total[0]} response tokens, {shard_t[-1]:.1f} s")

    build_dataset(lt, cfg, data_dir, progress, max_seconds=gen_s, exclude=heldout_user_messages())
    gen_wall = time.time() - t0
    shards = load_shards(data_dir)
    seqs = len(shards) * cfg.rows_per_shard
    steady = (len(shards) - 1) * cfg.rows_per_shard / (shard_t[-1] - shard_t[0]) * 60 if len(shard_t) > 1 else None
    res["data"] = {
        "sequences": seqs,
        "response_tokens": total[0],
        "shards": len(shards),
        "seconds": gen_wall,
        "sequences_per_minute": seqs / gen_wall * 60,
        "sequences_per_minute_after_first_shard": steady,
        "response_tokens_per_s": total[0] / gen_wall,
        "dtype": str(lt.model.embed[...].dtype),
        "config": {k: getattr(cfg, k) for k in cfg.__dataclass_fields__},
    }
    _log(f"data: {seqs} sequences in {gen_wall:.1f} s ({res['data']['sequences_per_minute']:.0f} per minute)")
    write_json(path, res)
    del lt
    # --- training (continues the committed drafter)
    eval_reserve = 0.2 * budget
    train_s = max(ctx["deadline"] - time.time() - eval_reserve, 5.0)
    tc = TrainConfig(
        num_layers=dcfg.num_layers,
        block_size=dcfg.block_size,
        target_layer_ids=tuple(dcfg.target_layer_ids),
        mask_token_id=dcfg.mask_token_id,
        num_anchors=ctx["train_anchors"],
        batch_size=ctx["train_batch"],
        steps=ctx["train_steps"] or 100_000,
        lr=6e-4,
        warmup_steps=2 if ctx["train_steps"] else 30,
        arch=dcfg.arch,
        conv_group_size=getattr(dcfg, "conv_group_size", 16),
        selector_rank=getattr(dcfg, "selector_rank", 256) or 256,
        selector_top_k=getattr(dcfg, "selector_top_k", 16) or 16,
        time_budget=0.0 if ctx["train_steps"] else train_s,
        save_every=1_000_000,
        log_every=2 if ctx["train_steps"] else 10,
        init_from=str(committed),
        seed=11,
    )
    run_dir = work / "train"
    if run_dir.exists():
        import shutil

        shutil.rmtree(run_dir)
    t0 = time.time()
    model, history = train(
        lt32.cfg,
        lt32.model.embed[...],
        lt32.model.lm_head[...],
        ShardData(shards),
        tc,
        run_dir,
        final_norm=lt32.model.norm[...],
        target=lt32.model,
        on_log=lambda r: _log(f"train: step {r['step']} loss {r['loss']:.3f} τ {r['tau']:.2f}"),
    )
    last = history[-1] if history else {}
    res["train"] = {
        "steps": int(last.get("step", 0)),
        "seconds": time.time() - t0,
        "s_per_step": last.get("s_per_step"),
        "final_loss": last.get("loss"),
        "final_tau_train": last.get("tau"),
        "budget_s": train_s,
        "config": {k: getattr(tc, k) for k in tc.__dataclass_fields__},
    }
    write_json(path, res)
    cand = work / "candidate_drafter"
    export_drafter(model, cand, lt32.cfg.num_layers, dtype=np.float16)
    res["candidate"] = write_candidate_parts(cand, Path(ctx["out"]), ctx["part_mib"])
    write_json(path, res)
    # --- held-out τ of both drafters
    res["eval"] = heldout_tau(lt32, {"committed": committed, "candidate": cand}, max_new=ctx["eval_max_new"])
    _log(f"eval: committed τ {res['eval']['committed_tau']:.3f}, candidate τ {res['eval']['candidate_tau']:.3f}")
    res["timed_out"] = time.time() > ctx["deadline"]
    write_json(path, res)
    return res


def write_candidate_parts(src: Path, out: Path, part_mib: float) -> dict:
    """The drafter directory as one uncompressed tar, split into `candidate_drafter.tar.NN` files of at most
    `part_mib` MiB (`cat candidate_drafter.tar.* | tar -x` restores it)."""
    for old in out.glob(CANDIDATE_PREFIX + "*"):
        old.unlink()
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        tf.add(src, arcname="candidate_drafter")
    data = buf.getvalue()
    size = max(int(part_mib * 2**20), 1)
    files = []
    for i in range(0, len(data), size):
        name = f"{CANDIDATE_PREFIX}{i // size:02d}"
        (out / name).write_bytes(data[i : i + size])
        files.append(name)
    return {"files": files, "bytes": len(data), "restore": "cat candidate_drafter.tar.* | tar -x"}


def heldout_tau(lt, drafters: dict[str, Path], *, max_new: int, anchors: int = 24, batch: int = 8) -> dict:
    """Teacher-forced τ (as `benchmarks/teacher_forced_eval.py`: the training loss's own forward, f32 LM head) of
    each drafter on the target's greedy responses to the held-out prompts (the same random anchors for all)."""
    from functools import partial

    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from dflash_jax.bench.prompts import encode_prompts, load_prompt_file
    from dflash_jax.checkpoints.drafter import load_drafter
    from dflash_jax.train.data import DataConfig, generate_shard
    from dflash_jax.train.losses import sample_anchors, teacher_forced_tau
    from dflash_jax.train.trainer import TrainConfig, drafter_loss

    prompts = encode_prompts(lt.tokenizer, load_prompt_file(None))
    out: dict = {"method": "teacher-forced τ on greedy responses to the held-out prompts", "max_new": max_new}
    d = None
    for name, path in drafters.items():
        drafter = load_drafter(path, lt.cfg)
        cfg = drafter.cfg
        if d is None:
            dc = DataConfig(
                taps=tuple(cfg.target_layer_ids),
                max_prompt=max(map(len, prompts)),
                max_new=max_new,
                sampled_fraction=0.0,
            )
            d = generate_shard(lt, dc, prompts, 0)
        tc = TrainConfig(
            num_layers=cfg.num_layers,
            block_size=cfg.block_size,
            target_layer_ids=cfg.target_layer_ids,
            mask_token_id=cfg.mask_token_id,
            num_anchors=anchors,
            arch=cfg.arch,
            ce_dtype="float32",
        )

        graphdef, dstate = nnx.split(drafter)

        @partial(jax.jit, static_argnums=0)
        def stats(graphdef, dstate, embed, head, b, tc=tc):  # weights as arguments, not constants of the program
            _, (_, valid, correct, _) = drafter_loss(nnx.merge(graphdef, dstate), embed, head, b, tc)
            c3 = correct.reshape(-1, anchors, tc.block_size - 1)
            v3 = valid.reshape(-1, anchors, tc.block_size - 1)
            kept = jnp.sum(v3[..., 0])
            return teacher_forced_tau(c3, v3) * kept, kept, jnp.sum(c3 & v3, axis=(0, 1)), jnp.sum(v3, axis=(0, 1))

        rng = np.random.default_rng(0)
        n = len(d["tokens"])
        tau_sum = blocks = 0.0
        hits, seen = np.zeros(tc.block_size - 1), np.zeros(tc.block_size - 1)
        for i in range(0, n, batch):
            rows = {k: d[k][i : i + batch] for k in ("tokens", "loss_mask", "lengths", "taps")}
            rows["anchors"], rows["keep"] = sample_anchors(
                rows["loss_mask"], rows["lengths"], anchors, tc.block_size, rng
            )
            batch_ = {k: jnp.asarray(v) for k, v in rows.items()}
            t, k, h, s = stats(graphdef, dstate, lt.model.embed[...], lt.model.lm_head[...], batch_)
            tau_sum, blocks = tau_sum + float(t), blocks + float(k)
            hits, seen = hits + np.asarray(h), seen + np.asarray(s)
        out[f"{name}_tau"] = tau_sum / max(blocks, 1.0)
        out[f"{name}_acceptance_by_position"] = [float(x) for x in hits / np.maximum(seen, 1)]
        out[f"{name}_path"] = str(path)
        out["rows"], out["blocks"] = n, blocks
    return out


STEP_FUNCS = {"attention": step_attention, "decode": step_decode, "cost": step_cost, "data_train": step_data_train}

if __name__ == "__main__":
    sys.exit(main())
