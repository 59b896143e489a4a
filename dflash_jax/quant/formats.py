"""Quantized weight formats (pytrees) and their quantize / dequantize functions.

Weights are in HF layout `[N, K]` = `[out, in]`; a linear layer is `y = x @ W.T`.

* `Fp8RowWeight`: E4M3 codes `[N, K]` + one f32 scale per output row, `scale = max|row| / 448` (1 for an
  all-zero row). Values are clipped to ±448 before the cast, because the E4M3 cast does not saturate.
* `Nvfp4Weight`: E2M1 codes packed two per byte (low nibble = even k) `[N, Kp/2]`, one E4M3 block scale per
  16 consecutive weights along K `[N, Kp/16]`, and one f32 global scale per tensor,
  `global = amax(whole tensor) / (448 * 6)`. `Kp` is K rounded up to 16 (zero padding); the true K is kept
  as static metadata. Dequantized weight = `e2m1(code) * block_scale * global`.

Both are registered pytrees, so they pass through `jax.jit`, `jax.tree.map`, `nnx.Param`, `nnx.split/merge`
and sharding like plain arrays (shard `scale` / `block_scale` with the rows of the weight).

Each weight carries the kernel backend its matmuls run on (`backend`, static metadata: "xla", "pallas" or
"interpret", `kernels.backends`), so `quant.linear(x, w)` reads it from the weight; `with_backend` sets it (the
drafter's loader and `--draft-weight-quantization` do, from `--kernel-backend`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.kernels.backends import BACKENDS  # the kernel backends a quantized weight's matmuls run on
from dflash_jax.kernels.nvfp4_matmul import NVFP4_BLOCK, decode_e2m1  # the layout the kernel reads

FP8_MAX = 448.0  # largest finite float8_e4m3fn
E2M1_MAX = 6.0  # largest float4_e2m1fn

# E2M1 code -> value, code = sign(bit 3) | exponent(bits 1-2) | mantissa(bit 0). Used by tests and docs; the
# computations use the arithmetic decode below (no gather, kernel friendly).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def _backend_field():
    return dataclasses.field(default="xla", metadata=dict(static=True), kw_only=True)


def _check_backend(w: Any) -> None:
    if w.backend not in BACKENDS:
        raise ValueError(f"{type(w).__name__}: backend must be one of {BACKENDS}, got {w.backend!r}")


def _ellipsis_getitem(self, idx):
    """`w[...]` is the weight itself, so `param[...]` on an `nnx.Param` holding it works as for arrays."""
    if idx is Ellipsis:
        return self
    raise TypeError(f"{type(self).__name__} supports only [...] indexing; dequantize() it first")


@dataclasses.dataclass(frozen=True)
class Fp8RowWeight:
    """FP8 E4M3 weight with one f32 scale per output row: `w[n, k] ≈ q[n, k] * scale[n]`."""

    q: Any  # float8_e4m3fn [N, K]
    scale: Any  # float32 [N]
    backend: str = _backend_field()

    __post_init__ = _check_backend

    @property
    def shape(self) -> tuple[int, int]:
        """Logical (dequantized) shape `(N, K)`."""
        return (int(self.q.shape[0]), int(self.q.shape[1]))

    @property
    def nbytes(self) -> int:
        return _nbytes(self.q) + _nbytes(self.scale)

    def dequantize(self, dtype: Any = jnp.float32) -> jax.Array:
        return dequantize_fp8_row(self, dtype)

    __getitem__ = _ellipsis_getitem


@dataclasses.dataclass(frozen=True)
class Nvfp4Weight:
    """NVFP4 weight: packed E2M1 codes, E4M3 scale per 16 weights along K, f32 global scale per tensor."""

    packed: Any  # uint8 [N, Kp/2], low nibble = even k
    block_scale: Any  # float8_e4m3fn [N, Kp/16]
    global_scale: Any  # float32 []
    k: int = dataclasses.field(metadata=dict(static=True))  # true K (Kp = k rounded up to 16)
    backend: str = _backend_field()

    __post_init__ = _check_backend

    @property
    def padded_k(self) -> int:
        return int(self.packed.shape[1]) * 2

    @property
    def shape(self) -> tuple[int, int]:
        """Logical (dequantized) shape `(N, K)`."""
        return (int(self.packed.shape[0]), min(self.k, self.padded_k))

    @property
    def nbytes(self) -> int:
        return _nbytes(self.packed) + _nbytes(self.block_scale) + _nbytes(self.global_scale)

    def dequantize(self, dtype: Any = jnp.float32) -> jax.Array:
        return dequantize_nvfp4(self, dtype)

    __getitem__ = _ellipsis_getitem


jax.tree_util.register_dataclass(Fp8RowWeight, data_fields=["q", "scale"], meta_fields=["backend"])
jax.tree_util.register_dataclass(
    Nvfp4Weight, data_fields=["packed", "block_scale", "global_scale"], meta_fields=["k", "backend"]
)

QuantizedWeight = Fp8RowWeight | Nvfp4Weight


@dataclasses.dataclass(frozen=True)
class DenseRows:
    """An unquantized weight stored `[out, in]` (`w` [N, K], N the flattened `out_shape`), read by `linear` as
    `w · xᵀ` with the product kept `[N, tokens]`: XLA:CPU runs that dot at memory speed for a few tokens, where
    `x @ W` of an `[in, out]` weight slows to a compute-bound GEMM from two tokens on (a γ-token verify then costs
    several decode steps; `models.layers.dense_rows_state` converts a model's weights, the runner does it on CPU).
    Same values as the `[in, out]` weight it came from; `out_shape` is the shape of one token's output (e.g. the
    fused q|k|v's `(kv_heads, g + 2, head_dim)`)."""

    w: Any  # [N, K]
    out_shape: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))

    @property
    def shape(self) -> tuple[int, int]:
        return (int(self.w.shape[0]), int(self.w.shape[1]))

    @property
    def dtype(self) -> Any:
        return self.w.dtype

    @property
    def nbytes(self) -> int:
        return _nbytes(self.w)

    __getitem__ = _ellipsis_getitem


jax.tree_util.register_dataclass(DenseRows, data_fields=["w"], meta_fields=["out_shape"])


def is_quantized(x: Any) -> bool:
    """True for a quantized weight (use as `is_leaf=` when mapping over params, e.g. dtype casts)."""
    return isinstance(x, Fp8RowWeight | Nvfp4Weight)


def is_rows(x: Any) -> bool:
    """True for a weight stored `[out, in]` that `quant.linear` reads: a quantized one or `DenseRows`."""
    return isinstance(x, Fp8RowWeight | Nvfp4Weight | DenseRows)


def with_backend(w: Any, backend: str) -> Any:
    """`w` with its matmuls on `backend` (every quantized weight in a pytree; plain arrays always use XLA)."""
    return jax.tree.map(
        lambda x: dataclasses.replace(x, backend=backend) if is_quantized(x) else x, w, is_leaf=is_quantized
    )


def _nbytes(a: Any) -> int:
    return int(np.prod(a.shape, dtype=np.int64)) * np.dtype(a.dtype).itemsize


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _check_2d(w: Any, what: str) -> None:
    if len(w.shape) != 2:
        raise ValueError(f"{what} expects a 2-D [N, K] weight, got shape {tuple(w.shape)}")


# ----------------------------------------------------------------------------------------------------- FP8


@jax.jit
def quantize_fp8_row(w: Any) -> Fp8RowWeight:
    """Quantize `w [N, K]` to E4M3 with one scale per row (`max|row| / 448`, 1 for an all-zero row)."""
    _check_2d(w, "quantize_fp8_row")
    w32 = jnp.asarray(w).astype(jnp.float32)
    amax = jnp.max(jnp.abs(w32), axis=1)
    scale = jnp.where(amax > 0, amax / FP8_MAX, 1.0).astype(jnp.float32)
    q = jnp.clip(w32 / scale[:, None], -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn)
    return Fp8RowWeight(q=q, scale=scale)


@functools.partial(jax.jit, static_argnames="dtype")
def dequantize_fp8_row(w: Fp8RowWeight, dtype: Any = jnp.float32) -> jax.Array:
    return (w.q.astype(jnp.float32) * w.scale.astype(jnp.float32)[:, None]).astype(dtype)


# --------------------------------------------------------------------------------------------------- NVFP4


def encode_e2m1(v: jax.Array) -> jax.Array:
    """Round f32 values to the nearest E2M1 code (ties to even, saturating at ±6); returns uint8 codes 0..15.

    Thresholds between grid points 0 .5 1 1.5 2 3 4 6 are .25 .75 1.25 1.75 2.5 3.5 5; a tie goes to the even
    code (mantissa bit 0), i.e. down at .25 1.25 2.5 5 and up at .75 1.75 3.5.
    """
    a = jnp.abs(v)
    code = (a > 0.25).astype(jnp.int32) + (a >= 0.75) + (a > 1.25) + (a >= 1.75) + (a > 2.5) + (a >= 3.5) + (a > 5.0)
    code = jnp.where(v < 0, code + 8, code)
    return code.astype(jnp.uint8)


def pack_nibbles(codes: jax.Array) -> jax.Array:
    """`uint8 [..., 2n]` codes (0..15) -> `uint8 [..., n]`, low nibble = even index."""
    c = codes.astype(jnp.uint8).reshape(*codes.shape[:-1], codes.shape[-1] // 2, 2)
    return (c[..., 0] | (c[..., 1] << 4)).astype(jnp.uint8)


def unpack_nibbles(packed: jax.Array) -> jax.Array:
    """`uint8 [..., n]` -> codes `uint8 [..., 2n]` (low nibble first)."""
    lo = packed & 0xF
    hi = packed >> 4
    return jnp.stack([lo, hi], axis=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def nvfp4_global_scale(w: Any) -> jax.Array:
    """Per-tensor global scale `amax / (448 * 6)` (1 if all zero); use the WHOLE unsharded tensor."""
    amax = jnp.max(jnp.abs(jnp.asarray(w).astype(jnp.float32)))
    return jnp.where(amax > 0, amax / (FP8_MAX * E2M1_MAX), 1.0).astype(jnp.float32)


@jax.jit
def quantize_nvfp4(w: Any, *, global_scale: Any = None) -> Nvfp4Weight:
    """Quantize `w [N, K]` to NVFP4.

    `global_scale` defaults to `nvfp4_global_scale(w)`; pass the whole tensor's global scale when quantizing a
    slice of it so that all slices share it. Block scale = E4M3(amax_block / (6 * global)); if rounding the
    block scale down would make the block's largest weight overflow ±6, the next E4M3 value up is used, so no
    weight is clipped and each dequantized weight is within half an E2M1 step (times its scale) of the input.
    """
    _check_2d(w, "quantize_nvfp4")
    w32 = jnp.asarray(w).astype(jnp.float32)
    n, k = w32.shape
    kp = _round_up(max(k, 1), NVFP4_BLOCK)
    if kp != k:
        w32 = jnp.pad(w32, ((0, 0), (0, kp - k)))
    g = nvfp4_global_scale(w32) if global_scale is None else jnp.asarray(global_scale, jnp.float32)
    blocks = w32.reshape(n, kp // NVFP4_BLOCK, NVFP4_BLOCK)
    bamax = jnp.max(jnp.abs(blocks), axis=-1)
    s8 = jnp.clip(bamax / (E2M1_MAX * g), 0.0, FP8_MAX).astype(jnp.float8_e4m3fn)
    # Bump a rounded-down scale to the next E4M3 value when the block would not fit in ±6 (0x7E = 448 is max).
    too_small = s8.astype(jnp.float32) * g * E2M1_MAX < bamax
    bits = jax.lax.bitcast_convert_type(s8, jnp.uint8)
    bits = jnp.where(too_small & (bits < 0x7E), bits + 1, bits).astype(jnp.uint8)
    s8 = jax.lax.bitcast_convert_type(bits, jnp.float8_e4m3fn)
    eff = s8.astype(jnp.float32) * g
    v = jnp.where(eff[..., None] > 0, blocks / jnp.where(eff > 0, eff, 1.0)[..., None], 0.0)
    codes = encode_e2m1(jnp.clip(v, -E2M1_MAX, E2M1_MAX)).reshape(n, kp)
    return Nvfp4Weight(packed=pack_nibbles(codes), block_scale=s8, global_scale=g, k=k)


def nvfp4_folded_scales(w: Nvfp4Weight) -> jax.Array:
    """Block scales with the global scale folded in: f32 `[N, Kp/16]` = block_scale * global."""
    return w.block_scale.astype(jnp.float32) * jnp.asarray(w.global_scale, jnp.float32)


@functools.partial(jax.jit, static_argnames="dtype")
def dequantize_nvfp4(w: Nvfp4Weight, dtype: Any = jnp.float32) -> jax.Array:
    """Dequantize to `[N, K]` (true K): `e2m1(code) * block_scale * global`."""
    n = w.packed.shape[0]
    vals = decode_e2m1(unpack_nibbles(w.packed))  # [N, Kp]
    scales = jnp.repeat(nvfp4_folded_scales(w), NVFP4_BLOCK, axis=1)  # [N, Kp]
    out = (vals * scales).reshape(n, -1)
    return out[:, : w.shape[1]].astype(dtype)


def dequantize(w: Any, dtype: Any = jnp.float32) -> jax.Array:
    """Dequantize any supported weight (a plain array is just cast)."""
    if isinstance(w, Fp8RowWeight):
        return dequantize_fp8_row(w, dtype)
    if isinstance(w, Nvfp4Weight):
        return dequantize_nvfp4(w, dtype)
    return jnp.asarray(w).astype(dtype)


def quantize(w: Any, fmt: str) -> Any:
    """Quantize `w` to `fmt` in {"fp8", "nvfp4"}."""
    if fmt == "fp8":
        return quantize_fp8_row(w)
    if fmt == "nvfp4":
        return quantize_nvfp4(w)
    raise ValueError(f"unknown weight format {fmt!r}; expected 'fp8' or 'nvfp4'")
