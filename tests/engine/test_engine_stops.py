"""Stop tokens, min_tokens and ignore_eos in `OutputState` (hand-built token sequences), and the engine's
`submit_many` (all or none) and slot accounting against the deterministic fake runner."""

from __future__ import annotations

import asyncio

import pytest

from dflash_jax.engine.engine import Engine
from dflash_jax.engine.output import OutputState
from dflash_jax.engine.types import GenerationRequest, QueueFullError
from dflash_jax.testing.fake_runner import ByteBPETokenizer, make_fake
from dflash_jax.testing.waits import GUARD_S, load_factor, wait_until_async

TOK = ByteBPETokenizer()
EOS = TOK.im_end_id
WORDS = TOK.encode("The cat sat on the mat. The dog ran in the park.")


def feed(st: OutputState, tokens: list[int], group: int = 1) -> tuple[str, list[int]]:
    """Feed tokens in groups of `group` (as speculative steps commit them); return (text emitted, consumed)."""
    text, consumed = "", []
    for i in range(0, len(tokens), group):
        delta, took = st.append(tokens[i : i + group])
        text += delta
        consumed += took
        if st.finished:
            break
    return text, consumed


@pytest.mark.parametrize("group", [1, 3, 7])
def test_stop_token_ends_like_eos_kept_in_ids_not_in_text(group):
    stop_at = 5
    stop_id = WORDS[stop_at]
    assert stop_id not in WORDS[:stop_at]
    st = OutputState(TOK, [], limit=100, stop_token_ids=[stop_id])
    text, consumed = feed(st, WORDS, group)
    assert consumed == WORDS[: stop_at + 1]  # the stop token is the last token id
    assert st.finish_reason == "stop"
    assert text == st.text == TOK.decode(WORDS[:stop_at])  # ... but not part of the text


def test_stop_token_ids_hold_with_ignore_eos_which_drops_only_eos():
    seq = WORDS[:3] + [EOS] + WORDS[3:8]
    st = OutputState(TOK, [], limit=100, ignore_eos=True, eos_token_ids={EOS}, stop_token_ids=[WORDS[6]])
    _, consumed = feed(st, seq)
    assert consumed == seq[: seq.index(WORDS[6]) + 1] and st.finish_reason == "stop"
    st = OutputState(TOK, [], limit=100, ignore_eos=True, eos_token_ids={EOS})
    _, consumed = feed(st, seq)
    assert consumed == seq and not st.finished  # EOS passed through
    st = OutputState(TOK, [], limit=100, eos_token_ids={EOS})
    _, consumed = feed(st, seq)
    assert consumed == seq[:4] and st.finish_reason == "stop"


@pytest.mark.parametrize("group", [1, 4])
def test_min_tokens_defers_eos_stop_tokens_and_stop_strings(group):
    # EOS as the 2nd token: with min_tokens 4 it is an ordinary token; the EOS at position 5 (count 6) stops.
    seq = [WORDS[0], EOS, WORDS[1], WORDS[2], WORDS[3], EOS, WORDS[4]]
    st = OutputState(TOK, [], limit=100, eos_token_ids={EOS}, min_tokens=4)
    text, consumed = feed(st, seq, group)
    assert consumed == seq[:6] and st.finish_reason == "stop"
    assert text == TOK.decode(seq[:5])  # the deferred EOS decodes to nothing (special); the stopping one is cut
    # exactly at min_tokens a stop token may stop (vLLM: stops count from the min_tokens-th token on)
    u = next(j for j in range(2, len(WORDS)) if WORDS.count(WORDS[j]) == 1)
    st = OutputState(TOK, [], limit=100, stop_token_ids=[WORDS[u]], min_tokens=u + 1)
    _, consumed = feed(st, WORDS, group)
    assert consumed == WORDS[: u + 1] and st.finish_reason == "stop"
    st = OutputState(TOK, [], limit=100, stop_token_ids=[WORDS[u]], min_tokens=u + 2)
    _, consumed = feed(st, WORDS, group)
    assert st.finish_reason is None and consumed == WORDS  # WORDS[u] occurs once, before min_tokens
    # a stop string wholly inside the first min_tokens tokens does not stop; a later occurrence does
    ids = TOK.encode("the cat and the cat")
    n_first = next(k for k in range(1, len(ids) + 1) if "cat" in TOK.decode(ids[:k]))
    st = OutputState(TOK, [], limit=100, stop=["cat"], min_tokens=n_first + 1)
    text, consumed = feed(st, ids, group)
    assert st.finish_reason == "stop" and text == "the cat and the "
    st = OutputState(TOK, [], limit=100, stop=["cat"])
    text, _ = feed(st, ids, group)
    assert text == "the "


def test_min_tokens_above_the_limit_is_refused():
    with pytest.raises(ValueError, match="min_tokens"):
        OutputState(TOK, [], limit=4, min_tokens=5)
    OutputState(TOK, [], limit=4, min_tokens=4)


def _run(coro):
    return asyncio.run(coro)


def test_submit_many_is_all_or_nothing_and_every_slot_comes_back():
    async def main():
        runner, tok = make_fake(max_slots=2, gamma=4, step_delay=0.001)
        eng = Engine(runner, tok, max_queued_requests=3, log_interval_s=0)
        await eng.start()
        p = tok.encode("hello there")
        reqs = [GenerationRequest(prompt_ids=p, max_tokens=40, ignore_eos=True, request_id=f"r{i}") for i in range(6)]
        with pytest.raises(QueueFullError):
            eng.submit_many(reqs)  # 6 > 2 slots + 3 queued
        assert eng.num_waiting == 0 and eng.num_running == 0 and eng.num_slots_in_use == 0
        streams = eng.submit_many(reqs[:5])
        assert eng.num_waiting == 5
        assert await wait_until_async(lambda: eng.num_slots_in_use == 2 == len(runner.slots))
        outs = await asyncio.gather(*(s.collect() for s in streams))
        expected = runner.continuation(p, 40)
        assert all(o.token_ids == expected and o.finish_reason == "length" for o in outs)
        assert eng.num_slots_in_use == 0 and not runner.slots
        # aborting a batch frees every slot again
        streams = eng.submit_many(
            [GenerationRequest(prompt_ids=p, max_tokens=250, ignore_eos=True, request_id=f"a{i}") for i in range(4)]
        )
        assert await wait_until_async(lambda: eng.num_running == 2)  # aborted while they run (and while 2 wait)
        for s in streams:
            s.abort()
        outs = await asyncio.gather(*(s.collect() for s in streams))
        assert all(o.finish_reason == "abort" for o in outs)
        assert eng.num_slots_in_use == 0 and eng.num_waiting == 0 and not runner.slots
        await eng.stop()

    _run(main())


def test_engine_stop_token_and_min_tokens_inside_speculative_steps():
    async def main():
        runner, tok = make_fake(max_slots=2, gamma=6, acceptance=0.9)
        eng = Engine(runner, tok, log_interval_s=0)
        await eng.start()
        p = tok.encode("stop me")
        ref = runner.continuation(p, 60)
        # a token whose first occurrence is at position k >= 3
        k = next(i for i in range(3, 60) if ref[i] not in ref[:i])
        out = await eng.submit(GenerationRequest(prompt_ids=p, max_tokens=60, stop_token_ids=(ref[k],))).collect()
        assert out.token_ids == ref[: k + 1] and out.finish_reason == "stop"
        assert out.text == tok.decode(ref[:k])
        # with min_tokens past k, the first occurrence no longer stops: the next one at index >= min_tokens - 1 does
        later = [i for i in range(k + 1, 60) if ref[i] == ref[k]]
        m = k + 2
        stream = eng.submit(
            GenerationRequest(
                prompt_ids=p, max_tokens=60, ignore_eos=True, stop_token_ids=(ref[k],), min_tokens=m, request_id="m"
            )
        )
        out = await stream.collect()
        end = next((i for i in later if i >= m - 1), None)
        if end is None:
            assert out.token_ids == ref and out.finish_reason == "length"
        else:
            assert out.token_ids == ref[: end + 1] and out.finish_reason == "stop"
        assert len(out.token_ids) >= m
        await eng.stop()

    _run(main())


def test_fail_from_another_thread_while_a_device_step_hangs():
    """A lost multi-host process: the device thread waits in a collective forever; `fail` from the watch thread
    still ends every request with an error and takes the engine out of service."""
    import threading

    async def main():
        runner, tok = make_fake(max_slots=2)
        hang, entered = threading.Event(), threading.Event()
        inner = runner.step

        def step(slots, max_new, num_drafts=None, no_propose=()):
            entered.set()
            hang.wait(GUARD_S * load_factor())
            return inner(slots, max_new, num_drafts, no_propose)

        runner.step = step
        eng = Engine(runner, tok, log_interval_s=0)
        await eng.start()
        p = tok.encode("waits forever")
        streams = eng.submit_many(
            [GenerationRequest(prompt_ids=p, max_tokens=50, request_id=f"h{i}") for i in range(3)]
        )  # two run (the device hangs in their first step), one waits for a slot
        assert await wait_until_async(entered.is_set)
        threading.Thread(target=eng.fail, args=("multi-host: lost process 1 of 2",)).start()
        outs = await asyncio.wait_for(asyncio.gather(*(s.collect() for s in streams)), GUARD_S * load_factor())
        assert all(o.finish_reason == "error" and "lost process 1" in (o.error or "") for o in outs)
        assert not eng.ready and eng.state == "dead" and "lost process 1" in str(eng.unavailable_error())
        hang.set()
        await eng.stop()

    _run(main())
