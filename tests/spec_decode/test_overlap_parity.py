"""The overlapped engine loop (`Engine(overlap=True)`: step n+1 dispatched before step n is read) on the real runner
is lossless: greedy speculative output equals plain greedy decoding by full-sequence forwards at batch 1, 4 and 8,
with long prompts admitted mid-run and prefilled inside mixed steps (`step_token_budget`), and equals the
step-by-step loop's."""

from __future__ import annotations

import pytest

from dflash_jax.engine.offline import OfflineEngine
from dflash_jax.spec_decode.runner import SpecRunner
from tests.spec_decode.test_mixed_step import LONG, MAX_LEN, prompt
from tests.spec_decode.test_spec_parity import IdTokenizer, plain_greedy

pytestmark = pytest.mark.usefixtures("highest_matmul_precision")  # f32 results meet f32 references

N_NEW = 12


def generate(target, drafter, prompts, *, slots, overlap, budget=16):
    runner = SpecRunner(target, drafter, max_slots=slots, max_model_len=MAX_LEN)
    with OfflineEngine(
        runner, IdTokenizer(), max_num_batched_tokens=16, step_token_budget=budget, overlap=overlap
    ) as llm:
        assert llm.engine.overlap == overlap
        outs = llm.generate(prompts, max_tokens=N_NEW)
    return [o.token_ids for o in outs], runner


@pytest.mark.parametrize("batch", [1, 4, 8])
def test_overlapped_loop_equals_plain_greedy_with_a_long_prompt_mid_run(tiny_target, tiny_drafter, batch):
    # `batch` short prompts fill the slots but one; the long one arrives while they decode and prefills in chunks
    prompts = [prompt(5 + i, 200 + i) for i in range(batch)] + [prompt(LONG, 9)]
    want = plain_greedy(tiny_target, prompts, N_NEW, tmax=MAX_LEN)
    got, runner = generate(tiny_target, tiny_drafter, prompts, slots=batch + 1, overlap=True)
    assert runner.device_calls["mixed"] > 0
    assert got == want


def test_overlapped_loop_equals_the_step_by_step_loop_with_slot_reuse(tiny_target, tiny_drafter):
    # more prompts than slots: finished sequences' slots settle one step late, then take the next prompt
    prompts = [prompt(4 + 3 * i, 300 + i) for i in range(5)]
    stepwise, _ = generate(tiny_target, tiny_drafter, prompts, slots=2, overlap=False)
    overlapped, _ = generate(tiny_target, tiny_drafter, prompts, slots=2, overlap=True)
    assert overlapped == stepwise == plain_greedy(tiny_target, prompts, N_NEW, tmax=MAX_LEN)
