"""A `SpecRunner`'s weights and caches on a mesh (`place_runner`, called once by its constructor when given a
mesh; the runner keeps what it returns).

* target: weights per the rules table (Megatron column/row/vocab-parallel), KV cache split on KV heads; the
  jitted steps then run as GSPMD programs over the mesh.
* drafter, `draft_tp == 1`: weights and cache replicated (every rank runs the whole drafter).
* drafter, `draft_tp == world`: weights split by heads/MLP, cache by KV heads, LM head by vocab rows; the propose
  inside the step runs in `shard_map` over the mesh (`parallel.drafter_tp`; DFlash2's conv and selector weights
  stay replicated); the context K/V written by the steps shard by heads under GSPMD (k/v projections
  column-parallel into a head-split cache, no collective).
"""

from __future__ import annotations

from typing import Any, NamedTuple

from flax import nnx
from jax.sharding import Mesh

from dflash_jax.parallel.drafter_tp import drafter_specs, lm_head_spec, place_drafter_tp, resolve_draft_tp
from dflash_jax.parallel.mesh import check_tp_heads, tp_size_of
from dflash_jax.parallel.rules import replicate, shard_kv_cache, shard_state


class Placed(NamedTuple):
    """A runner's weights and caches on the mesh, and how its drafter runs there."""

    tstate: Any
    dstate: Any  # None without a drafter
    embed: Any
    lm_head: Any
    draft_lm_head: Any
    tcache: Any
    dcache: Any
    draft_tp: int  # the drafter's ranks (1: replicated)
    draft_mesh: Mesh | None  # the drafter's `shard_map` mesh, or None when it is replicated


def place_runner(
    mesh: Mesh,
    draft_tp: str | int | None,
    cfg: Any,
    target: tuple[Any, Any],
    drafter: tuple[Any, Any],
    heads: tuple[Any, Any],
    caches: tuple[Any, Any],
) -> Placed:
    """The runner's weights and caches placed on `mesh`: `target` = (graph, state) of the target (config `cfg`),
    `drafter` = (graph, state) of the drafter (both None without one), `heads` = (the target's LM head, the array
    its state holds; the drafter's copy, that same array when not quantized apart), `caches` = (target, drafter)
    K/V. `draft_tp`: `--draft-tp-size`. UserError for a bad `--tp-size` / `--draft-tp-size`."""
    (tgraph, tstate), (dgraph, dstate), (lm_head, draft_lm_head), (tcache, dcache) = target, drafter, heads, caches
    speculative = dstate is not None
    tp = tp_size_of(mesh)
    check_tp_heads(tp, cfg.num_heads, cfg.num_kv_heads)
    dcfg = nnx.merge(dgraph, dstate).cfg if speculative else None
    n = resolve_draft_tp(draft_tp, tp, dcfg)  # validated even without a drafter (a mis-set flag is refused)
    shared_head = draft_lm_head is lm_head  # else a quantized copy per --draft-weight-quantization
    if speculative and n > 1:  # refuse a drafter that does not split before moving any weight
        drafter_specs(dstate, mesh)
        lm_head_spec(draft_lm_head, mesh)
    tstate = shard_state(tstate, mesh)
    tcache = shard_kv_cache(tcache, mesh)
    target = nnx.merge(tgraph, tstate)
    embed, lm_head = target.embed[...], target.lm_head[...]
    draft_head = lm_head if shared_head else draft_lm_head
    draft_mesh = None
    if speculative and n > 1:
        dstate, dcache, draft_head, embed = place_drafter_tp(dstate, dcache, draft_head, embed, mesh)
        draft_mesh = mesh
    elif speculative:
        dstate = shard_state(dstate, mesh, replicate=True)
        dcache = shard_kv_cache(dcache, mesh, replicate=True)
        if not shared_head:
            draft_head = replicate(draft_head, mesh)
    return Placed(tstate, dstate, embed, lm_head, draft_head, tcache, dcache, n if speculative else 1, draft_mesh)
