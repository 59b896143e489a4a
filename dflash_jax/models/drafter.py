"""The DFlash block-diffusion drafter (z-lab `DFlashDraftModel`), in Flax NNX.

A small Qwen3-style stack without embedding or LM head of its own (it uses the target's). Per context token t:
`c_t = hidden_norm(fc(concat(target hidden states at target_layer_ids)))`. In every layer the context enters only
as keys/values, through that layer's own k_proj/v_proj, k_norm and RoPE at the context token's absolute
position. The block `[anchor, MASK × (W-1)]` sits at absolute positions start..start+W-1; its queries see every
context key strictly before `start` (optionally within a sliding window) and the block keys (all of them, or
causally for causal layers). Slot k's output predicts position start+k; slot 0 is dropped.

Serving keeps context K/V in a per-slot cache (head-major `[slots, kv_heads, capacity, head_dim]` per layer, row index =
absolute position); block K/V are never stored.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dflash_jax.config import (
    DRAFTER_SCALARS,
    DrafterConfig,
    TargetConfig,
    default_target_layer_ids,
    drafter_scalar_default,
    parse_rope_scaling,
)
from dflash_jax.errors import CheckpointError
from dflash_jax.models.layers import (
    ParamBuilder,
    apply_rope,
    declare_decoder_block,
    gqa_attention,
    heads_major,
    read_rows,
    rms_norm,
    rope_cos_sin,
    rope_inv_freq,
    write_rows,
)

DRAFTER_ARCHS = ("DFlashDraftModel", "DFlash2DraftModel")  # the second: models.drafter2 (issue 9)


def dense(x: jax.Array, w: Any, backend: str = "xla") -> jax.Array:
    """x @ W for a dense `[in, out]` weight, or the quantized-weight dispatch (`--kernel-backend`) for quantized
    formats ([out, in] with their scales)."""
    if isinstance(w, jax.Array | np.ndarray):
        return x @ w
    from dflash_jax.quant import linear

    return linear(x, w, backend=backend)


class DraftLayer(nnx.Module):
    def __init__(self, cfg: DrafterConfig, i: int, p: ParamBuilder):
        # Qwen3-style: per-head q_norm/k_norm always present.
        declare_decoder_block(
            self,
            p,
            f"layers.{i}.",
            hidden=cfg.hidden_size,
            q_dim=cfg.q_dim,
            kv_dim=cfg.kv_dim,
            inter=cfg.intermediate_size,
            head_dim=cfg.head_dim,
            qk_norm=True,
        )

    def context_kv(self, cfg: DrafterConfig, c, cos, sin):
        """Context features c [B,T,H] -> (k, v) [B,T,kv_heads,hd] with k_norm and RoPE applied."""
        b, t, _ = c.shape
        k = dense(c, self.k_proj[...], cfg.kernel_backend).reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
        v = dense(c, self.v_proj[...], cfg.kernel_backend).reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
        k = apply_rope(rms_norm(k, self.k_norm[...], cfg.rms_norm_eps), cos, sin)
        return k, v

    def __call__(self, cfg: DrafterConfig, x, cos, sin, ctx_k, ctx_v, ctx_mask, blk_mask):
        """x [B,W,H]; ctx_k/ctx_v head-major [B,kv,S,hd]; ctx_mask [B,W,S]; blk_mask [W,W] (bool, True = visible)."""
        eps = cfg.rms_norm_eps
        hn = rms_norm(x, self.input_layernorm[...], eps)
        x = x + self.attention(cfg, hn, cos, sin, ctx_k, ctx_v, ctx_mask, blk_mask)
        return x + self.mlp(rms_norm(x, self.post_attention_layernorm[...], eps), cfg.kernel_backend)

    def attention(self, cfg: DrafterConfig, hn, cos, sin, ctx_k, ctx_v, ctx_mask, blk_mask):
        """The attention sublayer on the normed input hn [B,W,H] (through o_proj, before the residual add)."""
        b, w, _ = hn.shape
        eps = cfg.rms_norm_eps
        q = dense(hn, self.q_proj[...], cfg.kernel_backend).reshape(b, w, cfg.num_heads, cfg.head_dim)
        k = dense(hn, self.k_proj[...], cfg.kernel_backend).reshape(b, w, cfg.num_kv_heads, cfg.head_dim)
        v = dense(hn, self.v_proj[...], cfg.kernel_backend).reshape(b, w, cfg.num_kv_heads, cfg.head_dim)
        q = apply_rope(rms_norm(q, self.q_norm[...], eps), cos, sin)
        k = apply_rope(rms_norm(k, self.k_norm[...], eps), cos, sin)
        keys = jnp.concatenate([ctx_k, heads_major(k)], axis=2)
        vals = jnp.concatenate([ctx_v, heads_major(v)], axis=2)
        mask = jnp.concatenate([ctx_mask, jnp.broadcast_to(blk_mask, (b, w, w))], axis=-1)
        return dense(gqa_attention(q, keys, vals, mask), self.o_proj[...], cfg.kernel_backend)

    def mlp(self, hn, backend: str = "xla"):
        """The SwiGLU MLP sublayer on the normed input hn (before the residual add)."""
        gated = jax.nn.silu(dense(hn, self.gate_proj[...], backend)) * dense(hn, self.up_proj[...], backend)
        return dense(gated, self.down_proj[...], backend)


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
        return rms_norm(dense(target_hidden, self.fc[...], cfg.kernel_backend), self.hidden_norm[...], cfg.rms_norm_eps)

    def context_kv(self, target_hidden, positions):
        """Per-layer context (k, v) token rows [B,T,kv,hd] for the given target taps at absolute positions [B,T]."""
        cfg = self.cfg
        c = self.features(target_hidden)
        cos, sin = rope_cos_sin(positions, rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling))
        return [layer.context_kv(cfg, c, cos, sin) for layer in self.layers]

    def block_hidden(self, x, positions, ctx_k_layers, ctx_v_layers, ctx_pos, ctx_limit, block_id, slot):
        """The block forward (before the LM head), for one or many blocks per row.

        x [B,Q,H] block embeddings at absolute `positions` [B,Q]; per layer head-major context keys/values
        [B,kv,S,hd] at absolute positions `ctx_pos` [S]. A query sees context keys with position < ctx_limit
        [B,Q] (its block's anchor position), and the keys of its own block (`block_id` [Q]); causal layers only
        those at slots <= its own (`slot` [Q]); sliding-window layers only keys less than `window` positions
        behind it.
        Returns the final-normed hidden [B,Q,H].
        """
        cfg = self.cfg
        cos, sin = rope_cos_sin(positions, rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling))
        ctx_base = ctx_pos[None, None, :] < ctx_limit[:, :, None]  # [B,Q,S]
        same = block_id[:, None] == block_id[None, :]  # [Q,Q]
        kw = self.layer_kwargs(block_id, slot)
        for i, layer in enumerate(self.layers):
            window, causal = cfg.layer_attn[i]
            cm, bm = ctx_base, same
            if causal:
                bm = bm & (slot[None, :] <= slot[:, None])
            if window:
                cm = cm & (ctx_pos[None, None, :] > positions[:, :, None] - window)
                bm = bm & ((slot[:, None] - slot[None, :]) < window)
            x = layer(cfg, x, cos, sin, ctx_k_layers[i], ctx_v_layers[i], cm, bm, **kw)
        return rms_norm(x, self.norm[...], cfg.rms_norm_eps)

    def layer_kwargs(self, block_id, slot) -> dict:
        """Extra per-call layer inputs: none for DFlash (DFlash2's convs take the within-block shift mask)."""
        return {}


DrafterCache = tuple[tuple[jax.Array, jax.Array], ...]


def init_drafter_cache(cfg: DrafterConfig, slots: int, capacity: int, dtype=jnp.float32) -> DrafterCache:
    shape = (slots, cfg.num_kv_heads, capacity, cfg.head_dim)
    return tuple((jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)) for _ in range(cfg.num_layers))


def write_context(drafter: DrafterModel, cache: DrafterCache, target_hidden, positions, slot_ids) -> DrafterCache:
    """Compute context K/V for target taps [B,T,n*H] at positions [B,T] and store them in the slots' rows."""
    kvs = drafter.context_kv(target_hidden, positions)
    return tuple(
        (write_rows(ck, k, slot_ids, positions), write_rows(cv, v, slot_ids, positions))
        for (ck, cv), (k, v) in zip(cache, kvs, strict=True)
    )


def propose_block(
    drafter: DrafterModel, embed, lm_head, cache: DrafterCache, anchor, start, slot_ids, *, width, kv_len
):
    """Drafts [B, width-1] (argmax) and the draft logits for the block [anchor, MASK...] at `start`.

    Context = cached rows at positions < start[b].
    """
    h = propose_hidden(drafter, embed, cache, anchor, start, slot_ids, width=width, kv_len=kv_len)
    logits = dense(h[:, 1:], lm_head, drafter.cfg.kernel_backend).astype(jnp.float32)
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


def propose_hidden(drafter: DrafterModel, embed, cache: DrafterCache, anchor, start, slot_ids, *, width, kv_len):
    """The final-normed hidden [B, width, H] of the block [anchor, MASK...] at `start` (context: rows < start)."""
    cfg = drafter.cfg
    b = anchor.shape[0]
    tokens = jnp.concatenate([anchor[:, None], jnp.full((b, width - 1), cfg.mask_token_id, anchor.dtype)], axis=1)
    positions = start[:, None] + jnp.arange(width, dtype=start.dtype)[None, :]
    x = block_embeddings(cfg, embed, tokens)
    ctx_pos = jnp.arange(kv_len, dtype=start.dtype)
    ks = [read_rows(ck, slot_ids, kv_len) for ck, _ in cache]
    vs = [read_rows(cv, slot_ids, kv_len) for _, cv in cache]
    limit = jnp.broadcast_to(start[:, None], (b, width))
    slot = jnp.arange(width)
    return drafter.block_hidden(x, positions, ks, vs, ctx_pos, limit, jnp.zeros((width,), jnp.int32), slot)


# ------------------------------------------------------------------------------------------------ loading
def _resolve_layer_attn(d: dict[str, Any], n_layers: int) -> tuple[tuple[int, bool], ...]:
    """Per-layer (window, causal), resolved the way vLLM does: explicit `is_causal`, then
    `dflash_config.causal`, then sliding ⇒ causal, full ⇒ non-causal."""
    types = d.get("layer_types") or ["full_attention"] * n_layers
    if len(types) != n_layers:
        raise CheckpointError(f"drafter config: layer_types has {len(types)} entries for {n_layers} layers")
    window = int(d.get("sliding_window") or 0)
    if d.get("use_sliding_window") is False and "layer_types" not in d:
        window = 0
    explicit = d.get("is_causal")
    sub = (d.get("dflash_config") or {}).get("causal")
    out = []
    for t in types:
        if t not in ("full_attention", "sliding_attention"):
            raise CheckpointError(f"drafter config: unknown layer type {t!r}")
        sliding = t == "sliding_attention"
        if explicit is not None:
            causal = bool(explicit)
        elif sub is not None:
            causal = bool(sub)
        else:
            causal = sliding
        out.append((window if sliding else 0, causal))
    return tuple(out)


def _logit_scalars(d: dict, sub: dict, source: str) -> dict[str, float]:
    """`output_multiplier`, `final_logit_softcapping`, `input_embedding_scale` (dflash_config or top level)."""
    out = {}
    for name in DRAFTER_SCALARS:
        zero_ok = name == "final_logit_softcapping"  # 0 = no softcap
        raw = sub.get(name, d.get(name))
        try:
            out[name] = drafter_scalar_default(name) if raw is None else float(raw)
        except (TypeError, ValueError):
            raise CheckpointError(f"{source}: {name} must be a number, got {raw!r}") from None
        v = out[name]
        if not np.isfinite(v) or v < 0 or (v == 0 and not zero_ok):
            bound = "non-negative (0 = none)" if zero_ok else "positive"
            raise CheckpointError(f"{source}: {name} must be {bound} and finite, got {raw!r}")
    return out


def drafter_config_from_hf(d: dict[str, Any], source: str) -> DrafterConfig:
    archs = d.get("architectures") or []
    if not any(a in DRAFTER_ARCHS for a in archs):
        raise CheckpointError(
            f"{source}: architectures {archs} is not a DFlash drafter (expected one of {', '.join(DRAFTER_ARCHS)})"
        )
    sub = d.get("dflash_config") or {}
    if "mask_token_id" not in sub:
        raise CheckpointError(f"{source}: config.json has no dflash_config.mask_token_id")
    try:
        n_layers = int(d["num_hidden_layers"])
        hidden = int(d["hidden_size"])
        heads = int(d["num_attention_heads"])
        ids = sub.get("target_layer_ids")
        n_target = int(d.get("num_target_layers", 0))
        if not ids:
            if not n_target:
                raise CheckpointError(f"{source}: no dflash_config.target_layer_ids and no num_target_layers")
            ids = default_target_layer_ids(n_target, n_layers)
        v2 = {}
        if "DFlash2DraftModel" in archs:  # DFlash2 (issue 9): conv and selector fields
            from dflash_jax.models.drafter2 import dflash2_fields

            v2 = dict(arch="dflash2", **dflash2_fields(d, hidden, int(d["vocab_size"]), source))
        return DrafterConfig(
            hidden_size=hidden,
            intermediate_size=int(d["intermediate_size"]),
            num_layers=n_layers,
            num_heads=heads,
            num_kv_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(d.get("head_dim") or hidden // heads),
            vocab_size=int(d["vocab_size"]),
            block_size=int(sub.get("block_size") or d.get("block_size") or 16),
            mask_token_id=int(sub["mask_token_id"]),
            target_layer_ids=tuple(int(i) for i in ids),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=float(d.get("rope_theta", 10000.0)),
            rope_scaling=parse_rope_scaling(d.get("rope_scaling")),
            layer_attn=_resolve_layer_attn(d, n_layers),
            num_target_layers=n_target,
            measured_gamma=int(d.get("dflash_jax_gamma") or 0),
            **_logit_scalars(d, sub, source),
            **v2,
        )
    except KeyError as e:
        raise CheckpointError(f"{source}: config.json is missing field {e.args[0]!r}") from None


def check_against_target(cfg: DrafterConfig, tcfg: TargetConfig, source: str) -> None:
    if cfg.hidden_size != tcfg.hidden_size:
        raise CheckpointError(
            f"{source}: drafter hidden_size {cfg.hidden_size} differs from the target's hidden_size "
            f"{tcfg.hidden_size}; the drafter shares the target's embedding and LM head, so they must match"
        )
    if not 0 <= cfg.mask_token_id < tcfg.vocab_size:
        raise CheckpointError(
            f"{source}: dflash_config.mask_token_id {cfg.mask_token_id} is outside the target vocabulary "
            f"(0..{tcfg.vocab_size - 1})"
        )
    for i in cfg.target_layer_ids:
        if not 0 <= i < tcfg.num_layers:
            raise CheckpointError(
                f"{source}: dflash_config.target_layer_ids contains {i}, but the target has {tcfg.num_layers} "
                f"layers (ids are 0-based decoder-layer outputs)"
            )


def drafter_weights_to_ours(raw: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Strip the optional `model.` prefix and transpose matrices to our [in, out] layout."""
    out = {}
    for k, w in raw.items():
        name = k[len("model.") :] if k.startswith("model.") else k
        out[name] = np.ascontiguousarray(w.T) if w.ndim == 2 and not is_table(name) else w
    return out


def is_table(name: str) -> bool:
    """A 2-D tensor stored [rows, dim] in both layouts (not a Linear weight): the DFlash2 selector codebooks."""
    return name.endswith("_codebook")


def drafter_class(cfg: DrafterConfig) -> type[DrafterModel]:
    """DrafterModel, or Drafter2Model for `arch == "dflash2"`."""
    if cfg.arch == "dflash2":
        from dflash_jax.models.drafter2 import Drafter2Model

        return Drafter2Model
    return DrafterModel


def load_drafter(path: str | Path, tcfg: TargetConfig, dtype=jnp.float32) -> DrafterModel:
    """A z-lab DFlash drafter directory (or a `dflash-jax quantize` output; see `load_drafter_and_head`)."""
    return load_drafter_and_head(path, tcfg, dtype)[0]


def load_drafter_and_head(path: str | Path, tcfg: TargetConfig, dtype=jnp.float32):
    """(drafter, quantized LM-head copy or None). A checkpoint written by `dflash-jax quantize` keeps its quantized
    weights as they are and may carry the drafter's quantized copy of the LM head."""
    from dflash_jax.checkpoints.hf import read_json, read_safetensors, safetensors_files
    from dflash_jax.models.layers import DictBuilder

    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"--draft-model: path {str(path)!r} does not exist")
    if not (path / "config.json").exists():
        raise CheckpointError(f"--draft-model: {path} has no config.json (not a DFlash drafter directory)")
    raw_cfg = read_json(path / "config.json")
    cfg = drafter_config_from_hf(raw_cfg, str(path))
    check_against_target(cfg, tcfg, str(path))
    quantized: dict[str, Any] = {}
    if raw_cfg.get("dflash_jax_quantization"):
        from dflash_jax.quant import is_quantized
        from dflash_jax.quant.io import load_quantized

        raw = {}
        for k, w in load_quantized(path).items():
            name = k[len("model.") :] if k.startswith("model.") else k
            if is_quantized(w):
                quantized[name] = w
                raw[name] = np.zeros(w.shape, np.float32)  # placeholder with the declared [out, in] shape
            else:
                raw[name] = np.asarray(w, np.float32)
        head = quantized.pop("lm_head.weight", None)
        raw.pop("lm_head.weight", None)
    else:
        raw, head = read_safetensors(safetensors_files(path)), None
    b = DictBuilder(drafter_weights_to_ours(raw), str(path), dtype)
    m = drafter_class(cfg)(cfg, tcfg.hidden_size, b)
    b.check_all_used()
    if quantized:
        from dflash_jax.checkpoints.export import _key_to_param

        for name, w in quantized.items():
            _key_to_param(m, name).set_value(w)
    return m, head


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
