"""Row surgery on quantized `[out, in]` weights, as the fused projections need it: stacking several weights' rows
in a chosen order into one weight (q|k|v, gate|up) and taking rows back out (the checkpoint's tensors, the
context path's k|v rows).

* FP8-row: the codes and the per-row scales move with their rows, so stacking and taking are exact.
* NVFP4: codes and block scales move with their rows; the global scale is one per tensor. Weights whose global
  scales are equal stack exactly. Weights with differing global scales have no exact common representation
  (their block scales would have to be rescaled in E4M3), so they are requantized: dequantized (exact), stacked,
  and quantized again with the stacked tensor's global scale. `stack_rows` says which happened. Taking rows keeps
  the global scale, so a stacked weight splits back exactly and the parts stack back exactly.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax.numpy as jnp
import numpy as np

from dflash_jax.quant.formats import Fp8RowWeight, Nvfp4Weight, dequantize_nvfp4, quantize_nvfp4

QuantizedWeight = Fp8RowWeight | Nvfp4Weight


def stack_rows(parts: Sequence[QuantizedWeight], order: np.ndarray | None = None) -> tuple[QuantizedWeight, bool]:
    """One weight holding the rows of `parts` (concatenated in the given order, then permuted by `order`: row i
    of the result is row `order[i]` of the concatenation). Returns (weight, exact): `exact` is False only when
    NVFP4 parts with differing global scales had to be requantized (see the module docstring). Every part must
    have the same format, K and backend."""
    first = parts[0]
    kinds = {type(p) for p in parts}
    if len(kinds) != 1:
        raise ValueError(f"stack_rows: parts mix formats {sorted(k.__name__ for k in kinds)}")
    if len({p.shape[1] for p in parts}) != 1:
        raise ValueError(f"stack_rows: parts differ in K: {[p.shape for p in parts]}")
    idx = None if order is None else jnp.asarray(order)

    def rows(arrays):
        a = jnp.concatenate([jnp.asarray(x) for x in arrays], axis=0)
        return a if idx is None else a[idx]

    if isinstance(first, Fp8RowWeight):
        return dataclasses.replace(first, q=rows([p.q for p in parts]), scale=rows([p.scale for p in parts])), True
    globals_ = [float(np.asarray(p.global_scale)) for p in parts]
    if all(g == globals_[0] for g in globals_):
        packed, block = rows([p.packed for p in parts]), rows([p.block_scale for p in parts])
        return dataclasses.replace(first, packed=packed, block_scale=block), True
    dense = rows([dequantize_nvfp4(p, jnp.float32) for p in parts])
    return dataclasses.replace(quantize_nvfp4(dense), backend=first.backend), False


def map_rows(w: QuantizedWeight, fn) -> QuantizedWeight:
    """`w` with `fn` applied to each of its per-row arrays (codes and row or block scales, which share the row
    axis); an NVFP4 global scale kept."""
    if isinstance(w, Fp8RowWeight):
        return dataclasses.replace(w, q=fn(w.q), scale=fn(w.scale))
    return dataclasses.replace(w, packed=fn(w.packed), block_scale=fn(w.block_scale))


def take_rows(w: QuantizedWeight, rows: np.ndarray) -> QuantizedWeight:
    """The weight made of rows `rows` of `w` (scales with their rows; an NVFP4 global scale kept)."""
    idx = jnp.asarray(rows)
    return map_rows(w, lambda a: a[idx])


def row_block_slice(w: QuantizedWeight, block: int, lo: int, hi: int) -> QuantizedWeight:
    """Rows `lo:hi` of every consecutive block of `block` rows of `w` (e.g. every KV head's key and value rows of a
    fused q|k|v): a reshape and a static slice, no gather, so the jitted step reads the rows where they lie."""

    def cut(a):
        a = jnp.asarray(a)
        return a.reshape(-1, block, *a.shape[1:])[:, lo:hi].reshape(-1, *a.shape[1:])

    return map_rows(w, cut)


def qkv_row_order(num_kv_heads: int, group: int, head_dim: int) -> np.ndarray:
    """Rows of the concatenation [q; k; v] (`[out, in]`, query head h of KV head h // group) in the fused q|k|v
    order: per KV head its `group` query heads, then its key head, then its value head (`models.layers.fuse_qkv`
    flattened), so that a contiguous split by KV heads keeps each KV head's queries with it."""
    q_dim = num_kv_heads * group * head_dim
    kv_dim = num_kv_heads * head_dim
    q = np.arange(q_dim).reshape(num_kv_heads, group, head_dim)
    k = q_dim + np.arange(kv_dim).reshape(num_kv_heads, 1, head_dim)
    v = q_dim + kv_dim + np.arange(kv_dim).reshape(num_kv_heads, 1, head_dim)
    return np.concatenate([q, k, v], axis=1).reshape(-1)


def gate_up_row_order(intermediate: int) -> np.ndarray:
    """Rows of the concatenation [gate; up] in the fused gate|up order: gate row i then up row i, for every i, so
    that a contiguous split keeps each intermediate unit's gate and up rows together."""
    i = np.arange(intermediate)
    return np.stack([i, intermediate + i], axis=1).reshape(-1)
