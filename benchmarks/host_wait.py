"""Host-wait fraction per step with the engine's overlapped loop off and on (`--async-scheduling`), on the real
runner with the default model (SmolLM2-135M-Instruct + its committed drafter, as `make serve` builds it), batch 1
and 8, the two loops alternating in the same run.

Per step, from the runner's step clock (`StepTimes.launched` / `ready`: when its last device call was launched and
when its outputs were ready on the device): wall = ready(n) - ready(n-1); host wait = max(0, launched(n) -
ready(n-1)), the time the device sat done with step n-1 while the host had not launched step n; device busy = wall -
host wait. Reported: medians of wall and busy ms, the host-wait fraction (sum of waits / sum of walls; and the
median step's) and decode tok/s (completion tokens / the generate call's wall time). Warm-up rounds of both loops
at the measured length compile every shape first.

    python benchmarks/host_wait.py --json-out benchmarks/results/cpu-2core/host_wait.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

MAX_LEN = 512


def _round(runner, tok, prompts, max_tokens: int, overlap: bool) -> dict:
    from dflash_jax.engine.offline import OfflineEngine

    runner.times.launched.clear()
    runner.times.ready.clear()
    t0 = time.perf_counter()
    with OfflineEngine(runner, tok, overlap=overlap) as llm:
        outs = llm.generate(prompts, max_tokens=max_tokens, ignore_eos=True)
    wall_s = time.perf_counter() - t0
    launched, ready = runner.times.launched, runner.times.ready
    walls, waits = [], []
    for n in range(1, len(ready)):
        wait = max(0.0, launched[n] - ready[n - 1])
        walls.append(ready[n] - ready[n - 1])
        waits.append(wait)
    toks = sum(len(o.token_ids) for o in outs)
    return {
        "steps": len(walls),
        "wall_ms": 1e3 * statistics.median(walls),
        "busy_ms": 1e3 * statistics.median(w - h for w, h in zip(walls, waits, strict=True)),
        "host_wait_fraction": sum(waits) / sum(walls),
        "median_step_host_wait_fraction": statistics.median(h / w for w, h in zip(walls, waits, strict=True)),
        "tok_s": toks / wall_s,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=2, help="rounds per loop (off and on alternate)")
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args(argv)

    from dflash_jax.bench.prompts import encode_prompts, load_category
    from dflash_jax.builder import build_runner, load_models

    models = load_models("default", "default")
    tok = models.target.tokenizer
    batches = [int(b) for b in args.batches.split(",")]
    runner = build_runner(models, max_slots=max(batches), max_model_len=MAX_LEN)
    runner.timing = True
    chats = encode_prompts(tok, load_category("chat"))
    results: dict = {"model": "default (SmolLM2-135M-Instruct + drafter, f32)", "max_tokens": args.max_tokens}
    for b in batches:
        prompts = [chats[i % len(chats)] for i in range(b)]
        for overlap in (False, True):  # compiles every shape the measured rounds use
            _round(runner, tok, prompts, args.max_tokens, overlap)
        rows: dict[str, list[dict]] = {"off": [], "on": []}
        for _ in range(args.rounds):
            for name in ("off", "on"):
                rows[name].append(_round(runner, tok, prompts, args.max_tokens, name == "on"))
        summary = {}
        for name, rs in rows.items():
            summary[name] = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
        summary["tok_s_on_over_off"] = summary["on"]["tok_s"] / summary["off"]["tok_s"]
        results[f"batch_{b}"] = summary
        print(f"batch {b}: {json.dumps(summary)}", flush=True)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
