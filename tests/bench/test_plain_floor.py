"""`bench plain`'s floor: the jitted decode-step math without cache writes or sampling gives the runner's own next
token (so it times the same work as the decode step), on tiny random Llama and Qwen3 targets."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.bench.plain import _floor, _matmul_floor, floor_ms, target_weights
from dflash_jax.models.layers import Pages, read_rows
from dflash_jax.spec_decode.runner import SpecRunner
from dflash_jax.types import SamplingParams


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_floor_gives_the_decode_steps_next_token(arch, tiny_llama_cfg, tiny_qwen3_cfg, target_factory):
    cfg = tiny_llama_cfg if arch == "llama" else tiny_qwen3_cfg
    model = target_factory(cfg, seed=3)
    runner = SpecRunner(model, None, max_slots=2, max_model_len=64)
    rng = np.random.default_rng(1)
    prompts = [[int(t) for t in rng.integers(1, cfg.vocab_size, n)] for n in (7, 12)]
    first = runner.add_many([(s, p, SamplingParams()) for s, p in enumerate(prompts)])
    kv_len = 32  # rows past each prompt are stale and masked
    pages = Pages(jnp.asarray(runner._tables([0, 1], kv_len)))  # the slots' pages, gathered in logical order
    kv = [(read_rows(k, pages, kv_len), read_rows(v, pages, kv_len)) for k, v in runner.tcache]
    tokens = jnp.asarray([[first[s].tokens[0]] for s in (0, 1)], jnp.int32)
    positions = jnp.asarray([[len(p)] for p in prompts], jnp.int32)
    got = np.asarray(_floor(cfg, target_weights(model), tokens, positions, kv))
    step = runner.step([0, 1], {0: 1, 1: 1})
    assert got.tolist() == [step[0].tokens[0], step[1].tokens[0]]
    mm = np.asarray(_matmul_floor(cfg, target_weights(model), tokens))
    assert mm.shape == (2,) and all(0 <= t < cfg.vocab_size for t in mm.tolist())


def test_floor_ms_times_both_floors(tiny_target):
    assert floor_ms(tiny_target, 2, 128, calls=3) > 0
    assert floor_ms(tiny_target, 2, 128, calls=3, matmuls_only=True) > 0
