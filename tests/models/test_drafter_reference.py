"""The DFlash drafter forward against an independent numpy (float64) reference of the same math.

Reference (z-lab `DFlashDraftModel`): context features c = hidden_norm(concat(taps) @ fc);
in every layer the context enters only as keys/values through that layer's k_proj/v_proj, k_norm and RoPE at the
context token's absolute position; the block [anchor, MASK...] sits at absolute positions start..start+W-1, its
queries see the context strictly before `start` and the block keys (all of them, or causally for causal layers;
sliding-window layers only keys less than `window` positions from the query, behind or ahead: z-lab's window, w-1
keys each side as flash attention runs it); final norm, target LM head; the output at slot k predicts position
start+k (slot 0 dropped).

The reference receives only the context rows before `start`; the library gets a cache that also holds rows at and
after `start` (as left by a verify), so the strict context mask is tested, not assumed.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dflash_jax.checkpoints.drafter import drafter_config_from_hf
from dflash_jax.config import DrafterConfig
from dflash_jax.errors import CheckpointError
from dflash_jax.models.drafter import (
    DrafterModel,
    contiguous_drafter_cache,
    propose_block,
    write_context,
)
from dflash_jax.models.layers import DictBuilder, Pages, heads_major

V, H = 96, 32  # target vocab / hidden (the drafter's hidden must equal the target's)
TOL = 2e-4


# Jitted wrappers around the library functions (one compile each instead of op-by-op dispatch).
@partial(jax.jit, static_argnames=("graphdef",))
def jit_write_context(graphdef, state, cache, taps, positions, slots):
    return write_context(nnx.merge(graphdef, state), cache, taps, positions, slots)


@partial(jax.jit, static_argnames=("graphdef", "width", "kv_len"))
def jit_propose(graphdef, state, embed, lm_head, cache, anchor, start, slots, *, width, kv_len):
    return propose_block(
        nnx.merge(graphdef, state), embed, lm_head, cache, anchor, start, slots, width=width, kv_len=kv_len
    )


@partial(jax.jit, static_argnames=("graphdef",))
def jit_block_hidden(graphdef, state, taps, ctx_positions, x, positions, ctx_pos, limit, block_id, slot):
    model = nnx.merge(graphdef, state)
    kv = model.context_kv(taps, ctx_positions)
    ks, vs = [heads_major(k) for k, _ in kv], [heads_major(v) for _, v in kv]
    return model.block_hidden(x, positions, ks, vs, ctx_pos, limit, block_id, slot)


BASE = DrafterConfig(
    hidden_size=H,
    intermediate_size=56,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    vocab_size=V,
    block_size=5,
    mask_token_id=V - 1,
    target_layer_ids=(1, 3, 5),
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    layer_attn=((0, False), (0, False)),
)
VARIANTS = {
    "full": BASE,
    # per-layer (window, causal): full non-causal, sliding causal, sliding non-causal, full causal; the windows are
    # narrower than the blocks (4-5 wide), so they cut into the block itself (behind, and ahead for non-causal)
    "mixed": dataclasses.replace(
        BASE,
        num_layers=4,
        num_heads=6,
        num_kv_heads=3,
        rope_theta=500.0,
        layer_attn=((0, False), (3, True), (2, False), (0, True)),
    ),
    # non-causal windows at least as wide as the block: the whole block is visible, the window cuts the context
    "wide-window": dataclasses.replace(BASE, layer_attn=((5, False), (7, False))),
}


def random_weights(cfg: DrafterConfig, seed: int) -> dict[str, np.ndarray]:
    """z-lab names, our [in, out] layout. Norm weights are 1 + noise so every norm's role is visible."""
    rng = np.random.default_rng(seed)

    def m(*shape, std=0.3):
        return (std * rng.standard_normal(shape)).astype(np.float32)

    def norm(n):
        return (1 + 0.2 * rng.standard_normal(n)).astype(np.float32)

    q, kv, f = cfg.q_dim, cfg.kv_dim, cfg.intermediate_size
    w = {"fc.weight": m(cfg.num_taps * H, H, std=0.15), "hidden_norm.weight": norm(H), "norm.weight": norm(H)}
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        w |= {
            p + "input_layernorm.weight": norm(H),
            p + "post_attention_layernorm.weight": norm(H),
            p + "self_attn.q_proj.weight": m(H, q),
            p + "self_attn.k_proj.weight": m(H, kv),
            p + "self_attn.v_proj.weight": m(H, kv),
            p + "self_attn.o_proj.weight": m(q, H),
            p + "self_attn.q_norm.weight": norm(cfg.head_dim),
            p + "self_attn.k_norm.weight": norm(cfg.head_dim),
            p + "mlp.gate_proj.weight": m(H, f),
            p + "mlp.up_proj.weight": m(H, f),
            p + "mlp.down_proj.weight": m(f, H),
        }
    return w


# ------------------------------------------------------------------------------------------ numpy reference
def rms(x, w, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def rope(x, pos, theta):
    """x [T, heads, d] at absolute positions pos [T]; HF rotate-half convention, rotary_dim = head_dim."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (np.arange(0, d, 2, dtype=np.float64) / d)
    ang = np.asarray(pos, np.float64)[:, None] * inv[None, :]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def silu(x):
    return x / (1 + np.exp(-x))


def reference_block(
    cfg, w, taps, ctx_pos, anchor, start, width, embed, lm_head, layer_attn=None, ctx_limit=None, ahead=True
):
    """One block [anchor, MASK*(width-1)] at positions start.. with context taps [S, n*H] at ctx_pos [S]; context
    rows are visible iff their position < ctx_limit (default: start). `ahead=False` bounds windows behind the
    query only (for showing that the bound ahead matters). Returns (final-normed hidden [W, H], logits [W, V])."""
    ctx_limit = start if ctx_limit is None else ctx_limit
    w = {k: v.astype(np.float64) for k, v in w.items()}
    eps, nh, nkv, d = cfg.rms_norm_eps, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    layer_attn = layer_attn or cfg.layer_attn
    c = rms(taps.astype(np.float64) @ w["fc.weight"], w["hidden_norm.weight"], eps)
    s = c.shape[0]
    tokens = [anchor] + [cfg.mask_token_id] * (width - 1)
    x = embed.astype(np.float64)[tokens]
    qpos = start + np.arange(width)
    kpos = np.concatenate([ctx_pos, qpos])
    is_ctx = np.arange(s + width) < s
    for i in range(cfg.num_layers):
        p = f"layers.{i}.self_attn."
        window, causal = layer_attn[i]
        hn = rms(x, w[f"layers.{i}.input_layernorm.weight"], eps)
        q = rope(
            rms((hn @ w[p + "q_proj.weight"]).reshape(width, nh, d), w[p + "q_norm.weight"], eps), qpos, cfg.rope_theta
        )

        def keys_values(src, pos, p=p):
            k = rms((src @ w[p + "k_proj.weight"]).reshape(len(src), nkv, d), w[p + "k_norm.weight"], eps)
            return rope(k, pos, cfg.rope_theta), (src @ w[p + "v_proj.weight"]).reshape(len(src), nkv, d)

        kc, vc = keys_values(c, ctx_pos)
        kb, vb = keys_values(hn, qpos)
        k, v = np.concatenate([kc, kb]), np.concatenate([vc, vb])
        vis = np.broadcast_to(np.where(is_ctx, kpos < ctx_limit, True), (width, s + width)).copy()
        if causal:
            vis &= is_ctx[None, :] | (kpos[None, :] <= qpos[:, None])
        if window:
            dist = qpos[:, None] - kpos[None, :]
            vis &= (np.abs(dist) if ahead else dist) < window
        out = np.zeros((width, nh, d))
        for hh in range(nh):
            g = hh // (nh // nkv)
            sc = q[:, hh] @ k[:, g].T / np.sqrt(d)
            sc = np.where(vis, sc, -np.inf)
            pr = np.exp(sc - sc.max(-1, keepdims=True))
            pr /= pr.sum(-1, keepdims=True)
            out[:, hh] = pr @ v[:, g]
        x = x + out.reshape(width, nh * d) @ w[p + "o_proj.weight"]
        hn = rms(x, w[f"layers.{i}.post_attention_layernorm.weight"], eps)
        m = f"layers.{i}.mlp."
        x = x + (silu(hn @ w[m + "gate_proj.weight"]) * (hn @ w[m + "up_proj.weight"])) @ w[m + "down_proj.weight"]
    out = rms(x, w["norm.weight"], eps)
    return out, out @ lm_head.astype(np.float64)


# ------------------------------------------------------------------------------------------ fixtures
class Setup:
    def __init__(self, name: str):
        self.cfg = VARIANTS[name]
        self.w = random_weights(self.cfg, seed=11)
        self.model = DrafterModel(self.cfg, H, DictBuilder(dict(self.w), "test"))
        rng = np.random.default_rng(12)
        self.embed = rng.standard_normal((V, H)).astype(np.float32)
        self.lm_head = (0.3 * rng.standard_normal((H, V))).astype(np.float32)
        self.taps = rng.standard_normal((2, 14, self.cfg.num_taps * H)).astype(np.float32)


@pytest.fixture(scope="module", params=list(VARIANTS), ids=list(VARIANTS))
def setup(request) -> Setup:
    return Setup(request.param)


def test_propose_block_after_write_context_matches_reference(setup):
    """Two sequences in slots 2 and 0; context written in two chunks (a prefill of 9 rows, then a verify's 5
    rows, some of which lie at/after the block start and must stay invisible); blocks at starts 11 and 6."""
    cfg, W = setup.cfg, 5
    cache, pages = contiguous_drafter_cache(cfg, 3, 32, page_size=8)
    slots = Pages(pages.table[jnp.asarray([2, 0])])  # the pages of sequences 2 and 0 of three
    pos = np.broadcast_to(np.arange(14), (2, 14))
    gd, state = nnx.split(setup.model)
    for lo, hi in ((0, 9), (9, 14)):  # a 9-row prefill, then a 5-row verify
        cache = jit_write_context(
            gd, state, cache, jnp.asarray(setup.taps[:, lo:hi]), jnp.asarray(pos[:, lo:hi], jnp.int32), slots
        )
    starts, anchors = np.array([11, 6]), np.array([7, 42])
    drafts, logits = jit_propose(
        gd,
        state,
        jnp.asarray(setup.embed),
        jnp.asarray(setup.lm_head),
        cache,
        jnp.asarray(anchors, jnp.int32),
        jnp.asarray(starts, jnp.int32),
        slots,
        width=W,
        kv_len=16,
    )
    drafts, logits = np.asarray(drafts), np.asarray(logits)
    assert drafts.shape == (2, W - 1) and logits.shape == (2, W - 1, V)
    for b in range(2):
        st = starts[b]
        _, ref = reference_block(
            cfg, setup.w, setup.taps[b, :st], np.arange(st), anchors[b], st, W, setup.embed, setup.lm_head
        )
        np.testing.assert_allclose(logits[b], ref[1:], atol=TOL, rtol=TOL)  # slot 0 dropped
        np.testing.assert_array_equal(drafts[b], ref[1:].argmax(-1))
        # the reference discriminates: letting the context row at `start` leak in (`<=`) changes the logits
        _, leak = reference_block(
            cfg,
            setup.w,
            setup.taps[b, : st + 1],
            np.arange(st + 1),
            anchors[b],
            st,
            W,
            setup.embed,
            setup.lm_head,
            ctx_limit=st + 1,
        )
        assert np.abs(leak[1:] - ref[1:]).max() > 1e-3


def test_block_hidden_many_blocks_per_row_matches_reference(setup):
    """The training layout: two blocks per row in one call (each with its own anchor position, context limit and
    block id); each block equals the reference run on that block alone."""
    cfg, W = setup.cfg, 4
    anchors_pos = np.array([[4, 10], [7, 12]])
    anchor_tok = np.array([[3, 50], [91, 8]])
    S = 14
    ctx_pos = np.broadcast_to(np.arange(S), (2, S))
    tokens = np.stack(
        [np.concatenate([[anchor_tok[b, j]] + [cfg.mask_token_id] * (W - 1) for j in range(2)]) for b in range(2)]
    )
    positions = np.stack([np.concatenate([anchors_pos[b, j] + np.arange(W) for j in range(2)]) for b in range(2)])
    limit = np.repeat(anchors_pos, W, axis=1)
    block_id = np.repeat(np.arange(2), W)
    slot = np.tile(np.arange(W), 2)
    gd, state = nnx.split(setup.model)
    h = jit_block_hidden(
        gd,
        state,
        jnp.asarray(setup.taps),
        jnp.asarray(ctx_pos, jnp.int32),
        jnp.asarray(setup.embed)[tokens],
        jnp.asarray(positions, jnp.int32),
        jnp.arange(S, dtype=jnp.int32),
        jnp.asarray(limit, jnp.int32),
        jnp.asarray(block_id, jnp.int32),
        jnp.asarray(slot, jnp.int32),
    )
    h = np.asarray(h)
    for b in range(2):
        for j in range(2):
            st = anchors_pos[b, j]
            ref, _ = reference_block(
                cfg, setup.w, setup.taps[b, :st], np.arange(st), anchor_tok[b, j], st, W, setup.embed, setup.lm_head
            )
            np.testing.assert_allclose(h[b, j * W : (j + 1) * W], ref, atol=TOL, rtol=TOL, err_msg=f"row {b} block {j}")


def test_per_layer_masks_are_exercised():
    """Each layer's (window, causal) setting of the mixed variant matters: changing any one layer's setting changes
    the reference output, so the library's match with the reference above pins every layer's mask."""
    s = Setup("mixed")
    cfg, W, st, anchor = s.cfg, 5, 9, 17
    args = (cfg, s.w, s.taps[0, :st], np.arange(st), anchor, st, W, s.embed, s.lm_head)
    _, ref = reference_block(*args)
    for i in range(cfg.num_layers):
        for alt in ((0, False), (0, True), (3, False), (2, True)):
            if alt == cfg.layer_attn[i]:
                continue
            other = list(cfg.layer_attn)
            other[i] = alt
            _, changed = reference_block(*args, layer_attn=tuple(other))
            assert np.abs(changed[1:] - ref[1:]).max() > 1e-3, f"layer {i}: {cfg.layer_attn[i]} vs {alt}"
    # the window of the non-causal layer bounds keys ahead of the query too (a window bounding only the keys
    # behind, as a causal kernel's window does, gives other drafts)
    _, behind_only = reference_block(*args, ahead=False)
    assert np.abs(behind_only[1:] - ref[1:]).max() > 1e-3


def test_wide_windows_cut_the_context_only():
    """Windows >= the block width leave the whole block visible, so only their cut of the context matters: the
    wide-window variant differs from unbounded attention, and its one-sided form equals the two-sided one."""
    s = Setup("wide-window")
    cfg, W, st, anchor = s.cfg, 5, 11, 17
    args = (cfg, s.w, s.taps[0, :st], np.arange(st), anchor, st, W, s.embed, s.lm_head)
    _, ref = reference_block(*args)
    _, unbounded = reference_block(*args, layer_attn=((0, False), (0, False)))
    assert np.abs(unbounded[1:] - ref[1:]).max() > 1e-3
    _, behind_only = reference_block(*args, ahead=False)
    np.testing.assert_allclose(behind_only, ref, atol=1e-12)


# ------------------------------------------------------------------------------------------ config resolution
def hf_config(**kw) -> dict:
    base = {
        "architectures": ["DFlashDraftModel"],
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "vocab_size": 100,
        "block_size": 16,
        "dflash_config": {"mask_token_id": 99, "target_layer_ids": [1, 3]},
    }
    base.update(kw)
    return base


@pytest.mark.parametrize(
    "extra, expected",
    [
        ({}, ((0, False), (0, False))),
        # explicit is_causal (the DFlash 2 fixture: all sliding, use_sliding_window, is_causal false)
        (
            {
                "layer_types": ["sliding_attention"] * 2,
                "use_sliding_window": True,
                "sliding_window": 2048,
                "is_causal": False,
            },
            ((2048, False), (2048, False)),
        ),
        # then dflash_config.causal (vLLM's override)
        (
            {
                "layer_types": ["full_attention", "sliding_attention"],
                "use_sliding_window": True,
                "sliding_window": 5,
                "dflash_config": {"mask_token_id": 99, "target_layer_ids": [1, 3], "causal": True},
            },
            ((0, True), (5, True)),
        ),
        # transformers' Qwen3Config drops the window without use_sliding_window
        (
            {"layer_types": ["sliding_attention"] * 2, "sliding_window": 2048, "is_causal": False},
            ((0, False), (0, False)),
        ),
        # no explicit causality, the kernel named: z-lab's dflash/model.py (non-causal; window only under flash)
        (
            {
                "layer_types": ["full_attention", "sliding_attention"],
                "use_sliding_window": True,
                "sliding_window": 7,
                "_attn_implementation": "flash_attention_2",
            },
            ((0, False), (7, False)),
        ),
        (
            {
                "layer_types": ["full_attention", "sliding_attention"],
                "use_sliding_window": True,
                "sliding_window": 7,
                "attn_implementation": "sdpa",
            },
            ((0, False), (0, False)),
        ),
    ],
    ids=["default-full", "is_causal-false", "dflash_config-causal", "no-use_sliding_window", "flash", "sdpa"],
)
def test_layer_attention_resolved_like_the_reference(extra, expected):
    assert drafter_config_from_hf(hf_config(**extra), "d").layer_attn == expected


def test_sliding_layers_without_causality_are_refused():
    """References disagree on sliding layers without is_causal (z-lab's dflash/model.py: non-causal; vLLM:
    causal): refused, naming the field that settles it."""
    cfg = hf_config(layer_types=["full_attention", "sliding_attention"], use_sliding_window=True, sliding_window=7)
    with pytest.raises(CheckpointError, match=r"layers \[1\] are sliding_attention.*set is_causal"):
        drafter_config_from_hf(cfg, "d")
    with pytest.raises(CheckpointError, match=r"attn_implementation 'paged'"):
        drafter_config_from_hf({**cfg, "attn_implementation": "paged"}, "d")


def test_block_size_sub_config_alone_is_read_and_taps_are_read():
    cfg = drafter_config_from_hf(
        hf_config(block_size=None, dflash_config={"mask_token_id": 7, "target_layer_ids": [0, 2], "block_size": 8}),
        "d",
    )
    assert (cfg.block_size, cfg.mask_token_id, cfg.target_layer_ids) == (8, 7, (0, 2))
    assert drafter_config_from_hf(hf_config(), "d").block_size == 16
    # no taps given: z-lab's default spread over [1, L-3] for num_target_layers
    cfg = drafter_config_from_hf(
        hf_config(num_hidden_layers=5, num_target_layers=36, dflash_config={"mask_token_id": 7}), "d"
    )
    assert cfg.target_layer_ids == (1, 9, 17, 25, 33)
    with pytest.raises(CheckpointError, match="layer_types"):
        drafter_config_from_hf(hf_config(layer_types=["full_attention"]), "d")
