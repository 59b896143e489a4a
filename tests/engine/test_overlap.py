"""The overlapped engine loop (`Engine(overlap=True)`) against the step-by-step loop on the fake runner: the same
tokens and finish reasons (EOS, stop strings, max_tokens inside a multi-token step, max_model_len), step n+1
dispatched before step n is collected, finished and aborted sequences' slots released only once the in-flight step
that holds them is collected (the fake runner refuses an earlier release), preemption, and runners that cannot
overlap falling back to steps one by one."""

from __future__ import annotations

import asyncio

from dflash_jax.engine.engine import Engine
from dflash_jax.engine.types import GenerationRequest
from dflash_jax.testing.fake_runner import make_fake


def run(coro):
    return asyncio.run(coro)


def requests(tok) -> list[GenerationRequest]:
    texts = ["hello", "The cat", "Crème", "你好", "Emoji", "Numbers", "User: what", "Ελληνικά"]
    out = []
    for i, t in enumerate(texts):
        kw: dict = {"max_tokens": 7 + 9 * i}
        if i % 3 == 1:
            kw["stop"] = ["o", "the"]
        if i % 4 == 2:
            kw = {"max_tokens": None}  # to EOS or max_model_len
        out.append(GenerationRequest(tok.encode(t), **kw))
    return out


async def _generate(runner, tok, reqs, **kw):
    eng = Engine(runner, tok, log_interval_s=0, **kw)
    await eng.start()
    streams = eng.submit_many(reqs)
    outs = await asyncio.gather(*(s.collect() for s in streams))
    await eng.stop()
    return [(o.token_ids, o.text, o.finish_reason) for o in outs], eng


def generate(reqs_of, overlap, **fake):
    runner, tok = make_fake(**fake)
    outs, eng = run(_generate(runner, tok, reqs_of(tok), overlap=overlap))
    return outs, runner, eng


def test_overlap_gives_the_step_by_step_outputs_and_dispatches_ahead():
    fake = {"max_slots": 3, "gamma": 4, "acceptance": 0.6, "max_model_len": 96, "respect_max_new": False}
    want, _, _ = generate(requests, False, **fake)
    got, runner, eng = generate(requests, True, **fake)
    assert eng.overlap
    assert got == want
    assert {r for _, _, r in got} >= {"stop", "length"}
    log = runner.dispatch_log
    # some step n+1 was dispatched before step n was collected
    assert any(a[0] == "dispatch" and b == ("collect", a[1] - 1) for a, b in zip(log, log[1:], strict=False))
    assert not runner.slots and eng.num_slots_in_use == 0  # every slot released at the end


def test_aborted_sequence_settles_then_its_slot_is_reused():
    runner, tok = make_fake(gamma=4, acceptance=0.5, step_delay=0.01, max_model_len=4096, max_slots=1)

    async def main():
        eng = Engine(runner, tok, log_interval_s=0, overlap=True)
        await eng.start()
        stream = eng.submit(GenerationRequest(tok.encode("long"), max_tokens=3000, ignore_eos=True))
        await stream.__anext__()
        await stream.__anext__()
        stream.abort()
        rest = [o async for o in stream]
        assert rest[-1].finished and rest[-1].finish_reason == "abort"
        # the one slot comes back (released after the step holding it was collected) and serves the next request
        nxt = await eng.submit(GenerationRequest(tok.encode("next"), max_tokens=5)).collect()
        await eng.stop()
        return nxt

    nxt = run(main())
    assert nxt.token_ids == runner.continuation(tok.encode("next"), 5)
    assert runner.released[0] == 0 and runner.slots == {}


def test_preemption_under_overlap_keeps_outputs():
    def reqs(tok):
        return [GenerationRequest(tok.encode(t), max_tokens=60, ignore_eos=True) for t in ["a b", "c d", "e f"]]

    fake = {"max_slots": 3, "gamma": 4, "acceptance": 0.7, "max_model_len": 128, "num_pages": 10, "page_size": 16}
    want, _, _ = generate(reqs, False, **fake)
    got, _, eng = generate(reqs, True, **fake)
    assert eng.stats.preemptions > 0
    assert got == want


def test_runner_without_overlap_steps_one_by_one():
    runner, tok = make_fake(max_slots=2)
    runner.supports_overlap = False
    outs, eng = run(_generate(runner, tok, requests(tok)[:3], overlap=True))
    assert not eng.overlap and runner.dispatch_log == []
    want, _, _ = generate(lambda t: requests(t)[:3], False, max_slots=2)
    assert outs == want
