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


def lookup_drafts(model, drafter, w, dcache, anchor, start, kv, sp, ngram, *, width, kv_len):
    """A draft source for a step whose every drafting row verifies its n-gram drafts `ngram` [B, width-1]: no
    drafter work. The proposal is one-hot on each draft (no q: the standard acceptance rule, exact for a
    deterministic draft)."""
    return ngram.astype(jnp.int32), None


class HybridRunner(GivenDraftsRunner):
    """A runner whose speculative steps verify each row's n-gram drafts (its own tokens, prompt and emitted so far)
    when its last `min_n`..`max_n` tokens recur earlier in its context, and the drafter's proposal otherwise, in the
    product's one-call step (`hybrid_drafts`; a step whose every drafting row has n-gram drafts runs no drafter block,
    `lookup_drafts`). The host proposes from the tokens collected so far, so steps do not overlap with the host's work
    (`supports_overlap` is False). A row with n-gram drafts verifies only as many drafts as its proposal has, and its
    result says so (`StepResult.lookup`; `lookup_slots` names those rows before the step, for the controller). Prompt
    chunks carried by a step (mixed steps) and constrained steps verify the drafter's proposal."""

    ragged_verify = True  # its drafts are laid out per row of the plan (`_run`)
    min_n: int = HYBRID_MIN_N
    max_n: int = 4

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._proposals: dict[int, tuple[int, list[int]]] = {}  # slot -> (context length, its n-gram drafts)
        self._lookup_counts: dict[int, int] = {}  # the last step's n-gram rows: drafts verified

    def _lookup(self, slot: int) -> list[int]:
        """The slot's n-gram drafts (up to γ - 1) from its current context, memoised per context length."""
        tokens = self.slots[slot].tokens
        memo = self._proposals.get(slot)
        if memo is None or memo[0] != len(tokens):
            memo = (len(tokens), propose(tokens, self.gamma - 1, min_n=self.min_n, max_n=self.max_n))
            self._proposals[slot] = memo
        return memo[1]

    def lookup_slots(self, slots: list[int]) -> set[int]:
        return {s for s in slots if s in self.slots and self._lookup(s)}

    def dispatch(self, *args: Any, **kwargs: Any):
        self._lookup_counts = {}
        h = super().dispatch(*args, **kwargs)
        h.lookup, self._lookup_counts = self._lookup_counts, {}
        return h

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
            d = self._lookup(int(s))[: width - 1]
            if d:
                ngram[i, : len(d)], use[i] = d, True
                counted[i] = min(int(counted[i]), len(d))
                if counted[i] > 0:
                    self._lookup_counts[int(s)] = int(counted[i])
        # a step of lookup drafts alone carries no `ngram_use`: its own program, and its own precompiled-program key
        lookup_only = {**plan.arrays, "ngram_drafts": ngram, "num_drafts": counted}
        if self._planner is not None:  # the warm-up compiles both programs of these shapes
            SpecRunner._run(self, StepPlan(plan.kind, lookup_only, plan.static))
        elif np.all(use | (counted == 0)):
            return SpecRunner._run(self, StepPlan(plan.kind, lookup_only, plan.static))
        return SpecRunner._run(self, StepPlan(plan.kind, {**lookup_only, "ngram_use": use}, plan.static))

    def _variants(self, plan: StepPlan) -> list[StepPlan]:
        ids = plan.arrays["slot_ids"]
        ngram = {"ngram_drafts": np.zeros((len(ids), int(plan.static["width"]) - 1), np.int32)}
        lookup_only = StepPlan(plan.kind, {**plan.arrays, **ngram}, plan.static)
        both = StepPlan(plan.kind, {**plan.arrays, **ngram, "ngram_use": np.zeros(len(ids), bool)}, plan.static)
        return [lookup_only, both]

    def program_call(self, plan: StepPlan) -> tuple[Any, tuple, dict]:
        program, args, static = SpecRunner.program_call(self, plan)
        if plan.kind == "step" and "ngram_drafts" in plan.arrays:
            a = plan.arrays
            if "ngram_use" not in a:
                return step_program(self.step_model, lookup_drafts), (*args, a["ngram_drafts"]), static
            return step_program(self.step_model, hybrid_drafts), (*args, a["ngram_drafts"], a["ngram_use"]), static
        return program, args, static

    def release(self, slot: int) -> None:
        self._proposals.pop(slot, None)
        super().release(slot)
