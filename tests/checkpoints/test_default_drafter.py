"""The committed default drafter (`dflash_jax/drafters/smollm2-135m-dflash`) with the default target: it loads as
what its config declares, and speculative greedy output equals plain greedy output with drafts accepted."""

from __future__ import annotations

import pytest

from dflash_jax.bench.decode import bench_decode
from dflash_jax.bench.prompts import load_prompt_file
from dflash_jax.builder import load_models, make_controller


@pytest.mark.slow
def test_default_drafter_is_lossless_and_drafts():
    m = load_models("default", "default")
    cfg = m.drafter.cfg
    assert (cfg.arch, cfg.num_layers, cfg.block_size, cfg.target_layer_ids) == ("dflash2", 3, 8, (1, 10, 18, 27))
    assert make_controller(m.drafter).gamma == 8  # the measured `dflash_jax_gamma` of its config
    prompts = load_prompt_file(None)[:2]
    res = bench_decode(m, prompts, batch_size=1, max_tokens=24, gamma=8, log=lambda *a: None)
    assert res["outputs_identical"], res.get("first_mismatch")
    assert res["acceptance_by_position"][0] > 0  # the drafter's first draft is accepted at least sometimes
