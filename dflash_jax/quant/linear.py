"""One entry point for every linear layer: `linear(x, w)`, dispatching on the weight's type.

* plain array `[N, K]`  -> `dot_general` contracting x's last dim with w's dim 1 (HF layout, y = x @ W.T);
* `DenseRows`           -> the same product as `w · xᵀ`, kept `[N, tokens]` (XLA:CPU's fast layout for few tokens);
* `Fp8RowWeight`        -> dequant-matmul (XLA: cast E4M3 to x's dtype, dot with f32 accumulation, row scale);
* `Nvfp4Weight`         -> dequant-matmul (XLA: decode + block scale, dot, global scale; Pallas kernels).

A quantized weight names its own backend (`w.backend`): "xla", "pallas" (GPU, Triton lowering) or
"interpret" (the same kernel interpreted: CPU tests; `kernels.backends`). Plain arrays always use XLA.
`resolve_kernel_backend` maps the `--kernel-backend auto|xla|pallas` flag to one of these; `with_backend` puts it
on the weights.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from dflash_jax.kernels.backends import KERNEL_BACKEND_FLAGS, resolve_backend
from dflash_jax.kernels.fp8_matmul import fp8_matmul_any
from dflash_jax.kernels.nvfp4_matmul import nvfp4_matmul_any
from dflash_jax.quant.formats import NVFP4_BLOCK, DenseRows, Fp8RowWeight, Nvfp4Weight, decode_e2m1, unpack_nibbles


def resolve_kernel_backend(flag: str = "auto", platform: str | None = None) -> str:
    """Map `--kernel-backend` to a quantized weight's backend (see `with_backend`): `auto` = Pallas on GPU, XLA
    elsewhere (CPU, TPU); `pallas` off a GPU runs the kernels interpreted (correct but slow; meant for
    debugging). `platform` defaults to `jax.default_backend()`."""
    return resolve_backend(flag, choices=KERNEL_BACKEND_FLAGS, param="--kernel-backend", platform=platform)


def _contract_last(x: jax.Array, w: jax.Array, out_dtype: Any) -> jax.Array:
    """x [..., K] · w [N, K] over K with f32 accumulation."""
    return lax.dot_general(x, w, (((x.ndim - 1,), (1,)), ((), ())), preferred_element_type=out_dtype)


def rows_dot(x: jax.Array, w: jax.Array) -> jax.Array:
    """f32 x [..., K] · w [N, K] over K, computed as `w · xᵀ` [N, M] (f32 accumulation), materialized in that
    layout and then transposed (`DenseRows`: without the barrier XLA folds the transpose into the dot and picks the
    slow GEMM)."""
    lead = x.shape[:-1]
    y = lax.dot_general(w, x.reshape(-1, x.shape[-1]), (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    return lax.optimization_barrier(y).T.reshape(*lead, w.shape[0])


def _linear_fp8_xla(x: jax.Array, w: Fp8RowWeight) -> jax.Array:
    y = _contract_last(x, w.q.astype(x.dtype), jnp.float32)
    return (y * w.scale.astype(jnp.float32)).astype(x.dtype)


def _linear_nvfp4_xla(x: jax.Array, w: Nvfp4Weight) -> jax.Array:
    n = w.packed.shape[0]
    vals = decode_e2m1(unpack_nibbles(w.packed))  # [N, Kp]
    scales = jnp.repeat(w.block_scale.astype(jnp.float32), NVFP4_BLOCK, axis=1)
    wk = (vals * scales).reshape(n, -1)[:, : x.shape[-1]].astype(x.dtype)  # exact for bf16/f32
    y = _contract_last(x, wk, jnp.float32)
    return (y * jnp.asarray(w.global_scale, jnp.float32)).astype(x.dtype)


def _check_k(x: jax.Array, w: Any) -> None:
    if isinstance(w, Nvfp4Weight):
        kp = w.padded_k
        ok = kp - NVFP4_BLOCK < x.shape[-1] <= kp
    else:
        ok = x.shape[-1] == w.shape[1]
    if not ok:
        raise ValueError(
            f"linear: x has K={x.shape[-1]} but the weight is {type(w).__name__} of shape {tuple(w.shape)}"
        )


def linear(x: jax.Array, w: Any) -> jax.Array:
    """`y = x @ W.T` for x `[..., K]` and a weight `[N, K]` (plain, FP8-row or NVFP4); returns `[..., N]`.

    Works inside jit and for any leading shape. The output has x's dtype; accumulation is f32. Quantized weights
    run on their own `backend`. Under a K-sharded (row-parallel) `shard_map`, pass the local shards: x's last dim
    gives the local K.
    """
    _check_k(x, w)
    if isinstance(w, DenseRows):
        return rows_dot(x, w.w.astype(x.dtype)).astype(x.dtype)
    if isinstance(w, Fp8RowWeight):
        if w.backend == "xla":
            return _linear_fp8_xla(x, w)
        return fp8_matmul_any(x, w.q, w.scale, interpret=w.backend == "interpret")
    if isinstance(w, Nvfp4Weight):
        if w.backend == "xla":
            return _linear_nvfp4_xla(x, w)
        return nvfp4_matmul_any(x, w.packed, w.block_scale, w.global_scale, interpret=w.backend == "interpret")
    w = jnp.asarray(w)
    if w.dtype != x.dtype:
        w = w.astype(x.dtype)
    return _contract_last(x, w, jnp.float32).astype(x.dtype)
