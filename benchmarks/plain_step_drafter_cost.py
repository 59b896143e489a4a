"""What a loaded drafter costs the plain decode steps: the same batch of plain steps on a runner without a drafter
(`serve --no-spec`), on the speculative runner and on the hybrid (prompt-lookup) runner, every row decoding
plainly (its target taps go to the pending buffer, caught up into the drafter context when it fills).

    python benchmarks/plain_step_drafter_cost.py --batch 4 --steps 130 --rounds 3 --json-out F

Each round runs `--steps` plain steps of every runner in turn from a 100-token prompt and reports the median step
time (ms, host read included) and the device calls made; the first round also compiles.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from dflash_jax.builder import Models, build_runner, load_models
from dflash_jax.spec_decode.ngram import HybridRunner
from dflash_jax.spec_decode.runner import SpecRunner
from dflash_jax.types import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=130)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json-out", type=Path)
    args = ap.parse_args()
    m = load_models("default", "default")
    question = "Explain how a compiler works, step by step, with an example of each stage."
    prompt = (m.target.tokenizer.encode_chat([{"role": "user", "content": question}]) * 4)[:100]
    max_len = len(prompt) + args.steps + 16
    runners: dict[str, SpecRunner] = {
        "no drafter": build_runner(Models(m.target, None, None), max_slots=8, max_model_len=max_len),
        "drafter": build_runner(m, max_slots=8, max_model_len=max_len, gamma=8),
        "hybrid": build_runner(m, max_slots=8, max_model_len=max_len, gamma=8, runner_cls=HybridRunner),
    }
    slots = list(range(args.batch))
    rounds = []
    for i in range(args.rounds):
        row = {}
        for name, r in runners.items():
            r.add_many([(s, prompt, SamplingParams()) for s in slots])
            before = dict(r.device_calls)
            times = []
            for _ in range(args.steps):
                t0 = time.perf_counter()
                r.step(slots, {s: args.steps for s in slots}, {s: 0 for s in slots}, no_propose=slots)
                times.append((time.perf_counter() - t0) * 1e3)
            calls = {k: v - before.get(k, 0) for k, v in r.device_calls.items() if v - before.get(k, 0)}
            row[name] = {"median_ms": float(np.median(times)), "device_calls": calls}
            print(f"round {i}, {name}: {row[name]['median_ms']:.2f} ms/step, calls {calls}", flush=True)
            for s in slots:
                r.release(s)
        rounds.append(row)
    if args.json_out:
        out = {"batch": args.batch, "steps": args.steps, "prompt_tokens": len(prompt), "rounds": rounds}
        args.json_out.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
