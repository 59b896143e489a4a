"""Small shape helpers shared by the Pallas kernels."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

# tl.dot needs every tile dimension >= 16 on the Triton backend.
MIN_TILE = 16


def round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def fit_block(dim: int, block: int, minimum: int = MIN_TILE) -> int:
    """Shrink a (power-of-two) block to the dimension it tiles, keeping a power of two >= `minimum`."""
    return max(minimum, min(block, next_pow2(dim)))


def pad2d(a: jax.Array, rows: int, cols: int, value: float | int = 0) -> jax.Array:
    """Pad a 2-D array at the end to `(rows, cols)`; no copy when it already has that shape."""
    r, c = a.shape
    if (r, c) == (rows, cols):
        return a
    return jnp.pad(a, ((0, rows - r), (0, cols - c)), constant_values=jnp.asarray(value, a.dtype))


def dot_precision(dtype) -> lax.Precision | None:
    """Precision for an in-kernel `dot_general` whose operands have `dtype`.

    f32 operands ask for HIGHEST: the Pallas Triton lowering maps DEFAULT/HIGH to TF32 tensor-core dots
    (~2e-4 relative error on an H200) and HIGHEST to IEEE f32. Other dtypes (bf16) keep the default, which
    is exact on their products with f32 accumulation.
    """
    return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


def triton_params(num_warps: int, num_stages: int):
    """Triton compiler params (select the Triton lowering on GPU; ignored in interpret mode).

    JAX >= 0.8 lowers a bare `pl.pallas_call` to Mosaic GPU by default; these kernels are written for the
    portable Triton lowering (one program per output tile, K reduced inside the kernel), so they ask for it.
    """
    from jax.experimental.pallas import triton as pltriton

    return pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)
