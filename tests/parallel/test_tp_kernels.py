"""Quantized drafters reach the Pallas kernels, on one device and under drafter TP (`shard_map`), on 8 fake CPU
devices with the kernels in interpret mode.

The kernel backend travels with the quantized weights (`apply_weight_tier(..., kernel_backend=...)`), so the TP
propose, which runs the drafter's own forward on each rank's shards, dispatches every quantized matmul to the same
kernel as the one-rank propose. Counted in the traced program: one `pallas_call` per quantized matmul of the
propose (seven GEMMs per layer and the LM head; for DFlash2 at the nvfp4 tier also the conv kernel projections and
the selector projection), none with the XLA backend; and the TP drafts equal the one-rank drafts.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

from dflash_jax.checkpoints.export import apply_weight_tier
from dflash_jax.models.drafter import DrafterModel, propose_block
from dflash_jax.models.drafter2 import Drafter2Model, propose_block2
from dflash_jax.models.layers import RandomBuilder
from dflash_jax.parallel.drafter_tp import place_drafter_tp
from dflash_jax.parallel.mesh import make_mesh
from dflash_jax.quant import Fp8RowWeight, Nvfp4Weight
from tests.parallel.test_parallel_tp import DCFG, TCFG, WIDTH, _drafter_inputs, _models, propose_tp
from tests.parallel.test_tp_dflash2 import DCFG2, _check_same, _sampling, propose2_tp
from tests.quant.jaxpr_count import pallas_calls as _pallas_calls

TP = 4


def _quantized(drafter, tier: str, backend: str):
    target, _ = _models()
    head = apply_weight_tier(drafter, target.lm_head[...], tier, kernel_backend=backend)
    w = drafter.layers[0].qkv_proj.get_value()
    assert isinstance(w, Fp8RowWeight if tier == "fp8" else Nvfp4Weight) and w.backend == backend
    assert head.backend == backend
    return head


def _one_rank_dflash(drafter, head):
    target, _ = _models()
    cache, slots, anchor, start = _drafter_inputs(drafter)

    def fn(embed, head, cache):
        return propose_block(drafter, embed, head, cache, anchor, start, slots, width=WIDTH, kv_len=16)[0]

    args = (target.embed[...], head, cache)
    return np.asarray(jax.jit(fn)(*args)), _pallas_calls(fn, *args)


def _tp_dflash(drafter, head):
    target, _ = _models()
    cache, slots, anchor, start = _drafter_inputs(drafter)
    mesh = make_mesh(TP)
    dgraph, dstate = nnx.split(drafter)
    dstate, dcache, head, embed = place_drafter_tp(dstate, cache, head, target.embed[...], mesh)

    def fn(embed, head, dstate, dcache):
        return propose_tp(embed, head, dgraph, dstate, dcache, slots, anchor, start, mesh=mesh)

    args = (embed, head, dstate, dcache)
    calls = _pallas_calls(fn, *args)
    return np.asarray(fn(*args)), calls


@pytest.mark.parametrize("tier", ["fp8", "nvfp4"])
def test_quantized_tp_drafter_runs_the_pallas_kernels_and_equals_one_rank(tier):
    drafter = DrafterModel(DCFG, TCFG.hidden_size, RandomBuilder(1, std=0.2))
    head = _quantized(drafter, tier, "interpret")
    per_propose = 4 * DCFG.num_layers + 1  # fused q|k|v, o, fused gate|up, down per layer, and the LM head
    ref, ref_calls = _one_rank_dflash(drafter, head)
    assert ref_calls == per_propose
    assert len(np.unique(ref)) > 3  # the drafts are not degenerate
    drafts, calls = _tp_dflash(drafter, head)
    assert calls == per_propose  # once in the shard_map body: every rank runs the kernels on its shards
    np.testing.assert_array_equal(drafts, ref)


def test_xla_backend_runs_no_pallas_kernel():
    drafter = DrafterModel(DCFG, TCFG.hidden_size, RandomBuilder(1, std=0.2))
    head = _quantized(drafter, "nvfp4", "xla")
    ref, ref_calls = _one_rank_dflash(drafter, head)
    drafts, calls = _tp_dflash(drafter, head)
    assert ref_calls == calls == 0
    np.testing.assert_array_equal(drafts, ref)


def test_quantized_dflash2_tp_drafter_runs_the_pallas_kernels_and_equals_one_rank():
    """nvfp4 covers the replicated conv kernel projections and the selector projection too."""
    target, _ = _models()
    drafter = Drafter2Model(DCFG2, TCFG.hidden_size, RandomBuilder(1, std=0.2))
    head = _quantized(drafter, "nvfp4", "interpret")
    assert drafter.layers[0].attention_conv.kernel_projection.get_value().backend == "interpret"
    per_propose = (4 + 2) * DCFG2.num_layers + 2  # + two conv projections per layer; the LM head, the selector
    cache, slots, anchor, start = _drafter_inputs(drafter)
    sp = _sampling(4, sampled=True)

    kw = dict(width=WIDTH, kv_len=16, temperature=sp.temperature, seed=sp.seed)

    def one(embed, head, cache):
        return propose_block2(drafter, embed, head, cache, anchor, start, slots, **kw)

    args = (target.embed[...], head, cache)
    assert _pallas_calls(one, *args) == per_propose
    ref = tuple(np.asarray(x) for x in jax.jit(one)(*args))

    mesh = make_mesh(TP)
    dgraph, dstate = nnx.split(drafter)
    dstate, dcache, thead, embed = place_drafter_tp(dstate, cache, head, target.embed[...], mesh)

    def tp(embed, thead, dstate, dcache):
        return propose2_tp(embed, thead, dgraph, dstate, dcache, slots, anchor, start, sp, mesh=mesh)

    targs = (embed, thead, dstate, dcache)
    assert _pallas_calls(tp, *targs) == per_propose
    _check_same(tuple(np.asarray(x) for x in tp(*targs)), ref)
