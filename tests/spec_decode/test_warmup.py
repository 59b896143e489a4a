"""The runner's warm-up: it reports what it compiled, and afterwards the common shapes compile nothing more."""

from __future__ import annotations

from dflash_jax.compilation import CompileMeter
from dflash_jax.spec_decode.runner import SpecRunner
from dflash_jax.types import SamplingParams

MAX_LEN = 160  # two KV-length buckets: 128 and the capacity


def test_warmup_covers_the_common_shapes(tiny_target, tiny_drafter):
    """Plain steps, a catch-up, speculative steps and a min-tokens ban (a runtime input, not a variant) at warmed
    shapes, for prompts within and past the first KV bucket, compile no program after `warmup`."""
    r = SpecRunner(tiny_target, tiny_drafter, max_slots=2, max_model_len=MAX_LEN, gamma=4, batch_buckets=(1, 2))
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
            r.step([0], {0: 4})  # one row: batch bucket 1
            for s in (0, 1):
                r.release(s)
    assert m.counts.programs == 0, m.summary()


def test_a_second_runner_of_the_same_models_compiles_nothing(tiny_target, tiny_drafter):
    """Runners of the same models share their compiled programs: a second warm-up compiles none."""
    kw = dict(max_slots=2, max_model_len=MAX_LEN, gamma=4, batch_buckets=(1, 2))
    SpecRunner(tiny_target, tiny_drafter, **kw).warmup()
    assert SpecRunner(tiny_target, tiny_drafter, **kw).warmup().programs == 0
