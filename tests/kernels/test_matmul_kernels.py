"""Pallas dequant-matmul kernels in interpret mode vs their jnp references (rel err <= 1e-5, f32 accum).

Small shapes and few grid steps: interpret mode costs about 1 ms per grid step.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.kernels.bench import parse_shapes, run_kernel_bench
from dflash_jax.kernels.fp8_matmul import (
    Fp8MatmulConfig,
    fp8_matmul,
    fp8_matmul_any,
    fp8_matmul_reference,
)
from dflash_jax.kernels.fp8_matmul import select_config as fp8_select
from dflash_jax.kernels.nvfp4_matmul import (
    Nvfp4MatmulConfig,
    nvfp4_matmul,
    nvfp4_matmul_any,
    nvfp4_matmul_reference,
)
from dflash_jax.quant import quantize_fp8_row, quantize_nvfp4
from tests.cuda_lowering import TRITON_CALL, export_for_cuda

pytestmark = pytest.mark.usefixtures("highest_matmul_precision")  # f32 results meet f32 references

TOL = 1e-5
FP8_TILE = Fp8MatmulConfig(block_m=16, block_n=32, block_k=64)
NV_TILE = Nvfp4MatmulConfig(block_m=16, block_n=32, block_k=64)
NV_TILE_SPLIT = Nvfp4MatmulConfig(block_m=16, block_n=32, block_k=64, unpack="split")
# (M, N, K): multiples of the 16x32x64 tile (2x2 grid, 2 K steps), and not (padding on every axis)
SHAPES = [(32, 64, 128), (19, 45, 100), (5, 7, 40)]


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / np.abs(b).max())


def _data(m, n, k, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = (rng.standard_normal((n, k)) * rng.uniform(0.01, 3.0, size=(n, 1))).astype(np.float32)
    return jnp.asarray(x), w


@pytest.mark.parametrize("shape", SHAPES)
def test_fp8_kernel_interpret_matches_reference(shape):
    m, n, k = shape
    x, w = _data(m, n, k)
    qw = quantize_fp8_row(jnp.asarray(w))
    ref = fp8_matmul_reference(x, qw.q, qw.scale)
    # reference itself vs an independent numpy dequant-matmul
    w_np = np.asarray(qw.q).astype(np.float32).astype(np.float64) * np.asarray(qw.scale, np.float64)[:, None]
    assert _rel(ref, np.asarray(x, np.float64) @ w_np.T) <= TOL
    for cfg in (FP8_TILE, None):
        got = fp8_matmul(x, qw.q, qw.scale, config=cfg, interpret=True)
        assert got.shape == (m, n) and got.dtype == jnp.float32
        assert _rel(got, ref) <= TOL, cfg


@pytest.mark.parametrize("shape", SHAPES)
def test_nvfp4_kernel_interpret_matches_reference(shape):
    m, n, k = shape
    x, w = _data(m, n, k, seed=1)
    qw = quantize_nvfp4(jnp.asarray(w))
    ref = nvfp4_matmul_reference(x, qw.packed, qw.block_scale, qw.global_scale)
    w_np = np.asarray(qw.dequantize(), np.float64)
    assert _rel(ref, np.asarray(x, np.float64) @ w_np.T) <= TOL
    for cfg in (NV_TILE, NV_TILE_SPLIT, None):
        got = nvfp4_matmul(x, qw.packed, qw.block_scale, qw.global_scale, config=cfg, interpret=True)
        assert got.shape == (m, n) and got.dtype == jnp.float32
        assert _rel(got, ref) <= TOL, cfg


def test_kernels_bf16_activations_f32_output():
    x, w = _data(16, 32, 64, seed=2)
    xb = x.astype(jnp.bfloat16)
    f = quantize_fp8_row(jnp.asarray(w))
    got = fp8_matmul(xb, f.q, f.scale, config=FP8_TILE, interpret=True, out_dtype=jnp.float32)
    assert _rel(got, fp8_matmul_reference(xb, f.q, f.scale, out_dtype=jnp.float32)) <= TOL
    v = quantize_nvfp4(jnp.asarray(w))
    got = nvfp4_matmul(
        xb, v.packed, v.block_scale, v.global_scale, config=NV_TILE, interpret=True, out_dtype=jnp.float32
    )
    ref = nvfp4_matmul_reference(xb, v.packed, v.block_scale, v.global_scale, out_dtype=jnp.float32)
    assert _rel(got, ref) <= TOL
    assert fp8_matmul(xb, f.q, f.scale, config=FP8_TILE, interpret=True).dtype == jnp.bfloat16


def test_kernels_accept_leading_dims():
    x, w = _data(12, 24, 48, seed=3)
    x3 = x.reshape(2, 6, 48)
    f, v = quantize_fp8_row(jnp.asarray(w)), quantize_nvfp4(jnp.asarray(w))
    y = fp8_matmul_any(x3, f.q, f.scale, interpret=True)
    assert y.shape == (2, 6, 24)
    assert _rel(y.reshape(12, 24), fp8_matmul_reference(x, f.q, f.scale)) <= TOL
    y = nvfp4_matmul_any(x3, v.packed, v.block_scale, v.global_scale, interpret=True)
    assert _rel(y.reshape(12, 24), nvfp4_matmul_reference(x, v.packed, v.block_scale, v.global_scale)) <= TOL


def test_kernel_rejects_mismatched_k():
    x, w = _data(4, 8, 32)
    f, v = quantize_fp8_row(jnp.asarray(w)), quantize_nvfp4(jnp.asarray(w))
    with pytest.raises(ValueError, match="K="):
        fp8_matmul(x[:, :16], f.q, f.scale, interpret=True)
    with pytest.raises(ValueError, match="K="):
        nvfp4_matmul(x[:, :16], v.packed, v.block_scale, v.global_scale, interpret=True)


def test_tuning_configs_and_table():
    with pytest.raises(ValueError, match="unpack"):
        Nvfp4MatmulConfig(unpack="zigzag")
    with pytest.raises(ValueError, match="block_k"):
        Nvfp4MatmulConfig(block_k=48)
    with pytest.raises(dataclasses.FrozenInstanceError):
        FP8_TILE.block_m = 8
    small, large = fp8_select(8, 4096, 4096), fp8_select(4096, 4096, 4096)
    assert small.block_m <= large.block_m
    assert fp8_select(8, 64, 64, interpret=True).block_k >= 256  # few grid steps in interpret mode


def test_micro_benchmark_reports_agreement():
    assert parse_shapes("16x32x64, 8x8x40") == ((16, 32, 64), (8, 8, 40))
    with pytest.raises(ValueError):
        parse_shapes("16x32")
    res = run_kernel_bench([(8, 32, 48)], repeats=1)
    on_gpu = jax.default_backend() == "gpu"
    assert res["backend"] == ("pallas" if on_gpu else "interpret") and len(res["records"]) == 2
    # the kernel writes f32; the XLA path writes the activations' dtype (bf16 on a GPU: <= 2^-9 of max|y| rounding)
    xla_tol = TOL if res["dtype"] == "float32" else 2.0**-8
    for r in res["records"]:
        assert r["kernel_rel_err"] <= TOL and r["xla_rel_err"] <= xla_tol, r
        assert r["kernel_ms"] > 0 and r["weight_bytes"] < r["dense_bytes"]
        assert 0 < r["quant_rel_err"] < (0.05 if r["format"] == "fp8" else 0.25)
    assert jax.default_backend() == res["platform"]


def kernel_calls(w):
    """The FP8 kernel and the NVFP4 kernel (both unpack modes) on `w` quantized, as functions of the activations."""
    f, v = quantize_fp8_row(w), quantize_nvfp4(w)
    return [
        lambda x: fp8_matmul(x, f.q, f.scale),
        lambda x: nvfp4_matmul(x, v.packed, v.block_scale, v.global_scale),
        lambda x: nvfp4_matmul(x, v.packed, v.block_scale, v.global_scale, config=NV_TILE_SPLIT),
    ]


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_kernels_lower_to_triton_for_cuda_without_a_gpu(dtype):
    """Cross-platform lowering runs the Pallas->Triton lowering rules on CPU: every primitive in the kernels
    must be supported by the Triton backend (PTX compilation itself needs a GPU and is not checked here)."""
    x = jnp.ones((5, 328), dtype)
    w = jnp.ones((200, 328), jnp.float32)
    for fn in kernel_calls(w):
        assert export_for_cuda(fn, x).count(TRITON_CALL) == 1


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_in_kernel_dot_precision(dtype):
    """f32 activations ask for a HIGHEST-precision dot (the Triton lowering makes DEFAULT a TF32 dot, ~2e-4
    rel err on an H200; HIGHEST is IEEE f32); bf16 keeps the default. The process-wide default precision is
    pinned to "default" here: a run under JAX_DEFAULT_MATMUL_PRECISION=highest would otherwise write HIGHEST
    into every dot of the traced program."""
    x = jnp.ones((5, 72), dtype)
    w = jnp.ones((40, 72), jnp.float32)
    for fn in kernel_calls(w):
        with jax.default_matmul_precision("default"):
            text = str(jax.make_jaxpr(fn)(x))
        assert ("HIGHEST" in text) == (dtype == jnp.float32)


def test_device_loop_timing():
    from dflash_jax.kernels.bench import device_time_us
    from dflash_jax.quant.linear import linear

    x = jnp.ones((4, 48), jnp.float32)
    qw = quantize_nvfp4(jnp.ones((32, 48), jnp.float32))
    t = device_time_us(lambda x, w: linear(x, w), x, qw, iters=3, repeats=1)
    assert t > 0
    res = run_kernel_bench([(8, 32, 48)], formats=("fp8",), repeats=1, device_iters=2)
    (r,) = res["records"]
    assert res["device_iters"] == 2
    for field in ("dense_dev_us", "xla_dev_us", "kernel_dev_us", "loop_overhead_us", "loop_overhead_w_us"):
        assert r[field] > 0, field
