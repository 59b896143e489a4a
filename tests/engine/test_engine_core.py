"""Engine (continuous batching) against the deterministic fake runner: exact stops, streaming text, slots."""

from __future__ import annotations

import asyncio

import pytest

from dflash_jax.engine.engine import Engine, check_context_length
from dflash_jax.engine.output import IncrementalDetokenizer, OutputState
from dflash_jax.engine.types import (
    ContextLengthError,
    DraftController,
    EngineUnavailableError,
    GenerationRequest,
    QueueFullError,
    SpecStats,
)
from dflash_jax.testing.fake_runner import ByteBPETokenizer, FakeRunner, make_fake
from dflash_jax.testing.waits import GUARD_S, load_factor, wait_until_async
from dflash_jax.types import SamplingParams

TOK = ByteBPETokenizer()


def run(coro):
    return asyncio.run(coro)


async def started(runner, tok=TOK, **kw) -> Engine:
    eng = Engine(runner, tok, log_interval_s=0, **kw)
    await eng.start()
    return eng


async def gen_all(eng: Engine, req: GenerationRequest):
    """Submit and collect (deltas, final output)."""
    stream = eng.submit(req)
    deltas, tokens, last = [], [], None
    async for out in stream:
        deltas.append(out.text)
        tokens.extend(out.token_ids)
        last = out
    return deltas, tokens, last


def prompt(text: str) -> list[int]:
    return TOK.encode(text)


# ------------------------------------------------------------------------------------------- detokenizer


def test_incremental_detokenizer_never_emits_partial_characters():
    text = "naïve 你好 🚀🌍 Grüße ✨ done"
    ids = TOK.encode(text)
    assert any("\ufffd" in TOK.decode([i]) for i in ids), "test needs characters split across tokens"
    d = IncrementalDetokenizer(TOK, prompt_ids=TOK.encode("Hello"))
    pieces = [d.push(i) for i in ids]
    pieces.append(d.flush())
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
    assert "" in pieces  # some tokens completed no character


def test_output_state_holds_back_possible_stop_prefix_and_cuts_exactly():
    text = "The cat sat on the mat. The dog ran."
    ids = TOK.encode(text)
    st = OutputState(TOK, [], limit=1000, stop=["the mat", "dog"])
    emitted = ""
    for i in ids:
        delta, consumed = st.append([i])
        emitted += delta
        assert "the m" not in emitted or st.finished  # a stop prefix is never shown before the decision
        if st.finished:
            break
    assert st.finish_reason == "stop"
    assert emitted == "The cat sat on "
    # tokens consumed = the first n tokens whose text contains the stop string
    n = len(st.token_ids)
    assert "the mat" in TOK.decode(ids[:n]) and "the mat" not in TOK.decode(ids[: n - 1])


# ----------------------------------------------------------------------------------------------- engine


@pytest.mark.parametrize("gamma,acceptance", [(1, 0.0), (4, 0.7), (8, 1.0), (6, 0.0)])
def test_greedy_output_identical_with_and_without_speculation(gamma, acceptance):
    runner, tok = make_fake(gamma=gamma, acceptance=acceptance, max_model_len=512)

    async def main():
        eng = await started(runner, tok)
        outs = []
        for p in ["Hello", "What is the capital of France?", "x"]:
            ids = tok.encode(p)
            deltas, tokens, last = await gen_all(eng, GenerationRequest(ids, max_tokens=60))
            assert tokens == runner.continuation(ids, len(tokens))
            assert "".join(deltas) == tok.decode(tokens)
            outs.append(tokens)
        await eng.stop()
        return outs

    outs = run(main())
    if gamma == 1:
        assert runner.step_log and all(all(v >= 1 for v in mn.values()) for _, mn in runner.step_log)
    assert all(len(o) == 60 or o[-1] in tok.eos_token_ids for o in outs)


@pytest.mark.parametrize("respect_max_new", [True, False])
def test_max_tokens_inside_a_multi_token_step(respect_max_new):
    # acceptance 1: every step commits gamma tokens; max_tokens lands inside a step
    runner, tok = make_fake(gamma=8, acceptance=1.0, respect_max_new=respect_max_new)

    async def main():
        eng = await started(runner, tok)
        ids = tok.encode("Hello there")
        for max_tokens in (1, 2, 5, 9, 12):
            deltas, tokens, last = await gen_all(eng, GenerationRequest(ids, max_tokens=max_tokens, ignore_eos=True))
            assert len(tokens) == max_tokens == last.num_completion_tokens
            assert last.finish_reason == "length"
            assert tokens == runner.continuation(ids, max_tokens)
            assert "".join(deltas) == tok.decode(tokens)
        await eng.stop()

    run(main())
    if respect_max_new:
        # the engine passed the remaining budget as max_new: the runner never drafted beyond it
        assert all(v <= 11 for _, mn in runner.step_log for v in mn.values())


def _token_spans(tok, ids):
    """Character end offset of each token prefix (tokens that end mid-character get the previous end)."""
    ends, last = [], 0
    for n in range(1, len(ids) + 1):
        t = tok.decode(ids[:n])
        if not t.endswith("\ufffd"):
            last = len(t)
        ends.append(last)
    return ends


def test_stop_string_across_step_boundaries_and_streaming_never_leaks_it():
    runner, tok = make_fake(gamma=4, acceptance=1.0)  # add: 1 token, then steps of 4 tokens
    # tokens 0 | 1-4 | 5-8 | 9-12 ...: a stop string from token 6 to token 9 spans the boundary 8|9
    for i in range(50):
        ids = tok.encode(f"Tell me a story {i}")
        ref = runner.continuation(ids, 40)
        ref_text = tok.decode(ref)
        ends = _token_spans(tok, ref)
        start, stop_end = ends[5], ends[9]
        stop = ref_text[start:stop_end]
        if len(stop) >= 3 and ref_text.find(stop) == start and start < ends[8] < stop_end:
            break
    else:
        raise AssertionError("no suitable prompt")

    async def main():
        eng = await started(runner, tok)
        deltas, tokens, last = await gen_all(eng, GenerationRequest(ids, max_tokens=40, stop=("@@never", stop)))
        await eng.stop()
        return deltas, tokens, last

    deltas, tokens, last = run(main())
    assert last.finish_reason == "stop"
    assert "".join(deltas) == ref_text[:start]
    assert tokens == ref[:10] and last.num_completion_tokens == 10  # up to the token completing the stop
    assert len(deltas) >= 2  # it streamed before the stop arrived


def test_earliest_of_several_stop_strings_wins():
    runner, tok = make_fake(gamma=8, acceptance=1.0)
    ids = tok.encode("abc")
    ref_text = tok.decode(runner.continuation(ids, 60))
    a, b = ref_text[30:34], ref_text[10:13]

    async def main():
        eng = await started(runner, tok)
        _, _, last = await gen_all(eng, GenerationRequest(ids, max_tokens=60, stop=(a, b)))
        deltas, _, _ = await gen_all(eng, GenerationRequest(ids, max_tokens=60, stop=(a, b)))
        await eng.stop()
        return "".join(deltas), last

    text, last = run(main())
    assert text == ref_text[: ref_text.find(b)]
    assert last.finish_reason == "stop"


def test_eos_stops_unless_ignore_eos():
    eos = TOK.im_end_id
    body = TOK.encode("hello world, 你好")
    runner = FakeRunner(body + [eos], gamma=4, acceptance=1.0, starts=[0], max_model_len=128)

    async def main():
        eng = await started(runner)
        p = TOK.encode("hi")
        d1, t1, l1 = await gen_all(eng, GenerationRequest(p, max_tokens=50))
        d2, t2, l2 = await gen_all(eng, GenerationRequest(p, max_tokens=len(body) + 5, ignore_eos=True))
        await eng.stop()
        return (d1, t1, l1), (d2, t2, l2)

    (d1, t1, l1), (d2, t2, l2) = run(main())
    assert "".join(d1) == "hello world, 你好"
    assert t1 == body + [eos] and l1.finish_reason == "stop" and l1.num_completion_tokens == len(body) + 1
    assert l2.finish_reason == "length" and len(t2) == len(body) + 5 and eos in t2
    assert "".join(d2).startswith("hello world, 你好hello")


def test_max_model_len_caps_generation_and_context_check():
    runner, tok = make_fake(gamma=4, acceptance=1.0, max_model_len=40, respect_max_new=False)
    ids = tok.encode("Hello there, how are you?")
    n = len(ids)
    with pytest.raises(ContextLengthError) as e:
        check_context_length(n, 40, 40, where="messages")
    assert "maximum context length is 40 tokens" in str(e.value) and e.value.param == "messages"
    assert check_context_length(n, None, 40) == 40 - n
    with pytest.raises(ContextLengthError):
        check_context_length(40, None, 40)

    async def main():
        eng = await started(runner, tok)
        with pytest.raises(ContextLengthError):
            eng.submit(GenerationRequest(ids, max_tokens=40 - n + 1))
        _, tokens, last = await gen_all(eng, GenerationRequest(ids, max_tokens=40 - n, ignore_eos=True))
        await eng.stop()
        return tokens, last

    tokens, last = run(main())
    assert len(tokens) == 40 - n and last.finish_reason == "length"


def test_batching_many_requests_over_few_slots_all_correct():
    runner, tok = make_fake(max_slots=3, gamma=4, acceptance=0.6, max_model_len=256)
    prompts = [tok.encode(f"prompt number {i} 🚀") for i in range(7)]

    async def main():
        eng = await started(runner, tok, max_num_seqs=2, max_queued_requests=10)
        res = await asyncio.gather(
            *[gen_all(eng, GenerationRequest(p, max_tokens=15 + 3 * i)) for i, p in enumerate(prompts)]
        )
        stats = eng.stats
        await eng.stop()
        return res, stats

    res, stats = run(main())
    for i, (p, (deltas, tokens, _)) in enumerate(zip(prompts, res, strict=True)):
        assert tokens == runner.continuation(p, len(tokens))
        assert "".join(deltas) == tok.decode(tokens)
        assert len(tokens) == 15 + 3 * i or tokens[-1] in tok.eos_token_ids
    assert max(len(slots) for slots, _ in runner.step_log) == 2  # batched, never beyond max_num_seqs
    assert all(max(slots) < 2 for slots, _ in runner.step_log)
    assert runner.slots == {} and sorted(set(runner.released)) == [0, 1]
    total = SpecStats()
    for _, _, last in res:
        s = last.spec
        total.num_drafts += s.num_drafts
        total.num_draft_tokens += s.num_draft_tokens
        total.num_accepted_tokens += s.num_accepted_tokens
    assert (total.num_drafts, total.num_draft_tokens, total.num_accepted_tokens) == (
        stats.spec.num_drafts,
        stats.spec.num_draft_tokens,
        stats.spec.num_accepted_tokens,
    )
    assert stats.generation_tokens == sum(len(t) for _, t, _ in res)
    assert sum(stats.spec.accepted_per_pos) == stats.spec.num_accepted_tokens


def test_abort_frees_the_slot_within_a_step():
    runner, tok = make_fake(gamma=4, acceptance=0.5, step_delay=0.01, max_model_len=4096)

    async def main():
        eng = await started(runner, tok)
        stream = eng.submit(GenerationRequest(tok.encode("long"), max_tokens=3000, ignore_eos=True))
        first = await stream.__anext__()
        assert not first.finished
        steps_at_abort = runner.num_steps
        stream.abort()
        rest = [o async for o in stream]
        assert rest[-1].finished and rest[-1].finish_reason == "abort"
        assert eng.num_running == 0 and runner.slots == {}
        assert runner.num_steps <= steps_at_abort + 1
        # the slot is usable again
        _, tokens, last = await gen_all(eng, GenerationRequest(tok.encode("next"), max_tokens=5))
        await eng.stop()
        return tokens, last

    tokens, last = run(main())
    assert len(tokens) == 5 or last.finish_reason == "stop"


def test_queue_limit_and_abort_of_a_waiting_request():
    runner, tok = make_fake(max_slots=4, gamma=2, acceptance=0.5, step_delay=0.005, max_model_len=4096)

    async def main():
        eng = await started(runner, tok, max_num_seqs=2, max_queued_requests=1)
        p = tok.encode("q")
        streams = [eng.submit(GenerationRequest(p, max_tokens=2000, ignore_eos=True)) for _ in range(3)]
        with pytest.raises(QueueFullError):
            eng.submit(GenerationRequest(p, max_tokens=5))
        assert await wait_until_async(lambda: eng.num_running == 2)
        assert eng.num_waiting == 1
        streams[2].abort()  # waiting: ends at once, without ever taking a slot
        last = [o async for o in streams[2]][-1]
        assert last.finish_reason == "abort" and last.num_completion_tokens == 0
        assert eng.num_waiting == 0
        s4 = eng.submit(GenerationRequest(p, max_tokens=3))  # room again
        for s in streams[:2]:
            s.abort()
        out = await s4.collect()
        await eng.stop()
        return out

    out = run(main())
    assert out.finish_reason in ("length", "stop") and runner.num_adds == 3


def test_controller_hook_limits_drafts_and_observes():
    runner, tok = make_fake(gamma=8, acceptance=0.8)

    class Ctl(DraftController):
        def __init__(self):
            self.decided, self.observed, self.times, self.releases = [], [], [], []

        def decide(self, ids):
            self.decided.append(list(ids))
            return {rid: 2 for rid in ids}

        def observe(self, seq_id, num_drafts, accepted=0):
            self.observed.append((seq_id, num_drafts, [] if isinstance(accepted, int) else list(accepted)))

        def observe_step_time(self, width, depth, ms):
            self.times.append((width, depth, ms))

        def release(self, seq_id):
            self.releases.append(seq_id)

    ctl = Ctl()

    async def main():
        eng = await started(runner, tok, controller=ctl)
        ids = tok.encode("Hello")
        _, tokens, _ = await gen_all(eng, GenerationRequest(ids, max_tokens=20, ignore_eos=True, request_id="r1"))
        await eng.stop()
        return ids, tokens

    ids, tokens = run(main())
    assert tokens == runner.continuation(ids, 20)
    assert runner.drafts_log == [{0: 2}] * len(runner.step_log)  # the controller's count reaches the runner
    assert all(o[1] <= 2 for o in ctl.observed) and any(o[1] == 2 for o in ctl.observed)
    assert ctl.decided == [["r1"]] * len(runner.step_log)
    assert len(ctl.observed) == len(runner.step_log) and all(o[0] == "r1" and o[1] <= 2 for o in ctl.observed)
    assert all(len(mask) == n for _, n, mask in ctl.observed)
    assert len(ctl.times) == len(runner.step_log) and all(w == 1 and d <= 2 and ms >= 0 for w, d, ms in ctl.times)
    assert ctl.releases == ["r1"]


def test_with_the_real_speculation_controller():
    control = pytest.importorskip("dflash_jax.spec_decode.control.controller")
    ctl = control.Controller.from_flags(draft_ladder="1:2,2:1", gamma=4, block_size=16)
    runner, tok = make_fake(gamma=4, acceptance=0.9)

    async def main():
        eng = await started(runner, tok, controller=ctl)
        ps = [tok.encode(f"ladder {i}") for i in range(3)]
        outs = await asyncio.gather(*[gen_all(eng, GenerationRequest(p, max_tokens=12, ignore_eos=True)) for p in ps])
        await eng.stop()
        return ps, outs

    ps, outs = run(main())
    for p, (_, tokens, _) in zip(ps, outs, strict=True):
        assert tokens == runner.continuation(p, 12)
    for (slots, _), nd in zip(runner.step_log, runner.drafts_log, strict=True):
        cap = 2 if len(slots) == 1 else 1  # the ladder: 1 active -> 2 drafts, 2+ -> 1
        assert nd == {s: cap for s in slots}


def test_runner_failure_kills_the_engine_and_fails_requests():
    runner, tok = make_fake(gamma=4, fail_after_steps=3, max_model_len=1024)

    async def main():
        eng = await started(runner, tok)
        out = await eng.submit(GenerationRequest(tok.encode("x"), max_tokens=500, ignore_eos=True)).collect()
        assert eng.state == "dead" and not eng.ready
        with pytest.raises(EngineUnavailableError) as e:
            eng.submit(GenerationRequest(tok.encode("x"), max_tokens=5))
        assert e.value.reason == "dead"
        await eng.stop()
        return out

    out = run(main())
    assert out.finish_reason == "error" and "injected device failure" in out.error


def test_drain_refuses_new_and_finishes_running():
    runner, tok = make_fake(gamma=4, step_delay=0.002, max_model_len=1024)

    async def main():
        eng = await started(runner, tok, max_num_seqs=1, max_queued_requests=2)
        p = tok.encode("drain")
        s1 = eng.submit(GenerationRequest(p, max_tokens=30, ignore_eos=True))
        s2 = eng.submit(GenerationRequest(p, max_tokens=30, ignore_eos=True))  # queued
        eng.begin_drain()
        with pytest.raises(EngineUnavailableError) as e:
            eng.submit(GenerationRequest(p, max_tokens=5))
        assert e.value.reason == "draining"
        assert await eng.wait_idle(GUARD_S * load_factor())
        o1, o2 = await s1.collect(), await s2.collect()
        await eng.stop()
        return o1, o2

    o1, o2 = run(main())
    assert o1.num_completion_tokens == o2.num_completion_tokens == 30
    assert o1.token_ids == o2.token_ids


def test_seeded_sampling_is_reproducible():
    runner, tok = make_fake(gamma=4)

    async def main():
        eng = await started(runner, tok)
        p = tok.encode("seed me")
        outs = [
            await eng.submit(GenerationRequest(p, max_tokens=12, sampling=SamplingParams(0.8, seed=s))).collect()
            for s in (7, 7, 8)
        ]
        await eng.stop()
        return outs

    a, b, c = run(main())
    assert a.token_ids == b.token_ids != c.token_ids


def test_suspended_sequences_get_no_drafts_for_their_next_step():
    runner, tok = make_fake(gamma=4, acceptance=0.9)

    class Suspending(DraftController):
        """Suspends request "plain" (0 drafts, is_suspended) and lets "spec" draft 2 per step."""

        def decide(self, ids):
            return {i: (0 if i == "plain" else 2) for i in ids}

        def observe(self, seq_id, num_drafts, accepted=0):
            pass

        def is_suspended(self, seq_id):
            return seq_id == "plain"

    async def main():
        eng = await started(runner, tok, controller=Suspending())
        reqs = [
            GenerationRequest(tok.encode(f"p {r}"), max_tokens=10, ignore_eos=True, request_id=r)
            for r in ("spec", "plain")
        ]
        outs = await asyncio.gather(*[gen_all(eng, r) for r in reqs])
        await eng.stop()
        return reqs, outs

    reqs, outs = run(main())
    for r, (_, tokens, _) in zip(reqs, outs, strict=True):
        assert tokens == runner.continuation(r.prompt_ids, 10)
    both = [i for i, (slots, _) in enumerate(runner.step_log) if len(slots) == 2]
    assert both, "the two requests never shared a step"
    for i in both:
        nd, skip = runner.drafts_log[i], runner.no_propose_log[i]
        (plain_slot,) = [s for s, n in nd.items() if n == 0]
        assert skip == {plain_slot}  # exactly the suspended sequence's slot, never the speculating one
