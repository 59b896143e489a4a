"""Mixed steps (a step that carries other sequences' prompt chunks in the same device call) are lossless: against
plain greedy decoding by full-sequence forwards (`test_spec_parity.plain_greedy`), the runner with long prompts
admitted while 1, 4 and 8 sequences decode, and the engine with `step_token_budget` against plain greedy and against
itself with budget 0 (separate prefill calls), with prefix-cache hits and with preemptions."""

from __future__ import annotations

import numpy as np
import pytest

from dflash_jax.engine.offline import OfflineEngine
from dflash_jax.kv.pages import PagePool
from dflash_jax.spec_decode.runner import SpecRunner
from dflash_jax.types import SamplingParams
from tests.spec_decode.test_spec_parity import IdTokenizer, plain_greedy

pytestmark = pytest.mark.usefixtures("highest_matmul_precision")  # f32 results meet f32 references

MAX_LEN = 128
N_NEW = 16
LONG = 70  # the prompt admitted mid-run: 5 chunks of 16


def prompt(n: int, seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(1, 60, size=n)]


@pytest.mark.parametrize("batch", [1, 4, 8])
def test_long_prompt_prefilled_inside_steps_leaves_every_output_unchanged(tiny_target, tiny_drafter, batch):
    short = [prompt(5 + i, 100 + i) for i in range(batch)]
    long = prompt(LONG, 7)
    want = plain_greedy(tiny_target, [*short, long], N_NEW + 8, tmax=MAX_LEN)
    r = SpecRunner(tiny_target, tiny_drafter, max_slots=batch + 1, max_model_len=MAX_LEN)
    outs = {s: r.add(s, ids, SamplingParams()).tokens for s, ids in enumerate(short)}
    running = list(range(batch))
    for s, res in r.step(running, {s: 4 for s in running}).items():  # a step before the arrival
        outs[s] += res.tokens
    new = batch
    calls = dict(r.device_calls)
    r.admit([(new, long, SamplingParams())])
    assert r.device_calls == calls  # admission alone makes no device call
    outs[new] = []
    chunks = 0
    while new in r.prefilling:
        assert r.prompt_left(new) == LONG - 16 * chunks
        res = r.step(running, {s: N_NEW for s in running}, prefill={new: 16})
        chunks += 1
        for s in running:
            outs[s] += res[s].tokens
        outs[new] += res[new].tokens
    assert chunks == -(-LONG // 16) and outs[new] and len(outs[new]) == 1  # the first token with the last chunk
    assert r.device_calls["mixed"] == chunks and r.device_calls["prefill"] == calls["prefill"]
    everyone = [*running, new]
    while min(len(outs[s]) for s in everyone) < N_NEW:
        for s, res in r.step(everyone, {s: N_NEW for s in everyone}).items():
            outs[s] += res.tokens
    assert [outs[s][:N_NEW] for s in everyone] == [w[:N_NEW] for w in want]


def test_mixed_step_drafter_context_equals_a_separate_prefill(tiny_target, tiny_drafter):
    """The drafter context a mixed step writes for the prompt: the drafts after it equal a runner's whose prompt
    was prefilled in one call (a wrongly written context would still decode losslessly, with other drafts)."""
    long = prompt(LONG, 8)
    drafts = []
    for mixed in (True, False):
        r = SpecRunner(tiny_target, tiny_drafter, max_slots=2, max_model_len=MAX_LEN)
        r.add(0, prompt(6, 9), SamplingParams())
        if mixed:
            r.admit([(1, long, SamplingParams())])
            while 1 in r.prefilling:
                r.step([0], {0: 2}, prefill={1: 32})
        else:
            r.add(1, long, SamplingParams())
        r.step([1], {1: N_NEW})
        drafts.append(r.last_drafts[1].tolist())
    assert drafts[0] == drafts[1]


def generate(target, drafter, prompts, budget, *, slots=2, pool=None, max_tokens=N_NEW):
    runner = SpecRunner(target, drafter, max_slots=slots, max_model_len=MAX_LEN, pool=pool)
    # admissions of one prompt each (16 tokens): the second arrives while the first decodes
    with OfflineEngine(runner, IdTokenizer(), max_num_batched_tokens=16, step_token_budget=budget) as llm:
        outs = llm.generate(prompts, max_tokens=max_tokens)
        stats = llm.engine.stats
    return [o.token_ids for o in outs], runner, stats


@pytest.fixture(scope="module")
def prompts():
    # a short and a long one first, then more arriving as slots free up (mid-run, while the others decode)
    return [prompt(6, 1), prompt(LONG, 2), prompt(9, 3), prompt(LONG - 20, 4), prompt(4, 5)]


def test_engine_budget_equals_plain_greedy_and_budget_zero(tiny_target, tiny_drafter, prompts):
    want = plain_greedy(tiny_target, prompts, N_NEW, tmax=MAX_LEN)
    mixed, runner, _ = generate(tiny_target, tiny_drafter, prompts, budget=16)
    assert runner.device_calls["mixed"] > 0
    assert mixed == want
    separate, runner0, _ = generate(tiny_target, tiny_drafter, prompts, budget=0)
    assert runner0.device_calls["mixed"] == 0
    assert separate == mixed


def test_engine_budget_with_prefix_cache_hits(tiny_target, tiny_drafter):
    base = prompt(48, 11)
    prompts = [prompt(5, 12), base + prompt(9, 13), prompt(7, 14), base + prompt(13, 15)]
    want = plain_greedy(tiny_target, prompts, N_NEW, tmax=MAX_LEN)
    outs, runner, _ = generate(tiny_target, tiny_drafter, prompts, budget=16)
    assert runner.device_calls["mixed"] > 0
    assert runner.pages.stats.prefix_hits >= 48  # the last prompt's three full pages of the shared prefix
    assert outs == want


def test_engine_budget_with_preemption(tiny_target, tiny_drafter):
    prompts = [prompt(20 + 3 * i, 30 + i) for i in range(3)] + [prompt(LONG - 10, 40)]
    want = plain_greedy(tiny_target, prompts, 40, tmax=MAX_LEN)
    outs, runner, stats = generate(
        tiny_target, tiny_drafter, prompts, budget=16, slots=4, pool=PagePool(14, 16), max_tokens=40
    )
    assert stats.preemptions > 0 and runner.device_calls["mixed"] > 0
    assert outs == want
