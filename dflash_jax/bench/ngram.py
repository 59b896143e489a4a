"""Prompt-lookup (n-gram) drafting, measured on greedy outputs: the baseline `bench decode` reports beside the
drafter.

The proposer is `spec_decode.ngram.propose` (vLLM's `ngram`: what followed the latest earlier occurrence of the
context's last 4..1 tokens).

Under greedy verification the emitted sequence does not depend on the drafts (each step keeps the drafts that equal
the target's argmax, then the target's own next token), so a speculative run with these drafts emits exactly the
plain greedy output. Its τ and acceptance by position therefore follow from the plain output alone: each step
proposes from the context so far, accepts the longest prefix of the drafts that equals the next tokens of the plain
output, and emits that prefix plus one token. `simulate` replays that, step by step, and returns the emitted tokens
(equal to the plain output by construction, which the tests check against a step-by-step greedy loop).
`NgramRunner` runs the same drafts through the product's speculative step, for measured speed
(`bench decode --draft-method ngram`); `spec_decode.ngram.HybridRunner` verifies n-gram drafts beside the drafter's
(`--draft-method hybrid`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from dflash_jax.spec_decode.ngram import HYBRID_MIN_N, HybridRunner, propose
from dflash_jax.spec_decode.oracle import GivenDraftsRunner
from dflash_jax.spec_decode.plan import StepPlan
from dflash_jax.spec_decode.runner import SpecRunner

__all__ = ["HYBRID_MIN_N", "HybridRunner", "NgramRunner", "propose", "simulate", "step_through"]


def step_through(
    prompt: Sequence[int], output: Sequence[int], gamma: int, *, min_n: int = 1, max_n: int = 4
) -> tuple[list[int], list[int], list[list[bool]]]:
    """Greedy speculative decoding of `output` (the plain greedy continuation of `prompt`, its first token from
    the prefill) with n-gram drafts at verify width `gamma`: (emitted tokens, tokens emitted per speculative step,
    per step the acceptance of each draft position it verified). As in the engine, a step verifies at most one
    draft fewer than the tokens still to emit, and the last token, where none can be verified, is a plain step
    (not counted)."""
    if gamma < 2:
        raise ValueError(f"gamma must be >= 2 (drafts + 1), got {gamma}")
    out = list(output)
    emitted = out[:1]
    per_step: list[int] = []
    accepted: list[list[bool]] = []
    while len(emitted) < len(out):
        g = len(emitted)
        k = min(gamma - 1, len(out) - g - 1)
        if k == 0:
            emitted.append(out[g])
            continue
        drafts = propose(list(prompt) + emitted, k, min_n=min_n, max_n=max_n)
        n_ok = 0
        while n_ok < len(drafts) and drafts[n_ok] == out[g + n_ok]:
            n_ok += 1
        emitted += out[g : g + n_ok + 1]  # the accepted drafts, then the target's own token
        per_step.append(n_ok + 1)
        accepted.append([i < n_ok for i in range(k)])
    return emitted, per_step, accepted


def simulate(
    prompts: Sequence[Sequence[int]],
    outputs: Sequence[Sequence[int]],
    gamma: int,
    *,
    min_n: int = 1,
    max_n: int = 4,
) -> dict:
    """τ (tokens per speculative step), its histogram and acceptance by position (accepted over verified) of
    n-gram drafting over a set of greedy outputs; `outputs_identical` confirms the replay emitted every plain
    output unchanged."""
    steps: list[int] = []
    hits = np.zeros(gamma - 1)
    seen = np.zeros(gamma - 1)
    identical = True
    for p, o in zip(prompts, outputs, strict=True):
        emitted, per_step, accepted = step_through(p, o, gamma, min_n=min_n, max_n=max_n)
        identical &= emitted == list(o)
        steps += per_step
        for a in accepted:
            seen[: len(a)] += 1
            hits[: len(a)] += a
    al = np.array(steps)
    return {
        "method": "ngram",
        "min_n": min_n,
        "max_n": max_n,
        "gamma": gamma,
        "steps": int(al.size),
        "tau_mean": float(al.mean()) if al.size else 1.0,
        "tau_histogram": {str(k): int((al == k).sum()) for k in range(1, gamma + 1)},
        "acceptance_by_position": [float(h / n) if n else None for h, n in zip(hits, seen, strict=True)],
        "outputs_identical": bool(identical),
    }


class NgramRunner(GivenDraftsRunner):
    """A runner whose speculative steps verify n-gram drafts of each sequence's own tokens (prompt and emitted
    so far) with the product's step: the same target verify and acceptance, so greedy output equals plain. The
    drafter is not asked to propose, but keeps its context as in any speculative step (that write is part of the
    measured step time). A row counts only as many drafts as its proposal has (the rest of the step's width is
    padding that cannot be accepted), as the replay in `step_through` does."""

    min_n: int = 1
    max_n: int = 4

    def _run(self, plan: StepPlan) -> Any:
        if plan.kind != "step" or not plan.static["speculative"]:
            return super()._run(plan)
        ids = plan.arrays["slot_ids"]
        width = int(plan.static["width"])
        drafts = np.zeros((len(ids), width - 1), np.int32)
        counted = np.array(plan.arrays["num_drafts"], np.int32)
        for i, s in enumerate(ids):
            if s == self.scratch:
                continue
            d = propose(self.slots[int(s)].tokens, width - 1, min_n=self.min_n, max_n=self.max_n)
            drafts[i, : len(d)] = d
            counted[i] = min(int(counted[i]), len(d))
        plan = StepPlan(plan.kind, {**plan.arrays, "drafts": drafts, "num_drafts": counted}, plan.static)
        return SpecRunner._run(self, plan)  # the drafts are set: GivenDraftsRunner's step program verifies them
