"""Warm-up cost and step time of `make serve`'s configuration, in one process.

1. The planned warm-up (`SpecRunner.warmup`: calls traced in order, compiled ahead on every CPU, nothing run)
   against the same warm-up driven by real calls (the path a multi-host `plan_hook` takes): programs compiled,
   backend compile seconds (summed over threads), trace seconds and wall seconds.
2. Steady-state decode steps through the warm-up's executables against the same steps through `jax.jit`'s
   dispatch, alternating rounds, at batch 1 and 8: median step milliseconds and tokens per second.

No persistent compilation cache is enabled, so both warm-ups compile from nothing.

    python benchmarks/cold_start.py --json-out benchmarks/results/cpu-2core/cold_start.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

from dflash_jax.builder import build_serving
from dflash_jax.compilation import CompileMeter, compile_threads, release_programs
from dflash_jax.server.config import ServeConfig
from dflash_jax.types import SamplingParams

# `make serve`'s step-cost table (Makefile SPEC_COST).
SPEC_COST = "0:29.3,1:45.1,2:54.2,3:60.8,4:66.8,5:68.8,6:74.1,7:74.2"


def _warmup(runner, *, planned: bool) -> dict:
    runner.plan_hook = None if planned else (lambda plan, apply: apply(plan))
    try:
        with CompileMeter() as m:
            runner.warmup()
    finally:
        runner.plan_hook = None
    return m.as_dict()


def _steps(runner, batch: int, steps: int, speculative: bool) -> list[float]:
    """Per-step wall ms of `steps` decode steps of `batch` rows (greedy, 32-token prompts)."""
    slots = list(range(batch))
    runner.add_many([(s, [1 + (7 * i + s) % 300 for i in range(32)], SamplingParams()) for s in slots])
    while runner.prefilling:
        runner.prefill_step()
    k = None if speculative else {s: 0 for s in slots}
    runner.step(slots, {s: 8 for s in slots}, k)  # a catch-up first when speculative: not timed
    out = []
    for _ in range(steps):
        t0 = time.perf_counter()
        runner.step(slots, {s: 8 for s in slots}, k)
        out.append((time.perf_counter() - t0) * 1e3)
    for s in slots:
        runner.release(s)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json-out", type=Path)
    args = ap.parse_args()
    t0 = time.perf_counter()
    s = build_serving(ServeConfig(dflash_adaptive_k=SPEC_COST), log=lambda *a, **k: None)
    r = s.runner
    result = {
        "machine": {"platform": platform.platform(), "processor": platform.processor(), "cpus": compile_threads()},
        "build_s": round(time.perf_counter() - t0, 2),
        "batch_buckets": list(r.batch_buckets),
    }
    result["planned_warmup"] = _warmup(r, planned=True)
    executables = dict(r.programs.executables)
    r.programs.executables.clear()
    release_programs()
    result["warmup_by_real_calls"] = _warmup(r, planned=False)
    print(json.dumps({k: result[k] for k in ("planned_warmup", "warmup_by_real_calls")}), flush=True)
    rows = []
    for batch in (1, 8):
        for speculative in (False, True):
            times: dict[str, list[float]] = {"executables": [], "jit": []}
            for _ in range(args.rounds):
                for path in ("executables", "jit"):
                    r.programs.executables.clear()
                    if path == "executables":
                        r.programs.executables.update(executables)
                    times[path] += _steps(r, batch, args.steps, speculative)
            row = {"batch": batch, "speculative": speculative}
            for path, ts in times.items():
                row[f"{path}_step_ms"] = round(statistics.median(ts), 2)
            row["executables_over_jit"] = round(row["executables_step_ms"] / row["jit_step_ms"], 3)
            rows.append(row)
            print(json.dumps(row), flush=True)
    r.programs.executables.update(executables)
    result["steps"] = rows
    if args.json_out:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
