"""Log-probabilities through the engine (fake runner, no JAX): one per emitted token, cut with the tokens at a stop
inside a speculative step, the same with and without speculation, and prompt scoring with `max_tokens` 0."""

from __future__ import annotations

import asyncio

import pytest

from dflash_jax.engine.engine import Engine
from dflash_jax.engine.types import FINISH_LENGTH, FINISH_STOP, GenerationRequest
from dflash_jax.testing.fake_runner import fake_logprob, fake_prompt_logprobs, make_fake
from dflash_jax.types import SamplingParams


def run_engine(runner, tok, requests: list[GenerationRequest]):
    async def main():
        eng = Engine(runner, tok, log_interval_s=0)
        await eng.start()
        try:
            streams = [eng.submit(r) for r in requests]
            events: list[list] = [[] for _ in streams]
            outs = await asyncio.gather(*(s.collect(events[i].append) for i, s in enumerate(streams)))
            return outs, events
        finally:
            await eng.stop(join_device=True)

    return asyncio.run(main())


def expected_logprobs(runner, prompt_ids, n, top):
    off = runner.offset_for(prompt_ids)
    return [
        fake_logprob(off + i, runner.script[(off + i) % len(runner.script)], top, runner.vocab_size) for i in range(n)
    ]


@pytest.mark.parametrize("gamma", [1, 4])
def test_each_token_gets_its_logprob_and_streamed_events_carry_their_own(gamma):
    runner, tok = make_fake(gamma=gamma, acceptance=0.8)
    prompts = [tok.encode(t) for t in ("Hello", "Crème brûlée", "what is 2+2?")]
    reqs = [
        GenerationRequest(p, max_tokens=17, sampling=SamplingParams(logprobs=3), ignore_eos=True, request_id=f"r{i}")
        for i, p in enumerate(prompts)
    ]
    outs, events = run_engine(runner, tok, reqs)
    for p, out, evs in zip(prompts, outs, events, strict=True):
        assert out.finish_reason == FINISH_LENGTH and len(out.token_ids) == 17
        assert out.logprobs == expected_logprobs(runner, p, 17, 3)
        assert out.prompt_logprobs is None
        for ev in evs:
            assert len(ev.logprobs or []) == len(ev.token_ids)
        assert [lp for ev in evs for lp in ev.logprobs or []] == out.logprobs
        assert all(
            lp.top[0] == (t, lp.logprob) and len(lp.top) == 3 for t, lp in zip(out.token_ids, out.logprobs, strict=True)
        )


def test_speculative_and_plain_give_the_same_logprobs_with_a_stop_inside_a_step():
    results = []
    for gamma in (1, 5):
        runner, tok = make_fake(gamma=gamma, acceptance=0.9)
        p = tok.encode("Hello")
        toks = runner.continuation(p, 40)
        text = tok.decode(toks)
        stop = text[len(text) * 2 // 3 :][:3]  # a stop string two thirds in, likely inside a speculative step
        assert "\ufffd" not in stop
        req = GenerationRequest(p, max_tokens=40, sampling=SamplingParams(logprobs=1), stop=(stop,), request_id="a")
        (out,), _ = run_engine(runner, tok, [req])
        assert out.finish_reason == FINISH_STOP and len(out.logprobs) == len(out.token_ids) < 40
        results.append((out.text, out.token_ids, out.logprobs))
    assert results[0] == results[1]


@pytest.mark.parametrize("gamma", [1, 4])
def test_max_tokens_zero_scores_the_prompt_only(gamma):
    runner, tok = make_fake(gamma=gamma)
    p = tok.encode("The cat sat on the mat.")
    req = GenerationRequest(p, max_tokens=0, sampling=SamplingParams(prompt_logprobs=2), request_id="score")
    (out,), (evs,) = run_engine(runner, tok, [req])
    assert out.finish_reason == FINISH_LENGTH and out.token_ids == [] and out.text == ""
    assert out.num_completion_tokens == 0 and out.logprobs is None
    assert out.prompt_logprobs == fake_prompt_logprobs(p, 2, runner.vocab_size)
    assert len(evs) == 1 and evs[0].finished
    assert runner.slots == {} and runner.num_steps == 0  # prefill only; the slot is free again


def test_prompt_logprobs_come_once_on_the_first_event():
    runner, tok = make_fake(gamma=4)
    p = tok.encode("Hello world")
    sp = SamplingParams(logprobs=0, prompt_logprobs=0)
    (out,), (evs,) = run_engine(runner, tok, [GenerationRequest(p, max_tokens=9, sampling=sp, request_id="x")])
    assert [ev.prompt_logprobs is not None for ev in evs] == [True] + [False] * (len(evs) - 1)
    assert out.prompt_logprobs == fake_prompt_logprobs(p, 0, runner.vocab_size)
    assert all(lp.top == () for lp in out.logprobs)


def test_without_logprobs_nothing_is_attached():
    runner, tok = make_fake(gamma=4)
    (out,), (evs,) = run_engine(runner, tok, [GenerationRequest(tok.encode("Hi"), max_tokens=8, request_id="n")])
    assert out.logprobs is None and out.prompt_logprobs is None
    assert all(ev.logprobs is None and ev.prompt_logprobs is None for ev in evs)


def test_scoring_a_prompt_that_fills_the_context_is_refused_and_the_engine_lives():
    from dflash_jax.engine.types import ContextLengthError

    runner, tok = make_fake(gamma=4, max_model_len=32)

    async def main():
        eng = Engine(runner, tok, log_interval_s=0)
        await eng.start()
        try:
            with pytest.raises(ContextLengthError, match="maximum context length is 32"):
                eng.submit(GenerationRequest([5] * 32, max_tokens=0, sampling=SamplingParams(prompt_logprobs=1)))
            ok = await eng.submit(
                GenerationRequest([5] * 31, max_tokens=0, sampling=SamplingParams(prompt_logprobs=1))
            ).collect()
            return ok, eng.ready
        finally:
            await eng.stop(join_device=True)

    ok, ready = asyncio.run(main())
    assert ready and ok.finish_reason == FINISH_LENGTH and len(ok.prompt_logprobs) == 30
