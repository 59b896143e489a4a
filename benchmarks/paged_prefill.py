"""Long-prompt prefill over the KV page pool on the default model (+ its drafter), f32 on CPU:

  memory  — one 6K-token prompt prefilled in chunks of each --chunks size (each in a fresh process): XLA's
            temporary buffers of the largest prefill call (its working memory: activations, attention blocks),
            the process's peak resident memory above the loaded runner's (compilation included), the wall time.
  prefix  — two requests sharing a 1K-token prefix: the second's prefill skips the shared pages (prefix-cache hit
            tokens) and its time to first token against the first's, in the same run (every shape compiled by a
            throwaway pair with another prefix first; medians over --repeats fresh prefixes).

Usage: python benchmarks/paged_prefill.py [--json-out FILE] [--chunks 256,512,1024,2048,6144] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import numpy as np

PROMPT_LEN = 6000
PREFIX_LEN = 1024
SUFFIX_LEN = 64
MAX_LEN = 8192


def _rss_kib(field: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(field)


def _runner(chunk: int, slots: int = 1):
    from dflash_jax.builder import build_runner, load_models

    models = load_models("default", "default")
    return build_runner(models, max_slots=slots, max_model_len=MAX_LEN, max_num_batched_tokens=chunk), models


def _ids(n: int, seed: int, vocab: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(10, vocab - 10, n)]


def memory_one(chunk: int) -> dict:
    """In a fresh process: the prefill of a 6K-token prompt in chunks of `chunk`; XLA's temporary buffers of its
    largest call (`memory_analysis`, the call's working memory beyond its inputs and outputs) and the process's
    peak resident memory over the load + prefill (compilation included) above the loaded runner's."""
    import jax

    from dflash_jax.spec_decode.plan import StepPlan
    from dflash_jax.types import SamplingParams

    runner, models = _runner(chunk)
    vocab = models.target.cfg.vocab_size
    plans: list[StepPlan] = []
    run = runner.apply_plan

    def record(plan):
        plans.append(plan)
        return run(plan)

    runner.apply_plan = record
    base = _rss_kib("VmRSS")
    t0 = time.perf_counter()
    runner.add(0, _ids(PROMPT_LEN, 1, vocab), SamplingParams())
    wall = time.perf_counter() - t0
    peak = _rss_kib("VmHWM")
    last = max(plans, key=lambda p: (p.static["kv_len"], p.arrays["tokens"].shape[1]))
    a = last.arrays
    program, args, static = runner.program_call(last)
    lowered = program.lower(*args, **static)
    temp = lowered.compile().memory_analysis().temp_size_in_bytes
    return {
        "chunk": chunk,
        "prompt_tokens": PROMPT_LEN,
        "prefill_calls": len(plans),
        "largest_call": {"tokens": int(a["tokens"].shape[1]), "kv_len": int(last.static["kv_len"])},
        "xla_temp_mib": temp / 2**20,
        "rss_loaded_mib": base / 1024,
        "rss_peak_added_mib": (peak - base) / 1024,
        "prefill_s": wall,
        "jax": jax.__version__,
    }


def prefix(repeats: int) -> dict:
    from dflash_jax.types import SamplingParams

    runner, models = _runner(2048, slots=2)
    vocab = models.target.cfg.vocab_size

    def pair(seed: int) -> tuple[float, float, int]:
        shared = _ids(PREFIX_LEN, seed, vocab)
        a, b = shared + _ids(SUFFIX_LEN, seed + 1, vocab), shared + _ids(SUFFIX_LEN, seed + 2, vocab)
        hits = runner.pages.stats.prefix_hits
        t0 = time.perf_counter()
        runner.add(0, a, SamplingParams())
        t_a = time.perf_counter() - t0
        t0 = time.perf_counter()
        runner.add(1, b, SamplingParams())
        t_b = time.perf_counter() - t0
        runner.release(0), runner.release(1)
        return t_a, t_b, runner.pages.stats.prefix_hits - hits

    pair(1000)  # compile: the full prompt's shape and the suffix-after-hit shape
    runs = [pair(2000 + 10 * i) for i in range(repeats)]
    return {
        "prefix_tokens": PREFIX_LEN,
        "suffix_tokens": SUFFIX_LEN,
        "page_size": runner.page_size,
        "hit_tokens": [h for _, _, h in runs],
        "ttft_first_ms": [1e3 * a for a, _, _ in runs],
        "ttft_second_ms": [1e3 * b for _, b, _ in runs],
        "median_ratio_second_over_first": float(np.median([b / a for a, b, _ in runs])),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json-out")
    ap.add_argument("--chunks", default="256,512,1024,2048,6144")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--one", type=int, help=argparse.SUPPRESS)  # child process: one memory measurement
    args = ap.parse_args()
    if args.one:
        print(json.dumps(memory_one(args.one)))
        return
    out = {"memory": [], "prefix": None}
    for c in (int(x) for x in args.chunks.split(",")):
        p = subprocess.run([sys.executable, __file__, "--one", str(c)], capture_output=True, text=True, check=True)
        row = json.loads(p.stdout.strip().splitlines()[-1])
        print(json.dumps(row), flush=True)
        out["memory"].append(row)
    out["prefix"] = prefix(args.repeats)
    print(json.dumps(out["prefix"]), flush=True)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
