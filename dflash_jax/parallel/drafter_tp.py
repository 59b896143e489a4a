"""Drafter tensor parallelism (`--draft-tp-size auto|N`): the DFlash propose as one `jax.shard_map` program.

The program runs the drafter's own forward (`models.drafter.draft_head`, `models.drafter2.propose_block2`) on each
rank's weight shards, with a `psum` as its sublayer `reduce`; what is specific to TP is the placement and the global
top-k below.

Per rank (tp ranks on the mesh's `"tp"` axis):
* `n_kv/tp` KV heads with their query groups (`n_q/tp` query heads): column slices of q/k/v, row slice of o;
* a `1/tp` slice of the MLP intermediate: column slices of gate/up, row slice of down;
* `V/tp` rows of the (shared) LM head; the context K/V cache of its own KV heads.

Collectives per propose: two all-reduces (`psum`) per drafter layer, after o_proj and after down_proj (Megatron),
and one all-gather of each rank's local top-16 `(value, id)` per draft row (values and ids travel as one f32
array, the ids bit-cast), from which the global top-16 and the argmax drafts are taken; full-vocab logits are
never gathered. The block embedding is looked up in a replicated copy of the embedding table, so it needs no
collective (a vocab-parallel lookup would cost one more all-reduce per propose; the copy costs V*H per device).

DFlash2 drafters (`propose_block2_tp`): the conv kernel projections and base taps and the candidate selector (codebooks
[V, r], hidden projection) are replicated on every rank. A conv runs on full hidden states, which are replicated
after each all-reduce: application 0 on the normed sublayer input, application 1 on the all-reduced sublayer output,
so it adds no collective. The selector rescoring and the chain walk read the global top-K candidates `(value, id)`
of the one all-gather (each rank contributes max(16, K)), so the count stays 2·L all-reduces + 1 all-gather.

The drafts equal the one-rank drafts up to float summation order (ties between equal logits go to the lower
token id, as with `jnp.argmax` / `lax.top_k`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from dflash_jax.config import DrafterConfig
from dflash_jax.errors import UserError
from dflash_jax.models.drafter import DrafterCache, draft_head
from dflash_jax.models.drafter2 import ARCH as DFLASH2
from dflash_jax.models.drafter2 import propose_block2
from dflash_jax.parallel.mesh import TP, tp_size_of
from dflash_jax.parallel.rules import (
    ShardingError,
    kv_cache_spec,
    put,
    shard_kv_cache,
    shard_tree,
    state_specs,
    value_spec,
)
from dflash_jax.quant.formats import is_quantized

FLAG = "--draft-tp-size"
TOPK = 16  # candidates each rank contributes per draft row
LM_HEAD_AXES = ("embed", "vocab")  # logical axes of the target's LM head [hidden, vocab]


class TopK(NamedTuple):
    """The global top-k drafter candidates per draft row, best first: values [B,W-1,k] (f32), ids [B,W-1,k]."""

    values: jax.Array
    ids: jax.Array


# ----------------------------------------------------------------------------------------------- the flag
def resolve_draft_tp(value: str | int | None, world: int, dcfg: DrafterConfig | None) -> int:
    """`--draft-tp-size` -> rank count. `auto` (or None) = the world size (DFlash and DFlash2 alike). The result must
    be 1 or the world size and, above 1, the drafter's KV heads must divide among the ranks; else UserError naming
    the value, the world size and the heads."""
    raw = "auto" if value is None else str(value).strip().lower()
    heads = f"{dcfg.num_kv_heads} KV heads" if dcfg is not None else "no drafter"
    if raw == "auto":
        n = world
    else:
        try:
            n = int(raw)
        except ValueError:
            n = 0
        if n < 1:
            raise UserError(f"{FLAG} must be 'auto' or an integer >= 1, got {value!r}", param=FLAG)
    if n not in (1, world):
        raise UserError(
            f"{FLAG} {value}: must be 1 or the world size {world} (auto = {world}); the drafter has {heads}",
            param=FLAG,
        )
    if n > 1 and dcfg is not None and (dcfg.num_kv_heads % n or dcfg.num_heads % n):
        raise UserError(
            f"{FLAG} {value}: the drafter's {dcfg.num_kv_heads} KV heads ({dcfg.num_heads} attention heads) do not "
            f"divide among the world size {world} ranks (drafter KV heads must cover every rank); "
            f"use {FLAG} 1 to run the drafter replicated",
            param=FLAG,
        )
    return n


def _strict(what: str, tp: int, fn, *args, **kw):
    try:
        return fn(*args, **kw)
    except ShardingError as e:
        raise UserError(f"{FLAG} {tp}: {what}: {e}; use {FLAG} 1", param=FLAG) from None


def drafter_specs(dstate: Any, mesh: Mesh) -> list[P]:
    """Specs (leaf order) of a drafter state under drafter TP; every split must be exact (UserError otherwise)."""
    return _strict("a drafter weight does not split", tp_size_of(mesh), state_specs, dstate, mesh, strict=True)


def lm_head_spec(lm_head: Any, mesh: Mesh) -> Any:
    """Spec(s) of the shared LM head (`[hidden, vocab]`, or a quantized `[vocab, hidden]` weight): vocab rows."""
    return _strict(
        "the LM head's vocabulary does not split",
        tp_size_of(mesh),
        value_spec,
        LM_HEAD_AXES,
        lm_head,
        mesh,
        strict=True,
    )


def _specs_tree(spec: Any) -> list[P]:
    return jax.tree.leaves(spec, is_leaf=lambda s: isinstance(s, P))


def place_drafter_tp(dstate: Any, dcache: DrafterCache, lm_head: Any, embed: jax.Array, mesh: Mesh):
    """Place what the TP propose reads: drafter weights split by heads/MLP, the cache by KV heads, the LM head by
    vocab rows, the embedding replicated. Returns (dstate, dcache, lm_head, embed)."""
    dstate = shard_tree(dstate, drafter_specs(dstate, mesh), mesh)
    dcache = _strict("the drafter cache does not split", tp_size_of(mesh), shard_kv_cache, dcache, mesh, strict=True)
    lm_head = shard_tree(lm_head, _specs_tree(lm_head_spec(lm_head, mesh)), mesh)
    embed = put(embed, NamedSharding(mesh, P()))
    return dstate, dcache, lm_head, embed


# ----------------------------------------------------------------------------------------------- the body
def _psum_tp(x: jax.Array) -> jax.Array:
    """The drafter forward's `reduce` under TP: completes a row-parallel o_proj / down_proj."""
    return jax.lax.psum(x, TP)


def _global_topk(logits_local: jax.Array, k_out: int, k_local: int = TOPK) -> TopK:
    """Local top-k of a rank's vocab slice -> one all-gather of (value, id) -> the global top-k_out.
    Exact when k_local >= k_out (the global top-k_out lie in the union of the ranks' top-k_out)."""
    v_local = logits_local.shape[-1]
    k = min(k_local, v_local)
    vals, idx = jax.lax.top_k(logits_local, k)
    ids = idx.astype(jnp.int32) + jax.lax.axis_index(TP).astype(jnp.int32) * v_local
    packed = jnp.concatenate([vals, jax.lax.bitcast_convert_type(ids, jnp.float32)], axis=-1)  # [B,R,2k]
    allv = jax.lax.all_gather(packed, TP, axis=packed.ndim - 1, tiled=True, to="invarying")  # [B,R,tp*2k]
    allv = allv.reshape(*packed.shape[:-1], -1, 2 * k)  # [B,R,tp,2k], rank order = vocab order
    cand_v = allv[..., :k].reshape(*packed.shape[:-1], -1)
    cand_i = jax.lax.bitcast_convert_type(allv[..., k:], jnp.int32).reshape(*packed.shape[:-1], -1)
    top_v, pos = jax.lax.top_k(cand_v, min(k_out, cand_v.shape[-1]))
    return TopK(top_v, jnp.take_along_axis(cand_i, pos, axis=-1))


def _topk2(logits_local: jax.Array, k: int) -> TopK:
    """DFlash2's candidates under TP: each rank contributes max(16, K), so the global top-K is exact."""
    return _global_topk(logits_local, k, max(TOPK, k))


def _tp_program(drafter, embed, lm_head, cache, anchor, start, pages, temperature, seed, *, width, kv_len, mesh):
    """The shard_map program shared by DFlash and DFlash2. Returns, replicated:
    DFlash: (drafts, top-16 values, top-16 ids); DFlash2: (drafts, candidate ids [B,W-1,K], q [B,W-1,K])."""
    dflash2 = drafter.cfg.arch == DFLASH2
    graphdef, dstate = nnx.split(drafter)
    d_leaves, d_def = jax.tree.flatten(dstate)
    h_leaves, h_def = jax.tree.flatten(lm_head)
    c_leaves, c_def = jax.tree.flatten(cache)
    sampled = temperature is not None
    if not sampled:  # placeholders (unused): the program has one signature
        temperature, seed = jnp.zeros(anchor.shape, jnp.float32), jnp.zeros(anchor.shape, jnp.uint32)
    head_specs, cache_specs = _specs_tree(lm_head_spec(lm_head, mesh)), [kv_cache_spec(c.shape, mesh) for c in c_leaves]
    in_specs = (drafter_specs(dstate, mesh), P(), head_specs, cache_specs, *(P(),) * 5)  # the rest replicated

    def body(d_leaves, embed, h_leaves, c_leaves, anchor, start, pages, temperature, seed):
        local = nnx.merge(graphdef, jax.tree.unflatten(d_def, d_leaves))
        head = jax.tree.unflatten(h_def, h_leaves)  # this rank's LM-head vocabulary rows
        cache_local = jax.tree.unflatten(c_def, c_leaves)
        args = (local, embed, head, cache_local, anchor, start, pages)
        if not dflash2:
            _, logits = draft_head(*args, width=width, kv_len=kv_len, reduce=_psum_tp)
            top = _global_topk(logits, TOPK)
            return top.ids[..., 0], top.values, top.ids
        t = temperature if sampled else None
        return propose_block2(
            *args, temperature=t, seed=seed, width=width, kv_len=kv_len, reduce=_psum_tp, top_k=_topk2
        )

    # Pallas kernels (quantized weights on a non-XLA backend) carry no varying-axis types: only then is the check off
    fn = jax.shard_map(
        body, mesh=mesh, in_specs=in_specs, out_specs=(P(), P(), P()), check_vma=not _uses_kernels((dstate, lm_head))
    )
    return fn(d_leaves, embed, h_leaves, c_leaves, anchor, start, pages, temperature, seed)


def _uses_kernels(tree: Any) -> bool:
    """Does any quantized weight in `tree` run on a Pallas backend?"""
    return any(is_quantized(w) and w.backend != "xla" for w in jax.tree.leaves(tree, is_leaf=is_quantized))


def propose_block_tp(
    drafter, embed, lm_head, cache, anchor, start, pages, *, width, kv_len, mesh
) -> tuple[jax.Array, TopK]:
    """`propose_block` under drafter TP (DFlash): drafts [B, width-1] (int32 argmax) and the global top-16
    candidates (instead of full-vocab logits). Call inside `jax.jit`; inputs are resharded to the specs if needed
    (no reshard happens when they were placed by `place_drafter_tp`)."""
    if drafter.cfg.arch == DFLASH2:
        raise ValueError("propose_block_tp is the DFlash propose; use propose_block2_tp for a DFlash2 drafter")
    drafts, vals, ids = _tp_program(
        drafter, embed, lm_head, cache, anchor, start, pages, None, None, width=width, kv_len=kv_len, mesh=mesh
    )
    return drafts.astype(jnp.int32), TopK(vals, ids)


def propose_block2_tp(
    drafter, embed, lm_head, cache, anchor, start, pages, *, width, kv_len, mesh, temperature=None, seed=None
):
    """`models.drafter2.propose_block2` under drafter TP: (drafts [B, width-1] int32, candidate ids
    [B, width-1, K], q [B, width-1, K]); greedy walk when `temperature` is None, else per row temperature [B]
    (0 = argmax) and seed [B], with the same sample keys as the one-rank walk. Call inside `jax.jit`."""
    if drafter.cfg.arch != DFLASH2:
        raise ValueError("propose_block2_tp needs a DFlash2 drafter; use propose_block_tp for DFlash")
    drafts, ids, q = _tp_program(
        drafter,
        embed,
        lm_head,
        cache,
        anchor,
        start,
        pages,
        temperature,
        seed,
        width=width,
        kv_len=kv_len,
        mesh=mesh,
    )
    return drafts.astype(jnp.int32), ids.astype(jnp.int32), q
