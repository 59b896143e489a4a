"""FP8-row and NVFP4 formats: round-trip bounds, nibble order, zero rows, FP8 range, global-scale folding.

Expected values come from numpy + ml_dtypes (independent of the jnp code under test).
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from dflash_jax.quant import (
    E2M1_VALUES,
    Fp8RowWeight,
    Nvfp4Weight,
    decode_e2m1,
    encode_e2m1,
    nvfp4_folded_scales,
    pack_nibbles,
    quantize_fp8_row,
    quantize_nvfp4,
    unpack_nibbles,
)

E4M3 = ml_dtypes.float8_e4m3fn


def _e4m3_half_step(v: np.ndarray) -> np.ndarray:
    """Half the E4M3 spacing at |v| (3 mantissa bits; subnormal spacing 2^-9 below 2^-6)."""
    a = np.abs(v.astype(np.float64))
    e = np.floor(np.log2(np.maximum(a, 2.0**-6)))
    return 0.5 * 2.0 ** (e - 3)


def _e2m1_half_step(v: np.ndarray) -> np.ndarray:
    """Half the E2M1 spacing at |v|: grid 0 .5 1 1.5 2 | 3 4 | 6."""
    a = np.abs(v)
    return np.where(a < 2, 0.25, np.where(a < 4, 0.5, 1.0))


def _rows_of_many_magnitudes(rng, n, k):
    w = rng.standard_normal((n, k)).astype(np.float32)
    return w * (10.0 ** rng.uniform(-4, 4, size=(n, 1))).astype(np.float32)


# ------------------------------------------------------------------------------------------------------ FP8


def test_fp8_scale_codes_and_half_step_bound():
    rng = np.random.default_rng(0)
    w = _rows_of_many_magnitudes(rng, 24, 40)
    qw = quantize_fp8_row(jnp.asarray(w))
    scale = np.asarray(qw.scale)
    np.testing.assert_allclose(scale, np.abs(w).max(axis=1) / 448.0, rtol=1e-6)
    # Codes = independent numpy/ml_dtypes cast of the clipped, scaled weights.
    v = w / scale[:, None]
    np.testing.assert_array_equal(np.asarray(qw.q).view(np.uint8), np.clip(v, -448, 448).astype(E4M3).view(np.uint8))
    deq = np.asarray(qw.dequantize(), np.float64)
    err = np.abs(deq - w)
    bound = _e4m3_half_step(v) * scale[:, None] * (1 + 1e-6)
    assert np.all(err <= bound), float((err / bound).max())
    # the bound is tight, not vacuous: some weight uses most of its half step
    assert (err / bound).max() > 0.5
    assert qw.q.dtype == jnp.float8_e4m3fn and qw.scale.dtype == jnp.float32 and qw.shape == (24, 40)


def test_fp8_zero_row_gets_scale_one():
    w = np.ones((3, 8), np.float32)
    w[1] = 0.0
    qw = quantize_fp8_row(jnp.asarray(w))
    assert float(qw.scale[1]) == 1.0
    assert np.all(np.asarray(qw.q[1], np.float32) == 0)
    deq = np.asarray(qw.dequantize())
    assert np.all(np.isfinite(deq)) and np.all(deq[1] == 0)
    np.testing.assert_allclose(deq[[0, 2]], 1.0)


def test_fp8_values_beyond_e4m3_range_are_clipped_not_nan():
    # The raw cast does not saturate (this is why quantize clips first).
    assert np.isnan(np.float32(500.0).astype(E4M3).astype(np.float32))
    w = np.array([[1e4, -3e5, 7.0, 0.5], [600.0, 449.0, -448.0, 1.0]], np.float32)
    qw = quantize_fp8_row(jnp.asarray(w))
    q = np.asarray(qw.q, np.float32)
    assert np.all(np.isfinite(q)) and np.abs(q).max() == 448.0
    assert q[0, 1] == -448.0 and q[1, 0] == 448.0
    deq = np.asarray(qw.dequantize())
    assert np.all(np.isfinite(deq))
    np.testing.assert_allclose(deq[0, 1], -3e5, rtol=1e-6)
    np.testing.assert_allclose(deq[1, 0], 600.0, rtol=1e-6)


# ---------------------------------------------------------------------------------------------------- NVFP4


def test_e2m1_decode_matches_ml_dtypes_for_all_codes():
    codes = np.arange(16, dtype=np.uint8)
    ref = codes.view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    got = np.asarray(decode_e2m1(jnp.asarray(codes)))
    np.testing.assert_array_equal(got, ref)
    np.testing.assert_array_equal(np.signbit(got), np.signbit(ref))  # -0 for code 8
    np.testing.assert_array_equal(np.asarray(E2M1_VALUES, np.float32), ref)


def test_e2m1_encode_rounds_like_ml_dtypes():
    grid = np.concatenate(
        [
            np.linspace(-7.0, 7.0, 1401, dtype=np.float32),
            np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -2.5, -5.0, 1e-8, 100.0], np.float32),
        ]
    )
    ref = grid.astype(ml_dtypes.float4_e2m1fn).astype(np.float32)
    got = np.asarray(decode_e2m1(encode_e2m1(jnp.asarray(grid))))
    np.testing.assert_array_equal(got, ref)


def test_nibble_order_low_nibble_is_even_k():
    np.testing.assert_array_equal(np.asarray(unpack_nibbles(jnp.asarray([0x21], jnp.uint8))), [1, 2])
    packed = np.zeros((1, 8), np.uint8)
    packed[0, 0] = 0x21
    w = Nvfp4Weight(
        packed=jnp.asarray(packed),
        block_scale=jnp.ones((1, 1), jnp.float8_e4m3fn),
        global_scale=jnp.float32(1.0),
        k=16,
    )
    deq = np.asarray(w.dequantize())
    np.testing.assert_array_equal(deq[0, :2], [0.5, 1.0])
    assert np.all(deq[0, 2:] == 0)
    every_byte = jnp.arange(256, dtype=jnp.uint8).reshape(2, 128)
    repacked = pack_nibbles(unpack_nibbles(every_byte))
    np.testing.assert_array_equal(np.asarray(repacked), np.asarray(every_byte))


def _check_nvfp4_against_numpy(w: np.ndarray, qw: Nvfp4Weight, g: float) -> None:
    n, k = w.shape
    kp = -(-k // 16) * 16
    assert qw.packed.shape == (n, kp // 2) and qw.block_scale.shape == (n, kp // 16)
    assert qw.shape == (n, k) and qw.k == k
    np.testing.assert_allclose(float(qw.global_scale), g, rtol=1e-6)
    wp = np.pad(w, ((0, 0), (0, kp - k))).astype(np.float64)
    bs = np.asarray(qw.block_scale).astype(np.float32).astype(np.float64)
    s = np.repeat(bs * g, 16, axis=1)
    # block scale = E4M3(amax_block / (6 g)), or the next E4M3 value up when rounding down would overflow ±6
    target = np.abs(wp).reshape(n, kp // 16, 16).max(-1) / (6 * g)
    nearest = target.astype(np.float32).astype(E4M3)
    nxt = (nearest.view(np.uint8) + 1).view(E4M3)
    near_f, next_f = nearest.astype(np.float64), nxt.astype(np.float64)
    ok = (bs == near_f) | ((bs == next_f) & (near_f < target))
    assert (bs == next_f).any(), "the test data should exercise the round-up rule"
    assert ok.all()
    v = np.divide(wp, s, out=np.zeros_like(wp), where=s > 0)
    assert np.abs(v).max() <= 6 * (1 + 1e-6), "no weight may be clipped"
    deq = np.asarray(qw.dequantize(), np.float64)
    assert deq.shape == (n, k)
    err = np.abs(deq - w)
    bound = (_e2m1_half_step(v) * s * (1 + 1e-6))[:, :k]
    assert np.all(err <= bound), float((err / bound).max())
    assert (err[bound > 0] / bound[bound > 0]).max() > 0.5


def test_nvfp4_half_step_bound_with_k_not_multiple_of_16():
    rng = np.random.default_rng(1)
    w = _rows_of_many_magnitudes(rng, 12, 72)  # Kp = 80
    w[3, 16:32] *= 1e-7  # a block whose scale is E4M3-subnormal relative to the tensor amax
    w[5, 32:48] = 0.0  # an all-zero block
    qw = quantize_nvfp4(jnp.asarray(w))
    _check_nvfp4_against_numpy(w, qw, float(np.abs(w).max()) / (448 * 6))
    assert float(np.asarray(qw.block_scale[5, 2], np.float32)) == 0.0


def test_nvfp4_zero_rows_and_zero_tensor():
    w = np.random.default_rng(2).standard_normal((4, 32)).astype(np.float32)
    w[2] = 0.0
    qw = quantize_nvfp4(jnp.asarray(w))
    deq = np.asarray(qw.dequantize())
    assert np.all(deq[2] == 0) and np.all(np.isfinite(deq))
    zero = quantize_nvfp4(jnp.zeros((3, 20)))
    assert float(zero.global_scale) == 1.0
    assert np.all(np.asarray(zero.dequantize()) == 0) and zero.shape == (3, 20)


def test_nvfp4_global_scale_folding():
    rng = np.random.default_rng(3)
    w = rng.standard_normal((8, 48)).astype(np.float32)
    qw = quantize_nvfp4(jnp.asarray(w))
    # folded scale = block_scale * global, and dequant = e2m1(code) * folded (numpy, table decode)
    folded = np.asarray(qw.block_scale).astype(np.float32) * np.float32(qw.global_scale)
    np.testing.assert_array_equal(np.asarray(nvfp4_folded_scales(qw)), folded)
    codes = np.stack([np.asarray(qw.packed) & 0xF, np.asarray(qw.packed) >> 4], -1).reshape(8, 48)
    table = np.asarray(E2M1_VALUES, np.float32)
    expected = table[codes] * np.repeat(folded, 16, 1)
    np.testing.assert_allclose(np.asarray(qw.dequantize()), expected, rtol=1e-7)
    # the global scale absorbs the tensor's magnitude: scaling by 2^10 changes only the global scale
    big = quantize_nvfp4(jnp.asarray(w * 1024.0))
    np.testing.assert_array_equal(np.asarray(big.packed), np.asarray(qw.packed))
    np.testing.assert_array_equal(np.asarray(big.block_scale).view(np.uint8), np.asarray(qw.block_scale).view(np.uint8))
    np.testing.assert_allclose(float(big.global_scale), float(qw.global_scale) * 1024.0, rtol=1e-7)


def test_nvfp4_shards_share_the_whole_tensor_global_scale():
    rng = np.random.default_rng(4)
    w = rng.standard_normal((8, 32)).astype(np.float32)
    w[0, 0] = 50.0  # the tensor amax lives in the first half of the rows
    whole = quantize_nvfp4(jnp.asarray(w))
    half = quantize_nvfp4(jnp.asarray(w[4:]), global_scale=whole.global_scale)
    np.testing.assert_array_equal(np.asarray(half.packed), np.asarray(whole.packed[4:]))
    np.testing.assert_array_equal(
        np.asarray(half.block_scale).view(np.uint8), np.asarray(whole.block_scale[4:]).view(np.uint8)
    )
    alone = quantize_nvfp4(jnp.asarray(w[4:]))
    assert float(alone.global_scale) < float(whole.global_scale)


def test_formats_are_pytrees_with_static_k():
    qw = quantize_nvfp4(jnp.ones((4, 20)))
    leaves, treedef = jax.tree.flatten(qw)
    assert len(leaves) == 3
    back = jax.tree.unflatten(treedef, leaves)
    assert isinstance(back, Nvfp4Weight) and back.k == 20
    f = quantize_fp8_row(jnp.ones((4, 20)))
    assert len(jax.tree.leaves(f)) == 2
    assert isinstance(jax.jit(lambda t: t)(f), Fp8RowWeight)
    assert jax.jit(lambda t: t)(qw).k == 20


@pytest.mark.parametrize("bad", [jnp.ones((4,)), jnp.ones((2, 3, 4))])
def test_quantize_rejects_non_matrix(bad):
    with pytest.raises(ValueError, match="2-D"):
        quantize_fp8_row(bad)
    with pytest.raises(ValueError, match="2-D"):
        quantize_nvfp4(bad)
