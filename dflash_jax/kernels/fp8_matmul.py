"""FP8 (E4M3, per-output-row f32 scale) weight-only dequant-matmul: `y = x @ (q * scale[:, None]).T`.

Three pieces, one numerics contract (f32 accumulation, output in x's dtype):
* `fp8_matmul_reference` — pure jnp (dequantize, then one `dot_general` at HIGHEST precision); the oracle.
* `fp8_matmul` — a `pl.pallas_call` + BlockSpec kernel: grid over output tiles `(M/bm, N/bn)`, each program
  walks K in `block_k` steps, casts the E4M3 tile to x's dtype in-kernel (exact for bf16/f32), accumulates
  in f32 and applies the row scale once at the end (it factors out of the K sum). f32 activations use an
  IEEE f32 dot (precision HIGHEST), not TF32. Runs on GPU through the
  Triton lowering, and on CPU with `interpret=True` (tests).
* `Fp8MatmulConfig` — frozen block sizes; `select_config` picks one from a small tuned table.

Shapes that are not multiples of the tile are zero-padded (K padding must be zero; M/N padding is cut off).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from dflash_jax.kernels._util import dot_precision, fit_block, pad2d, round_up, triton_params


@dataclasses.dataclass(frozen=True)
class Fp8MatmulConfig:
    """Tile sizes (powers of two, >= 16) and Triton launch parameters."""

    block_m: int = 64
    block_n: int = 128
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 3


# Tuned table: (max M, config) for GPU; first row whose bound >= M wins. See benchmarks/results for the sweep.
# H200 sweep, benchmarks/results/gpu_kernels_h200.json (N=K=4096, bf16 x, on-device `dev_us` from a 50-call loop;
# the wall-clock `ms` is host-dispatch bound and noisy): M=16: 16x32x256 19 us (at the loop's ~18 us floor) vs
# 23 us for 16x64x128; M=128: 64x64x128 39 us vs 85 us for 128x128x64 with 8 warps.
TUNED_GPU: tuple[tuple[int, Fp8MatmulConfig], ...] = (
    (16, Fp8MatmulConfig(block_m=16, block_n=32, block_k=256, num_warps=4, num_stages=4)),
    (1 << 30, Fp8MatmulConfig(block_m=64, block_n=64, block_k=128, num_warps=4, num_stages=4)),
)
# Interpret mode costs ~1 ms per grid step: use big tiles so CPU tests take a few steps.
INTERPRET_CONFIG = Fp8MatmulConfig(block_m=256, block_n=512, block_k=512)


def select_config(m: int, n: int, k: int, *, interpret: bool = False) -> Fp8MatmulConfig:
    """Pick block sizes for an `[m, k] @ [n, k].T` product (table lookup on m, shrunk to the shape)."""
    del n, k  # the table is keyed on M only; shapes are fitted in `fp8_matmul`.
    if interpret:
        return INTERPRET_CONFIG
    for bound, cfg in TUNED_GPU:
        if m <= bound:
            return cfg
    return TUNED_GPU[-1][1]


def fp8_matmul_reference(x: jax.Array, q: jax.Array, scale: jax.Array, *, out_dtype: Any = None) -> jax.Array:
    """Pure-jnp oracle: dequantize to f32, `x @ w.T` with f32 accumulation, in `out_dtype` (x's dtype)."""
    w = q.astype(jnp.float32) * scale.astype(jnp.float32)[:, None]
    y = lax.dot_general(
        x.astype(jnp.float32),
        w,
        (((x.ndim - 1,), (1,)), ((), ())),
        precision=lax.Precision.HIGHEST,
        preferred_element_type=jnp.float32,
    )
    return y.astype(out_dtype or x.dtype)


def _fp8_kernel(x_ref, q_ref, s_ref, o_ref, *, block_k: int, num_k: int):
    bm, bn = o_ref.shape

    def body(kk, acc):
        start = pl.multiple_of(kk * block_k, block_k)
        x = x_ref[:, pl.ds(start, block_k)]
        w = q_ref[:, pl.ds(start, block_k)].astype(x.dtype)  # in-kernel dequant (scale applied at the end)
        return acc + lax.dot_general(
            x, w, (((1,), (1,)), ((), ())), precision=dot_precision(x.dtype), preferred_element_type=jnp.float32
        )

    acc = lax.fori_loop(0, num_k, body, jnp.zeros((bm, bn), jnp.float32))
    o_ref[...] = (acc * s_ref[...].astype(jnp.float32)).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("config", "interpret", "out_dtype"))
def fp8_matmul(
    x: jax.Array,
    q: jax.Array,
    scale: jax.Array,
    *,
    config: Fp8MatmulConfig | None = None,
    interpret: bool = False,
    out_dtype: Any = None,
) -> jax.Array:
    """`x [M, K] @ dequant(q [N, K], scale [N]).T -> [M, N]`, f32 accumulation (Pallas).

    The output has `out_dtype` (default: x's dtype).
    """
    m, k = x.shape
    n, kq = q.shape
    if kq != k:
        raise ValueError(f"fp8_matmul: x has K={k} but the weight has K={kq}")
    cfg = config or select_config(m, n, k, interpret=interpret)
    bm, bn, bk = fit_block(m, cfg.block_m), fit_block(n, cfg.block_n), fit_block(k, cfg.block_k)
    mp, np_, kp = round_up(m, bm), round_up(n, bn), round_up(k, bk)
    xp = pad2d(x, mp, kp)
    qp = pad2d(q, np_, kp)
    sp = pad2d(scale.astype(jnp.float32).reshape(1, n), 1, np_, 1.0)
    kernel = functools.partial(_fp8_kernel, block_k=bk, num_k=kp // bk)
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((mp, np_), out_dtype or x.dtype),
        grid=(mp // bm, np_ // bn),
        in_specs=[
            pl.BlockSpec((bm, kp), lambda i, j: (i, 0)),
            pl.BlockSpec((bn, kp), lambda i, j: (j, 0)),
            pl.BlockSpec((1, bn), lambda i, j: (0, j)),
        ],
        out_specs=pl.BlockSpec((bm, bn), lambda i, j: (i, j)),
        interpret=interpret,
        compiler_params=None if interpret else triton_params(cfg.num_warps, cfg.num_stages),
        name="fp8_row_matmul",
    )(xp, qp, sp)
    return out[:m, :n] if (mp, np_) != (m, n) else out


def fp8_matmul_any(x: jax.Array, q: jax.Array, scale: jax.Array, **kw: Any) -> jax.Array:
    """`fp8_matmul` for x of any leading shape `[..., K]`."""
    lead = x.shape[:-1]
    y = fp8_matmul(x.reshape(-1, x.shape[-1]), q, scale, **kw)
    return y.reshape(*lead, q.shape[0])
