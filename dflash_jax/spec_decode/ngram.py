"""Prompt-lookup (n-gram) drafts, and the hybrid proposer that verifies them beside the drafter's.

The lookup is the one vLLM calls `ngram`: take the last n tokens of the context (prompt and everything generated so
far), find their latest earlier occurrence in the context, and propose the tokens that followed it; n runs from
`max_n` down to `min_n` and the first n that matches wins; no match proposes nothing. `HybridRunner` verifies, per row
and step, the n-gram drafts where the row's last `HYBRID_MIN_N` or more tokens recur earlier in its context, and the
drafter's proposal elsewhere (`serve --draft-method hybrid`, `bench decode --draft-method hybrid`): n-gram drafts,
once they match, keep matching where an answer repeats its context, and the drafter covers the rest.
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
