"""The GPU proof kit's output contract (`benchmarks/gpu/run.sh`): the files it writes, the fields each must hold,
the per-step time boxes, and the summary table. The driver (`benchmarks/gpu/kit.py`) and its test share these.

Files (at most `MAX_FILES` in the output directory):
  summary.json       — the machine, the run's settings, per step: status, wall time, `timed_out`, `error`; the GPU
                       test subset's counts; the paged attention step's results (`attention`); the headline figures
  decode.json        — plain vs speculative decoding of the default model by batch size (`runs`, attention backend
                       xla) and the same at one batch size with the Pallas paged attention kernel (`pallas_runs`)
  cost8b.json        — the 8B-shaped cost table (`dflash_jax.bench.cost_table`)
  data_train.json    — data generation rate, the drafter's continued training, the candidate's held-out τ
  cost.png           — t_step(γ)/t_decode by γ per batch size, from cost8b.json
  run.log            — every step's console output
  candidate_drafter.tar.NN — the exported candidate drafter (a tar split into parts of at most `--part-mib`)
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

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
CANDIDATE_PREFIX = "candidate_drafter.tar."
# Share of the whole budget each step may take (the rest, ~6%, is start-up and the summary).
BUDGET_SHARES = {"tests": 0.14, "attention": 0.14, "decode": 0.19, "cost": 0.17, "data_train": 0.30}
# The paged attention step's cases (B, T, kv_len), bf16, in the order they run: decode at batch 1/8/32 over 2K and
# 8K keys, a verify of 16 positions at batch 8, one 2048-token prefill chunk over 8K keys.
ATTENTION_CASES = ((1, 1, 2048), (8, 1, 2048), (32, 1, 2048), (1, 1, 8192), (8, 1, 8192), (32, 1, 8192))
ATTENTION_CASES += ((8, 16, 2048), (1, 2048, 8192))
DRY_ATTENTION_CASES = ((2, 4, 64),)

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
        "propose_by_tier.*.t_propose_ms",
        "propose_by_tier.*.prepare_s",
    ),
    "data_train.json": (
        "timed_out",
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


def step_budgets(total: float) -> dict[str, float]:
    return {k: total * v for k, v in BUDGET_SHARES.items()}


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
