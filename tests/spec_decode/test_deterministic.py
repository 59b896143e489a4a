"""`deterministic=True` (`--deterministic`): every step runs the target at one shape (the verify width, every
slot, the whole context), so in bf16 greedy speculative output is bit-identical to plain decoding, whatever the
drafts, their acceptance and the mix of plain and speculative steps.

This holds the construction (every step of both runners at one shape) and the equality, with drafts taken from the
plain output and corrupted at scheduled positions, so every accept length and mixed plain/speculative steps occur.
A model this small agrees in bf16 even without the mode; that the mode removes real divergences is shown on the
default model (`tests/bench/test_parity_smollm.py`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dflash_jax.errors import UserError
from dflash_jax.spec_decode.oracle import GivenDraftsRunner
from dflash_jax.spec_decode.runner import SpecRunner
from dflash_jax.types import SamplingParams
from tests.conftest import make_target

GAMMA, SLOTS, MAX_LEN, N_NEW = 4, 4, 64, 20


def _bf16(model):
    graphdef, state = nnx.split(model)
    return nnx.merge(graphdef, jax.tree.map(lambda x: x.astype(jnp.bfloat16), state))


class GivenDrafts(GivenDraftsRunner):
    """Drafts from `future[slot]` (prompt + a continuation), with draft index `(step + slot) % GAMMA` corrupted."""

    future: dict[int, list[int]]
    calls = 0

    def given_drafts(self, slot_list, width):
        self.calls += 1
        out = np.zeros((len(slot_list), width - 1), np.int32)
        for r, s in enumerate(slot_list):
            pos = len(self.slots[s].tokens)
            cont = self.future[s][pos : pos + width - 1]
            out[r, : len(cont)] = cont
            bad = (self.calls + s) % GAMMA
            if bad < width - 1:
                out[r, bad] = (out[r, bad] + 1) % 200
        return out


def _drive(runner, prompts, choose=None):
    """Prefill, then step until every slot has N_NEW tokens; tokens per slot and every step's static shape."""
    shapes = []
    runner.plan_hook = lambda plan, apply: (shapes.append((plan.kind, dict(plan.static), plan.arrays)), apply(plan))[1]
    out = {
        i: list(r.tokens) for i, r in runner.add_many([(i, p, SamplingParams()) for i, p in enumerate(prompts)]).items()
    }
    step = 0
    while active := [i for i in out if len(out[i]) < N_NEW]:
        step += 1
        res = runner.step(active, {i: 10**6 for i in active}, choose(step, active) if choose else None)
        for i, r in res.items():
            out[i] += r.tokens
    for i in out:
        runner.release(i)
    return [out[i][:N_NEW] for i in sorted(out)], [(st, a) for kind, st, a in shapes if kind == "step"]


def _choose(step, active):
    """Every third step plain (no drafts), else per-slot draft counts 0..GAMMA-1."""
    return {i: 0 if step % 3 == 0 else (step + i) % GAMMA for i in active}


@pytest.fixture(scope="module")
def models(tiny_llama_cfg):
    from tests.conftest import make_drafter, tiny_drafter_config

    target = _bf16(make_target(tiny_llama_cfg, seed=3, std=0.02))
    drafter = _bf16(make_drafter(tiny_drafter_config(tiny_llama_cfg), tiny_llama_cfg.hidden_size))
    return target, drafter


def test_deterministic_speculative_is_bit_identical_to_plain_in_bf16(models):
    target, drafter = models
    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, 200, size=int(n)).tolist() for n in (3, 11, 6, 14)]
    plain = SpecRunner(target, None, max_slots=SLOTS, max_model_len=MAX_LEN, gamma=GAMMA, deterministic=True)
    ref, plain_shapes = _drive(plain, prompts)
    spec = GivenDrafts(target, drafter, max_slots=SLOTS, max_model_len=MAX_LEN, gamma=GAMMA, deterministic=True)
    spec.future = {i: [*p, *r] for i, (p, r) in enumerate(zip(prompts, ref, strict=True))}
    outs, spec_shapes = _drive(spec, prompts, _choose)
    assert outs == ref
    kinds = {st["speculative"] for st, _ in spec_shapes}
    assert kinds == {False, True}  # plain and speculative steps both ran
    for st, arrays in plain_shapes + spec_shapes:  # one shape: full width, every slot, the whole context
        assert st["width"] == GAMMA and st["kv_len"] == spec.capacity == plain.capacity
        assert arrays["slot_ids"].shape == (SLOTS,)


def test_deterministic_needs_a_verify_width(models):
    target, _ = models
    with pytest.raises(UserError, match="--deterministic"):
        SpecRunner(target, None, max_slots=1, max_model_len=MAX_LEN, deterministic=True)
