"""Drafter tensor parallelism over the fused q|k|v and gate|up (8 host devices): a plain split of a fused weight's
output axis gives each rank its own KV heads with their query heads and its own slice of gate and of up (dense,
fp8 and nvfp4), and the TP propose's top-16 logits equal those of the one-device propose.

Reference for the placement: the separate q/k/v and gate/up tensors quantized one by one and cut by hand per
rank; for the logits: the one-device drafter's full-vocabulary logits."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dflash_jax.checkpoints.export import apply_weight_tier
from dflash_jax.models.drafter import DrafterModel, propose_block
from dflash_jax.models.layers import RandomBuilder, unfused_block
from dflash_jax.parallel.drafter_tp import TOPK, place_drafter_tp, propose_block_tp
from dflash_jax.parallel.mesh import make_mesh
from dflash_jax.quant import quantize_fp8_row, quantize_nvfp4
from tests.parallel.test_parallel_tp import DCFG, TCFG, WIDTH, _drafter_inputs, _models

# 16 query heads over 8 KV heads (groups of 2), so TP 8 leaves each rank one KV head and two query heads;
# q_dim 128 and intermediate 256 split into whole 16-blocks for the row-parallel NVFP4 o_proj and down_proj.
FCFG = dataclasses.replace(
    DCFG, num_heads=16, num_kv_heads=8, intermediate_size=256, num_layers=2, layer_attn=((0, False), (3, True))
)


@functools.partial(jax.jit, static_argnames=("dgraph", "mesh"))
def _propose_tp(embed, head, dgraph, dstate, dcache, slots, anchor, start, *, mesh):
    drafter = nnx.merge(dgraph, dstate)
    kw = dict(width=WIDTH, kv_len=16, mesh=mesh)
    drafts, top = propose_block_tp(drafter, embed, head, dcache, anchor, start, slots, **kw)
    return drafts, top.values, top.ids


def _drafter(tier: str):
    target, _ = _models()
    drafter = DrafterModel(FCFG, TCFG.hidden_size, RandomBuilder(3, std=0.2))
    dense = [{n: np.asarray(a) for n, a in unfused_block(layer).items()} for layer in drafter.layers]
    head = apply_weight_tier(drafter, target.lm_head[...], tier)
    return drafter, head, dense


def _quantize(tier: str, w_in_out: np.ndarray, global_scale=None):
    w = jnp.asarray(w_in_out.T)
    return quantize_fp8_row(w) if tier == "fp8" else quantize_nvfp4(w, global_scale=global_scale)


def _row_fields(tier: str) -> tuple[str, ...]:
    return ("q", "scale") if tier == "fp8" else ("packed", "block_scale")


def _shard_rows(arr: jax.Array, rank: int) -> np.ndarray:
    """The rows rank `rank` holds of a weight split on its first axis (shards in row order)."""
    shards = sorted(arr.addressable_shards, key=lambda s: s.index[0].start or 0)
    return _codes(shards[rank].data)


def _codes(a) -> np.ndarray:
    a = np.asarray(a)
    return a.view(np.uint8) if a.dtype.itemsize == 1 else a


@pytest.mark.parametrize("tier", ["fp8", "nvfp4"])
def test_each_rank_holds_its_heads_and_its_intermediate_slice(tier):
    tp = 8
    drafter, head, dense = _drafter(tier)
    cache = _drafter_inputs(drafter)[0]
    dgraph, dstate = nnx.split(drafter)
    placed = place_drafter_tp(dstate, cache, head, _models()[0].embed[...], make_mesh(tp))[0]
    g, d = FCFG.num_heads // FCFG.num_kv_heads, FCFG.head_dim
    kv_per, inter_per = FCFG.num_kv_heads // tp, FCFG.intermediate_size // tp
    for i, w in enumerate(dense):
        qkv_parts = {n: w[n] for n in ("q_proj", "k_proj", "v_proj")}
        mlp_parts = {n: w[n] for n in ("gate_proj", "up_proj")}
        shared = {
            "qkv": quantize_nvfp4(jnp.asarray(np.concatenate(list(qkv_parts.values()), axis=1).T)).global_scale,
            "mlp": quantize_nvfp4(jnp.asarray(np.concatenate(list(mlp_parts.values()), axis=1).T)).global_scale,
        }
        sep = {n: _quantize(tier, a, shared["qkv"]) for n, a in qkv_parts.items()}
        sep |= {n: _quantize(tier, a, shared["mlp"]) for n, a in mlp_parts.items()}
        layer = placed["layers"][i]
        qkv, gate_up = layer["qkv_proj"][...], layer["gate_up_proj"][...]
        for field in _row_fields(tier):
            q, k, v = (_codes(getattr(sep[n], field)) for n in ("q_proj", "k_proj", "v_proj"))
            gate, up = (_codes(getattr(sep[n], field)) for n in ("gate_proj", "up_proj"))
            for r in range(tp):
                heads = range(r * kv_per, (r + 1) * kv_per)  # this rank's KV heads, each with its query group
                want = np.concatenate(
                    [
                        np.concatenate([q[h * g * d : (h + 1) * g * d], k[h * d : (h + 1) * d], v[h * d : (h + 1) * d]])
                        for h in heads
                    ]
                )
                got = _shard_rows(getattr(qkv, field), r)
                np.testing.assert_array_equal(got, want, err_msg=f"layer {i} qkv {field} rank {r}")
                units = slice(r * inter_per, (r + 1) * inter_per)
                want = np.stack([gate[units], up[units]], axis=1).reshape(2 * inter_per, *gate.shape[1:])
                got = _shard_rows(getattr(gate_up, field), r)
                np.testing.assert_array_equal(got, want, err_msg=f"layer {i} gate|up {field} rank {r}")


@pytest.mark.parametrize(("tier", "tp"), [("declared", 8), ("fp8", 8), ("nvfp4", 8), ("nvfp4", 4)])
def test_fused_drafter_tp_logits_equal_one_device(tier, tp):
    target, _ = _models()
    drafter, head, _ = _drafter(tier)
    cache, slots, anchor, start = _drafter_inputs(drafter)
    ref_drafts, ref_logits = jax.jit(
        lambda: propose_block(drafter, target.embed[...], head, cache, anchor, start, slots, width=WIDTH, kv_len=16)
    )()
    ref_drafts, ref_logits = np.asarray(ref_drafts), np.asarray(ref_logits)
    assert len(np.unique(ref_drafts)) > 3  # the drafts are not degenerate
    mesh = make_mesh(tp)
    dgraph, dstate = nnx.split(drafter)
    dstate, dcache, dhead, embed = place_drafter_tp(dstate, cache, head, target.embed[...], mesh)
    out = _propose_tp(embed, dhead, dgraph, dstate, dcache, slots, anchor, start, mesh=mesh)
    drafts, values, ids = (np.asarray(a) for a in out)
    np.testing.assert_array_equal(drafts, ref_drafts)
    scale = max(1.0, float(np.abs(ref_logits).max()))
    ref_top = -np.sort(-ref_logits, axis=-1)[..., :TOPK]
    np.testing.assert_allclose(values, ref_top, atol=1e-5 * scale, rtol=0)  # the top-16 logits, in order
    # each candidate's value is the one-device logit of its token
    np.testing.assert_allclose(values, np.take_along_axis(ref_logits, ids, axis=-1), atol=1e-5 * scale, rtol=0)
    assert len(set(ids.reshape(-1, TOPK)[0])) == TOPK
