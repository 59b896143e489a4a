"""The offline engine (`OfflineEngine.generate`) against the deterministic fake runner: outputs, stops,
streaming pieces, several prompts over few slots, the controller once per step, and the run's statistics."""

from __future__ import annotations

import itertools

import pytest

from dflash_jax.engine.offline import OfflineEngine
from dflash_jax.engine.types import ContextLengthError, DraftController
from dflash_jax.testing.fake_runner import make_fake
from dflash_jax.types import SamplingParams


class RecordingController(DraftController):
    """A `DraftController` that asks for `k` drafts and records every call."""

    def __init__(self, k: int = 2):
        self.k = k
        self.decided: list[list[str]] = []
        self.observed: list[tuple[str, int, int]] = []
        self.times: list[tuple[int, int, float]] = []
        self.released: list[str] = []

    def decide(self, ids):
        self.decided.append(list(ids))
        return {rid: self.k for rid in ids}

    def observe(self, seq_id, num_drafts, accepted=0):
        n = accepted if isinstance(accepted, int) else len(list(itertools.takewhile(bool, accepted)))
        self.observed.append((seq_id, num_drafts, n))

    def observe_step_time(self, width, depth, ms):
        self.times.append((width, depth, ms))

    def release(self, seq_id):
        self.released.append(seq_id)


def record_steps(runner):
    """Wrap `runner.step` to keep every step's raw results (before the engine cuts anything)."""
    raw: list[dict] = []
    inner = runner.step

    def step(slots, max_new, num_drafts=None, no_propose=()):
        out = inner(slots, max_new, num_drafts, no_propose)
        raw.append(out)
        return out

    runner.step = step
    return raw


def test_outputs_in_prompt_order_over_fewer_slots_than_prompts():
    runner, tok = make_fake(max_slots=2, gamma=4, acceptance=0.7)
    prompts = [tok.encode(f"prompt number {i}") for i in range(5)]
    lengths = [3, 17, 9, 30, 1]
    with OfflineEngine(runner, tok) as llm:
        outs = [llm.generate([p], max_tokens=n, ignore_eos=True)[0] for p, n in zip(prompts, lengths, strict=True)]
        batch = llm.generate(prompts, max_tokens=20, ignore_eos=True)
        stats = llm.stats
    for p, n, o in zip(prompts, lengths, outs, strict=True):
        assert o.token_ids == runner.continuation(p, n) and o.finish_reason == "length"
        assert o.num_completion_tokens == n and o.num_prompt_tokens == len(p)
    for p, o in zip(prompts, batch, strict=True):
        assert o.token_ids == runner.continuation(p, 20)
        assert o.text == tok.decode(o.token_ids)
    assert stats.max_running == 2 and runner.num_adds == 10
    assert all(len(slots) <= 2 for slots, _ in runner.step_log)
    assert len(runner.released) == 10 and not runner.slots


def test_text_prompts_and_per_prompt_sampling():
    runner, tok = make_fake(max_slots=2)
    sps = [SamplingParams(temperature=0.8, seed=1), SamplingParams(temperature=0.8, seed=2)]
    with OfflineEngine(runner, tok) as llm:
        a = llm.generate(["Hello", "Hello"], sps, max_tokens=12, ignore_eos=True)
        b = llm.generate(["Hello", "Hello"], sps, max_tokens=12, ignore_eos=True)
        g = llm.generate(["Hello"], max_tokens=12, ignore_eos=True)
    ids = tok.encode("Hello")
    assert [o.token_ids for o in a] == [o.token_ids for o in b]  # seeded: reproducible
    assert a[0].token_ids == runner.continuation(ids, 12, sps[0]) != a[1].token_ids
    assert g[0].token_ids == runner.continuation(ids, 12)


def test_stops_eos_stop_strings_and_max_tokens_inside_a_step():
    runner, tok = make_fake(max_slots=1, max_model_len=4096, gamma=8, acceptance=1.0, respect_max_new=False)
    p = tok.encode("stops")
    with OfflineEngine(runner, tok) as llm:
        full = llm.generate([p], max_tokens=len(runner.script) + 1)[0]  # the script ends with EOS
        cut = llm.generate([p], max_tokens=5)[0]
        raw = record_steps(runner)
        stop_word = full.text[20:26]
        stopped = llm.generate([p], max_tokens=len(runner.script) + 1, stop=[stop_word])[0]
    assert full.finish_reason == "stop" and full.token_ids[-1] == tok.im_end_id
    assert full.token_ids == runner.continuation(p, len(full.token_ids))
    assert cut.token_ids == full.token_ids[:5] and cut.finish_reason == "length"  # a step of 8 was cut at 5
    assert stopped.finish_reason == "stop" and stopped.text == full.text[: full.text.index(stop_word)]
    assert stop_word not in stopped.text
    produced = 1 + sum(len(r[0].tokens) for r in raw)
    assert produced > len(stopped.token_ids)  # the runner went past the stop; the engine dropped the rest


def test_streaming_pieces_add_up_and_never_split_a_character():
    runner, tok = make_fake(max_slots=3, gamma=4, acceptance=0.6)
    prompts = [tok.encode(f"stream {i}") for i in range(3)]
    pieces: dict[int, list[str]] = {0: [], 1: [], 2: []}
    finished: list[int] = []

    def on_output(i, out):
        pieces[i].append(out.text)
        if out.finished:
            finished.append(i)

    with OfflineEngine(runner, tok) as llm:
        outs = llm.generate(prompts, max_tokens=60, ignore_eos=True, on_output=on_output)
    assert sorted(finished) == [0, 1, 2]
    for i, o in enumerate(outs):
        assert "".join(pieces[i]) == o.text
        assert len([x for x in pieces[i] if x]) > 5  # streamed step by step, not at the end
        assert all("\ufffd" not in x for x in pieces[i])


def test_controller_decides_and_observes_once_per_step():
    runner, tok = make_fake(max_slots=2, gamma=8, acceptance=0.8)
    ctl = RecordingController(k=2)
    prompts = [tok.encode(f"ctl {i}") for i in range(3)]
    with OfflineEngine(runner, tok, controller=ctl) as llm:
        outs = llm.generate(prompts, max_tokens=16, ignore_eos=True)
        stats = llm.stats
    for p, o in zip(prompts, outs, strict=True):
        assert o.token_ids == runner.continuation(p, 16)
    assert len(ctl.decided) == stats.steps == runner.num_steps == len(ctl.times)
    assert [len(d) for d in ctl.decided] == [len(slots) for slots, _ in runner.step_log]
    assert len(ctl.observed) == sum(len(d) for d in ctl.decided)  # every sequence of every step
    assert all(nd == {s: 2 for s in slots} for (slots, _), nd in zip(runner.step_log, runner.drafts_log, strict=True))
    assert all(n <= 2 for _, n, _ in ctl.observed)
    assert sorted(ctl.released) == sorted({rid for d in ctl.decided for rid in d}) and len(ctl.released) == 3


def test_stats_count_every_speculative_step_and_exclude_prefill():
    runner, tok = make_fake(max_slots=2, gamma=4, acceptance=0.5, step_delay=0.002)
    raw = record_steps(runner)
    prompts = [tok.encode(f"stats {i}") for i in range(4)]
    with OfflineEngine(runner, tok) as llm:
        outs = llm.generate(prompts, max_tokens=24, ignore_eos=True)
        st = llm.stats
    expected = [r for step in raw for r in step.values() if r.num_drafts > 0]
    assert [(r.num_drafts, r.num_accepted, r.accepted_mask) for r in st.spec_results] == [
        (r.num_drafts, r.num_accepted, r.accepted_mask) for r in expected
    ]
    assert st.steps == len(raw) and len(st.records) == 4
    assert sorted(r.num_completion_tokens for r in st.records) == [24] * 4
    assert all(o.spec is not None and o.spec.num_drafts > 0 for o in outs)
    assert 0 < st.prefill_s < st.wall_s and st.decode_s == pytest.approx(st.wall_s - st.prefill_s)


def test_errors_context_length_bad_prompts_and_runner_failure():
    runner, tok = make_fake(max_slots=1, max_model_len=64)
    with OfflineEngine(runner, tok) as llm:
        with pytest.raises(ContextLengthError):
            llm.generate([tok.encode("x"), [1] * 60], max_tokens=10)
        assert runner.num_adds == 0  # refused before anything ran
        with pytest.raises(TypeError, match="list of prompts"):
            llm.generate(tok.encode("x"), max_tokens=4)
        with pytest.raises(ValueError, match="sampling"):
            llm.generate(["a", "b"], [SamplingParams()], max_tokens=4)
    failing, tok = make_fake(max_slots=1, fail_after_steps=2)
    with OfflineEngine(failing, tok) as llm:
        with pytest.raises(RuntimeError, match="injected device failure"):
            llm.generate(["boom"], max_tokens=20, ignore_eos=True)
