"""The runner's warm-up: it reports what it compiled, and afterwards the common shapes compile nothing more."""

from __future__ import annotations

import itertools

from dflash_jax.compilation import CompileMeter, release_programs
from dflash_jax.spec_decode.runner import SpecRunner
from dflash_jax.types import SamplingParams

MAX_LEN = 160  # two KV-length buckets: 128 and the capacity


def test_warmup_covers_the_common_shapes(tiny_target, tiny_drafter):
    """Plain steps, a catch-up, speculative steps of every draft count (each runs at a compiled verify width, 1, 2
    or 4), ragged verifies (one row drafting, one or two plain; those the warm-up did not compile run every row at
    one width), a min-tokens ban (a runtime input, not a variant)
    and mixed steps (one or two prompts arriving while one sequence decodes, plainly or speculatively) at warmed
    shapes, for prompts within and past the first KV bucket, compile no program after `warmup`."""

    class Ragged(SpecRunner):
        plain_rows_seen: set = set()

        def _run(self, plan):
            if plan.kind == "step" and self._planner is None:
                self.plain_rows_seen.add(plan.static.get("plain_rows", 0))
            return super()._run(plan)

    r = Ragged(tiny_target, tiny_drafter, max_slots=3, max_model_len=MAX_LEN, gamma=4, batch_buckets=(1, 2))
    counts = r.warmup()
    assert counts.programs > 0 and counts.seconds > 0
    assert counts.cache_hits == 0  # no persistent cache in the tests
    with CompileMeter() as m:
        for plen in (5, 130):
            prompts = [[1 + (i * 7 + s) % 50 for i in range(plen)] for s in range(2)]
            bans = SamplingParams(min_tokens=3, stop_token_ids=(2,))
            r.add_many([(0, prompts[0], SamplingParams()), (1, prompts[1], bans)])
            while r.prefilling:
                r.prefill_step()
            r.step([0, 1], {0: 2, 1: 2}, {0: 0, 1: 0})  # plain
            r.step([0, 1], {0: 4, 1: 4})  # catch-up, then speculative
            for k in (1, 2):  # 2 drafts: width 4, the row verifying 2 of its 3
                res = r.step([0, 1], {0: 4, 1: 4}, {0: k, 1: k})
                assert [res[s].num_drafts for s in (0, 1)] == [k, k]
            # ragged verifies: one row drafting at the full width, the other plain; a batch of three, (1 | 2)
            r.step([0, 1], {0: 4, 1: 4}, {0: 3, 1: 0})
            r.add(2, prompts[0][:5], SamplingParams())
            r.step([0, 1, 2], {s: 4 for s in range(3)}, {0: 0, 1: 3, 2: 0})
            r.release(2)
            r.step([0], {0: 4})  # one row: batch bucket 1
            r.release(1)
            for k, new in itertools.product((0, 2), ([1], [1, 2])):  # prompts' chunks carried by a decode step
                r.admit([(s, prompts[s % 2][:4], SamplingParams()) for s in new])
                res = r.step([0], {0: 4}, {0: k}, prefill={s: 4 for s in new})
                assert res[0].num_drafts == k and [len(res[s].tokens) for s in new] == [1] * len(new)
                for s in new:
                    r.release(s)
            r.release(0)
    assert m.counts.programs == 0, m.summary()
    # past the first length bucket the ragged verifies ran from the warm-up's programs, (1 | 1) and (1 | 2); within
    # it (not warmed) every row ran at one width
    assert r.plain_rows_seen == {0, 1, 2}


def test_a_second_runner_of_the_same_models_compiles_nothing(tiny_target, tiny_drafter):
    """Runners of the same models share their compiled programs: a second warm-up compiles none."""
    kw = dict(max_slots=2, max_model_len=MAX_LEN, gamma=4, batch_buckets=(1, 2))
    SpecRunner(tiny_target, tiny_drafter, **kw).warmup()
    assert SpecRunner(tiny_target, tiny_drafter, **kw).warmup().programs == 0


def _generate(r: SpecRunner, prompts: list[list[int]], steps: int) -> list[list[int]]:
    r.add_many([(s, p, SamplingParams()) for s, p in enumerate(prompts)])
    while r.prefilling:
        r.prefill_step()
    slots = list(range(len(prompts)))
    out = {s: [] for s in slots}
    for i in range(steps):
        # plain steps, then speculative ones (a catch-up first)
        res = r.step(slots, {s: 8 for s in slots}, {s: 0 for s in slots} if i < 2 else None)
        for s in slots:
            out[s] += res[s].tokens
    for s in slots:
        r.release(s)
    return [out[s] for s in slots]


def test_planned_warmup_compiles_what_real_calls_compile_and_runs_them(tiny_target, tiny_drafter):
    """The planned warm-up (calls traced and compiled ahead, on 1 or 2 threads) compiles exactly the programs the
    same warm-up driven by real calls compiles, and generation through its executables is token for token that of
    a runner that never warmed up."""
    kw = dict(max_slots=2, max_model_len=MAX_LEN, gamma=4, batch_buckets=(1, 2))
    prompts = [[1 + (i * 7 + s) % 50 for i in range(9 + 3 * s)] for s in range(2)]
    cold = _generate(SpecRunner(tiny_target, tiny_drafter, **kw), prompts, 6)
    release_programs()
    real = SpecRunner(tiny_target, tiny_drafter, **kw)
    plans = set()

    def hook(plan, apply):  # the multi-host hook's path: real calls
        plans.add(real._plan_key(plan))
        return apply(plan)

    real.plan_hook = hook
    by_calls = real.warmup().programs
    assert not real.programs.executables and by_calls == len(plans)
    for threads in (1, 2):
        release_programs()
        r = SpecRunner(tiny_target, tiny_drafter, **kw)
        assert r.warmup(threads=threads).programs == by_calls
        assert len(r.programs.executables) == by_calls
        assert sum(r.device_calls.values()) == 0  # planned, not run
        with CompileMeter() as m:
            assert _generate(r, prompts, 6) == cold
        assert m.counts.programs == 0, m.summary()


def test_background_warmup_returns_after_the_first_bucket_and_the_rest_still_serve(tiny_target, tiny_drafter):
    """With `background`, the warm-up plans the prefill, plain and full-width programs and returns once batch
    bucket 1's are compiled; batch bucket 2's finish in the background, and generation then runs them (no new
    compile), token for token as a runner that never warmed up. The narrower widths and mixed steps are planned by
    `warm_more`, a part per call, to the same programs as a warm-up in the foreground."""
    kw = dict(max_slots=2, max_model_len=MAX_LEN, gamma=4, batch_buckets=(1, 2))
    prompts = [[1 + (i * 7 + s) % 50 for i in range(9 + 3 * s)] for s in range(2)]
    cold = _generate(SpecRunner(tiny_target, tiny_drafter, **kw), prompts, 6)
    release_programs()
    full = SpecRunner(tiny_target, tiny_drafter, **kw).warmup(threads=1).programs
    release_programs()
    r = SpecRunner(tiny_target, tiny_drafter, **kw)
    counts = r.warmup(threads=1, background=True)
    first = [k for k in r.programs.executables if {n: sh for n, sh, _ in k[-1]}["page_table"][0] == 1]
    assert first and all(r.programs.executables[k].ready for k in first)
    assert 0 < counts.background <= len(r.programs.executables) - len(first) < full - len(first)
    jitted = [r.programs.prefill, r.programs.step, r.programs.catch_up]
    before = [f._cache_size() for f in jitted]
    with CompileMeter() as m:
        assert _generate(r, prompts, 6) == cold
    assert [f._cache_size() for f in jitted] == before  # every call ran a warm-up executable
    assert m.counts.programs <= counts.background, m.summary()  # only the background compiles finished meanwhile
    parts = 0
    while r.warm_more():
        parts += 1
    assert parts == 4 and len(r.programs.executables) == full  # 2 batch buckets x 2 lengths
    for e in r.programs.executables.values():  # nothing left compiling for the tests after this one
        assert e.compiled is not None


def test_until_the_rest_of_a_background_warmup_is_compiled_steps_run_at_the_full_width(tiny_target, tiny_drafter):
    """Before `warm_more` has planned and compiled the narrower widths, a step of one draft runs at the full width
    (its row verifying one draft) and a prompt's chunk prefills in a call of its own: nothing compiles at run time.
    Afterwards the same step runs at width 2 and the chunk rides in a mixed step, from precompiled programs."""
    r = SpecRunner(tiny_target, tiny_drafter, max_slots=2, max_model_len=MAX_LEN, gamma=4, batch_buckets=(1, 2))
    r.warmup(background=True)
    widths, kinds = [], []
    run = r._run

    def recording(plan):
        kinds.append(plan.kind)
        if plan.kind == "step":
            widths.append(plan.static["width"])
        return run(plan)

    r._run = recording
    for phase in ("deferred", "warmed"):
        widths.clear()
        kinds.clear()
        with CompileMeter() as m:
            r.add(0, [3, 1, 4, 1, 5], SamplingParams())
            r.step([0], {0: 4})  # catch-up, then full width
            res = r.step([0], {0: 4}, {0: 1})
            r.admit([(1, [2, 7, 1, 8], SamplingParams())])
            both = r.step([0], {0: 4}, {0: 1}, prefill={1: 4})
            r.release(0)
            r.release(1)
        assert m.counts.programs == 0, (phase, m.summary())
        assert res[0].num_drafts == 1 and both[0].num_drafts == 1 and len(both[1].tokens) == 1
        if phase == "deferred":
            assert widths == [4, 4, 4] and "mixed" not in kinds
            while r.warm_more():
                pass
            for e in r.programs.executables.values():
                assert e.compiled is not None
        else:
            assert widths == [4, 2] and "mixed" in kinds


def test_a_warmed_hybrid_runner_runs_its_lookup_and_hybrid_steps_from_precompiled_programs(tiny_target, tiny_drafter):
    """The hybrid runner's warm-up compiles both of its speculative programs: after it, a step whose rows all verify
    lookup drafts and a step mixing lookup and drafter rows each run their own executable (a shared one would be
    called with the other's arguments) and compile nothing, with the tokens of a runner that never warmed up."""
    from dflash_jax.spec_decode.ngram import HybridRunner

    class Scripted(HybridRunner):
        script: dict[int, list[int]] = {}

        def _lookup(self, slot: int) -> list[int]:
            return self.script.get(slot, [])

    kw = dict(max_slots=2, max_model_len=MAX_LEN, gamma=4, batch_buckets=(1, 2))
    warm, cold = Scripted(tiny_target, tiny_drafter, **kw), Scripted(tiny_target, tiny_drafter, **kw)
    warm.warmup()
    prompts = [[1 + (i * 7 + s) % 50 for i in range(6)] for s in range(2)]
    outs = []
    for r in (warm, cold):
        with CompileMeter() as m:
            r.add_many([(s, p, SamplingParams()) for s, p in enumerate(prompts)])
            while r.prefilling:
                r.prefill_step()
            out = []
            for script in ({0: [3, 3, 3], 1: [5, 4]}, {0: [3, 3, 3]}, {}):  # lookup alone, hybrid, drafter alone
                r.script = script
                res = r.step([0, 1], {0: 8, 1: 8})
                out.append([(res[s].tokens, res[s].lookup, res[s].num_drafts) for s in (0, 1)])
            for s in (0, 1):
                r.release(s)
        outs.append(out)
        if r is warm:
            assert m.counts.programs == 0, m.summary()
    assert outs[0] == outs[1]
    assert [[look for _, look, _ in step] for step in outs[0]] == [[True, True], [True, False], [False, False]]
    assert [n for _, _, n in outs[0][0]] == [3, 2]  # a lookup row verifies as many drafts as its proposal has
