"""The target's fused projections: q|k|v grouped by KV head and gate|up, built from the checkpoint's separate
tensors, compute what the separate matmuls compute (numpy reference), and split back to the file's tensors."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.models.layers import (
    DictBuilder,
    fuse_qkv,
    fused_gated_mlp,
    qkv_heads,
    split_qkv,
    unfused_block,
)
from dflash_jax.models.target import TargetModel
from tests.conftest import TINY_LLAMA


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (8, 2), (4, 1)])
def test_qkv_heads_equal_the_separate_projections(heads, kv_heads):
    rng = np.random.default_rng(heads + kv_heads)
    hidden, d = 12, 4
    q = rng.standard_normal((hidden, heads * d)).astype(np.float32)
    k = rng.standard_normal((hidden, kv_heads * d)).astype(np.float32)
    v = rng.standard_normal((hidden, kv_heads * d)).astype(np.float32)
    x = rng.standard_normal((2, 3, hidden)).astype(np.float32)
    fused = fuse_qkv(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), kv_heads, d)
    assert fused.shape == (hidden, kv_heads, heads // kv_heads + 2, d)
    gq, gk, gv = (np.asarray(a) for a in qkv_heads(jnp.asarray(x), fused))
    np.testing.assert_allclose(gq, (x @ q).reshape(2, 3, heads, d), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(gk, (x @ k).reshape(2, 3, kv_heads, d), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(gv, (x @ v).reshape(2, 3, kv_heads, d), rtol=1e-5, atol=1e-5)
    for got, want in zip(split_qkv(fused), (q, k, v), strict=True):
        np.testing.assert_array_equal(np.asarray(got), want)


def test_fused_gated_mlp_equals_the_separate_matmuls():
    rng = np.random.default_rng(1)
    x, gate, up, down = (rng.standard_normal(s).astype(np.float32) for s in ((3, 8), (8, 10), (8, 10), (10, 8)))
    got = np.asarray(fused_gated_mlp(jnp.asarray(x), jnp.stack([jnp.asarray(gate), jnp.asarray(up)], axis=1), down))
    silu = lambda a: a / (1 + np.exp(-a))  # noqa: E731
    np.testing.assert_allclose(got, (silu(x @ gate) * (x @ up)) @ down, rtol=1e-5, atol=1e-5)


def test_a_loaded_target_splits_back_to_the_checkpoint_tensors():
    cfg = dataclasses.replace(TINY_LLAMA, num_layers=1)
    rng = np.random.default_rng(2)
    names = {
        "q_proj": (cfg.hidden_size, cfg.q_dim),
        "k_proj": (cfg.hidden_size, cfg.kv_dim),
        "v_proj": (cfg.hidden_size, cfg.kv_dim),
        "o_proj": (cfg.q_dim, cfg.hidden_size),
        "gate_proj": (cfg.hidden_size, cfg.intermediate_size),
        "up_proj": (cfg.hidden_size, cfg.intermediate_size),
        "down_proj": (cfg.intermediate_size, cfg.hidden_size),
    }
    sub = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn"}
    w = {
        f"layers.0.{sub.get(n, 'mlp')}.{n}.weight": rng.standard_normal(sh).astype(np.float32)
        for n, sh in names.items()
    }
    for n in ("input_layernorm", "post_attention_layernorm"):
        w[f"layers.0.{n}.weight"] = np.ones(cfg.hidden_size, np.float32)
    w |= {"embed_tokens.weight": rng.standard_normal((cfg.vocab_size, cfg.hidden_size)).astype(np.float32)}
    w |= {"norm.weight": np.ones(cfg.hidden_size, np.float32)}
    if not cfg.tie_word_embeddings:
        w["lm_head.weight"] = rng.standard_normal((cfg.hidden_size, cfg.vocab_size)).astype(np.float32)
    b = DictBuilder(w, "test")
    model = TargetModel(cfg, b)
    b.check_all_used()
    split = unfused_block(model.layers[0])
    for n in names:
        np.testing.assert_array_equal(np.asarray(split[n]), w[f"layers.0.{sub.get(n, 'mlp')}.{n}.weight"], err_msg=n)
