"""Prompt-lookup (n-gram) drafting, measured on greedy outputs: the baseline `bench decode` reports beside the
drafter.

The proposer is the one vLLM calls `ngram`: take the last n tokens of the context (prompt and everything generated
so far), find their latest earlier occurrence in the context, and propose the tokens that followed it; n runs from
`max_n` down to `min_n` and the first n that matches wins; no match proposes nothing.

Under greedy verification the emitted sequence does not depend on the drafts (each step keeps the drafts that equal
the target's argmax, then the target's own next token), so a speculative run with these drafts emits exactly the
plain greedy output. Its τ and acceptance by position therefore follow from the plain output alone: each step
proposes from the context so far, accepts the longest prefix of the drafts that equals the next tokens of the plain
output, and emits that prefix plus one token. `simulate` replays that, step by step, and returns the emitted tokens
(equal to the plain output by construction, which the tests check against a step-by-step greedy loop).
`NgramRunner` runs the same drafts through the product's speculative step, for measured speed
(`bench decode --draft-method ngram`). `HybridRunner` verifies, per row and step, the n-gram drafts where the context's
last `HYBRID_MIN_N` or more tokens recur earlier in it, and the drafter's proposal elsewhere
(`bench decode --draft-method hybrid`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

from dflash_jax.spec_decode.oracle import GivenDraftsRunner
from dflash_jax.spec_decode.plan import StepPlan
from dflash_jax.spec_decode.runner import SpecRunner
from dflash_jax.spec_decode.step import _propose, step_program

# The shortest recurring suffix whose n-gram drafts the hybrid verifies instead of the drafter's: on the held-out
# categories (default drafter, γ 8, the decode-exact teacher-forced chain of docs/benchmarks.md) 2 gave the highest τ
# on chat, code and edit, and 1 tied it on structured.
HYBRID_MIN_N = 2


def propose(context: Sequence[int], k: int, *, min_n: int = 1, max_n: int = 4) -> list[int]:
    """Up to `k` draft tokens: what followed the latest earlier occurrence of the context's last n tokens (n from
    `max_n` down to `min_n`; none if no such suffix recurs)."""
    if k <= 0 or min_n < 1 or max_n < min_n:
        raise ValueError(f"propose: need k >= 1 and 1 <= min_n <= max_n, got k={k}, min_n={min_n}, max_n={max_n}")
    ctx = list(context)
    size = len(ctx)
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        suffix = ctx[size - n :]
        for start in range(size - n - 1, -1, -1):  # latest occurrence that ends before the suffix does
            if ctx[start : start + n] == suffix:
                return ctx[start + n : start + n + k]
    return []


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


def hybrid_drafts(model, drafter, w, dcache, anchor, start, kv, sp, ngram, use, *, width, kv_len):
    """A draft source: rows with `use` [B] verify their n-gram drafts `ngram` [B, width-1], the others the drafter's
    proposal. For DFlash2 an n-gram row's proposal distribution is one-hot on its draft (every candidate slot holds
    the draft, the first with mass 1): the sampled acceptance rule is then exact for a deterministic draft, as for
    the drafter's own rows with their walk's q."""
    drafts, q = _propose(model, drafter, w, dcache, anchor, start, kv, sp, width=width, kv_len=kv_len)
    ngram = ngram.astype(jnp.int32)
    drafts = jnp.where(use[:, None], ngram, drafts.astype(jnp.int32))
    if q is not None:
        ids, probs = q
        one_hot = (jnp.arange(ids.shape[-1]) == 0).astype(probs.dtype)
        ids = jnp.where(use[:, None, None], ngram[..., None], ids)
        probs = jnp.where(use[:, None, None], one_hot, probs)
        q = (ids, probs)
    return drafts, q


class HybridRunner(GivenDraftsRunner):
    """A runner whose speculative steps verify each row's n-gram drafts (its own tokens, prompt and emitted so far)
    when its last `min_n`..`max_n` tokens recur earlier in its context, and the drafter's proposal otherwise, in the
    product's one-call step (`hybrid_drafts`). The host proposes from the tokens collected so far, so steps do not
    overlap with the host's work (`supports_overlap` is False). A row with n-gram drafts counts only as many drafts as
    its proposal has. Prompt chunks carried by a step (mixed steps; the offline engine runs none) and constrained
    steps verify the drafter's proposal."""

    min_n: int = HYBRID_MIN_N
    max_n: int = 4

    def _run(self, plan: StepPlan) -> Any:
        if plan.kind != "step" or not plan.static["speculative"] or "proposal" in plan.arrays:
            return SpecRunner._run(self, plan)
        ids = plan.arrays["slot_ids"]
        width = int(plan.static["width"])
        ngram = np.zeros((len(ids), width - 1), np.int32)
        use = np.zeros(len(ids), bool)
        counted = np.array(plan.arrays["num_drafts"], np.int32)
        for i, s in enumerate(ids):
            if s == self.scratch:
                continue
            d = propose(self.slots[int(s)].tokens, width - 1, min_n=self.min_n, max_n=self.max_n)
            if d:
                ngram[i, : len(d)], use[i] = d, True
                counted[i] = min(int(counted[i]), len(d))
        arrays = {**plan.arrays, "ngram_drafts": ngram, "ngram_use": use, "num_drafts": counted}
        return SpecRunner._run(self, StepPlan(plan.kind, arrays, plan.static))

    def program_call(self, plan: StepPlan) -> tuple[Any, tuple, dict]:
        program, args, static = SpecRunner.program_call(self, plan)
        if plan.kind == "step" and "ngram_drafts" in plan.arrays:
            extra = (plan.arrays["ngram_drafts"], plan.arrays["ngram_use"])
            return step_program(self.step_model, hybrid_drafts), (*args, *extra), static
        return program, args, static
