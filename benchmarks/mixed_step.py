"""Inter-token latency of running streams while a long prompt prefills, with and without mixed steps, on the default
model (SmolLM2-135M-Instruct + its committed drafter, f32 on CPU, as `make serve` builds it), through the serving
engine (`engine.Engine`), all in one run:

  3 streams decode (greedy, chat prompts), then one ~1,500-token prompt arrives. Per `--step-token-budget` (0: the
  prompt prefills in a call of its own between steps; N: each step carries at most N of its tokens): the streams'
  longest gap between two outputs from the arrival to the long prompt's first token, over their median gap before
  the arrival, and the long prompt's time to first token, against its time to first token alone (nothing decoding).

Every shape is compiled first by a throwaway round of the same scenario (other random prompts, so no prefix-cache
hit helps the measured rounds); each measured round uses fresh prompts.

Usage: python benchmarks/mixed_step.py [--budgets 0,64,128] [--long 1500] [--json-out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from itertools import pairwise

import numpy as np

STREAMS = 3
MAX_LEN = 2048
BEFORE = 12  # outputs per stream before the long prompt arrives
AFTER = 4  # outputs per stream after the long prompt's first token


def _long_prompt(n: int, seed: int, vocab: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(10, vocab - 10, n)]


async def _round(runner, tok, chats, long_ids, budget: int, *, alone: bool = False) -> dict:
    from dflash_jax.engine.engine import Engine
    from dflash_jax.engine.types import GenerationRequest

    eng = Engine(runner, tok, max_num_seqs=STREAMS + 1, log_interval_s=0, step_token_budget=budget)
    await eng.start()
    times: list[list[float]] = [[] for _ in range(STREAMS)]
    arrival = first = None

    async def follow(i: int, stream) -> None:
        async for _ in stream:
            times[i].append(time.monotonic())
            if first is not None and len([t for t in times[i] if t > first]) >= AFTER:
                stream.abort()

    tasks = []
    if not alone:
        reqs = [GenerationRequest(ids, max_tokens=MAX_LEN - len(long_ids) - 64, ignore_eos=True) for ids in chats]
        tasks = [asyncio.create_task(follow(i, s)) for i, s in enumerate(eng.submit_many(reqs))]
        while min(len(t) for t in times) < BEFORE:
            await asyncio.sleep(0.001)
    arrival = time.monotonic()
    long = eng.submit(GenerationRequest(long_ids, max_tokens=1, ignore_eos=True))
    async for _ in long:
        first = time.monotonic()
        break
    ttft = first - arrival
    await asyncio.gather(*tasks)
    await eng.stop()
    if alone:
        return {"ttft_s": ttft}
    before = [b - a for ts in times for a, b in pairwise(ts[2:]) if b <= arrival]
    during = [b - a for ts in times for a, b in pairwise(ts) if b > arrival and a < first]
    median = statistics.median(before)
    worst = max(during)
    return {
        "budget": budget,
        "median_gap_before_ms": 1e3 * median,
        "max_gap_during_ms": 1e3 * worst,
        "max_over_median": worst / median,
        "ttft_s": ttft,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--budgets", default="0,64,128", help="comma-separated --step-token-budget values (0 included)")
    ap.add_argument("--long", type=int, default=1500, help="tokens of the prompt that arrives mid-run")
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args(argv)
    budgets = [int(b) for b in args.budgets.split(",")]

    from dflash_jax.bench.prompts import encode_prompts, load_category
    from dflash_jax.builder import build_runner, load_models

    models = load_models("default", "default")
    tok = models.target.tokenizer
    vocab = models.target.cfg.vocab_size
    runner = build_runner(models, max_slots=STREAMS + 1, max_model_len=MAX_LEN)
    chats = encode_prompts(tok, load_category("chat"))
    seed = iter(range(1000))

    def scenario(budget: int) -> dict:
        pick = [chats[(next(seed) * 7) % len(chats)] for _ in range(STREAMS)]
        return asyncio.run(_round(runner, tok, pick, _long_prompt(args.long, next(seed), vocab), budget))

    t0 = time.perf_counter()
    for b in budgets:  # compiles every shape the measured rounds take
        scenario(b)
    alone_run = asyncio.run(_round(runner, tok, [], _long_prompt(args.long, next(seed), vocab), 0, alone=True))
    print(f"warm-up rounds: {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    alone = asyncio.run(_round(runner, tok, [], _long_prompt(args.long, next(seed), vocab), 0, alone=True))["ttft_s"]
    rows = []
    for b in budgets:
        r = scenario(b)
        r["ttft_over_alone"] = r["ttft_s"] / alone
        rows.append(r)
        print(
            f"budget {b:5d}: median gap before {r['median_gap_before_ms']:.0f} ms, longest gap while prefilling "
            f"{r['max_gap_during_ms']:.0f} ms ({r['max_over_median']:.1f}x); long prompt TTFT {r['ttft_s']:.2f} s "
            f"({r['ttft_over_alone']:.2f}x alone: {alone:.2f} s)"
        )
    out = {
        "model": "SmolLM2-135M-Instruct + committed drafter (f32, CPU)",
        "streams": STREAMS,
        "long_prompt_tokens": args.long,
        "ttft_alone_s": alone,
        "warmup_alone_ttft_s": alone_run["ttft_s"],
        "rounds": rows,
    }
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
