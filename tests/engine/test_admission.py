"""Batched admission: the engine prefills the waiting requests that fit the free slots and `max_num_batched_tokens`
in one `runner.add_many` between steps (FIFO; a first prompt over the budget goes alone), against the fake runner,
and gives the same tokens as one-at-a-time admission on real tiny models."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

from dflash_jax.engine.engine import Engine
from dflash_jax.engine.offline import OfflineEngine
from dflash_jax.engine.types import EngineObserver, GenerationRequest
from dflash_jax.testing.fake_runner import FakeRunner, make_fake
from dflash_jax.testing.waits import wait_until
from dflash_jax.types import SamplingParams


class PrefillLog(EngineObserver):
    def __init__(self):
        self.prefills: list[tuple[list[int], float]] = []

    def prefill_done(self, prompt_lens, seconds):
        self.prefills.append((list(prompt_lens), seconds))


def ids(n: int, start: int = 1) -> list[int]:
    """A prompt of `n` token ids (distinct prompts for distinct `start`)."""
    return [(start + i) % 200 + 1 for i in range(n)]


def run_engine(runner, tok, requests, **kw):
    """Submit `requests` together, collect every output; (outputs, engine stats, observer)."""
    obs = PrefillLog()

    async def main():
        eng = Engine(runner, tok, log_interval_s=0, observer=obs, **kw)
        await eng.start()
        streams = eng.submit_many(requests)
        outs = await asyncio.gather(*(s.collect() for s in streams))
        stats = eng.stats
        await eng.stop()
        return outs, stats

    outs, stats = asyncio.run(main())
    return outs, stats, obs


def test_waiting_requests_are_prefilled_in_one_call_before_the_first_step():
    runner, tok = make_fake(max_slots=4, gamma=3)
    reqs = [GenerationRequest(ids(5 + i, 10 * i), max_tokens=6, ignore_eos=True) for i in range(3)]
    outs, stats, obs = run_engine(runner, tok, reqs)
    assert runner.add_log == [[0, 1, 2]] and runner.num_add_calls == 1
    assert runner.step_log[0][0] == [0, 1, 2]
    assert [o.token_ids for o in outs] == [runner.continuation(r.prompt_ids, 6) for r in reqs]
    assert (stats.prefills, stats.prefill_batches, stats.prompt_tokens) == (3, 1, 5 + 6 + 7)
    assert [lens for lens, _ in obs.prefills] == [[5, 6, 7]]


def test_the_token_budget_splits_admission_fifo_with_a_step_between():
    runner, tok = make_fake(max_slots=4, gamma=2)
    lens = [10, 10, 10, 3]
    reqs = [GenerationRequest(ids(n, 50 * i), max_tokens=40, ignore_eos=True) for i, n in enumerate(lens)]
    outs, _, obs = run_engine(runner, tok, reqs, max_num_batched_tokens=25)
    # 10 + 10 fit in 25; the third waits for the next admission and takes the 3-token prompt with it
    assert runner.add_log == [[0, 1], [2, 3]]
    assert [x for x, _ in obs.prefills] == [[10, 10], [10, 3]]
    assert runner.step_log[0][0] == [0, 1]  # the running pair decoded a step before the rest was admitted
    assert [o.token_ids for o in outs] == [runner.continuation(r.prompt_ids, 40) for r in reqs]


def test_budget_is_fifo_a_later_short_prompt_does_not_overtake():
    runner, tok = make_fake(max_slots=4, gamma=2)
    lens = [10, 30, 5]
    reqs = [GenerationRequest(ids(n, 7 * i), max_tokens=20, ignore_eos=True) for i, n in enumerate(lens)]
    run_engine(runner, tok, reqs, max_num_batched_tokens=20)
    # 5 would fit next to 10, but the 30-token prompt before it does not: admission stops there
    assert runner.add_log == [[0], [1], [2]]


def test_the_budget_counts_the_padded_rectangle():
    """A batch is prefilled padded to its longest prompt: 20 + 1 + 1 + 1 tokens would fit 25, but the prefill
    would be 4 x 20; the long prompt goes alone and the short ones together (3 x 1)."""
    runner, tok = make_fake(max_slots=4, gamma=2)
    lens = [20, 1, 1, 1]
    reqs = [GenerationRequest(ids(n, 11 * i), max_tokens=4, ignore_eos=True) for i, n in enumerate(lens)]
    run_engine(runner, tok, reqs, max_num_batched_tokens=25)
    assert runner.add_log == [[0], [1, 2, 3]]


def test_a_lone_prompt_over_the_budget_still_runs():
    runner, tok = make_fake(max_slots=2, gamma=2)
    reqs = [GenerationRequest(ids(40), max_tokens=8, ignore_eos=True), GenerationRequest(ids(30, 9), max_tokens=8)]
    outs, _, _ = run_engine(runner, tok, reqs, max_num_batched_tokens=16)
    assert runner.add_log == [[0], [1]]
    assert outs[0].token_ids == runner.continuation(reqs[0].prompt_ids, 8) and outs[0].finish_reason == "length"
    assert outs[1].token_ids == runner.continuation(reqs[1].prompt_ids, len(outs[1].token_ids))


def test_free_slots_bound_a_batch_and_the_rest_comes_in_when_slots_free_up():
    runner, tok = make_fake(max_slots=2, gamma=2)
    reqs = [GenerationRequest(ids(4, 3 * i), max_tokens=3 + 4 * i, ignore_eos=True) for i in range(4)]
    outs, stats, _ = run_engine(runner, tok, reqs)
    assert runner.add_log[0] == [0, 1]
    assert all(len(b) <= 2 for b in runner.add_log) and sum(len(b) for b in runner.add_log) == 4
    assert [o.token_ids for o in outs] == [runner.continuation(r.prompt_ids, 3 + 4 * i) for i, r in enumerate(reqs)]
    assert stats.prefills == 4 and stats.prefill_batches == len(runner.add_log)


def test_max_num_batched_tokens_must_be_positive():
    runner, tok = make_fake()
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        Engine(runner, tok, max_num_batched_tokens=0)


class GatedRunner(FakeRunner):
    """A fake runner whose batched prefill waits, inside the device call, until the test lets it go."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.entered = threading.Event()
        self.go = threading.Event()

    def add_many(self, items):
        self.entered.set()
        assert wait_until(self.go.is_set, interval=0.001)
        return super().add_many(items)


def test_abort_during_a_batched_prefill_ends_only_that_request_and_frees_its_slot():
    base, tok = make_fake(max_slots=4, gamma=3)
    runner = GatedRunner(base.script, max_slots=4, gamma=3, starts=base.starts, vocab_size=base.vocab_size)
    reqs = [GenerationRequest(ids(6, 20 * i), max_tokens=10, ignore_eos=True) for i in range(3)]

    async def main():
        eng = Engine(runner, tok, log_interval_s=0)
        await eng.start()
        streams = eng.submit_many(reqs)
        while not runner.entered.is_set():
            await asyncio.sleep(0.001)
        streams[1].abort()  # its prefill is running on the device thread
        runner.go.set()
        outs = await asyncio.gather(*(s.collect() for s in streams))
        free = list(eng._free_slots)
        await eng.stop()
        return outs, free

    outs, free = asyncio.run(main())
    assert runner.add_log == [[0, 1, 2]]
    assert outs[1].finish_reason == "abort" and outs[1].token_ids == []
    assert 1 in runner.released and all(1 not in slots for slots, _ in runner.step_log)
    for i in (0, 2):
        assert outs[i].finish_reason == "length"
        assert outs[i].token_ids == runner.continuation(reqs[i].prompt_ids, 10)
    assert sorted(free) == [0, 1, 2, 3] and runner.slots == {}


def test_logprobs_and_prompt_logprobs_of_a_batch_reach_their_own_requests():
    runner, tok = make_fake(max_slots=4, gamma=3)
    sps = [SamplingParams(logprobs=2), SamplingParams(), SamplingParams(prompt_logprobs=1)]
    reqs = [
        GenerationRequest(ids(5 + i, 11 * i), max_tokens=4, sampling=sp, ignore_eos=True) for i, sp in enumerate(sps)
    ]
    outs, _, _ = run_engine(runner, tok, reqs)
    assert runner.add_log == [[0, 1, 2]]
    ref, _, _ = run_engine(make_fake(max_slots=4, gamma=3)[0], tok, reqs, max_num_batched_tokens=1)
    for o, r in zip(outs, ref, strict=True):
        assert (o.token_ids, o.logprobs, o.prompt_logprobs) == (r.token_ids, r.logprobs, r.prompt_logprobs)
    assert outs[0].logprobs is not None and len(outs[0].logprobs) == 4 and outs[0].prompt_logprobs is None
    assert outs[1].logprobs is None and outs[1].prompt_logprobs is None
    assert outs[2].prompt_logprobs is not None and len(outs[2].prompt_logprobs) == 6


def test_offline_engine_passes_the_budget_and_counts_batched_prefills():
    runner, tok = make_fake(max_slots=4, gamma=2)
    prompts = [ids(10, 5 * i) for i in range(4)]
    with OfflineEngine(runner, tok, max_num_batched_tokens=20) as llm:
        outs = llm.generate(prompts, max_tokens=5, ignore_eos=True)
        assert llm.stats.prefill_batches == 2
    assert runner.add_log == [[0, 1], [2, 3]]
    assert [o.token_ids for o in outs] == [runner.continuation(p, 5) for p in prompts]


# ------------------------------------------------------------------------------------------- real tiny models


class _IdTokenizer:
    """Token ids in, a character per id out; no EOS (every request runs to max_tokens)."""

    eos_token_ids: set[int] = set()

    def encode(self, text, add_special_tokens=True):
        return [ord(c) % 100 + 1 for c in text]

    def decode(self, ids):
        return "".join(chr(0x100 + int(i)) for i in ids)

    def apply_chat_template(self, messages, add_generation_prompt=True, chat_template_kwargs=None):
        raise NotImplementedError


@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "dflash"])
def test_batched_admission_gives_the_tokens_of_one_at_a_time_admission(speculative, tiny_target, tiny_drafter):
    """T=0 on a tiny random Llama (+ drafter): prompts of different lengths (two length buckets) prefilled together,
    padded, give the same tokens as each prefilled alone."""
    from dflash_jax.spec_decode.runner import SpecRunner

    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(1, 120, n)] for n in (3, 17, 9, 130, 5)]

    def generate(budget: int):
        runner = SpecRunner(tiny_target, tiny_drafter if speculative else None, max_slots=4, max_model_len=180)
        calls: list[int] = []
        inner = runner.add_many

        def add_many(items):
            calls.append(len(items))
            return inner(items)

        runner.add_many = add_many
        with OfflineEngine(runner, _IdTokenizer(), max_num_batched_tokens=budget) as llm:
            outs = llm.generate(prompts, SamplingParams(), max_tokens=12)
        return [o.token_ids for o in outs], calls

    batched, calls = generate(4096)
    alone, calls_alone = generate(1)
    assert calls[0] == 4 and calls_alone == [1] * len(prompts)  # the first four prompts in one prefill
    assert batched == alone
    assert all(len(t) == 12 for t in batched)
