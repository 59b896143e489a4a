"""Ragged verify: a speculative step whose non-drafting rows decode plainly at width 1 in the same call
(`step._ragged_step`, laid out by `kv.sizing.ragged_split`). Against plain greedy decoding by full-sequence forwards,
against the same schedule run with every row at the verify width (`ragged_verify = False`), for sampling rows, and
for the drafter context of a row that decodes plainly for a while (its pending taps, then the catch-up)."""

from __future__ import annotations

import numpy as np
import pytest

from dflash_jax.kv.sizing import ragged_split
from dflash_jax.spec_decode.runner import SpecRunner
from dflash_jax.types import SamplingParams
from tests.spec_decode.test_spec_parity import plain_greedy

pytestmark = pytest.mark.usefixtures("highest_matmul_precision")  # f32 results meet f32 references

MAX_LEN = 128
BUCKETS = (1, 2, 4, 8)


@pytest.mark.parametrize(
    ("rows", "drafting", "want"),
    [
        (4, 1, (1, 3)),  # one drafting row, three plain rows: the bucket of 4
        (4, 2, (2, 2)),
        (3, 1, (1, 3)),  # a padding row in the plain group
        (3, 2, (2, 2)),  # a padding row in the plain group
        (2, 1, (1, 1)),
        (6, 3, (4, 4)),  # a padding row in each group
        (8, 1, (1, 7)),
        (4, 3, None),  # the drafting group's bucket (4) leaves no room for the plain row
        (8, 5, None),
        (4, 4, None),  # every row drafts
        (4, 0, None),  # none does: a plain step
        (1, 1, None),
    ],
)
def test_ragged_split_lays_out_the_groups_in_the_batch_bucket(rows, drafting, want):
    assert ragged_split(rows, drafting, BUCKETS) == want


class Recording(SpecRunner):
    """Keeps each step's `plain_rows` (0 when the step ran every row at one width), the verified drafts of its
    drafting rows and what its results say of it (`StepResult.ragged`)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.plain_rows: list[int] = []
        self.drafts: list[dict[int, list[int]]] = []
        self.reported: list[set[bool]] = []

    def _run(self, plan):
        if plan.kind == "step":
            self.plain_rows.append(int(plan.static.get("plain_rows", 0)))
        return super()._run(plan)

    def step(self, slot_list, max_new=None, num_drafts=None, *a, **kw):
        res = super().step(slot_list, max_new, num_drafts, *a, **kw)
        self.drafts.append({s: list(self.last_drafts[s][: r.num_drafts]) for s, r in res.items() if r.num_drafts})
        self.reported.append({r.ragged for r in res.values()})
        return res


def prompt(n: int, seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(1, 60, size=n)]


# per step, the drafts each of four rows verifies: rows drafting and decoding plainly side by side, rows switching
# between the two (a switch back to drafting catches up the pending taps), every row drafting, none
SCHEDULE = [
    (7, 0, 0, 0),
    (7, 0, 0, 0),
    (0, 3, 0, 0),
    (3, 0, 7, 0),
    (7, 7, 7, 7),
    (0, 0, 0, 0),
    (0, 0, 1, 0),
    (7, 0, 0, 3),
    (1, 7, 0, 0),
    (0, 0, 0, 7),
]


def run(runner: Recording, prompts, sampling, n_new: int) -> dict[int, list[int]]:
    out = {s: list(r.tokens) for s, r in runner.add_many(
        [(s, p, sp) for s, (p, sp) in enumerate(zip(prompts, sampling, strict=True))]
    ).items()}  # fmt: skip
    i = 0
    while min(len(t) for t in out.values()) < n_new:
        want = SCHEDULE[i % len(SCHEDULE)]
        i += 1
        active = list(out)
        res = runner.step(active, {s: n_new for s in active}, {s: want[s] for s in active})
        for s, r in res.items():
            out[s] += r.tokens
    return {s: t[:n_new] for s, t in out.items()}


def test_ragged_steps_decode_as_plain_greedy_and_as_full_width_steps(tiny_target, tiny_drafter):
    prompts = [prompt(5 + 3 * i, 40 + i) for i in range(4)]
    n_new = 40
    want = plain_greedy(tiny_target, prompts, n_new, tmax=MAX_LEN)
    greedy = [SamplingParams()] * 4
    ragged = Recording(tiny_target, tiny_drafter, max_slots=4, max_model_len=MAX_LEN)
    got = run(ragged, prompts, greedy, n_new)
    assert [got[s] for s in range(4)] == want
    assert 3 in ragged.plain_rows and 2 in ragged.plain_rows  # (1 | 3) and (2 | 2) steps ran
    assert ragged.reported == [{p > 0} for p in ragged.plain_rows]  # every row's result says how its step ran
    full = Recording(tiny_target, tiny_drafter, max_slots=4, max_model_len=MAX_LEN)
    full.ragged_verify = False
    assert run(full, prompts, greedy, n_new) == got
    assert set(full.plain_rows) == {0}
    # the drafting rows' drafts: the drafter context of a row that decoded plainly in ragged steps (its taps in the
    # pending buffer, caught up when it drafts again) is the one full-width steps wrote
    assert ragged.drafts == full.drafts


def test_sampling_rows_in_both_groups_match_full_width_steps(tiny_target, tiny_drafter):
    """Rows that sample (their random bits keyed by seed and position, whatever their row) in the drafting and in
    the plain group, beside greedy rows: the same tokens as the schedule run at one width."""
    prompts = [prompt(6 + 2 * i, 60 + i) for i in range(4)]
    sampling = [
        SamplingParams(temperature=0.9, seed=1),
        SamplingParams(),
        SamplingParams(temperature=1.3, top_k=20, seed=2),
        SamplingParams(temperature=0.7, top_p=0.9, seed=3),
    ]
    outs = []
    for ragged_verify in (True, False):
        r = Recording(tiny_target, tiny_drafter, max_slots=4, max_model_len=MAX_LEN)
        r.ragged_verify = ragged_verify
        outs.append(run(r, prompts, sampling, 32))
        assert (max(r.plain_rows) > 0) == ragged_verify
    assert outs[0] == outs[1]
