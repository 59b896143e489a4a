"""DFlash2 drafters under tensor parallelism: the drafter-TP propose covers DFlash only, so `--draft-tp-size auto`
runs a DFlash2 drafter replicated (the target still splits) and an explicit `--draft-tp-size N > 1` is refused with
one line naming the flag."""

from __future__ import annotations

import pytest

from dflash_jax.engine.runner import SamplingParams
from dflash_jax.errors import UserError
from dflash_jax.models.drafter2 import Drafter2Model
from dflash_jax.models.layers import RandomBuilder
from dflash_jax.parallel.drafter_tp import resolve_draft_tp
from dflash_jax.parallel.mesh import make_mesh
from dflash_jax.spec.runner import SpecRunner
from tests.conftest import TINY_LLAMA, make_target, tiny_drafter_config

CFG2 = tiny_drafter_config(TINY_LLAMA, arch="dflash2", selector_rank=8, selector_top_k=8)


def test_resolve_draft_tp_keeps_dflash2_on_one_rank():
    assert resolve_draft_tp("auto", 2, CFG2) == 1
    assert resolve_draft_tp(None, 2, CFG2) == 1
    assert resolve_draft_tp("1", 2, CFG2) == 1
    with pytest.raises(UserError) as e:
        resolve_draft_tp("2", 2, CFG2)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("--draft-tp-size 2: a DFlash2 drafter") and "--draft-tp-size 1" in msg
    assert e.value.param == "--draft-tp-size"


def _greedy(runner: SpecRunner, prompts: list[list[int]], steps: int) -> list[list[int]]:
    slots = list(range(len(prompts)))
    first = runner.add_many([(s, p, SamplingParams()) for s, p in zip(slots, prompts, strict=True)])
    toks = [list(first[s].tokens) for s in slots]
    for _ in range(steps):
        out = runner.step(slots, {s: runner.gamma for s in slots})
        for s in slots:
            toks[s] += out[s].tokens
    return toks


def test_dflash2_runs_replicated_under_target_tp_and_refuses_draft_tp():
    target = make_target(TINY_LLAMA)
    drafter = Drafter2Model(CFG2, TINY_LLAMA.hidden_size, RandomBuilder(1, std=0.2))
    mesh = make_mesh(2)  # TINY_LLAMA: 4 heads, 2 KV heads; the drafter: 4 heads, 2 KV heads
    with pytest.raises(UserError, match=r"^--draft-tp-size 2: a DFlash2 drafter"):
        SpecRunner(target, drafter, max_slots=2, max_model_len=48, batch_buckets=(2,), mesh=mesh, draft_tp="2")
    prompts = [[5, 17, 99, 3], [42, 7, 8, 9, 10]]
    ref = _greedy(SpecRunner(target, drafter, max_slots=2, max_model_len=48, batch_buckets=(2,)), prompts, 4)
    tp = SpecRunner(target, drafter, max_slots=2, max_model_len=48, batch_buckets=(2,), mesh=mesh)
    assert tp.draft_tp == 1 and tp.draft_q is not None
    assert _greedy(tp, prompts, 4) == ref
