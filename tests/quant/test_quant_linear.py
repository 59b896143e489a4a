"""`linear()` dispatch (plain / FP8-row / NVFP4; XLA and Pallas-interpret) inside jit, the backend resolver,
and quantized weights inside Flax NNX `nnx.Param` (split/merge, jit)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dflash_jax.errors import UserError
from dflash_jax.quant import (
    Fp8RowWeight,
    Nvfp4Weight,
    linear,
    quantize_fp8_row,
    quantize_nvfp4,
    resolve_kernel_backend,
    with_backend,
)

pytestmark = pytest.mark.usefixtures("highest_matmul_precision")  # f32 results meet f32 references


def _np_dequant(w) -> np.ndarray:
    """Independent numpy dequantization (table decode for NVFP4)."""
    if isinstance(w, Fp8RowWeight):
        q = np.asarray(w.q).astype(np.float32).astype(np.float64)
        return q * np.asarray(w.scale, np.float64)[:, None]
    if isinstance(w, Nvfp4Weight):
        p = np.asarray(w.packed)
        codes = np.stack([p & 0xF, p >> 4], -1).reshape(p.shape[0], -1)
        table = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])
        bs = np.asarray(w.block_scale).astype(np.float32).astype(np.float64) * float(w.global_scale)
        return (table[codes] * np.repeat(bs, 16, axis=1))[:, : w.k]
    return np.asarray(w, np.float64)


@pytest.mark.parametrize("fmt", ["plain", "fp8", "nvfp4"])
@pytest.mark.parametrize("backend", ["xla", "interpret"])
def test_linear_dispatch_inside_jit(fmt, backend):
    rng = np.random.default_rng(0)
    k, n = 40, 24  # K not a multiple of 16: NVFP4 pads and remembers K
    x = jnp.asarray(rng.standard_normal((2, 3, k)), jnp.float32)
    w32 = jnp.asarray(rng.standard_normal((n, k)), jnp.float32)
    w = {"plain": w32, "fp8": quantize_fp8_row(w32), "nvfp4": quantize_nvfp4(w32)}[fmt]
    y = jax.jit(linear)(x, with_backend(w, backend))
    assert y.shape == (2, 3, n) and y.dtype == jnp.float32
    expected = np.asarray(x, np.float64) @ _np_dequant(w).T
    np.testing.assert_allclose(np.asarray(y), expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())
    if fmt != "plain":  # quantization really happened: close to, but not equal to, the f32 product
        dense = np.asarray(x, np.float64) @ np.asarray(w32, np.float64).T
        err = np.abs(np.asarray(y) - dense).max() / np.abs(dense).max()
        assert 1e-4 < err < (0.05 if fmt == "fp8" else 0.2)


def test_linear_keeps_bf16_activations_and_checks_k():
    x = jnp.ones((4, 32), jnp.bfloat16)
    w = quantize_fp8_row(jnp.ones((8, 32)))
    assert linear(x, w).dtype == jnp.bfloat16
    assert linear(x, quantize_nvfp4(jnp.ones((8, 32)))).dtype == jnp.bfloat16
    assert linear(x, jnp.ones((8, 32), jnp.float32)).dtype == jnp.bfloat16
    with pytest.raises(ValueError, match="K=16"):
        linear(x[:, :16], w)
    with pytest.raises(ValueError, match="backend"):
        linear(x, with_backend(w, "cuda"))


def test_resolve_kernel_backend():
    assert resolve_kernel_backend("auto", "cpu") == "xla"
    assert resolve_kernel_backend("auto", "gpu") == "pallas"
    assert resolve_kernel_backend("auto", "cuda") == "pallas"
    assert resolve_kernel_backend("auto", "tpu") == "xla"
    assert resolve_kernel_backend("xla", "gpu") == "xla"
    assert resolve_kernel_backend("pallas", "gpu") == "pallas"
    assert resolve_kernel_backend("pallas", "cpu") == "interpret"
    assert resolve_kernel_backend("AUTO") == ("pallas" if jax.default_backend() == "gpu" else "xla")
    with pytest.raises(UserError, match="--kernel-backend") as e:
        resolve_kernel_backend("triton", "gpu")
    assert e.value.param == "--kernel-backend"


class _Tiny(nnx.Module):
    def __init__(self, w_fp8, w_nv, w_plain):
        self.a = nnx.Param(w_fp8)
        self.b = nnx.Param(w_nv)
        self.c = nnx.Param(w_plain)

    def __call__(self, x, backend="xla"):
        h = linear(x, with_backend(self.a[...], backend))  # [...] works for quantized pytrees and arrays alike
        h = linear(h, with_backend(self.b.get_value(), backend))
        return linear(h, with_backend(self.c[...], backend))


def test_quantized_weights_inside_nnx_param_survive_split_merge_and_jit():
    rng = np.random.default_rng(1)
    wa = jnp.asarray(rng.standard_normal((32, 16)), jnp.float32)
    wb = jnp.asarray(rng.standard_normal((24, 32)), jnp.float32)
    wc = jnp.asarray(rng.standard_normal((8, 24)), jnp.float32)
    model = _Tiny(quantize_fp8_row(wa), quantize_nvfp4(wb), wc)
    x = jnp.asarray(rng.standard_normal((3, 16)), jnp.float32)
    eager = model(x)

    graphdef, state = nnx.split(model)
    leaves = jax.tree.leaves(state)
    assert {str(a.dtype) for a in leaves} == {"float8_e4m3fn", "float32", "uint8"}
    assert len(leaves) == 2 + 3 + 1

    @jax.jit
    def pure(state, x):
        return nnx.merge(graphdef, state)(x)

    np.testing.assert_allclose(np.asarray(pure(state, x)), np.asarray(eager), rtol=1e-6)
    merged = nnx.merge(graphdef, state)
    assert isinstance(merged.a.get_value(), Fp8RowWeight)
    assert isinstance(merged.b.get_value(), Nvfp4Weight) and merged.b.get_value().k == 32
    np.testing.assert_allclose(np.asarray(nnx.jit(lambda m, x: m(x))(model, x)), np.asarray(eager), rtol=1e-6)
    np.testing.assert_allclose(
        np.asarray(nnx.jit(lambda m, x: m(x, "interpret"))(model, x)), np.asarray(eager), rtol=1e-5
    )
    # expected: numpy chain through the dequantized weights
    h = np.asarray(x, np.float64) @ _np_dequant(model.a.get_value()).T
    h = h @ _np_dequant(model.b.get_value()).T
    expected = h @ np.asarray(wc, np.float64).T
    np.testing.assert_allclose(np.asarray(eager), expected, rtol=1e-4, atol=1e-4 * np.abs(expected).max())
