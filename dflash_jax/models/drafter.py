"""The DFlash block-diffusion drafter (z-lab `DFlashDraftModel`), in Flax NNX.

A small Qwen3-style stack without embedding or LM head of its own (it uses the target's). Per context token t:
`c_t = hidden_norm(fc(concat(target hidden states at target_layer_ids)))`. In every layer the context enters only
as keys/values, through that layer's own k_proj/v_proj, k_norm and RoPE at the context token's absolute
position. The block `[anchor, MASK × (W-1)]` sits at absolute positions start..start+W-1; its queries see every
context key strictly before `start` and the block keys (all of them, or causally for causal layers); a
sliding-window layer only the keys less than `window` positions away, behind or ahead. Slot k's output predicts
position start+k; slot 0 is dropped.

The context K/V cache is a head-major page pool `[pages, kv_heads, page_size, head_dim]` per layer, addressed through
the rows' page tables (`layers.Pages`, shared with the target's cache); block K/V are never stored. Training passes
the context K/V of whole rows to `block_hidden` directly.

One forward serves one device and drafter tensor parallelism (`dflash_jax.parallel.drafter_tp`): head counts come
from the (possibly sharded) weight shapes, and `reduce` completes each sublayer's output after o_proj and after
down_proj (the identity on one device, a `psum` over the TP axis inside `shard_map`). Checkpoint loading lives in
`dflash_jax.checkpoints.drafter`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from dflash_jax.config import DrafterConfig, TargetConfig, default_target_layer_ids
from dflash_jax.kernels.paged_attention import masked_attention, merge_attention, paged_attention
from dflash_jax.models.layers import (
    Pages,
    ParamBuilder,
    apply_rope,
    contiguous_pages,
    declare_fused_block,
    dense,
    fused_gated_mlp,
    gqa_attention,
    heads_major,
    kv_heads,
    logits_f32,
    qkv_heads,
    read_rows,
    rms_norm,
    rope_attention_factor,
    rope_cos_sin,
    rope_inv_freq,
    write_rows,
)
from dflash_jax.quant.formats import is_rows

Reduce = Callable[[jax.Array], jax.Array]  # completes a sublayer's output (identity, or psum over the TP ranks)


class PagedContext(NamedTuple):
    """A layer's context visibility when its K/V are page pools: block query (b, t) sees the context positions
    lo[b, t] <= s < hi[b, t] of the row's pages, below `kv_len`."""

    pages: Pages
    lo: jax.Array
    hi: jax.Array
    kv_len: int


def no_reduce(x: jax.Array) -> jax.Array:
    """The one-device `Reduce`: the sublayer output is already complete."""
    return x


def out_features(w: Any) -> int:
    """The output width of a dense `[in, out]` or an `[out, in]` (quantized, `DenseRows`) weight (a rank's share
    under TP)."""
    return int(w.shape[0] if is_rows(w) else w.shape[-1])


class DraftLayer(nnx.Module):
    def __init__(self, cfg: DrafterConfig, i: int, p: ParamBuilder):
        # Qwen3-style: per-head q_norm/k_norm always present; q|k|v and gate|up fused as the layer is built.
        declare_fused_block(self, p, f"layers.{i}.", cfg, qk_norm=True)

    def context_kv(self, cfg: DrafterConfig, c, cos, sin):
        """Context features c [B,T,H] -> (k, v) [B,T,kv_heads,hd] with k_norm and RoPE applied (one matmul over the
        fused weight's key and value rows)."""
        k, v = kv_heads(c, self.qkv_proj[...], cfg.num_heads // cfg.num_kv_heads, cfg.head_dim)
        k = apply_rope(rms_norm(k, self.k_norm[...], cfg.rms_norm_eps), cos, sin)
        return k, v

    def __call__(self, cfg: DrafterConfig, x, cos, sin, ctx_k, ctx_v, ctx_mask, blk_mask, *, reduce=no_reduce):
        """x [B,W,H]; ctx_k/ctx_v head-major [B,kv,S,hd]; ctx_mask [B,W,S]; blk_mask [W,W] (bool, True = visible)."""
        eps = cfg.rms_norm_eps
        hn = rms_norm(x, self.input_layernorm[...], eps)
        x = x + self.attention(cfg, hn, cos, sin, ctx_k, ctx_v, ctx_mask, blk_mask, reduce)
        return x + self.mlp(rms_norm(x, self.post_attention_layernorm[...], eps), reduce)

    def attention(self, cfg: DrafterConfig, hn, cos, sin, ctx_k, ctx_v, ctx_mask, blk_mask, reduce: Reduce = no_reduce):
        """The attention sublayer on the normed input hn [B,W,H] (through o_proj and `reduce`, before the residual
        add)."""
        b, w, _ = hn.shape
        eps = cfg.rms_norm_eps
        q, k, v = qkv_heads(hn, self.qkv_proj[...], cfg.num_heads // cfg.num_kv_heads, cfg.head_dim)
        q = apply_rope(rms_norm(q, self.q_norm[...], eps), cos, sin)
        k = apply_rope(rms_norm(k, self.k_norm[...], eps), cos, sin)
        if isinstance(ctx_mask, PagedContext):  # the context through the paged kernel, merged with the block's
            c = ctx_mask
            out_c, lse_c = paged_attention(
                q,
                ctx_k,
                ctx_v,
                c.pages.table,
                c.lo,
                c.hi,
                kv_len=c.kv_len,
                backend=c.pages.backend,
                interpret=c.pages.interpret,
                return_lse=True,
            )
            blk = jnp.broadcast_to(blk_mask, (b, w, w))
            out_b, lse_b = masked_attention(q, heads_major(k), heads_major(v), blk)
            out, _ = merge_attention(out_c, lse_c, out_b, lse_b, q.shape[2])
            return reduce(dense(out, self.o_proj[...]))
        keys = jnp.concatenate([ctx_k, heads_major(k)], axis=2)
        vals = jnp.concatenate([ctx_v, heads_major(v)], axis=2)
        mask = jnp.concatenate([ctx_mask, jnp.broadcast_to(blk_mask, (b, w, w))], axis=-1)
        return reduce(dense(gqa_attention(q, keys, vals, mask), self.o_proj[...]))

    def mlp(self, hn, reduce: Reduce = no_reduce):
        """The SwiGLU MLP sublayer on the normed input hn (through down_proj and `reduce`, before the residual add)."""
        return reduce(fused_gated_mlp(hn, self.gate_up_proj[...], self.down_proj[...]))


class DrafterModel(nnx.Module):
    layer_cls = DraftLayer  # Drafter2Model (models.drafter2) uses its Draft2Layer

    def __init__(self, cfg: DrafterConfig, target_hidden: int, p: ParamBuilder):
        self.cfg = cfg
        h = cfg.hidden_size
        self.fc = p("fc.weight", (cfg.num_taps * target_hidden, h), (None, "embed"))
        self.hidden_norm = p("hidden_norm.weight", (h,), ("embed",), "ones")
        self.layers = nnx.List([self.layer_cls(cfg, i, p) for i in range(cfg.num_layers)])
        self.norm = p("norm.weight", (h,), ("embed",), "ones")

    def features(self, target_hidden: jax.Array) -> jax.Array:
        """Concatenated target taps [B,T,n*H_t] -> context features [B,T,H]."""
        cfg = self.cfg
        return rms_norm(dense(target_hidden, self.fc[...]), self.hidden_norm[...], cfg.rms_norm_eps)

    def context_kv(self, target_hidden, positions):
        """Per-layer context (k, v) token rows [B,T,kv,hd] for the given target taps at absolute positions [B,T]."""
        cfg = self.cfg
        c = self.features(target_hidden)
        inv = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        cos, sin = rope_cos_sin(positions, inv, rope_attention_factor(cfg.rope_scaling))
        return [layer.context_kv(cfg, c, cos, sin) for layer in self.layers]

    def block_hidden(
        self,
        x,
        positions,
        ctx_k_layers,
        ctx_v_layers,
        ctx_pos,
        ctx_limit,
        block_id,
        slot,
        reduce: Reduce = no_reduce,
        *,
        pages: Pages | None = None,
        kv_len: int = 0,
    ):
        """The block forward (before the LM head), for one or many blocks per row.

        x [B,Q,H] block embeddings at absolute `positions` [B,Q]; per layer head-major context keys/values
        [B,kv,S,hd] at absolute positions `ctx_pos` [S]. A query sees context keys with position < ctx_limit
        [B,Q] (its block's anchor position), and the keys of its own block (`block_id` [Q]); causal layers only
        those at slots <= its own (`slot` [Q]); sliding-window layers only keys less than `window` positions
        away from it, behind or ahead (z-lab's window; `checkpoints.drafter.resolve_layer_attn`). `reduce`
        completes each sublayer's output (see the module docstring). With `pages` (the Pallas backend), the
        context K/V are the layers' page pools read by `paged_attention` up to `kv_len` (`ctx_pos` unused).
        Returns the final-normed hidden [B,Q,H].
        """
        cfg = self.cfg
        inv = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        cos, sin = rope_cos_sin(positions, inv, rope_attention_factor(cfg.rope_scaling))
        ctx_base = None if pages is not None else ctx_pos[None, None, :] < ctx_limit[:, :, None]  # [B,Q,S]
        same = block_id[:, None] == block_id[None, :]  # [Q,Q]
        kw = self.layer_kwargs(block_id, slot)
        for i, layer in enumerate(self.layers):
            window, causal = cfg.layer_attn[i]
            cm, bm = ctx_base, same
            if causal:
                bm = bm & (slot[None, :] <= slot[:, None])
            if window:  # the block's own keys, on either path
                bm = bm & (jnp.abs(slot[:, None] - slot[None, :]) < window)
            if pages is not None:
                lo = jnp.maximum(positions - window + 1, 0) if window else jnp.zeros_like(positions)
                cm = PagedContext(pages, lo, ctx_limit, kv_len)
            elif window:
                cm = cm & (ctx_pos[None, None, :] > positions[:, :, None] - window)
            x = layer(cfg, x, cos, sin, ctx_k_layers[i], ctx_v_layers[i], cm, bm, reduce=reduce, **kw)
        return rms_norm(x, self.norm[...], cfg.rms_norm_eps)

    def layer_kwargs(self, block_id, slot) -> dict:
        """Extra per-call layer inputs: none for DFlash (DFlash2's convs take the within-block shift mask)."""
        return {}

    @property
    def dtype(self) -> jnp.dtype:
        """The activations' (and context cache's) dtype: the norms' (never quantized)."""
        return jnp.dtype(self.norm[...].dtype)


DrafterCache = tuple[tuple[jax.Array, jax.Array], ...]


def init_drafter_cache(cfg: DrafterConfig, num_pages: int, page_size: int, dtype=jnp.float32) -> DrafterCache:
    """Context K/V per layer: a page pool of `num_pages` pages (the null page 0 included) of `page_size`
    positions, in `dtype` (pass the drafter's `DrafterModel.dtype`)."""
    shape = (num_pages, cfg.num_kv_heads, page_size, cfg.head_dim)
    return tuple((jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)) for _ in range(cfg.num_layers))


def contiguous_drafter_cache(
    cfg: DrafterConfig, rows: int, positions: int, dtype=jnp.float32, page_size: int = 16
) -> tuple[DrafterCache, Pages]:
    """A fresh context cache for `rows` sequences of up to `positions` positions each and their page tables
    (`layers.contiguous_pages`; the same tables as `target.contiguous_kv_cache` for the same arguments)."""
    pages, num_pages = contiguous_pages(rows, positions, page_size)
    return init_drafter_cache(cfg, num_pages, page_size, dtype), pages


def write_context(drafter: DrafterModel, cache: DrafterCache, target_hidden, positions, pages: Pages) -> DrafterCache:
    """Compute context K/V for target taps [B,T,n*H] at positions [B,T] and store them in the rows' pages."""
    kvs = drafter.context_kv(target_hidden, positions)
    return tuple(
        (write_rows(ck, k, pages, positions), write_rows(cv, v, pages, positions))
        for (ck, cv), (k, v) in zip(cache, kvs, strict=True)
    )


def draft_head(
    drafter, embed, lm_head, cache: DrafterCache, anchor, start, pages: Pages, *, width, kv_len, reduce=no_reduce
):
    """(hidden [B, width-1, H], logits [B, width-1, V] f32) of the draft slots of the block [anchor, MASK...] at
    `start` (context: cached rows < start). Under TP the logits cover the rank's LM-head rows."""
    h = propose_hidden(drafter, embed, cache, anchor, start, pages, width=width, kv_len=kv_len, reduce=reduce)
    h = h[:, 1:]
    return h, logits_f32(h, lm_head)


def propose_block(
    drafter: DrafterModel, embed, lm_head, cache: DrafterCache, anchor, start, pages: Pages, *, width, kv_len
):
    """Drafts [B, width-1] (argmax) and the draft logits for the block [anchor, MASK...] at `start`.

    Context = cached rows at positions < start[b].
    """
    _, logits = draft_head(drafter, embed, lm_head, cache, anchor, start, pages, width=width, kv_len=kv_len)
    return jnp.argmax(logits, axis=-1).astype(jnp.int32), logits


def block_embeddings(cfg: DrafterConfig, embed, tokens):
    """The block's input embeddings: the target's rows, times the checkpoint's `input_embedding_scale`."""
    x = embed[tokens]
    return x if cfg.input_embedding_scale == 1.0 else x * jnp.asarray(cfg.input_embedding_scale, x.dtype)


def candidate_logits(cfg: DrafterConfig, logits):
    """The selector's U from the LM-head logits: × output_multiplier, then softcapped (order-preserving, so the
    top-K candidates are the same either way)."""
    if cfg.output_multiplier != 1.0:
        logits = logits * cfg.output_multiplier
    if cfg.final_logit_softcapping > 0:
        c = cfg.final_logit_softcapping
        logits = jnp.tanh(logits / c) * c
    return logits


def propose_hidden(
    drafter, embed, cache: DrafterCache, anchor, start, pages: Pages, *, width, kv_len, reduce=no_reduce
):
    """The final-normed hidden [B, width, H] of the block [anchor, MASK...] at `start` (context: the rows' cached
    positions < start). The Pallas kernel reads the context from the pages in place; the XLA path gathers the
    rows' first `kv_len` positions and attends to them and the block in one softmax, as training does."""
    cfg = drafter.cfg
    b = anchor.shape[0]
    tokens = jnp.concatenate([anchor[:, None], jnp.full((b, width - 1), cfg.mask_token_id, anchor.dtype)], axis=1)
    positions = start[:, None] + jnp.arange(width, dtype=start.dtype)[None, :]
    x = block_embeddings(cfg, embed, tokens)
    limit = jnp.broadcast_to(start[:, None], (b, width))
    slot = jnp.arange(width)
    blocks = jnp.zeros((width,), jnp.int32)
    if pages.in_place:
        ks, vs = [ck for ck, _ in cache], [cv for _, cv in cache]
        return drafter.block_hidden(x, positions, ks, vs, None, limit, blocks, slot, reduce, pages=pages, kv_len=kv_len)
    ctx_pos = jnp.arange(kv_len, dtype=start.dtype)
    ks = [read_rows(ck, pages, kv_len) for ck, _ in cache]
    vs = [read_rows(cv, pages, kv_len) for _, cv in cache]
    return drafter.block_hidden(x, positions, ks, vs, ctx_pos, limit, blocks, slot, reduce)


def random_drafter_config(tcfg: TargetConfig, num_layers: int = 1, block_size: int = 8) -> DrafterConfig:
    mask = tcfg.vocab_size - 1
    L = tcfg.num_layers
    taps = default_target_layer_ids(L, num_layers) if L >= 4 else tuple(range(min(L, 2)))
    return DrafterConfig(
        hidden_size=tcfg.hidden_size,
        intermediate_size=tcfg.intermediate_size,
        num_layers=num_layers,
        num_heads=tcfg.num_heads,
        num_kv_heads=tcfg.num_kv_heads,
        head_dim=tcfg.head_dim,
        vocab_size=tcfg.vocab_size,
        block_size=block_size,
        mask_token_id=mask,
        target_layer_ids=taps,
        rms_norm_eps=tcfg.rms_norm_eps,
        rope_theta=tcfg.rope_theta,
        rope_scaling=tcfg.rope_scaling,
        layer_attn=tuple((0, False) for _ in range(num_layers)),
        num_target_layers=tcfg.num_layers,
    )
