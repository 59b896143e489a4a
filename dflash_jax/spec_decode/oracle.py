"""`GivenDraftsRunner`: a `SpecRunner` whose speculative steps verify drafts the host gives instead of the
drafter's proposals (the drafter still keeps its context, so later proposals would see the same state).

For the test oracles (drafts that are known to be right, or wrong at chosen places) and for the cost table's
verify-only timing. Its step is its own program (`step.step_program` with a draft source that returns the step's
extra input), so the product's programs carry no such input.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

from dflash_jax.spec_decode.plan import StepPlan
from dflash_jax.spec_decode.runner import SpecRunner
from dflash_jax.spec_decode.step import step_program


def _given(model, drafter, w, dcache, anchor, start, kv, sp, drafts, *, width, kv_len):
    """A draft source: the step's extra input, drafts [B, width-1]."""
    return drafts.astype(jnp.int32), None


class GivenDraftsRunner(SpecRunner):
    """Override `given_drafts`; where it returns None the drafter proposes as usual."""

    supports_overlap = False  # `given_drafts` reads the slots' host state, current only once each step is collected
    ragged_verify = False  # `given_drafts` fills the leading rows of a step, so its rows stay in one group

    def given_drafts(self, slot_list: list[int], width: int) -> np.ndarray | None:
        """Drafts [len(slot_list), width-1] to verify for the step's slots (in its row order), or None."""
        return None

    def _run(self, plan: StepPlan) -> Any:
        if plan.kind == "propose":  # a constrained step's proposal (`SpecRunner._grammar_masks`)
            ids = plan.arrays["slot_ids"]
            real = [int(s) for s in ids if s != self.scratch]
            given = self.given_drafts(real, int(plan.static["width"]))
            if given is not None:
                drafts = np.zeros((len(ids), int(plan.static["width"]) - 1), np.int32)
                drafts[: len(real)] = given
                return drafts, None, drafts[..., None]  # each given draft is its position's only candidate
        if plan.kind == "step" and plan.static["speculative"] and "proposal" not in plan.arrays:
            ids = plan.arrays["slot_ids"]
            real = [int(s) for s in ids if s != self.scratch]
            width = int(plan.static["width"])
            given = self.given_drafts(real, width)
            if given is not None:
                drafts = np.zeros((len(ids), width - 1), np.int32)
                drafts[: len(real)] = given
                plan = StepPlan(plan.kind, {**plan.arrays, "drafts": drafts}, plan.static)
        return super()._run(plan)

    def program_call(self, plan: StepPlan) -> tuple[Any, tuple, dict]:
        program, args, static = super().program_call(plan)
        if plan.kind == "step" and "drafts" in plan.arrays:
            return step_program(self.step_model, _given), (*args, plan.arrays["drafts"]), static
        return program, args, static
