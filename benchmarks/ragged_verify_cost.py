"""What a ragged verify saves: full-width speculative steps of a batch where only some rows draft, run with every
row at the verify width and as a ragged verify (the non-drafting rows at width 1 in the same call,
`step._ragged_step`), beside the plain step and the step where every row drafts.

    python benchmarks/ragged_verify_cost.py --batch 4 --steps 12 --rounds 5 --json-out F

Each round runs `--steps` steps of every configuration in turn (default drafter, γ 8, greedy, a `--prompt-tokens`
chat prompt per row) and reports the median step time (ms, host read and any catch-up included); the first round
also compiles. A configuration `d of B drafting` has its first d rows verify γ - 1 drafts and the others none.
The defaults keep every step's positions inside one KV length bucket (140 + 12 x 8 < 256), so the configurations
differ in their verify shapes alone.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from dflash_jax.builder import build_runner, load_models
from dflash_jax.types import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--prompt-tokens", type=int, default=140)
    ap.add_argument("--json-out", type=Path)
    args = ap.parse_args()
    m = load_models("default", "default")
    question = "Explain how a compiler works, step by step, with an example of each stage."
    prompt = (m.target.tokenizer.encode_chat([{"role": "user", "content": question}]) * 16)[: args.prompt_tokens]
    gamma = 8
    r = build_runner(m, max_slots=8, max_model_len=len(prompt) + gamma * args.steps + 16, gamma=gamma)
    b = args.batch
    configs = [("plain", 0, 1, True)]
    for d in sorted({1, b // 4, b // 2} - {0}):
        configs += [(f"{d} of {b} drafting, one width", d, gamma, False)]
        configs += [(f"{d} of {b} drafting, ragged", d, gamma, True)]
    configs += [(f"{b} of {b} drafting", b, gamma, True)]
    slots = list(range(b))
    rounds = []
    for i in range(args.rounds):
        row = {}
        for name, d, width, ragged in configs:
            r.ragged_verify = ragged
            r.add_many([(s, prompt, SamplingParams()) for s in slots])
            k = {s: (width - 1 if s < d else 0) for s in slots}
            times = []
            for _ in range(args.steps):
                t0 = time.perf_counter()
                r.step(slots, {s: gamma * args.steps for s in slots}, k, no_propose=[s for s in slots if not k[s]])
                times.append((time.perf_counter() - t0) * 1e3)
            row[name] = float(np.median(times))
            print(f"round {i}, {name}: {row[name]:.2f} ms/step", flush=True)
            for s in slots:
                r.release(s)
        rounds.append(row)
    if args.json_out:
        out = {"batch": b, "steps": args.steps, "prompt_tokens": len(prompt), "rounds": rounds}
        args.json_out.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
