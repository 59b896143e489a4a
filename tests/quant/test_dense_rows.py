"""`DenseRows`: a dense weight stored `[out, in]` and read as `W·xᵀ` (`--dense-layout out-in`), against `x @ W` in
numpy and the dense layers' own einsums."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dflash_jax.errors import UserError
from dflash_jax.models.layers import (
    dense,
    dense_rows_state,
    fused_gated_mlp,
    kv_heads,
    logits_f32,
    qkv_heads,
    resolve_dense_layout,
    to_dense_rows,
)
from dflash_jax.models.target import contiguous_kv_cache
from dflash_jax.quant import DenseRows, is_quantized, is_rows, linear
from dflash_jax.server.config import ServeConfig
from dflash_jax.spec_decode.runner import SpecRunner
from dflash_jax.types import SamplingParams


def _rand(rng, *shape):
    return rng.standard_normal(shape, dtype=np.float32)


@pytest.mark.parametrize("lead", [(1,), (3,), (2, 5)])
def test_linear_reads_dense_rows_as_x_at_w(lead):
    rng = np.random.default_rng(0)
    w, x = _rand(rng, 48, 40), _rand(rng, *lead, 48)
    rows = to_dense_rows(jnp.asarray(w))
    assert isinstance(rows, DenseRows) and rows.shape == (40, 48) and rows.out_shape == (40,)
    assert is_rows(rows) and not is_quantized(rows)
    np.testing.assert_array_equal(np.asarray(rows.w), w.T)
    np.testing.assert_allclose(np.asarray(linear(jnp.asarray(x), rows)), x @ w, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(dense(jnp.asarray(x), rows)), x @ w, rtol=1e-5, atol=1e-5)
    head = to_dense_rows(jnp.asarray(w))
    out = logits_f32(jnp.asarray(x), head)
    assert out.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(out), x @ w, rtol=1e-5, atol=1e-5)


def test_a_weight_of_more_output_axes_keeps_them_per_token():
    w = jnp.asarray(_rand(np.random.default_rng(1), 16, 3, 5, 4))
    rows = to_dense_rows(w)
    assert rows.shape == (60, 16) and rows.out_shape == (3, 5, 4)
    assert to_dense_rows(jnp.ones((7,))).shape == (7,)  # a norm's vector is not a matmul weight


def test_fused_layers_with_dense_rows_match_the_dense_einsums():
    rng = np.random.default_rng(2)
    h, kv, g, d, inter = 32, 2, 3, 8, 24
    x = jnp.asarray(_rand(rng, 2, 3, h))
    qkv = jnp.asarray(_rand(rng, h, kv, g + 2, d))
    gate_up, down = jnp.asarray(_rand(rng, h, 2, inter)), jnp.asarray(_rand(rng, inter, h))
    close = lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-4)  # noqa: E731
    for a, b in zip(qkv_heads(x, qkv), qkv_heads(x, to_dense_rows(qkv)), strict=True):
        assert a.shape == b.shape
        close(a, b)
    for a, b in zip(kv_heads(x, qkv, g, d), kv_heads(x, to_dense_rows(qkv), g, d), strict=True):
        assert a.shape == b.shape
        close(a, b)
    close(fused_gated_mlp(x, gate_up, down), fused_gated_mlp(x, to_dense_rows(gate_up), to_dense_rows(down)))


def test_dense_rows_state_converts_a_copy_and_keeps_the_logits(tiny_target):
    graph, state = nnx.split(tiny_target)
    rows = nnx.merge(graph, dense_rows_state(state))
    for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
        assert isinstance(getattr(rows.layers[0], name)[...], DenseRows)
        assert isinstance(getattr(tiny_target.layers[0], name)[...], jax.Array)  # the model keeps its weights
    assert isinstance(rows.lm_head[...], DenseRows) and isinstance(tiny_target.lm_head[...], jax.Array)
    assert isinstance(rows.embed[...], jax.Array)  # the embedding is a lookup table, not a matmul weight
    tokens = jnp.asarray(np.random.default_rng(3).integers(0, tiny_target.cfg.vocab_size, (2, 6)))
    positions = jnp.broadcast_to(jnp.arange(6), (2, 6))
    out = []
    for m in (tiny_target, rows):
        cache, pages = contiguous_kv_cache(tiny_target.cfg, 2, 32)
        h, _, _ = m(tokens, positions, cache, pages, kv_len=32)
        out.append(np.asarray(m.logits(h)))
    np.testing.assert_allclose(out[1], out[0], rtol=1e-4, atol=1e-4)


def test_both_layouts_decode_the_same_greedy_tokens(tiny_target, tiny_drafter):
    rng = np.random.default_rng(4)
    prompts = [rng.integers(0, tiny_target.cfg.vocab_size, n).tolist() for n in (4, 9)]
    tokens = {}
    for layout in ("in-out", "out-in"):
        for drafter in (None, tiny_drafter):
            r = SpecRunner(tiny_target, drafter, max_slots=2, max_model_len=64, gamma=4, dense_layout=layout)
            assert r.dense_layout == layout
            first = r.add_many([(i, p, SamplingParams()) for i, p in enumerate(prompts)])
            out = {i: list(res.tokens) for i, res in first.items()}
            while any(len(o) < 12 for o in out.values()):
                active = [i for i, o in out.items() if len(o) < 12]
                for i, res in r.step(active, {i: 12 - len(out[i]) for i in active}).items():
                    out[i] += res.tokens
            tokens[layout, drafter is not None] = {i: o[:12] for i, o in out.items()}
    assert len({str(t) for t in tokens.values()}) == 1, tokens


def test_the_lm_head_rows_are_held_once(tiny_qwen3_cfg, target_factory, drafter_factory, tiny_llama_cfg):
    """A tied head's rows are the embedding itself, and the drafter reads the target's head rows, in both the
    tied and the untied case; the tied runner decodes what the in-out runner decodes."""
    tied = target_factory(tiny_qwen3_cfg, seed=2)
    prompt = np.random.default_rng(5).integers(0, tiny_qwen3_cfg.vocab_size, 7).tolist()
    out = {}
    for layout in ("in-out", "out-in"):
        drafter = drafter_factory(tiny_qwen3_cfg, seed=3)
        head = tied.lm_head[...]  # as the builder passes an untiered drafter head: the target's own array
        r = SpecRunner(tied, drafter, max_slots=1, max_model_len=64, gamma=4, draft_lm_head=head, dense_layout=layout)
        res = r.add_many([(0, prompt, SamplingParams())])[0]
        out[layout] = list(res.tokens) + [t for _ in range(4) for t in r.step([0], {0: 16})[0].tokens]
    head = r.tstate["lm_head"].get_value()
    assert isinstance(head, DenseRows) and head.w is r.embed and r.draft_lm_head.w is r.embed
    np.testing.assert_array_equal(np.asarray(head.w), np.asarray(tied.lm_head[...]).T)
    assert out["out-in"] == out["in-out"]
    untied = target_factory(tiny_llama_cfg, seed=2)
    r = SpecRunner(untied, None, max_slots=1, max_model_len=64, gamma=4, dense_layout="out-in")
    head = r.tstate["lm_head"].get_value()
    assert r.draft_lm_head.w is head.w and head.w is not r.embed


def test_the_dense_layout_flag():
    assert resolve_dense_layout("auto", platform="cpu") == "out-in"
    assert resolve_dense_layout("auto", tp=2, platform="cpu") == "in-out"
    assert resolve_dense_layout("auto", platform="gpu") == "in-out"
    assert resolve_dense_layout("in-out", platform="cpu") == "in-out"
    with pytest.raises(UserError, match="--dense-layout must be one of auto, in-out, out-in") as e:
        resolve_dense_layout("rows")
    assert e.value.param == "--dense-layout"
    with pytest.raises(UserError, match="--tp-size 1"):
        resolve_dense_layout("out-in", tp=2)
    with pytest.raises(UserError, match="--dense-layout"):
        ServeConfig(dense_layout="rows")
    with pytest.raises(UserError, match="--dense-layout: out-in runs on one device"):
        ServeConfig(dense_layout="out-in", tp_size=2)
