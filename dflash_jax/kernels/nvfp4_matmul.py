"""NVFP4 weight-only dequant-matmul (W4A16): `y = x @ (e2m1(codes) * block_scale * global).T`.

* `nvfp4_matmul_reference` — pure jnp: dequantize with the global scale folded into one f32 scale per block,
  one `dot_general` at HIGHEST precision; the oracle.
* `nvfp4_matmul` — `pl.pallas_call` + BlockSpec kernel: grid over output tiles `(M/bm, N/bn)`, each program
  walks K in `block_k` steps. Per step it loads the packed uint8 tile `[bn, bk/2]` and the E4M3 block scales
  `[bn, bk/16]`, decodes the nibbles arithmetically (sign = bit 3, exponent = bits 1-2, mantissa = bit 0; no
  table), multiplies by the block scale (exact in bf16/f32: E2M1 x E4M3 has <= 5 significant bits),
  accumulates `x @ w.T` in f32 (IEEE f32 dot for f32 x, not TF32), and multiplies by the per-tensor global
  scale once at the end.
  `unpack="interleave"` rebuilds the `[bn, bk]` tile (join + reshape, one dot); `unpack="split"` keeps the
  even/odd halves apart and contracts them with x's even/odd columns (two dots, x split in the wrapper).
* `Nvfp4MatmulConfig` — frozen block sizes; `select_config` picks one from a small tuned table.

Shapes that are not multiples of the tile are zero-padded (code 0 and scale 0 decode to 0).
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

UNPACK_MODES = ("interleave", "split")


NVFP4_BLOCK = 16  # weights per block scale along K


def decode_e2m1(codes: jax.Array) -> jax.Array:
    """Arithmetic E2M1 decode of integer codes 0..15 (any int dtype) to f32; no table lookup.

    magnitude = m/2 for exponent 0 (0, 0.5), else (2 + m) * 2^e / 4 (1, 1.5, 2, 3, 4, 6); sign = bit 3.
    """
    c = codes.astype(jnp.int32)
    m = (c & 1).astype(jnp.float32)
    e = (c >> 1) & 3
    pow2 = jnp.left_shift(jnp.int32(1), e).astype(jnp.float32)
    mag = jnp.where(e == 0, m * 0.5, (m + 2.0) * pow2 * 0.25)
    return jnp.where((c & 8) != 0, -mag, mag)


@dataclasses.dataclass(frozen=True)
class Nvfp4MatmulConfig:
    """Tile sizes (powers of two; block_k >= 32) and Triton launch parameters."""

    block_m: int = 64
    block_n: int = 128
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 3
    unpack: str = "interleave"

    def __post_init__(self):
        if self.unpack not in UNPACK_MODES:
            raise ValueError(f"unpack must be one of {UNPACK_MODES}, got {self.unpack!r}")
        if self.block_k % (2 * NVFP4_BLOCK):
            raise ValueError(f"block_k must be a multiple of {2 * NVFP4_BLOCK}, got {self.block_k}")


# Tuned table: (max M, config) for GPU; first row whose bound >= M wins. See benchmarks/results for the sweep.
# H200 sweep, benchmarks/results/gpu_kernels_h200.json (N=K=4096, bf16 x, on-device `dev_us` from a 50-call loop;
# the wall-clock `ms` is host-dispatch bound and noisy): M=16: 16x32x256 interleave 28 us vs 51 us for 16x64x128;
# M=128: 64x64x128 68 us vs 123 us for 128x128x64 with 8 warps. "split" is at best within ~2% of "interleave"
# (usually slower).
TUNED_GPU: tuple[tuple[int, Nvfp4MatmulConfig], ...] = (
    (16, Nvfp4MatmulConfig(block_m=16, block_n=32, block_k=256, num_warps=4, num_stages=4)),
    (1 << 30, Nvfp4MatmulConfig(block_m=64, block_n=64, block_k=128, num_warps=4, num_stages=4)),
)
# Interpret mode costs ~1 ms per grid step: use big tiles so CPU tests take a few steps.
INTERPRET_CONFIG = Nvfp4MatmulConfig(block_m=256, block_n=512, block_k=512)


def select_config(m: int, n: int, k: int, *, interpret: bool = False) -> Nvfp4MatmulConfig:
    """Pick block sizes for an `[m, k] @ [n, k].T` product (table lookup on m, shrunk to the shape)."""
    del n, k
    if interpret:
        return INTERPRET_CONFIG
    for bound, cfg in TUNED_GPU:
        if m <= bound:
            return cfg
    return TUNED_GPU[-1][1]


def nvfp4_matmul_reference(
    x: jax.Array, packed: jax.Array, block_scale: jax.Array, global_scale: jax.Array, *, out_dtype: Any = None
) -> jax.Array:
    """Pure-jnp oracle. `x [M, K]` with K <= Kp = 2 * packed.shape[1]; `[M, N]` in `out_dtype` (x's dtype)."""
    n, half = packed.shape
    codes = jnp.stack([packed & 0xF, packed >> 4], axis=-1).reshape(n, 2 * half)
    folded = block_scale.astype(jnp.float32) * jnp.asarray(global_scale, jnp.float32)  # [N, Kp/16]
    w = decode_e2m1(codes) * jnp.repeat(folded, NVFP4_BLOCK, axis=1)
    k = x.shape[-1]
    y = lax.dot_general(
        x.astype(jnp.float32),
        w[:, :k],
        (((x.ndim - 1,), (1,)), ((), ())),
        precision=lax.Precision.HIGHEST,
        preferred_element_type=jnp.float32,
    )
    return y.astype(out_dtype or x.dtype)


def _scales_tile(s_ref, kk, bk: int, width: int):
    """Block scales for K step `kk`, broadcast along K to `width` columns (f32)."""
    nb = bk // NVFP4_BLOCK
    s = s_ref[:, pl.ds(pl.multiple_of(kk * nb, nb), nb)].astype(jnp.float32)  # [bn, bk/16]
    rep = width // nb
    return jnp.broadcast_to(s[:, :, None], (s.shape[0], nb, rep)).reshape(s.shape[0], width)


def _nvfp4_kernel_interleave(x_ref, p_ref, s_ref, g_ref, o_ref, *, block_k: int, num_k: int):
    bm, bn = o_ref.shape
    half = block_k // 2

    def body(kk, acc):
        x = x_ref[:, pl.ds(pl.multiple_of(kk * block_k, block_k), block_k)]
        p = p_ref[:, pl.ds(pl.multiple_of(kk * half, half), half)].astype(jnp.int32)  # [bn, bk/2]
        lo, hi = decode_e2m1(p & 0xF), decode_e2m1(p >> 4)
        w = jnp.stack([lo, hi], axis=-1).reshape(bn, block_k)  # even k = low nibble
        w = (w * _scales_tile(s_ref, kk, block_k, block_k)).astype(x.dtype)
        return acc + lax.dot_general(
            x, w, (((1,), (1,)), ((), ())), precision=dot_precision(x.dtype), preferred_element_type=jnp.float32
        )

    acc = lax.fori_loop(0, num_k, body, jnp.zeros((bm, bn), jnp.float32))
    o_ref[...] = (acc * g_ref[...].astype(jnp.float32)).astype(o_ref.dtype)


def _nvfp4_kernel_split(xe_ref, xo_ref, p_ref, s_ref, g_ref, o_ref, *, block_k: int, num_k: int):
    bm, bn = o_ref.shape
    half = block_k // 2

    def body(kk, acc):
        sl = pl.ds(pl.multiple_of(kk * half, half), half)
        xe, xo = xe_ref[:, sl], xo_ref[:, sl]  # x[:, 0::2], x[:, 1::2] for this K step
        p = p_ref[:, sl].astype(jnp.int32)
        s = _scales_tile(s_ref, kk, block_k, half)
        w_lo = (decode_e2m1(p & 0xF) * s).astype(xe.dtype)
        w_hi = (decode_e2m1(p >> 4) * s).astype(xe.dtype)
        dims, prec = (((1,), (1,)), ((), ())), dot_precision(xe.dtype)
        acc = acc + lax.dot_general(xe, w_lo, dims, precision=prec, preferred_element_type=jnp.float32)
        return acc + lax.dot_general(xo, w_hi, dims, precision=prec, preferred_element_type=jnp.float32)

    acc = lax.fori_loop(0, num_k, body, jnp.zeros((bm, bn), jnp.float32))
    o_ref[...] = (acc * g_ref[...].astype(jnp.float32)).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("config", "interpret", "out_dtype"))
def nvfp4_matmul(
    x: jax.Array,
    packed: jax.Array,
    block_scale: jax.Array,
    global_scale: jax.Array,
    *,
    config: Nvfp4MatmulConfig | None = None,
    interpret: bool = False,
    out_dtype: Any = None,
) -> jax.Array:
    """`x [M, K] @ dequant(packed [N, Kp/2], block_scale [N, Kp/16], global).T -> [M, N]` (Pallas).

    f32 accumulation; the output has `out_dtype` (default: x's dtype).
    K may be smaller than Kp (the true K of a padded weight); x is zero-padded up to the tile.
    """
    m, k = x.shape
    n, half_p = packed.shape
    kw = 2 * half_p
    if not (kw - NVFP4_BLOCK < k <= kw) or block_scale.shape != (n, kw // NVFP4_BLOCK):
        raise ValueError(
            f"nvfp4_matmul: x has K={k}, weight packed {packed.shape} / scales {block_scale.shape} (padded K={kw})"
        )
    cfg = config or select_config(m, n, k, interpret=interpret)
    bm, bn = fit_block(m, cfg.block_m), fit_block(n, cfg.block_n)
    bk = fit_block(kw, cfg.block_k, minimum=2 * NVFP4_BLOCK)
    mp, np_, kp = round_up(m, bm), round_up(n, bn), round_up(kw, bk)
    pp = pad2d(packed, np_, kp // 2)
    sp = pad2d(block_scale, np_, kp // NVFP4_BLOCK)
    g = jnp.asarray(global_scale, jnp.float32).reshape(1, 1)
    xp = pad2d(x, mp, kp)
    grid = (mp // bm, np_ // bn)
    w_specs = [
        pl.BlockSpec((bn, kp // 2), lambda i, j: (j, 0)),
        pl.BlockSpec((bn, kp // NVFP4_BLOCK), lambda i, j: (j, 0)),
        pl.BlockSpec((1, 1), lambda i, j: (0, 0)),
    ]
    if cfg.unpack == "split":
        kernel = functools.partial(_nvfp4_kernel_split, block_k=bk, num_k=kp // bk)
        x_specs = [pl.BlockSpec((bm, kp // 2), lambda i, j: (i, 0))] * 2
        x_args = (xp[:, 0::2], xp[:, 1::2])
    else:
        kernel = functools.partial(_nvfp4_kernel_interleave, block_k=bk, num_k=kp // bk)
        x_specs = [pl.BlockSpec((bm, kp), lambda i, j: (i, 0))]
        x_args = (xp,)
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((mp, np_), out_dtype or x.dtype),
        grid=grid,
        in_specs=[*x_specs, *w_specs],
        out_specs=pl.BlockSpec((bm, bn), lambda i, j: (i, j)),
        interpret=interpret,
        compiler_params=None if interpret else triton_params(cfg.num_warps, cfg.num_stages),
        name=f"nvfp4_matmul_{cfg.unpack}",
    )(*x_args, pp, sp, g)
    return out[:m, :n] if (mp, np_) != (m, n) else out


def nvfp4_matmul_any(
    x: jax.Array, packed: jax.Array, block_scale: jax.Array, global_scale: jax.Array, **kw: Any
) -> jax.Array:
    """`nvfp4_matmul` for x of any leading shape `[..., K]`."""
    lead = x.shape[:-1]
    y = nvfp4_matmul(x.reshape(-1, x.shape[-1]), packed, block_scale, global_scale, **kw)
    return y.reshape(*lead, packed.shape[0])
