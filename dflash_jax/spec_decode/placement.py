"""Put a `SpecRunner`'s weights and caches on a mesh (called once, from its constructor, when given a mesh).

* target: weights per the rules table (Megatron column/row/vocab-parallel), KV cache split on KV heads; the
  jitted steps then run as GSPMD programs over the mesh.
* drafter, `draft_tp == 1`: weights and cache replicated (every rank runs the whole drafter).
* drafter, `draft_tp == world`: weights split by heads/MLP, cache by KV heads, LM head by vocab rows; the propose
  inside the step runs in `shard_map` over the mesh (`parallel.drafter_tp`; DFlash2's conv and selector weights
  stay replicated); the context K/V written by the steps shard by heads under GSPMD (k/v projections
  column-parallel into a head-split cache, no collective).
"""

from __future__ import annotations

from typing import Any

from flax import nnx
from jax.sharding import Mesh

from dflash_jax.parallel.drafter_tp import drafter_specs, lm_head_spec, place_drafter_tp, resolve_draft_tp
from dflash_jax.parallel.mesh import check_tp_heads, tp_size_of
from dflash_jax.parallel.rules import replicate, shard_kv_cache, shard_state


def place_runner(runner: Any, mesh: Mesh, draft_tp: str | int | None, tcache: Any, dcache: Any) -> tuple[Any, Any]:
    """Reassign `runner`'s weights to shardings on `mesh` and return the caches `tcache`, `dcache` placed; set
    `runner.draft_tp` (resolved rank count) and `runner.draft_mesh` (the drafter's `shard_map` mesh, or None when
    the drafter is replicated). UserError for a bad `--tp-size` / `--draft-tp-size`."""
    tp = tp_size_of(mesh)
    cfg = runner.cfg
    check_tp_heads(tp, cfg.num_heads, cfg.num_kv_heads)
    dcfg = nnx.merge(runner.dgraph, runner.dstate).cfg if runner.speculative else None
    n = resolve_draft_tp(draft_tp, tp, dcfg)  # validated even without a drafter (a mis-set flag is refused)
    shared_head = runner.draft_lm_head is runner.lm_head  # else a quantized copy per --draft-weight-quantization
    if runner.speculative and n > 1:  # refuse a drafter that does not split before moving any weight
        drafter_specs(runner.dstate, mesh)
        lm_head_spec(runner.draft_lm_head, mesh)
    runner.tstate = shard_state(runner.tstate, mesh)
    tcache = shard_kv_cache(tcache, mesh)
    target = nnx.merge(runner.tgraph, runner.tstate)
    runner.embed, runner.lm_head = target.embed[...], target.lm_head[...]
    draft_head = runner.lm_head if shared_head else runner.draft_lm_head
    runner.draft_tp = n if runner.speculative else 1
    if runner.speculative and n > 1:
        runner.dstate, dcache, draft_head, runner.embed = place_drafter_tp(
            runner.dstate, dcache, draft_head, runner.embed, mesh
        )
        runner.draft_mesh = mesh
    elif runner.speculative:
        runner.dstate = shard_state(runner.dstate, mesh, replicate=True)
        dcache = shard_kv_cache(dcache, mesh, replicate=True)
        if not shared_head:
            draft_head = replicate(draft_head, mesh)
    runner.draft_lm_head = draft_head
    return tcache, dcache
