"""`bench spec-cost`: measure the step-cost table (ms per step by draft count) for `--dflash-adaptive-k`.

For each batch width n and draft count k = 0..γ-1, runs steps where every sequence verifies exactly k drafts
(k = 0: a plain decode step, no drafter work) and reports the median wall time of a whole step (one device call:
propose, verify, context write; and the host read of its result).
"""

from __future__ import annotations

import time

import numpy as np

from dflash_jax.spec_decode.runner import SpecRunner
from dflash_jax.types import SamplingParams


def measure_costs(
    lt,
    drafter,
    draft_lm_head,
    *,
    widths=(1,),
    gamma: int,
    steps: int = 12,
    prompt: list[int] | None = None,
    dense_layout: str = "auto",
    log=print,
) -> dict[int, dict[int, float]]:
    prompt = prompt or lt.tokenizer.encode_chat([{"role": "user", "content": "Explain how a compiler works."}])
    out: dict[int, dict[int, float]] = {}
    max_len = len(prompt) + (steps + 2) * gamma * 2 + 16
    for n in widths:
        table = {}
        for k in range(gamma):
            r = SpecRunner(
                lt.model,
                drafter,
                max_slots=n,
                max_model_len=max_len,
                gamma=gamma,
                draft_lm_head=draft_lm_head,
                dense_layout=dense_layout,
            )
            slots = list(range(n))
            r.add_many([(s, prompt, SamplingParams()) for s in slots])
            times = []
            for i in range(steps + 2):
                t0 = time.perf_counter()
                r.step(slots, {s: gamma for s in slots}, {s: k for s in slots})
                if i >= 2:  # the first steps compile
                    times.append((time.perf_counter() - t0) * 1e3)
            table[k] = float(np.median(times))
            log(f"width {n}, {k} drafts: {table[k]:.1f} ms/step")
        out[n] = table
    return out
