"""The engine over a KV page pool, against the fake runner (whose continuation is a function of the context):
admission waits for pages, the newest sequence is preempted when the pool runs out mid-decode and resumes with
identical output, long prompts prefill in chunks interleaved with decode steps, and no page leaks."""

from __future__ import annotations

import asyncio

from dflash_jax.engine.engine import Engine
from dflash_jax.engine.types import DraftController, GenerationRequest
from dflash_jax.testing.fake_runner import make_fake


def ids(n: int, start: int = 1) -> list[int]:
    return [(start + i) % 200 + 1 for i in range(n)]


def run(runner, tok, requests, *, abort_after: int | None = None, **kw):
    async def main():
        eng = Engine(runner, tok, log_interval_s=0, **kw)
        await eng.start()
        streams = eng.submit_many(requests)
        if abort_after is not None:
            while eng.stats.steps < abort_after:
                await asyncio.sleep(0.001)
            streams[0].abort()
        outs = await asyncio.gather(*(s.collect() for s in streams))
        stats = eng.stats
        await eng.stop()
        return outs, stats

    return asyncio.run(main())


def test_preempted_sequences_resume_with_identical_output_and_no_page_leaks():
    reqs = [GenerationRequest(ids(20, 7 * i), max_tokens=90, ignore_eos=True) for i in range(4)]
    free, tok = make_fake(max_slots=4, max_model_len=256, gamma=4, page_size=16)
    want, free_stats = run(free, tok, reqs)
    assert free_stats.preemptions == 0
    # 4 sequences of up to 20 + 90 + 3 positions need 4 x 8 pages; the pool has 14
    small, _ = make_fake(max_slots=4, max_model_len=256, gamma=4, page_size=16, num_pages=15)
    got, stats = run(small, tok, reqs)
    assert stats.preemptions > 0
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.finish_reason for o in got] == ["length"] * 4
    assert small.pages.used == 0 and small.pages.free == small.pages.total
    # the preempted sequences were re-prefilled from their prompt + generated tokens
    assert small.num_adds == 4 + stats.preemptions


def test_admission_waits_for_pages():
    reqs = [GenerationRequest(ids(60, 11 * i), max_tokens=5, ignore_eos=True) for i in range(3)]
    runner, tok = make_fake(max_slots=3, max_model_len=256, gamma=2, page_size=16, num_pages=10)
    outs, stats = run(runner, tok, reqs)
    # each prompt takes 4 pages (+1 to decode): the third waits until one finishes
    assert runner.add_log[0] == [0, 1] and len(runner.add_log) == 2
    assert [o.token_ids for o in outs] == [runner.continuation(r.prompt_ids, 5) for r in reqs]
    assert stats.preemptions == 0 and runner.pages.used == 0


def test_long_prompts_prefill_in_chunks_interleaved_with_decode():
    short = GenerationRequest(ids(10, 3), max_tokens=30, ignore_eos=True)
    long = GenerationRequest(ids(200, 50), max_tokens=4, ignore_eos=True)
    runner, tok = make_fake(max_slots=2, max_model_len=512, gamma=1, prefill_chunk=48)
    outs, stats = run(runner, tok, [short, long], max_num_batched_tokens=48)
    assert [o.token_ids for o in outs] == [
        runner.continuation(short.prompt_ids, 30),
        runner.continuation(long.prompt_ids, 4),
    ]
    # while the long prompt took its 5 chunks, the short one decoded: steps ran with slot 0 alone
    assert [slots for slots, _ in runner.step_log[:4]] == [[0]] * 4
    assert runner.pages.used == 0


def test_abort_while_prefilling_frees_the_pages():
    long = GenerationRequest(ids(300, 5), max_tokens=4, ignore_eos=True)
    short = GenerationRequest(ids(10, 9), max_tokens=40, ignore_eos=True)
    runner, tok = make_fake(max_slots=2, max_model_len=512, gamma=1, prefill_chunk=16, step_delay=0.002)
    outs, _ = run(runner, tok, [long, short], abort_after=2, max_num_batched_tokens=16)
    assert outs[0].finish_reason == "abort" and outs[1].finish_reason == "length"
    assert runner.pages.used == 0 and not runner.prefilling


def test_step_token_budget_prefills_inside_the_steps():
    """With a budget, a prompt admitted while a sequence decodes is started without a prefill call and prefilled by
    the steps, at most `step_token_budget` prompt tokens each, oldest first; the outputs are unchanged."""
    short = GenerationRequest(ids(10, 3), max_tokens=30, ignore_eos=True)
    long = GenerationRequest(ids(200, 50), max_tokens=4, ignore_eos=True)
    other = GenerationRequest(ids(40, 9), max_tokens=4, ignore_eos=True)
    runner, tok = make_fake(max_slots=3, max_model_len=512, gamma=1, prefill_chunk=48)
    outs, stats = run(runner, tok, [short, long, other], max_num_batched_tokens=16, step_token_budget=32)
    assert [o.token_ids for o in outs] == [
        runner.continuation(r.prompt_ids, n) for r, n in ((short, 30), (long, 4), (other, 4))
    ]
    assert runner.add_log == [[0]] and runner.admit_log == [[1], [2]]  # one prefill call: the first prompt's
    chunks = [p for p in runner.prefill_log if p]
    assert all(sum(p.values()) <= 32 for p in chunks)
    assert sum(p.get(1, 0) for p in chunks) == 200 and sum(p.get(2, 0) for p in chunks) == 40
    assert chunks[0] == {1: 32} and chunks[6] == {1: 8, 2: 24}  # oldest first, the rest of the budget to the next
    # the short sequence stepped in every step that prefilled
    assert all(0 in slots for (slots, _), p in zip(runner.step_log, runner.prefill_log, strict=True) if p)
    assert stats.prefills == 3 and runner.pages.used == 0


def test_the_controller_is_told_which_steps_carry_prompt_chunks():
    """A step carrying prompt chunks verifies at the runner's full width, so the engine asks the controller for it
    with `full_width=True`, and for no other step."""

    class Recorder(DraftController):
        def __init__(self):
            self.full: list[bool] = []

        def decide(self, ids, lookup=(), *, full_width=False):
            self.full.append(full_width)
            return {i: 1 for i in ids}

        def observe(self, seq_id, num_drafts, accepted=0, *, lookup=False):
            pass

    short = GenerationRequest(ids(10, 3), max_tokens=30, ignore_eos=True)
    long = GenerationRequest(ids(100, 50), max_tokens=4, ignore_eos=True)
    runner, tok = make_fake(max_slots=2, max_model_len=512, gamma=2, prefill_chunk=48)
    ctl = Recorder()
    outs, _ = run(runner, tok, [short, long], max_num_batched_tokens=16, step_token_budget=32, controller=ctl)
    assert [o.token_ids for o in outs] == [runner.continuation(r.prompt_ids, n) for r, n in ((short, 30), (long, 4))]
    assert ctl.full == [bool(p) for p in runner.prefill_log] and 0 < sum(ctl.full) < len(ctl.full)


def test_step_token_budget_zero_prefills_between_steps():
    short = GenerationRequest(ids(10, 3), max_tokens=30, ignore_eos=True)
    long = GenerationRequest(ids(200, 50), max_tokens=4, ignore_eos=True)
    runner, tok = make_fake(max_slots=2, max_model_len=512, gamma=1, prefill_chunk=48)
    outs, _ = run(runner, tok, [short, long], max_num_batched_tokens=16, step_token_budget=0)
    assert [o.token_ids for o in outs] == [
        runner.continuation(short.prompt_ids, 30),
        runner.continuation(long.prompt_ids, 4),
    ]
    assert runner.admit_log == [] and not any(runner.prefill_log) and len(runner.add_log) == 2


def test_a_controller_that_prices_ragged_verifies_is_told_how_many_rows_drafted():
    """The engine hands the runner's ragged-verify buckets to the controller once, and, when it prices them, says
    with each step time how many rows verified drafts where not all did and the runner ran the step as a ragged
    verify (and not otherwise)."""

    class Recorder(DraftController):
        def __init__(self):
            self.buckets: object = "unset"
            self.times: list[tuple[int, int, int | None]] = []

        def use_ragged_verify(self, batch_buckets):
            self.buckets = batch_buckets
            return True

        def decide(self, ids, lookup=(), *, full_width=False):
            return {i: 2 if n == 0 else 0 for n, i in enumerate(ids)}  # the first row drafts, the others not

        def observe(self, seq_id, num_drafts, accepted=0, *, lookup=False):
            pass

        def observe_step_time(self, width, depth, ms, *, lookup=False, drafting=None):
            self.times.append((width, depth, drafting))

    runner, tok = make_fake(max_slots=2, max_model_len=256, gamma=4)
    runner.ragged_buckets = (1, 2)
    reqs = [GenerationRequest(ids(8, 3 + 20 * i), max_tokens=12 + 12 * i, ignore_eos=True) for i in range(2)]
    ctl = Recorder()
    outs, _ = run(runner, tok, reqs, step_token_budget=0, controller=ctl)
    assert [o.token_ids for o in outs] == [runner.continuation(r.prompt_ids, r.max_tokens) for r in reqs]
    assert ctl.buckets == (1, 2)
    two = [t for t in ctl.times if t[0] == 2]
    assert (2, 2, 1) in two  # one of two rows drafted (its drafts capped near its end, then none)
    assert all(drafting == (1 if depth else None) for _, depth, drafting in two)
    assert all(t[2] is None for t in ctl.times if t[0] == 1)  # a lone row: all of it drafted
    # a runner that ran such a step at one width (no layout over its buckets) reports no ragged verify
    runner, tok = make_fake(max_slots=2, max_model_len=256, gamma=4)
    runner.ragged_buckets = (2,)
    ctl = Recorder()
    run(runner, tok, reqs, step_token_budget=0, controller=ctl)
    assert ctl.buckets == (2,) and any(t[:2] == (2, 2) for t in ctl.times)
    assert all(t[2] is None for t in ctl.times)
