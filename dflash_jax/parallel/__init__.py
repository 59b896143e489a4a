"""Tensor parallelism over a device mesh.

* `mesh.make_mesh(tp_size)`: a 1-D `("tp",)` mesh with `AxisType.Auto` (`--tp-size`).
* `rules`: the one logical-axis -> mesh-axis table (`RULES`), `logical_to_spec`, `shard_state` (NNX params placed
  from their `out_sharding` metadata, quantized weights included) and `shard_kv_cache` (split on KV heads).
* `drafter_tp`: `--draft-tp-size` resolution and the drafter's propose (DFlash and DFlash2) in `jax.shard_map`
  (2 psums per layer, one all-gather of per-rank top-16 candidates); placing a runner on a mesh is
  `spec_decode.placement`.
* `distributed.init_distributed`: multi-host start-up (`jax.distributed.initialize`).
"""

from dflash_jax.parallel.distributed import init_distributed, is_leader
from dflash_jax.parallel.drafter_tp import propose_block2_tp, propose_block_tp, resolve_draft_tp
from dflash_jax.parallel.mesh import TP, make_mesh
from dflash_jax.parallel.rules import RULES, logical_to_spec, shard_kv_cache, shard_state

__all__ = [
    "RULES",
    "TP",
    "init_distributed",
    "is_leader",
    "logical_to_spec",
    "make_mesh",
    "propose_block2_tp",
    "propose_block_tp",
    "resolve_draft_tp",
    "shard_kv_cache",
    "shard_state",
]
