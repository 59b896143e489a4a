"""DFlash2 drafters: the two-tap grouped dynamic conv, the candidate selector and its walk, lossless
verification with the selector's q, identity initialisation, export/load, training.

The numpy reference (float64) re-implements the block forward with the convs (slot 0 of the block reads zero
padding for x_{t-1}) and the selector walk from the reference hidden states, independently of the library.
Projection layout assumed by both: (application, tap, group), row-major.
"""

from __future__ import annotations

import dataclasses
import json
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from scipy import stats

from dflash_jax.checkpoints.drafter import drafter_config_from_hf, load_drafter, load_drafter_and_head
from dflash_jax.checkpoints.export import apply_weight_tier, drafter_state_dict, export_drafter
from dflash_jax.errors import CheckpointError
from dflash_jax.models.drafter import (
    DrafterModel,
    contiguous_drafter_cache,
    propose_block,
    propose_hidden,
    write_context,
)
from dflash_jax.models.drafter2 import (
    Drafter2Model,
    DynamicConv,
    identity_init,
    propose_block2,
    shift_mask,
)
from dflash_jax.models.layers import DictBuilder, Pages, RandomBuilder, heads_major
from dflash_jax.models.target import TargetModel
from dflash_jax.spec_decode.sampling import SamplingArrays, speculative_accept, speculative_accept_q
from dflash_jax.train.losses import block_layout, selector_topk_loss
from tests.conftest import tiny_drafter_config
from tests.models.test_drafter_reference import BASE, random_weights, rms, rope, silu

V, H = BASE.vocab_size, BASE.hidden_size  # 96, 32
CFG2 = dataclasses.replace(
    BASE, arch="dflash2", conv_group_size=8, selector_rank=6, selector_top_k=5, layer_attn=((0, False), (0, True))
)
G = H // CFG2.conv_group_size
TOL = 2e-4


def random_weights2(cfg, seed: int) -> dict[str, np.ndarray]:
    """Our layout (matrices [in, out]); taps around the identity so every term matters."""
    w = random_weights(cfg, seed)
    rng = np.random.default_rng(seed + 100)
    taps = cfg.conv_kernel_size
    for i in range(cfg.num_layers):
        for conv in ("attention_conv", "mlp_conv"):
            base = 0.3 * rng.standard_normal((2, taps, H))
            base[:, 0] += 1.0
            w[f"layers.{i}.{conv}.base_kernel"] = base.astype(np.float32)
            w[f"layers.{i}.{conv}.kernel_projection.weight"] = (
                0.15 * rng.standard_normal((H, 2 * taps * (H // cfg.conv_group_size)))
            ).astype(np.float32)
    r = cfg.selector_rank
    w["candidate_selector.predecessor_codebook"] = rng.standard_normal((cfg.vocab_size, r)).astype(np.float32)
    w["candidate_selector.successor_codebook"] = rng.standard_normal((cfg.vocab_size, r)).astype(np.float32)
    w["candidate_selector.hidden_projection.weight"] = (0.5 * rng.standard_normal((H, r))).astype(np.float32)
    return w


# ------------------------------------------------------------------------------------------ numpy reference
def ref_conv(y, base, delta, group):
    """One application on a single block: y [W,H], base [taps,H], delta [W,taps,G]; y_{t-j} = 0 for t < j."""
    out = np.zeros_like(y)
    for t in range(y.shape[0]):
        for j in range(base.shape[0]):
            if t - j >= 0:
                out[t] += (base[j] + np.repeat(delta[t, j], group)) * y[t - j]
    return out


def reference_block2(cfg, w, taps, ctx_pos, anchor, start, width, embed):
    """Final-normed hidden [W,H] of one DFlash2 block (context rows at ctx_pos all < start)."""
    w = {k: v.astype(np.float64) for k, v in w.items()}
    eps, nh, nkv, d, gs, nt = (
        cfg.rms_norm_eps,
        cfg.num_heads,
        cfg.num_kv_heads,
        cfg.head_dim,
        cfg.conv_group_size,
        cfg.conv_kernel_size,
    )
    c = rms(taps.astype(np.float64) @ w["fc.weight"], w["hidden_norm.weight"], eps)
    s = c.shape[0]
    x = embed.astype(np.float64)[[anchor] + [cfg.mask_token_id] * (width - 1)] * cfg.input_embedding_scale
    qpos = start + np.arange(width)
    for i in range(cfg.num_layers):
        p, ac, mc = f"layers.{i}.self_attn.", f"layers.{i}.attention_conv.", f"layers.{i}.mlp_conv."
        _, causal = cfg.layer_attn[i]
        hn = rms(x, w[f"layers.{i}.input_layernorm.weight"], eps)
        delta = (hn @ w[ac + "kernel_projection.weight"]).reshape(width, 2, nt, H // gs)
        hn = ref_conv(hn, w[ac + "base_kernel"][0], delta[:, 0], gs)
        q = rope(
            rms((hn @ w[p + "q_proj.weight"]).reshape(width, nh, d), w[p + "q_norm.weight"], eps), qpos, cfg.rope_theta
        )

        def kv(src, pos, p=p):
            k = rms((src @ w[p + "k_proj.weight"]).reshape(len(src), nkv, d), w[p + "k_norm.weight"], eps)
            return rope(k, pos, cfg.rope_theta), (src @ w[p + "v_proj.weight"]).reshape(len(src), nkv, d)

        kc, vc = kv(c, ctx_pos)
        kb, vb = kv(hn, qpos)
        k, v = np.concatenate([kc, kb]), np.concatenate([vc, vb])
        vis = np.ones((width, s + width), bool)
        if causal:
            vis[:, s:] = np.tril(np.ones((width, width), bool))
        att = np.zeros((width, nh, d))
        for hh in range(nh):
            g = hh // (nh // nkv)
            sc = np.where(vis, q[:, hh] @ k[:, g].T / np.sqrt(d), -np.inf)
            pr = np.exp(sc - sc.max(-1, keepdims=True))
            att[:, hh] = (pr / pr.sum(-1, keepdims=True)) @ v[:, g]
        o = att.reshape(width, nh * d) @ w[p + "o_proj.weight"]
        x = x + ref_conv(o, w[ac + "base_kernel"][1], delta[:, 1], gs)
        hn = rms(x, w[f"layers.{i}.post_attention_layernorm.weight"], eps)
        delta = (hn @ w[mc + "kernel_projection.weight"]).reshape(width, 2, nt, H // gs)
        hn = ref_conv(hn, w[mc + "base_kernel"][0], delta[:, 0], gs)
        m = f"layers.{i}.mlp."
        mlp = (silu(hn @ w[m + "gate_proj.weight"]) * (hn @ w[m + "up_proj.weight"])) @ w[m + "down_proj.weight"]
        x = x + ref_conv(mlp, w[mc + "base_kernel"][1], delta[:, 1], gs)
    return rms(x, w["norm.weight"], eps)


def reference_walk(cfg, w, hidden, lm_head, anchor, preds=None, temperature=1.0):
    """Greedy walk over the draft slots of hidden [W,H]. With `preds` (the predecessors actually used), also the
    softmax q at `temperature` along that path. Returns (drafts, candidate ids per slot, q per slot)."""
    w = {k: v.astype(np.float64) for k, v in w.items()}
    a_cb, b_cb = w["candidate_selector.predecessor_codebook"], w["candidate_selector.successor_codebook"]
    p = w["candidate_selector.hidden_projection.weight"]
    pred, drafts, cands, qs = anchor, [], [], []
    for t in range(1, hidden.shape[0]):
        logits = hidden[t] @ lm_head.astype(np.float64)
        ids = np.argsort(-logits, kind="stable")[: cfg.selector_top_k]
        if preds is not None:
            pred = preds[t - 1]
        u = logits[ids] * cfg.output_multiplier  # z-lab compute_logits: multiplier, then softcap
        if cfg.final_logit_softcapping > 0:
            u = np.tanh(u / cfg.final_logit_softcapping) * cfg.final_logit_softcapping
        s = u + (a_cb[pred] * (hidden[t] @ p)) @ b_cb[ids].T
        e = np.exp((s - s.max()) / temperature)
        qs.append(e / e.sum())
        cands.append(ids)
        pred = int(ids[np.argmax(s)])
        drafts.append(pred)
    return drafts, np.stack(cands), np.stack(qs)


# ------------------------------------------------------------------------------------------ helpers
@partial(jax.jit, static_argnames=("graphdef",))
def jit_write(graphdef, state, cache, taps, positions, slots):
    return write_context(nnx.merge(graphdef, state), cache, taps, positions, slots)


@partial(jax.jit, static_argnames=("graphdef", "width", "kv_len", "v2"))
def jit_propose(
    graphdef, state, embed, lm_head, cache, anchor, start, slots, temperature, seed, *, width, kv_len, v2=True
):
    m = nnx.merge(graphdef, state)
    if not v2:
        return propose_block(m, embed, lm_head, cache, anchor, start, slots, width=width, kv_len=kv_len)[0]
    return propose_block2(
        m, embed, lm_head, cache, anchor, start, slots, width=width, kv_len=kv_len, temperature=temperature, seed=seed
    )


@partial(jax.jit, static_argnames=("graphdef", "width", "kv_len"))
def jit_hidden(graphdef, state, embed, cache, anchor, start, slots, *, width, kv_len):
    return propose_hidden(nnx.merge(graphdef, state), embed, cache, anchor, start, slots, width=width, kv_len=kv_len)


def sp_arrays(n, t=1.0, top_k=0, top_p=1.0, seeds=None):
    return SamplingArrays(
        jnp.full((n,), t, jnp.float32),
        jnp.full((n,), top_k, jnp.int32),
        jnp.full((n,), top_p, jnp.float32),
        jnp.asarray(np.arange(n) if seeds is None else seeds, jnp.uint32),
    )


class Setup:
    """A random-weight DFlash2 drafter (numpy weights) with a filled context cache in slot 0."""

    def __init__(self, cfg=CFG2, seed=21, n_ctx=9):
        self.cfg, self.w = cfg, random_weights2(cfg, seed)
        self.model = Drafter2Model(cfg, H, DictBuilder(dict(self.w), "test"))
        self.graphdef, self.state = nnx.split(self.model)
        rng = np.random.default_rng(seed + 1)
        self.embed = rng.standard_normal((cfg.vocab_size, H)).astype(np.float32)
        self.lm_head = (0.4 * rng.standard_normal((H, cfg.vocab_size))).astype(np.float32)
        self.taps = rng.standard_normal((n_ctx, cfg.num_taps * H)).astype(np.float32)
        self.n_ctx = n_ctx
        cache, self.pages = contiguous_drafter_cache(cfg, 1, 32, page_size=8)
        pos = jnp.arange(n_ctx, dtype=jnp.int32)[None]
        self.cache = jit_write(self.graphdef, self.state, cache, jnp.asarray(self.taps)[None], pos, self.pages)

    def propose(self, anchor, start, n=1, temperature=None, seed=None, width=None):
        width = width or self.cfg.block_size
        return jit_propose(
            self.graphdef,
            self.state,
            jnp.asarray(self.embed),
            jnp.asarray(self.lm_head),
            self.cache,
            jnp.full((n,), anchor, jnp.int32),
            jnp.full((n,), start, jnp.int32),
            Pages(jnp.broadcast_to(self.pages.table, (n, self.pages.table.shape[1]))),  # n rows, one sequence
            temperature,
            seed,
            width=width,
            kv_len=16,
        )


@pytest.fixture(scope="module")
def setup() -> Setup:
    return Setup()


# ------------------------------------------------------------------------------------------ config
def _hf(**kw):
    d = {
        "architectures": ["DFlash2DraftModel"],
        "hidden_size": 32,
        "intermediate_size": 56,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "vocab_size": 96,
        "dflash_config": {"mask_token_id": 95, "target_layer_ids": [0, 2]},
    }
    d.update(kw)
    return d


def test_config_fields_top_level_or_dflash_config():
    cfg = drafter_config_from_hf(_hf(conv_group_size=8, selector_rank=12), "d")
    assert (cfg.arch, cfg.conv_kernel_size, cfg.conv_group_size, cfg.selector_rank, cfg.selector_top_k) == (
        "dflash2",
        2,
        8,
        12,
        16,
    )
    sub = {"mask_token_id": 95, "target_layer_ids": [0, 2], "selector_top_k": 4, "conv_group_size": 4}
    cfg = drafter_config_from_hf(_hf(dflash_config=sub), "d")
    assert (cfg.selector_top_k, cfg.conv_group_size) == (4, 4)
    assert drafter_config_from_hf(_hf(architectures=["DFlashDraftModel"]), "d").arch == "dflash"
    with pytest.raises(CheckpointError, match="conv_group_size 5 does not divide hidden_size 32"):
        drafter_config_from_hf(_hf(conv_group_size=5), "d")
    with pytest.raises(CheckpointError, match="selector_top_k"):
        drafter_config_from_hf(_hf(selector_top_k=200), "d")


# ------------------------------------------------------------------------------------------ reference
def test_block_forward_and_walk_match_numpy_reference(setup):
    start, anchor, width = setup.n_ctx, 7, setup.cfg.block_size
    h = np.asarray(
        jit_hidden(
            setup.graphdef,
            setup.state,
            jnp.asarray(setup.embed),
            setup.cache,
            jnp.asarray([anchor], jnp.int32),
            jnp.asarray([start], jnp.int32),
            setup.pages,
            width=width,
            kv_len=16,
        )
    )[0]
    ref = reference_block2(setup.cfg, setup.w, setup.taps, np.arange(start), anchor, start, width, setup.embed)
    np.testing.assert_allclose(h, ref, atol=TOL, rtol=TOL)
    # the convs matter: with identity taps the reference differs
    ident = dict(setup.w)
    for k in ident:
        if k.endswith("base_kernel"):
            ident[k] = np.broadcast_to(np.array([1.0, 0.0])[None, :, None], ident[k].shape).astype(np.float32)
        if k.endswith("kernel_projection.weight"):
            ident[k] = np.zeros_like(ident[k])
    assert (
        np.abs(
            reference_block2(setup.cfg, ident, setup.taps, np.arange(start), anchor, start, width, setup.embed) - ref
        ).max()
        > 0.05
    )

    drafts, ids, q = (np.asarray(x)[0] for x in setup.propose(anchor, start))
    ref_drafts, ref_ids, _ = reference_walk(setup.cfg, setup.w, ref, setup.lm_head, anchor)
    assert drafts.tolist() == ref_drafts
    np.testing.assert_array_equal(ids, ref_ids)
    np.testing.assert_array_equal(q, (ids == drafts[:, None]).astype(np.float32))  # greedy: one-hot q
    # the selector matters: the walk differs from the backbone's argmax somewhere in these blocks
    differs = False
    for a in range(12):
        d, i, _ = (np.asarray(x)[0] for x in setup.propose(a, start))
        differs |= bool((d != i[:, 0]).any())
    assert differs


def test_sampled_walk_q_matches_numpy_reference(setup):
    start, anchor, n, t = setup.n_ctx, 3, 6, 8.0
    drafts, ids, q = (np.asarray(x) for x in setup.propose(anchor, start, n, jnp.full((n,), t), jnp.arange(n) + 40))
    ref = reference_block2(
        setup.cfg, setup.w, setup.taps, np.arange(start), anchor, start, setup.cfg.block_size, setup.embed
    )
    for r in range(n):
        preds = [anchor] + drafts[r, :-1].tolist()
        _, ref_ids, ref_q = reference_walk(setup.cfg, setup.w, ref, setup.lm_head, anchor, preds, t)
        np.testing.assert_array_equal(ids[r], ref_ids)
        np.testing.assert_allclose(q[r], ref_q, atol=1e-4)
        assert all(drafts[r, t] in ids[r, t] for t in range(drafts.shape[1]))
    assert len({tuple(d) for d in drafts.tolist()}) > 1  # the seeds matter


def test_logit_scalars_parsed_and_applied_like_the_reference():
    """z-lab checkpoints set output_multiplier / final_logit_softcapping (applied to the selector's U) and may set
    input_embedding_scale (applied to the block's embeddings); greedy and sampled walks follow the reference."""
    sub = {
        "mask_token_id": 95,
        "target_layer_ids": [0, 2],
        "output_multiplier": 0.2,
        "final_logit_softcapping": 3.0,
        "input_embedding_scale": 1.5,
    }
    parsed = drafter_config_from_hf(_hf(dflash_config=sub), "d")
    assert (parsed.output_multiplier, parsed.final_logit_softcapping, parsed.input_embedding_scale) == (0.2, 3.0, 1.5)
    for bad in ({"output_multiplier": 0}, {"final_logit_softcapping": -1}, {"input_embedding_scale": "x"}):
        with pytest.raises(CheckpointError, match=next(iter(bad))):
            drafter_config_from_hf(_hf(dflash_config={**sub, **bad}), "d")
    cfg = dataclasses.replace(CFG2, output_multiplier=0.2, final_logit_softcapping=3.0, input_embedding_scale=1.5)
    st = Setup(cfg)
    from dflash_jax.checkpoints.export import drafter_config_json

    # the export keeps them (non-defaults only); config.json has one is_causal, so export a uniform-causality copy
    uniform = Drafter2Model(dataclasses.replace(cfg, layer_attn=((0, False), (0, False))), H, RandomBuilder(0))
    written = drafter_config_json(uniform, 4)["dflash_config"]
    assert (written["output_multiplier"], written["final_logit_softcapping"], written["input_embedding_scale"]) == (
        0.2,
        3.0,
        1.5,
    )
    start, anchor, n, t = st.n_ctx, 5, 4, 2.0
    ref = reference_block2(cfg, st.w, st.taps, np.arange(start), anchor, start, cfg.block_size, st.embed)
    drafts, ids, _ = (np.asarray(x)[0] for x in st.propose(anchor, start))
    ref_drafts, ref_ids, _ = reference_walk(cfg, st.w, ref, st.lm_head, anchor)
    assert drafts.tolist() == ref_drafts
    np.testing.assert_array_equal(ids, ref_ids)
    drafts, ids, q = (np.asarray(x) for x in st.propose(anchor, start, n, jnp.full((n,), t), jnp.arange(n) + 9))
    for r in range(n):
        preds = [anchor] + drafts[r, :-1].tolist()
        np.testing.assert_allclose(q[r], reference_walk(cfg, st.w, ref, st.lm_head, anchor, preds, t)[2], atol=1e-4)
    # and they matter: the unscaled reference walks elsewhere or with another q
    plain = reference_walk(CFG2, st.w, ref, st.lm_head, anchor, [anchor] + drafts[0, :-1].tolist(), t)[2]
    assert np.abs(plain - q[0]).max() > 1e-3


# ------------------------------------------------------------------------------------------ block boundaries
def test_shift_mask_layouts():
    bid, slot = (jnp.asarray(a) for a in block_layout(3, 4))
    m = np.asarray(shift_mask(bid, slot, 3))
    assert m[0].all()
    np.testing.assert_array_equal(m[1], np.tile([0, 1, 1, 1], 3).astype(bool))
    np.testing.assert_array_equal(m[2], np.tile([0, 0, 1, 1], 3).astype(bool))


def test_conv_slot0_reads_zero_padding():
    cfg = dataclasses.replace(CFG2, conv_group_size=8)
    conv = DynamicConv(cfg, "c", RandomBuilder(3, std=0.5))
    y = jnp.asarray(np.random.default_rng(0).standard_normal((2, 8, H)), jnp.float32)
    k = conv.coefficients(y)
    bid, slot = (jnp.asarray(a) for a in block_layout(2, 4))
    out = np.asarray(conv(y, k, 1, shift_mask(bid, slot, 2)))
    kk = np.asarray(k)[:, :, 1]  # [B,Q,taps,G,gs]
    yg = np.asarray(y).reshape(2, 8, G, -1)
    exp = kk[:, :, 0] * yg
    exp[:, 1:4] += kk[:, 1:4, 1] * yg[:, 0:3]  # block 0: slots 1..3 read their predecessor
    exp[:, 5:8] += kk[:, 5:8, 1] * yg[:, 4:7]  # block 1: slot 0 (row 4) reads zero, not row 3
    np.testing.assert_allclose(out, exp.reshape(2, 8, H), rtol=1e-6, atol=1e-6)


def test_packed_training_blocks_equal_blocks_alone(setup):
    """Several blocks packed end to end in one row (training layout) give each block's own forward."""
    m, cfg = setup.model, setup.cfg
    rng = np.random.default_rng(5)
    taps = jnp.asarray(rng.standard_normal((1, 14, cfg.num_taps * H)), jnp.float32)
    anchors = np.array([3, 6, 10])
    toks = rng.integers(0, V - 1, 3)
    b = cfg.block_size
    ctx_pos = jnp.arange(14, dtype=jnp.int32)

    @partial(jax.jit, static_argnums=2)
    def run(anchors, toks, n):
        bid, slot = (jnp.asarray(a) for a in block_layout(n, b))
        kv = m.context_kv(taps, ctx_pos[None])
        blk = jnp.where(slot == 0, toks[bid], cfg.mask_token_id)
        pos = (anchors[bid] + slot)[None]
        ks, vs = [heads_major(k) for k, _ in kv], [heads_major(v) for _, v in kv]
        return m.block_hidden(jnp.asarray(setup.embed)[blk][None], pos, ks, vs, ctx_pos, anchors[bid][None], bid, slot)

    packed = np.asarray(run(jnp.asarray(anchors), jnp.asarray(toks), 3))[0]
    for i in range(3):
        alone = np.asarray(run(jnp.asarray(anchors[i : i + 1]), jnp.asarray(toks[i : i + 1]), 1))[0]
        np.testing.assert_allclose(packed[i * b : (i + 1) * b], alone, atol=1e-5)


# ------------------------------------------------------------------------------------------ identity init
def _v2_from_v1(v1: DrafterModel, cfg2, seed=7) -> Drafter2Model:
    m2 = identity_init(Drafter2Model(cfg2, v1.cfg.hidden_size, RandomBuilder(seed, std=0.2)), seed)
    nnx.update(m2, nnx.state(v1, nnx.Param))
    return m2


def test_identity_initialised_dflash2_drafts_what_dflash_drafts():
    cfg1 = dataclasses.replace(BASE, layer_attn=((0, False), (0, True)))
    v1 = DrafterModel(cfg1, H, DictBuilder(random_weights(cfg1, 3), "v1"))
    m2 = _v2_from_v1(
        v1, dataclasses.replace(cfg1, arch="dflash2", conv_group_size=8, selector_rank=6, selector_top_k=5)
    )
    rng = np.random.default_rng(9)
    embed = jnp.asarray(rng.standard_normal((V, H)), jnp.float32)
    lm_head = jnp.asarray(0.4 * rng.standard_normal((H, V)), jnp.float32)
    taps = jnp.asarray(rng.standard_normal((3, 12, cfg1.num_taps * H)), jnp.float32)
    pos = jnp.broadcast_to(jnp.arange(12, dtype=jnp.int32), (3, 12))
    anchor, start = jnp.asarray([5, 40, 77], jnp.int32), jnp.asarray([4, 9, 12], jnp.int32)
    out = []
    for m in (v1, m2):
        g, s = nnx.split(m)
        cache, slots = contiguous_drafter_cache(m.cfg, 3, 32, page_size=8)
        cache = jit_write(g, s, cache, taps, pos, slots)
        out.append((cache, np.asarray(jit_hidden(g, s, embed, cache, anchor, start, slots, width=5, kv_len=16))))
    np.testing.assert_array_equal(out[0][1], out[1][1])  # bitwise: the convs are exact identities
    g1, s1 = nnx.split(v1)
    g2, s2 = nnx.split(m2)
    d1 = jit_propose(g1, s1, embed, lm_head, out[0][0], anchor, start, slots, None, None, width=5, kv_len=16, v2=False)
    d2, ids, _ = jit_propose(g2, s2, embed, lm_head, out[1][0], anchor, start, slots, None, None, width=5, kv_len=16)
    np.testing.assert_array_equal(np.asarray(d1), np.asarray(d2))
    np.testing.assert_array_equal(np.asarray(d2), np.asarray(ids)[..., 0])


# ------------------------------------------------------------------------------------------ lossless sampling
def chi2_ok(samples, probs, what):
    probs = np.asarray(probs, np.float64) / np.sum(probs, dtype=np.float64)
    counts = np.bincount(samples, minlength=len(probs))
    support = probs > 0
    assert counts[~support].sum() == 0, f"{what}: samples outside the support"
    res = stats.chisquare(counts[support], probs[support] * counts.sum())
    assert res.pvalue > 1e-3, f"{what}: counts {counts} vs {np.round(probs * counts.sum())} (p={res.pvalue})"


def ref_probs(logits, t, k):
    z = logits / t
    if k:
        z = np.where(z >= np.sort(z)[-k], z, -np.inf)
    e = np.exp(z - z.max())
    return e / e.sum()


def test_sampled_selector_drafts_are_verified_losslessly():
    """Drafts sampled by the selector walk at T > 0 (q over its top-4 of 8 tokens), verified against a target whose
    next-token distribution depends on the first draft: the first emitted token ~ p0, the second given an accepted
    first f ~ p1[f], the drafts themselves ~ q, and the first draft is accepted with probability Σ min(p0, q)."""
    v, n, t, topk = 8, 16000, 4.0, 5
    cfg = dataclasses.replace(CFG2, vocab_size=v, mask_token_id=v - 1, block_size=3, selector_top_k=4)
    s = Setup(cfg, seed=4, n_ctx=6)
    drafts, ids, q = (np.asarray(x) for x in s.propose(2, 6, n, jnp.full((n,), t), jnp.arange(n) * 7919 + 11))
    q1 = np.zeros(v)
    q1[ids[0, 0]] = q[0, 0]
    chi2_ok(drafts[:, 0], q1, "first draft ~ q")
    assert (q1 > 0.05).sum() >= 2  # a genuinely random proposal

    rng = np.random.default_rng(0)
    l0 = 1.2 * t * rng.standard_normal(v).astype(np.float32)
    l1 = 1.2 * t * rng.standard_normal((v, v)).astype(np.float32)  # next row's logits given the first draft
    l2 = 1.2 * t * rng.standard_normal((v, v)).astype(np.float32)
    logits = jnp.asarray(np.stack([np.broadcast_to(l0, (n, v)), l1[drafts[:, 0]], l2[drafts[:, 1]]], axis=1))
    sp = sp_arrays(n, t, topk, seeds=np.arange(n) * 31 + 5)
    positions = jnp.broadcast_to(jnp.arange(6, 9, dtype=jnp.int32), (n, 3))
    nd = jnp.full((n,), 2, jnp.int32)
    acc, bonus = (
        np.asarray(x)
        for x in jax.jit(speculative_accept_q)(
            jnp.asarray(drafts), logits, nd, sp, positions, jnp.asarray(ids), jnp.asarray(q)
        )
    )
    p0 = ref_probs(l0, t, topk)
    first = np.where(acc >= 1, drafts[:, 0], bonus)
    chi2_ok(first, p0, "first token")
    cond = acc >= 1
    second = np.where(acc >= 2, drafts[:, 1], bonus)
    checked = 0
    for f in range(v):
        rows = cond & (first == f)
        if rows.sum() >= 800:
            chi2_ok(second[rows], ref_probs(l1[f], t, topk), f"second token given {f}")
            checked += 1
    assert checked >= 2
    # acceptance of the first draft: Σ min(p0, q) (the one-hot rule, also lossless, only reaches Σ p0·q)
    assert abs(cond.mean() - np.minimum(p0, q1).sum()) < 0.015
    acc1, _ = jax.jit(speculative_accept)(jnp.asarray(drafts), logits, nd, sp, positions)
    assert abs((np.asarray(acc1) >= 1).mean() - (p0 * q1).sum()) < 0.015
    assert np.minimum(p0, q1).sum() > (p0 * q1).sum() + 0.05
    # the check has power: resampling from p (not the residual) after a rejection fails it
    wrong = np.where(cond, drafts[:, 0], np.random.default_rng(1).choice(v, size=n, p=p0 / p0.sum()))
    with pytest.raises(AssertionError):
        chi2_ok(wrong, p0, "wrong rule")


def test_accept_q_with_one_hot_q_equals_speculative_accept():
    rng = np.random.default_rng(1)
    b, k, v = 48, 3, 16
    logits = jnp.asarray(rng.standard_normal((b, k + 1, v)), jnp.float32)
    drafts = jnp.asarray(rng.integers(0, v, (b, k)), jnp.int32)
    ids = jnp.concatenate([drafts[..., None], (drafts[..., None] + jnp.arange(1, 4)) % v], axis=-1)
    q = jnp.zeros(ids.shape).at[..., 0].set(1.0)
    temps = np.where(np.arange(b) % 3 == 0, 0.0, 0.9)  # greedy rows too
    sp = SamplingArrays(
        jnp.asarray(temps, jnp.float32), jnp.zeros((b,), jnp.int32), jnp.ones((b,)), jnp.arange(b, dtype=jnp.uint32)
    )
    pos = jnp.broadcast_to(jnp.arange(k + 1, dtype=jnp.int32), (b, k + 1))
    nd = jnp.asarray(rng.integers(0, k + 1, b), jnp.int32)
    a1, b1 = jax.jit(speculative_accept)(drafts, logits, nd, sp, pos)
    a2, b2 = jax.jit(speculative_accept_q)(drafts, logits, nd, sp, pos, ids, q)
    np.testing.assert_array_equal(np.asarray(a1), np.asarray(a2))
    np.testing.assert_array_equal(np.asarray(b1), np.asarray(b2))


# ------------------------------------------------------------------------------------------ through the runner
@pytest.fixture(scope="module")
def drafter2(tiny_llama_cfg):
    cfg = tiny_drafter_config(tiny_llama_cfg, arch="dflash2", selector_rank=8, selector_top_k=8)
    return Drafter2Model(cfg, tiny_llama_cfg.hidden_size, RandomBuilder(1, std=0.2))


def test_greedy_parity_with_a_dflash2_drafter(tiny_target, drafter2):
    from dflash_jax.spec_decode.runner import SpecRunner
    from tests.spec_decode.test_spec_parity import run_batch

    prompts = [[5, 17, 99, 3], [42, 7, 8, 9, 10, 11, 12]]
    n = 14
    plain = SpecRunner(tiny_target, None, max_slots=2, max_model_len=48, batch_buckets=(2,))
    ref, _ = run_batch(plain, prompts, n)
    spec = SpecRunner(tiny_target, drafter2, max_slots=2, max_model_len=48, batch_buckets=(2,))
    out, steps = run_batch(spec, prompts, n)
    assert out == ref
    assert all(r.num_drafts >= 1 for s in steps.values() for r in s[:-1])


def test_runner_samples_with_a_dflash2_drafter(tiny_target, drafter2):
    """T > 0 through SpecRunner: runs, verifies with the walk's q (the step traces `speculative_accept_q`'s
    residual scatter), and is a pure function of the seeds."""
    from dflash_jax.spec_decode.runner import SpecRunner
    from dflash_jax.types import SamplingParams

    def run():
        r = SpecRunner(tiny_target, drafter2, max_slots=2, max_model_len=48, batch_buckets=(2,))
        sps = [SamplingParams(temperature=0.8, seed=3), SamplingParams(temperature=0.0)]
        first = r.add_many([(i, [5, 17, 99, 3], sp) for i, sp in enumerate(sps)])
        out = {i: list(x.tokens) for i, x in first.items()}
        for _ in range(3):
            for i, res in r.step([0, 1], {0: 50, 1: 50}).items():
                assert len(res.tokens) == res.num_accepted + 1 <= r.gamma
                out[i] += res.tokens
        return out

    a, b = run(), run()
    assert a == b


# ------------------------------------------------------------------------------------------ export / load
def test_export_load_round_trip(tmp_path, tiny_llama_cfg, drafter2):
    from safetensors.numpy import load_file

    out = export_drafter(drafter2, tmp_path / "d2", tiny_llama_cfg.num_layers)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["DFlash2DraftModel"]
    assert (cfg["conv_group_size"], cfg["selector_rank"], cfg["dflash_config"]["selector_top_k"]) == (16, 8, 8)
    t = load_file(str(out / "model.safetensors"))
    h, g = tiny_llama_cfg.hidden_size, tiny_llama_cfg.hidden_size // 16
    assert t["layers.1.attention_conv.base_kernel"].shape == (2, 2, h)
    assert t["layers.0.mlp_conv.kernel_projection.weight"].shape == (2 * 2 * g, h)  # HF [out, in]
    assert t["candidate_selector.predecessor_codebook"].shape == (tiny_llama_cfg.vocab_size, 8)
    assert t["candidate_selector.successor_codebook"].shape == (tiny_llama_cfg.vocab_size, 8)
    assert t["candidate_selector.hidden_projection.weight"].shape == (8, h)
    loaded = load_drafter(out, tiny_llama_cfg)
    assert isinstance(loaded, Drafter2Model) and loaded.cfg == drafter2.cfg
    a, b = drafter_state_dict(drafter2), drafter_state_dict(loaded)
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def test_fp8_aux_tier_quantizes_the_dflash2_projections(tmp_path, tiny_target, tiny_llama_cfg):
    """The conv kernel projections and the selector's hidden projection are covered by fp8-aux (codebooks are not);
    the quantized drafter drafts, and a quantized checkpoint (as `dflash-jax quantize` writes it) loads back."""
    from dflash_jax.checkpoints.export import drafter_config_json, drafter_weights_as_stored
    from dflash_jax.quant import is_quantized
    from dflash_jax.quant.io import save_quantized

    cfg = tiny_drafter_config(tiny_llama_cfg, arch="dflash2", selector_rank=8, selector_top_k=8)
    m = Drafter2Model(cfg, tiny_llama_cfg.hidden_size, RandomBuilder(2, std=0.2))
    head = apply_weight_tier(m, tiny_target.lm_head[...], "fp8-aux")
    assert is_quantized(m.layers[0].attention_conv.kernel_projection[...])
    assert is_quantized(m.candidate_selector.hidden_projection[...])
    assert not is_quantized(m.candidate_selector.successor_codebook[...])
    weights = drafter_weights_as_stored(m)
    weights["lm_head.weight"] = head
    save_quantized(tmp_path / "q", weights)
    js = drafter_config_json(m, tiny_llama_cfg.num_layers) | {"dflash_jax_quantization": "fp8-aux"}
    (tmp_path / "q" / "config.json").write_text(json.dumps(js))
    loaded, lhead = load_drafter_and_head(tmp_path / "q", tiny_llama_cfg)
    assert isinstance(loaded, Drafter2Model) and is_quantized(loaded.layers[1].mlp_conv.kernel_projection[...])
    drafts = []
    for model, hd in ((m, head), (loaded, lhead)):
        cache, pages = contiguous_drafter_cache(cfg, 1, 16, page_size=8)
        d, _, _ = propose_block2(
            model,
            tiny_target.embed[...],
            hd,
            cache,
            jnp.asarray([3]),
            jnp.asarray([4]),
            pages,
            width=4,
            kv_len=8,
        )
        drafts.append(np.asarray(d))
    np.testing.assert_array_equal(drafts[0], drafts[1])


# ------------------------------------------------------------------------------------------ training
def test_selector_loss_matches_direct_computation():
    rng = np.random.default_rng(2)
    r, h, v, rank, k = 11, 8, 20, 3, 4
    hs = jnp.asarray(rng.standard_normal((r, h)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((h, v)), jnp.float32)
    a, b, p = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in ((v, rank), (v, rank), (h, rank)))
    logits = np.asarray(hs @ w)
    top = np.argsort(-logits, axis=-1)[:, :k]
    labels = np.where(rng.random(r) < 0.7, top[np.arange(r), rng.integers(0, k, r)], rng.integers(0, v, r))
    pred = rng.integers(0, v, r)
    wt = rng.random(r).astype(np.float32)
    loss, m, correct = selector_topk_loss(
        hs, w, a, b, p, jnp.asarray(pred), jnp.asarray(labels), jnp.asarray(wt), jnp.asarray(top, jnp.int32)
    )
    num = den = 0.0
    for i in range(r):
        s = logits[i, top[i]] + (np.asarray(a)[pred[i]] * (np.asarray(hs)[i] @ np.asarray(p))) @ np.asarray(b)[top[i]].T
        assert bool(correct[i]) == (top[i][np.argmax(s)] == labels[i])  # the selector's pick is the true token
        if labels[i] not in top[i]:
            continue
        ce = np.log(np.exp(s - s.max()).sum()) + s.max() - s[list(top[i]).index(labels[i])]
        num, den = num + wt[i] * ce, den + wt[i]
    assert float(loss) == pytest.approx(num / den, rel=1e-4)
    assert float(m["candidate_recall"]) == pytest.approx(np.mean([labels[i] in top[i] for i in range(r)]))


def test_dflash2_training_loss_runs_and_decreases(tmp_path):
    from dflash_jax.train.trainer import TrainConfig, drafter_loss, init_drafter, train
    from tests.train.test_train import TINY, _tc, _toy_data

    target = TargetModel(TINY, RandomBuilder(0, std=0.2))
    data = _toy_data(rows=16)
    kw = dict(arch="dflash2", conv_group_size=16, selector_rank=8, selector_top_k=8)
    # fresh DFlash2 = DFlash: with the same backbone weights the decay CE is the same number
    tc1, tc2 = _tc(), _tc(**kw)
    v1, m2 = init_drafter(TINY, tc1), init_drafter(TINY, tc2)
    nnx.update(m2, nnx.state(v1, nnx.Param))
    batch = {k: jnp.asarray(x) for k, x in data.batch(0, tc1).items()}
    loss_fn = jax.jit(drafter_loss, static_argnums=(4,))
    l1, _ = loss_fn(v1, target.embed[...], target.lm_head[...], batch, tc1)
    l2, (*_, extra) = loss_fn(m2, target.embed[...], target.lm_head[...], batch, tc2)
    assert float(extra["ce_loss"]) == pytest.approx(float(l1), rel=1e-6)
    assert float(l2) > float(l1)  # + the selector term
    tc = TrainConfig(**{**dataclasses.asdict(tc2), "steps": 8, "save_every": 8, "lr": 3e-3})
    model, hist = train(TINY, target.embed[...], target.lm_head[...], data, tc, tmp_path / "run")
    assert isinstance(model, Drafter2Model)
    assert hist[-1]["loss"] < hist[0]["loss"]
    assert all(np.isfinite(r["sel_loss"]) and 0 <= r["candidate_recall"] <= 1 for r in hist)
