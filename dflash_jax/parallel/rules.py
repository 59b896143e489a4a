"""The one table from logical axis names to mesh axes, and placement of weights and caches on the mesh.

Model parameters carry logical axis names of their dense `[in, out]` layout in the `out_sharding` metadata
(`dflash_jax.models.layers.ParamBuilder`). With `RULES` that gives the Megatron layout:

* q/k/v `("embed", "heads"|"kv_heads")` and gate/up `("embed", "mlp")`: column-parallel (`P(None, "tp")`);
* o `("heads", "embed")` and down `("mlp", "embed")`: row-parallel (`P("tp", None)`);
* embedding `("vocab", "embed")` and LM head `("embed", "vocab")`: vocab-parallel;
* norms, `fc` and anything on `embed` only: replicated.

`MeshPlacement` applies the same table while a checkpoint loads, so each tensor goes straight to its shards.

KV caches (page pools `[pages, kv_heads, page_size, head_dim]`) are sharded on the KV heads. Quantized weights
(`Fp8RowWeight`, `Nvfp4Weight`) are stored `[out, in]`, so their specs are the transposed ones, and their
per-row scales shard with their rows (block scales also with their K blocks; the NVFP4 global scale is replicated).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from dflash_jax.models.layers import Placement
from dflash_jax.parallel.mesh import TP
from dflash_jax.quant.formats import NVFP4_BLOCK, Fp8RowWeight, Nvfp4Weight

# Logical axis name -> mesh axis (None = replicated). The only place this mapping is written down.
RULES: Mapping[str, str | None] = {
    "vocab": TP,
    "heads": TP,
    "kv_heads": TP,
    "mlp": TP,
    "embed": None,
    "batch": None,
    "seq": None,
    "head_dim": None,
}

# Logical axes of one KV-cache page pool (target and drafter): [pages, kv_heads, page_size, head_dim].
KV_CACHE_AXES: tuple[str | None, ...] = ("batch", "kv_heads", "seq", "head_dim")


class ShardingError(ValueError):
    """A dimension that must be split over the mesh does not divide (only raised with `strict=True`)."""


def _mesh_axis(name: str | None, rules: Mapping[str, str | None]) -> str | None:
    if name is None:
        return None
    if name not in rules:
        raise KeyError(f"logical axis {name!r} has no sharding rule (known: {', '.join(sorted(rules))})")
    return rules[name]


def logical_to_spec(
    axes: Sequence[str | None],
    shape: Sequence[int] | None = None,
    mesh: Mesh | None = None,
    *,
    rules: Mapping[str, str | None] = RULES,
    strict: bool = False,
    block: Sequence[int] | None = None,
) -> P:
    """PartitionSpec for logical `axes`. With `shape` and `mesh`, a dimension whose size does not divide by its
    mesh axis (times `block[i]`, the granule that must stay whole on one rank) is replicated instead, or raises
    `ShardingError` when `strict`. A mesh axis of size 1 is dropped."""
    out: list[str | None] = []
    for i, name in enumerate(axes):
        ax = _mesh_axis(name, rules)
        if ax is not None and mesh is not None:
            n = int(mesh.shape[ax])
            if n == 1:
                ax = None
            elif shape is not None:
                g = n * (block[i] if block is not None else 1)
                if int(shape[i]) % g:
                    if strict:
                        raise ShardingError(
                            f"dimension {i} ({name}) of size {shape[i]} does not split into {n} equal parts"
                            + (f" of whole {block[i]}-blocks" if block is not None and block[i] > 1 else "")
                        )
                    ax = None
        out.append(ax)
    while out and out[-1] is None:
        out.pop()
    return P(*out)


def value_spec(
    axes: Sequence[str | None] | None,
    value: Any,
    mesh: Mesh | None = None,
    *,
    rules: Mapping[str, str | None] = RULES,
    strict: bool = False,
) -> Any:
    """Spec(s) for one parameter value: a PartitionSpec for an array, a pytree of specs (same structure) for a
    quantized weight. `axes` are the logical names of the dense `[in, out]` layout; None = replicated."""
    if axes is None:
        return jax.tree.map(lambda _: P(), value)
    if isinstance(value, Fp8RowWeight | Nvfp4Weight):
        if len(axes) != 2:
            raise ValueError(f"a quantized weight needs 2 logical axes, got {tuple(axes)}")
        k_ax, n_ax = axes  # dense [in, out] -> quantized [out, in]
        if isinstance(value, Fp8RowWeight):
            q = logical_to_spec((n_ax, k_ax), value.q.shape, mesh, rules=rules, strict=strict)
            return dataclasses.replace(value, q=q, scale=P(q[0]) if len(q) and q[0] is not None else P())
        # NVFP4: a rank's K slice must be whole 16-weight blocks (8 packed bytes, one block scale each), and a
        # padded K tail (K not a multiple of 16) would land on the last rank only, so it is never split.
        kp = value.padded_k
        k_mesh = _mesh_axis(k_ax, rules)
        if value.k != kp and k_mesh is not None and mesh is not None and int(mesh.shape[k_mesh]) > 1:
            if strict:
                raise ShardingError(
                    f"an NVFP4 weight with K={value.k} (not a multiple of {NVFP4_BLOCK}) cannot be split along K"
                )
            k_ax = None
        pk = logical_to_spec(
            (n_ax, k_ax), (value.packed.shape[0], kp), mesh, rules=rules, strict=strict, block=(1, NVFP4_BLOCK)
        )
        return dataclasses.replace(value, packed=pk, block_scale=pk, global_scale=P())
    return logical_to_spec(tuple(axes), np.shape(value), mesh, rules=rules, strict=strict)


def _is_var(x: Any) -> bool:
    return isinstance(x, nnx.Variable)


def state_specs(
    state: Any,
    mesh: Mesh | None = None,
    *,
    replicate: bool = False,
    rules: Mapping[str, str | None] = RULES,
    strict: bool = False,
) -> list[P]:
    """One PartitionSpec per array leaf of an NNX state (in `jax.tree.leaves(state)` order), from each
    Variable's `out_sharding` metadata. `replicate=True` gives `P()` everywhere."""
    specs: list[P] = []
    for v in jax.tree.leaves(state, is_leaf=_is_var):
        if _is_var(v):
            value = v.get_value()
            axes = None if replicate else v.get_metadata().get("out_sharding")
            sub = value_spec(axes, value, mesh, rules=rules, strict=strict)
        else:  # a bare array leaf (no metadata): replicated
            sub = jax.tree.map(lambda _: P(), v)
        specs.extend(jax.tree.leaves(sub, is_leaf=lambda s: isinstance(s, P)))
    n = len(jax.tree.leaves(state))
    if len(specs) != n:  # pragma: no cover - a pytree type whose leaves we do not know
        raise ValueError(f"state has {n} array leaves but {len(specs)} specs were derived")
    return specs


def put(x: Any, sharding: NamedSharding) -> jax.Array:
    """`device_put` that also works when the sharding spans other processes' devices (multi-host): every
    process passes the same full value and keeps the shards it owns."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:  # already global: reshard on the devices
        if x.sharding.is_equivalent_to(sharding, x.ndim):
            return x
        return jax.jit(lambda a: a, out_shardings=sharding)(x)
    if sharding.is_fully_addressable:
        return jax.device_put(x, sharding)
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])


class MeshPlacement(Placement):
    """Loading straight onto a mesh: each parameter's sharding from its logical axes by the rules table (as
    `shard_state` places a built state), each host tensor put with `put` (multi-host: every process passes the
    full tensor and keeps its own shards)."""

    def __init__(self, mesh: Mesh, rules: Mapping[str, str | None] = RULES):
        self.mesh = mesh
        self.rules = rules

    def sharding(self, axes, shape) -> NamedSharding:
        return NamedSharding(self.mesh, logical_to_spec(tuple(axes), shape, self.mesh, rules=self.rules))

    def put(self, x, sharding) -> jax.Array:
        return put(x, sharding)


def shard_tree(tree: Any, specs: Sequence[P], mesh: Mesh) -> Any:
    """Place each array leaf of `tree` with `NamedSharding(mesh, spec)` (specs in leaf order)."""
    leaves, treedef = jax.tree.flatten(tree)
    if len(leaves) != len(specs):
        raise ValueError(f"{len(leaves)} leaves but {len(specs)} specs")
    return jax.tree.unflatten(treedef, [put(x, NamedSharding(mesh, s)) for x, s in zip(leaves, specs, strict=True)])


def shard_state(state: Any, mesh: Mesh, *, replicate: bool = False, strict: bool = False) -> Any:
    """An NNX state with every parameter placed on `mesh` per the rules (or replicated)."""
    return shard_tree(state, state_specs(state, mesh, replicate=replicate, strict=strict), mesh)


def state_shardings(state: Any, mesh: Mesh, *, replicate: bool = False) -> list[NamedSharding]:
    """The NamedShardings `shard_state` would use, in leaf order."""
    return [NamedSharding(mesh, s) for s in state_specs(state, mesh, replicate=replicate)]


def kv_cache_spec(shape: Sequence[int] | None = None, mesh: Mesh | None = None, *, strict: bool = False) -> P:
    """Spec of one cache page pool (KV heads on axis 1): split on the KV heads."""
    return logical_to_spec(KV_CACHE_AXES, shape, mesh, strict=strict)


def shard_kv_cache(cache: Any, mesh: Mesh, *, replicate: bool = False, strict: bool = False) -> Any:
    """Place every cache array (a tuple of per-layer `(k, v)`) on `mesh`, split on KV heads (or replicated)."""
    leaves = jax.tree.leaves(cache)
    specs = [P() if replicate else kv_cache_spec(x.shape, mesh, strict=strict) for x in leaves]
    return shard_tree(cache, specs, mesh)


def replicate(x: Any, mesh: Mesh) -> Any:
    """Every array leaf of `x` replicated on `mesh`."""
    return shard_tree(x, [P()] * len(jax.tree.leaves(x)), mesh)
