"""The target model: Llama family (Llama 2/3, SmolLM2, Mistral) and Qwen3, in Flax NNX.

One forward handles T new tokens per sequence for a batch of sequence slots at given absolute positions, against a
KV cache, so prefill, 1-token decode and T-token verify are the same function at different static widths. It can
return the hidden states of chosen layers (layer id i = HF `hidden_states[i+1]`: the output of decoder layer i, and
for the last layer that output after the final norm, as transformers returns it), concatenated in the order asked for.

KV cache: a tuple with one `(k, v)` page pool per layer, each head-major `[pages, kv_heads, page_size, head_dim]`,
addressed through the rows' page tables (`layers.Pages`: the serving pool's tables, or contiguous tables for batch
jobs, `layers.contiguous_pages`). Positions past a sequence's length are stale and masked by position (query at
position p sees keys at positions <= p; on a sliding-window layer of window w only those > p - w), so rollback is
only moving lengths. The MLP's activation is the checkpoint's `hidden_act`. q|k|v and gate|up are fused as a layer
is built (`layers.declare_fused_block`: one matmul each; the checkpoint's tensors are read under their own names).
The layer loop is a Python loop (unrolled under jit): on CPU `lax.scan` over stacked layers measured ~2x slower.
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from dflash_jax.config import TargetConfig
from dflash_jax.models.layers import (
    Pages,
    ParamBuilder,
    apply_rope,
    attention_ranges,
    cached_attention,
    contiguous_pages,
    declare_fused_block,
    dense,
    fused_gated_mlp,
    logits_f32,
    qkv_heads,
    rms_norm,
    rope_attention_factor,
    rope_cos_sin,
    rope_inv_freq,
    write_rows,
)

KVCache = tuple[tuple[jax.Array, jax.Array], ...]


class Rows(NamedTuple):
    """One group of rows of a ragged forward (`TargetModel.ragged`): tokens and absolute positions [B,T], the rows'
    page tables and the static bucket of positions their attention reads."""

    tokens: jax.Array
    positions: jax.Array
    pages: Pages
    kv_len: int


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: TargetConfig, i: int, p: ParamBuilder):
        declare_fused_block(self, p, f"layers.{i}.", cfg)

    def ragged(self, cfg: TargetConfig, x, cos, sin, cache_kv, groups):
        """x [N,H]: the tokens of every group laid end to end (cos/sin [N,d] likewise); `groups`: per group its
        `Rows` (positions and pages) and visible key ranges. Dense work runs once over all N tokens; the K/V write
        and the attention run per group, each over its own rows' pages."""
        eps = cfg.rms_norm_eps
        hn = rms_norm(x, self.input_layernorm[...], eps)
        q, k, v = qkv_heads(hn, self.qkv_proj[...])
        if cfg.qk_norm:
            q = rms_norm(q, self.q_norm[...], eps)
            k = rms_norm(k, self.k_norm[...], eps)
        q = apply_rope(q, cos, sin)
        k = apply_rope(k, cos, sin)
        ck, cv = cache_kv
        spans, start = [], 0
        for rows, _ in groups:
            b, t = rows.positions.shape
            spans.append((slice(start, start + b * t), b, t))
            start += b * t
        for (sl, b, t), (rows, _) in zip(spans, groups, strict=True):
            ck = write_rows(ck, k[sl].reshape(b, t, *k.shape[1:]), rows.pages, rows.positions)
            cv = write_rows(cv, v[sl].reshape(b, t, *v.shape[1:]), rows.pages, rows.positions)
        out = []
        for (sl, b, t), (rows, visible) in zip(spans, groups, strict=True):  # a group reads only its own rows' pages
            qg = q[sl].reshape(b, t, *q.shape[1:])
            out.append(cached_attention(qg, ck, cv, rows.pages, visible, rows.kv_len).reshape(b * t, -1))
        attn = out[0] if len(out) == 1 else jnp.concatenate(out, axis=0)
        x = x + dense(attn, self.o_proj[...])
        hn = rms_norm(x, self.post_attention_layernorm[...], eps)
        x = x + fused_gated_mlp(hn, self.gate_up_proj[...], self.down_proj[...], cfg.hidden_act)
        return x, (ck, cv)


class TargetModel(nnx.Module):
    """Llama/Qwen3 decoder. `lm_head` is `[hidden, vocab]`; for tied checkpoints it is a copy of `embed.T`
    (stored once more so the decode GEMV reads it in the fast layout)."""

    def __init__(self, cfg: TargetConfig, p: ParamBuilder):
        self.cfg = cfg
        self.embed = p("embed_tokens.weight", (cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"))
        self.layers = nnx.List([DecoderLayer(cfg, i, p) for i in range(cfg.num_layers)])
        self.norm = p("norm.weight", (cfg.hidden_size,), ("embed",), "ones")
        if cfg.tie_word_embeddings:
            self.lm_head = nnx.Param(self.embed[...].T, out_sharding=("embed", "vocab"), eager_sharding=False)
        else:
            self.lm_head = p("lm_head.weight", (cfg.hidden_size, cfg.vocab_size), ("embed", "vocab"))

    def __call__(self, tokens, positions, cache: KVCache, pages: Pages, *, capture: tuple[int, ...] = (), kv_len: int):
        """tokens/positions [B,T] -> (final-normed hidden [B,T,H], captured [B,T,n*H] or None, new cache).

        Row b of the batch lives in the pages of its page table `pages.table[b]`; its K/V are written at
        `positions[b]` (writes past the table are dropped). Attention reads positions [0, kv_len) of the row,
        limited causally by absolute position, and on sliding-window layers to the window (kv_len is a static
        bucket > every position in the call).
        """
        (h,), (hidden,), cache = self.ragged([Rows(tokens, positions, pages, kv_len)], cache, capture=capture)
        return h, hidden, cache

    def ragged(self, groups: list[Rows], cache: KVCache, *, capture: tuple[int, ...] = ()):
        """One forward over several groups of rows, each with its own width, positions, page tables and `kv_len`
        (a step's verify rows and other sequences' prompt chunks): the dense layers see every token of every group
        at once (the weights are read once), the K/V writes and attention are per group. Per group as `__call__`
        returns them: (hidden [B,T,H] per group, captured [B,T,n*H] (or None) per group, new cache)."""
        cfg = self.cfg
        shapes = [r.tokens.shape for r in groups]
        flat = lambda xs: xs[0] if len(xs) == 1 else jnp.concatenate(xs, axis=0)  # noqa: E731
        x = self.embed[...][flat([r.tokens.reshape(-1) for r in groups])]
        inv = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        factor = rope_attention_factor(cfg.rope_scaling)
        cos, sin = rope_cos_sin(flat([r.positions.reshape(-1) for r in groups]), inv, factor)
        visible = [attention_ranges(r.positions, cfg.layer_windows) for r in groups]  # by window: visible keys
        taps = {}
        new_cache = []
        for i, layer in enumerate(self.layers):
            geo = [(r, vis[cfg.window(i)]) for r, vis in zip(groups, visible, strict=True)]
            x, kv = layer.ragged(cfg, x, cos, sin, cache[i], geo)
            new_cache.append(kv)
            if i in capture:
                taps[i] = x
        x = rms_norm(x, self.norm[...], cfg.rms_norm_eps)
        if cfg.num_layers - 1 in taps:
            taps[cfg.num_layers - 1] = x  # HF's last `hidden_states` entry is the final-normed output
        hidden = jnp.concatenate([taps[i] for i in capture], axis=-1) if capture else None

        def split(a):
            out, start = [], 0
            for b, t in shapes:
                out.append(a[start : start + b * t].reshape(b, t, -1))
                start += b * t
            return out

        return split(x), (split(hidden) if capture else [None] * len(groups)), tuple(new_cache)

    @property
    def dtype(self) -> jnp.dtype:
        """The weights' (and so the activations' and KV caches') dtype."""
        return jnp.dtype(self.embed[...].dtype)

    def logits(self, h: jax.Array) -> jax.Array:
        """f32 logits [..., V] of final-normed hidden states (the dot accumulates in f32 whatever the weights'
        dtype, so sampling and acceptance see unrounded logits)."""
        return logits_f32(h, self.lm_head[...])


def init_kv_cache(cfg: TargetConfig, num_pages: int, page_size: int, dtype=jnp.float32) -> KVCache:
    """A page pool of `num_pages` pages (the null page 0 included) of `page_size` positions per layer, in `dtype`
    (pass the model's `TargetModel.dtype`: a cache in another dtype changes the attention's dtype)."""
    shape = (num_pages, cfg.num_kv_heads, page_size, cfg.head_dim)
    # K and V must be distinct buffers (donating one buffer twice fails).
    return tuple((jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)) for _ in range(cfg.num_layers))


def contiguous_kv_cache(
    cfg: TargetConfig, rows: int, positions: int, dtype=jnp.float32, page_size: int = 16
) -> tuple[KVCache, Pages]:
    """A fresh cache for `rows` sequences of up to `positions` positions each and their page tables
    (`layers.contiguous_pages`: every row its own run of pages), as batch jobs and references use it."""
    pages, num_pages = contiguous_pages(rows, positions, page_size)
    return init_kv_cache(cfg, num_pages, page_size, dtype), pages


class ForwardOut(NamedTuple):
    logits: jax.Array  # [B,T,V] (or [B,1,V] when last_only)
    hidden: jax.Array | None  # [B,T,n*H] captured taps
    cache: KVCache


@partial(jax.jit, static_argnames=("graphdef", "capture", "kv_len", "last_only"), donate_argnames=("cache",))
def target_forward(
    graphdef, state, tokens, positions, cache, pages, last_idx=None, *, capture=(), kv_len, last_only=False
):
    """Pure jitted target forward. With `last_only`, logits only at index `last_idx[b]` of each row."""
    model = nnx.merge(graphdef, state)
    h, hidden, cache = model(tokens, positions, cache, pages, capture=capture, kv_len=kv_len)
    if last_only:
        h = jnp.take_along_axis(h, last_idx[:, None, None], axis=1)
    return ForwardOut(model.logits(h), hidden, cache)


def param_count(cfg: TargetConfig) -> int:
    h, f, q, kv = cfg.hidden_size, cfg.intermediate_size, cfg.q_dim, cfg.kv_dim
    per_layer = 2 * h + h * q + 2 * h * kv + q * h + 3 * h * f
    if cfg.qk_norm:
        per_layer += 2 * cfg.head_dim
    n = cfg.vocab_size * h + cfg.num_layers * per_layer + h
    if not cfg.tie_word_embeddings:
        n += h * cfg.vocab_size
    return n
