"""The models compute in their weight dtype: a bfloat16 target, DFlash drafter and DFlash2 drafter keep every
matmul operand, activation and KV cache in bfloat16, and only norm statistics, softmax, logits and the DFlash2
selector scores are float32.

Checked on the traced programs (`jax.make_jaxpr`): every `dot_general` of the target forward, of the drafter's
context-K/V write and of its block forward has bfloat16 operands (a float32 operand anywhere would mean that an f32
value leaked into the residual stream or a cache), and on the outputs: the caches, the captured hidden states and
the draft hidden states are bfloat16, the logits float32.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dflash_jax.models.drafter import (
    DrafterModel,
    contiguous_drafter_cache,
    draft_head,
    random_drafter_config,
    write_context,
)
from dflash_jax.models.drafter2 import Drafter2Model, identity_init, propose_block2
from dflash_jax.models.layers import RandomBuilder
from dflash_jax.models.target import TargetModel, contiguous_kv_cache, target_forward
from tests.conftest import TINY_LLAMA, TINY_QWEN3

BF16 = jnp.dtype(jnp.bfloat16)


def dot_operand_dtypes(jaxpr) -> list[tuple[str, str]]:
    """(lhs dtype, rhs dtype) of every dot_general in a (closed) jaxpr, sub-jaxprs (jit, scan, ...) included."""
    out = []

    def walk(jp):
        for eqn in jp.eqns:
            if eqn.primitive.name == "dot_general":
                out.append(tuple(str(v.aval.dtype) for v in eqn.invars))
            for p in eqn.params.values():
                for sub in p if isinstance(p, tuple | list) else (p,):
                    if isinstance(sub, jax.extend.core.ClosedJaxpr):
                        walk(sub.jaxpr)
                    elif isinstance(sub, jax.extend.core.Jaxpr):
                        walk(sub)

    walk(jaxpr.jaxpr)
    return out


def assert_all_bf16(dots: list[tuple[str, str]], what: str) -> None:
    assert dots, f"{what}: no dot_general traced"
    bad = [d for d in dots if d != ("bfloat16", "bfloat16")]
    assert not bad, f"{what}: {len(bad)} of {len(dots)} dots have operands {bad[:3]}"


@pytest.mark.parametrize("cfg", [TINY_LLAMA, TINY_QWEN3], ids=["llama-untied", "qwen3-tied-qknorm"])
def test_bf16_target_stays_bf16(cfg):
    model = TargetModel(cfg, RandomBuilder(0, std=0.2, dtype=jnp.bfloat16))
    assert model.dtype == BF16
    graphdef, state = nnx.split(model)
    assert {str(x.dtype) for x in jax.tree.leaves(state)} == {"bfloat16"}
    b, t, cap = 2, 5, 16
    cache, pages = contiguous_kv_cache(cfg, b, cap, model.dtype, page_size=8)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (b, t)), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    capture = (0, cfg.num_layers - 1)

    def fwd(state, cache):
        return target_forward(graphdef, state, tokens, pos, cache, pages, capture=capture, kv_len=cap)

    assert_all_bf16(dot_operand_dtypes(jax.make_jaxpr(fwd)(state, cache)), "target forward")
    out = fwd(state, cache)
    assert out.logits.dtype == jnp.float32
    assert out.hidden.dtype == BF16
    assert {str(x.dtype) for x in jax.tree.leaves(out.cache)} == {"bfloat16"}
    assert np.isfinite(np.asarray(out.logits)).all()


@pytest.mark.parametrize("arch", ["dflash", "dflash2"])
def test_bf16_drafter_stays_bf16(arch):
    tcfg = TINY_LLAMA
    dcfg = random_drafter_config(tcfg, num_layers=2, block_size=4)
    if arch == "dflash2":
        dcfg = dataclasses.replace(dcfg, arch="dflash2", conv_group_size=16, selector_rank=8, selector_top_k=4)
        drafter = identity_init(Drafter2Model(dcfg, tcfg.hidden_size, RandomBuilder(1, std=0.2, dtype=jnp.bfloat16)))
        # a conv that is not the identity, so its arithmetic is traced with real coefficients
        for layer in drafter.layers:
            pk = layer.attention_conv.kernel_projection
            pk.set_value(jnp.full(pk[...].shape, 0.01, jnp.bfloat16))
    else:
        drafter = DrafterModel(dcfg, tcfg.hidden_size, RandomBuilder(1, std=0.2, dtype=jnp.bfloat16))
    assert drafter.dtype == BF16
    target = TargetModel(tcfg, RandomBuilder(0, std=0.2, dtype=jnp.bfloat16))
    embed, lm_head = target.embed[...], target.lm_head[...]
    b, t, cap, width = 2, 6, 24, dcfg.block_size
    rng = np.random.default_rng(1)
    taps = jnp.asarray(rng.standard_normal((b, t, dcfg.num_taps * tcfg.hidden_size)), jnp.bfloat16)
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    dgraph, dstate = nnx.split(drafter)
    cache, pages = contiguous_drafter_cache(dcfg, b, cap, drafter.dtype, page_size=8)

    def write(dstate, cache):
        return write_context(nnx.merge(dgraph, dstate), cache, taps, pos, pages)

    assert_all_bf16(dot_operand_dtypes(jax.make_jaxpr(write)(dstate, cache)), "drafter context K/V")
    cache = write(dstate, cache)
    assert {str(x.dtype) for x in jax.tree.leaves(cache)} == {"bfloat16"}

    anchor = jnp.asarray([3, 7], jnp.int32)
    start = jnp.asarray([t, t], jnp.int32)

    def head(dstate, cache):
        d = nnx.merge(dgraph, dstate)
        return draft_head(d, embed, lm_head, cache, anchor, start, pages, width=width, kv_len=cap)

    assert_all_bf16(dot_operand_dtypes(jax.make_jaxpr(head)(dstate, cache)), f"{arch} block forward")
    h, logits = head(dstate, cache)
    assert h.dtype == BF16 and logits.dtype == jnp.float32
    assert np.isfinite(np.asarray(logits)).all()
    if arch == "dflash2":  # the selector walk scores in f32 and still yields valid drafts and a distribution q
        drafts, ids, q = propose_block2(drafter, embed, lm_head, cache, anchor, start, pages, width=width, kv_len=cap)
        assert q.dtype == jnp.float32 and drafts.dtype == jnp.int32
        np.testing.assert_allclose(np.asarray(q).sum(-1), 1.0, rtol=1e-6)


def test_f32_models_stay_f32():
    """The same programs in float32 have float32 operands only (the dtype follows the weights both ways)."""
    cfg = TINY_LLAMA
    model = TargetModel(cfg, RandomBuilder(0, std=0.2))
    graphdef, state = nnx.split(model)
    tokens = jnp.zeros((1, 3), jnp.int32)
    pos = jnp.arange(3, dtype=jnp.int32)[None]
    cache, pages = contiguous_kv_cache(cfg, 1, 8, model.dtype, page_size=8)
    jp = jax.make_jaxpr(lambda s, c: target_forward(graphdef, s, tokens, pos, c, pages, kv_len=8))
    dots = dot_operand_dtypes(jp(state, cache))
    assert dots and all(d == ("float32", "float32") for d in dots)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_attention_gradient_equals_the_plain_einsums(dtype):
    """The attention's f32-accumulated scores have a hand-written gradient (its dots in the operands' dtype): it
    equals autodiff of the same attention written with plain einsums, computed in f32 from the same inputs."""
    rng = np.random.default_rng(0)
    b, t, hkv, g, d, s = 2, 3, 2, 2, 8, 5
    q = jnp.asarray(rng.standard_normal((b, t, hkv * g, d)), dtype)
    k = jnp.asarray(rng.standard_normal((b, hkv, s, d)), dtype)
    v = jnp.asarray(rng.standard_normal((b, hkv, s, d)), dtype)
    mask = jnp.asarray(rng.random((b, t, s)) < 0.7).at[..., 0].set(True)
    w = jnp.asarray(rng.standard_normal((b, t, hkv * g * d)), jnp.float32)

    def ref(q, k, v):
        qg = q.reshape(b, t, hkv, g, d)
        sc = jnp.einsum("btkgd,bksd->bkgts", qg, k) / np.sqrt(d)
        p = jax.nn.softmax(jnp.where(mask[:, None, None], sc, -1e30), axis=-1)
        return jnp.einsum("bkgts,bksd->btkgd", p, v).reshape(b, t, -1)

    def loss(fn, q, k, v):
        return jnp.sum(fn(q, k, v).astype(jnp.float32) * w)

    got = jax.grad(lambda *a: loss(gqa_attention_masked(mask), *a), argnums=(0, 1, 2))(q, k, v)
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    want = jax.grad(lambda *a: loss(ref, *a), argnums=(0, 1, 2))(*f32)
    tol = 1e-5 if dtype == jnp.float32 else 0.05  # bf16: gradients rounded to 2^-8 relative, O(1) values
    for gi, wi in zip(got, want, strict=True):
        assert gi.dtype == jnp.dtype(dtype)
        np.testing.assert_allclose(np.asarray(gi, np.float32), np.asarray(wi), atol=tol, rtol=tol)


def gqa_attention_masked(mask):
    from dflash_jax.models.layers import gqa_attention

    return lambda q, k, v: gqa_attention(q, k, v, mask)


@pytest.mark.parametrize("drafts", ["propose", "none"])
def test_bf16_serving_step_stays_bf16(drafts):
    """The runner's one-call step (propose, verify, context write; or a plain step) over bf16 models: every dot has
    bf16 operands; the device state (target and drafter caches, pending taps) is bf16."""
    from dflash_jax.spec_decode.runner import SpecRunner

    target = TargetModel(TINY_LLAMA, RandomBuilder(0, std=0.2, dtype=jnp.bfloat16))
    dcfg = random_drafter_config(TINY_LLAMA, num_layers=2, block_size=4)
    drafter = DrafterModel(dcfg, TINY_LLAMA.hidden_size, RandomBuilder(1, std=0.2, dtype=jnp.bfloat16))
    r = SpecRunner(target, drafter, max_slots=2, max_model_len=32, batch_buckets=(2,))
    st = r.state
    assert {str(x.dtype) for x in jax.tree.leaves((st.tcache, st.dcache, st.pending))} == {"bfloat16"}
    traced = r.programs.step.trace(
        r.weights,
        st,
        np.asarray([0, 1], np.int32),
        np.zeros((2, r.kv_buckets[0] // r.page_size), np.int32),
        np.asarray([3, 3], np.int32),
        np.asarray(False),
        width=4 if drafts == "propose" else 1,
        kv_len=r.kv_buckets[0],
        sampled=0,
        speculative=drafts == "propose",
    )
    assert_all_bf16(dot_operand_dtypes(traced.jaxpr), f"step ({drafts})")
