"""The kernels' backend vocabulary (`kernels.backends`): flags to `xla | pallas | interpret`, and the attention
and matmul kernels taking `interpret` as a backend of its own."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.errors import UserError
from dflash_jax.kernels.backends import (
    ATTENTION_BACKEND_FLAGS,
    BACKENDS,
    KERNEL_BACKEND_FLAGS,
    attention_backend_for,
    resolve_backend,
)
from dflash_jax.kernels.paged_attention import paged_attention
from dflash_jax.kernels.paged_attention_bench import make_case


@pytest.mark.parametrize(
    ("flag", "platform", "want"),
    [
        ("auto", "cpu", "xla"),
        ("auto", "gpu", "pallas"),
        ("auto", "cuda", "pallas"),
        ("xla", "gpu", "xla"),
        ("pallas", "gpu", "pallas"),
        ("pallas", "cpu", "interpret"),
        ("pallas", "tpu", "interpret"),
        (" Pallas ", "cpu", "interpret"),
    ],
)
def test_flags_resolve_to_one_vocabulary(flag, platform, want):
    assert resolve_backend(flag, choices=KERNEL_BACKEND_FLAGS, param="--kernel-backend", platform=platform) == want
    attention = resolve_backend(flag, choices=ATTENTION_BACKEND_FLAGS, param="--attention-backend", platform=platform)
    assert attention == want
    assert want in BACKENDS


@pytest.mark.parametrize(
    ("flag", "tp", "platform", "want"),
    [
        ("auto", 1, "gpu", "pallas"),
        ("auto", 8, "gpu", "xla"),
        ("pallas", 8, "gpu", "pallas"),
        ("auto", 1, "cpu", "xla"),
        ("pallas", 1, "cpu", "interpret"),
    ],
)
def test_attention_auto_is_the_kernel_on_one_gpu_only(flag, tp, platform, want):
    assert attention_backend_for(flag, tp, platform) == want


def test_a_flag_outside_its_choices_is_refused_by_name():
    with pytest.raises(UserError, match="--attention-backend must be one of auto, xla, pallas, got 'triton'") as e:
        resolve_backend("triton", choices=ATTENTION_BACKEND_FLAGS, param="--attention-backend", platform="cpu")
    assert e.value.param == "--attention-backend"
    with pytest.raises(UserError, match="--kernel-backend must be one of auto, xla, pallas, got 'interpret'"):
        resolve_backend("interpret", choices=KERNEL_BACKEND_FLAGS, param="--kernel-backend", platform="cpu")


def test_paged_attention_interpret_is_the_pallas_kernel_interpreted():
    q, kp, vp, table, lo, hi, *_ = make_case(
        2, 3, 32, heads=4, kv_heads=2, head_dim=16, page_size=16, dtype=jnp.float32
    )
    ref = paged_attention(q, kp, vp, table, lo, hi, kv_len=32, backend="reference")
    got = paged_attention(q, kp, vp, table, lo, hi, kv_len=32, backend="interpret")
    same = paged_attention(q, kp, vp, table, lo, hi, kv_len=32, backend="pallas", interpret=True)
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=2e-5, atol=2e-5)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(same))
    with pytest.raises(ValueError, match="backend must be one of"):
        paged_attention(q, kp, vp, table, lo, hi, kv_len=32, backend="pallas_interpret")
