"""The DFlash2 drafter (`DFlash2DraftModel`): the DFlash backbone plus a two-tap grouped dynamic convolution around
every sublayer and a top-K candidate (path) selector.

Convolution (one `DynamicConv` per sublayer, `attention_conv` and `mlp_conv`). Its projection runs once on the
normed sublayer input xn and gives per-position, per-group coefficient corrections for two applications:

    k[t, app, j, c] = base_kernel[app, j, c] + δ[t, app, j, c // group],   δ = (xn @ kernel_projection)[t]
    Conv_app(y)_t = Σ_j k[t, app, j] ⊙ y_{t-j}          (j = 0..taps-1; y_{t-j} = 0 across a block boundary)

    x += Conv_1(Attn(Conv_0(RMSNorm(x))))   and the same for the MLP.

The projection output (2·taps·G, G = H / group) is laid out (application, tap, group), row-major. A shifted tap
never crosses a block boundary: slot 0 of a block sees zero padding for x_{t-1}, also when many blocks are packed
end to end (training).

Selector: at draft slot t the backbone's top-K tokens b with logits U_t(b) are rescored against the predecessor a:
`S_t(a, b) = U_t(b) + ⟨A[a] ⊙ P h_t, B[b]⟩` (A/B = predecessor/successor codebooks [V, r], P = hidden_projection,
h_t = the final-normed hidden). The walk starts at the anchor; each slot takes the argmax over the K (T = 0) or a
sample from softmax(S/T) (T > 0), which becomes the next predecessor. The walk returns q (the distribution it drew
from, over the K candidates) so the verifier can accept losslessly (`spec_decode.sampling.speculative_accept_q`).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dflash_jax.config import DrafterConfig
from dflash_jax.errors import CheckpointError
from dflash_jax.models.drafter import (
    DrafterModel,
    DraftLayer,
    candidate_logits,
    dense,
    draft_head,
    no_reduce,
)
from dflash_jax.models.layers import ParamBuilder, rms_norm
from dflash_jax.rng import DRAFT_SAMPLE, row_keys

ARCH = "dflash2"
SELECTOR_TABLES = ("candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook")
TopKFn = Callable[[jax.Array, int], tuple[jax.Array, jax.Array]]  # (logits, k) -> (values, ids), best first


# ----------------------------------------------------------------------------------------------- convolution
def shift_mask(block_id: jax.Array, slot: jax.Array, taps: int) -> jax.Array:
    """[taps, Q] bool: may row t read row t-j (same block, j slots earlier)? Row j = 0 is all True."""
    q = slot.shape[0]
    rows = [jnp.ones((q,), bool)]
    for j in range(1, taps):
        prev_b = jnp.concatenate([jnp.full((j,), -1, block_id.dtype), block_id[:-j]])[:q]
        prev_s = jnp.concatenate([jnp.full((j,), -1, slot.dtype), slot[:-j]])[:q]
        rows.append((jnp.arange(q) >= j) & (prev_b == block_id) & (slot - prev_s == j))
    return jnp.stack(rows)


class DynamicConv(nnx.Module):
    """`{name}.base_kernel` [2, taps, H] and `{name}.kernel_projection.weight` (ours [H, 2·taps·G])."""

    def __init__(self, cfg: DrafterConfig, name: str, p: ParamBuilder):
        h, taps = cfg.hidden_size, cfg.conv_kernel_size
        self.taps, self.group = taps, cfg.conv_group_size
        self.base_kernel = p(name + ".base_kernel", (2, taps, h), (None, None, "embed"))
        self.kernel_projection = p(
            name + ".kernel_projection.weight", (h, 2 * taps * (h // self.group)), ("embed", None)
        )

    def coefficients(self, xn: jax.Array) -> jax.Array:
        """xn [B,Q,H] (the normed sublayer input) -> taps [B,Q,2,taps,G,group] (in xn's dtype)."""
        b, q, h = xn.shape
        g = h // self.group
        delta = dense(xn, self.kernel_projection[...]).reshape(b, q, 2, self.taps, g, 1)
        base = self.base_kernel[...].astype(xn.dtype).reshape(2, self.taps, g, self.group)
        return base + delta

    def __call__(self, y: jax.Array, k: jax.Array, app: int, shift_valid: jax.Array) -> jax.Array:
        """Application `app` of the coefficients k to y [B,Q,H]; shift_valid [taps, Q] from `shift_mask`.
        Computed in y's dtype."""
        b, q, h = y.shape
        yg = y.reshape(b, q, h // self.group, self.group)
        k = k.astype(y.dtype)
        out = k[:, :, app, 0] * yg
        for j in range(1, self.taps):
            prev = jnp.concatenate([jnp.zeros_like(yg[:, :j]), yg[:, :-j]], axis=1)[:, :q]
            prev = jnp.where(shift_valid[j][None, :, None, None], prev, jnp.zeros((), y.dtype))
            out = out + k[:, :, app, j] * prev
        return out.reshape(b, q, h)


class Draft2Layer(DraftLayer):
    def __init__(self, cfg: DrafterConfig, i: int, p: ParamBuilder):
        super().__init__(cfg, i, p)
        self.attention_conv = DynamicConv(cfg, f"layers.{i}.attention_conv", p)
        self.mlp_conv = DynamicConv(cfg, f"layers.{i}.mlp_conv", p)

    def __call__(self, cfg, x, cos, sin, ctx_k, ctx_v, ctx_mask, blk_mask, *, shift_valid, reduce=no_reduce):
        """`x += Conv_1(sublayer(Conv_0(hn)))` per sublayer; the convs see full hidden states (application 1 reads
        the sublayer output after `reduce`)."""
        eps = cfg.rms_norm_eps
        hn = rms_norm(x, self.input_layernorm[...], eps)
        conv = self.attention_conv
        k = conv.coefficients(hn)
        a = self.attention(cfg, conv(hn, k, 0, shift_valid), cos, sin, ctx_k, ctx_v, ctx_mask, blk_mask, reduce)
        x = x + conv(a, k, 1, shift_valid)
        hn = rms_norm(x, self.post_attention_layernorm[...], eps)
        conv = self.mlp_conv
        k = conv.coefficients(hn)
        return x + conv(self.mlp(conv(hn, k, 0, shift_valid), reduce), k, 1, shift_valid)


# ----------------------------------------------------------------------------------------------- selector
class CandidateSelector(nnx.Module):
    def __init__(self, cfg: DrafterConfig, p: ParamBuilder):
        v, r, h = cfg.vocab_size, cfg.selector_rank, cfg.hidden_size
        self.predecessor_codebook = p("candidate_selector.predecessor_codebook", (v, r), (None, None))
        self.successor_codebook = p("candidate_selector.successor_codebook", (v, r), (None, None))
        self.hidden_projection = p("candidate_selector.hidden_projection.weight", (h, r), ("embed", None))

    def project(self, h: jax.Array) -> jax.Array:
        """P h: [..., H] -> [..., r] (f32)."""
        return dense(h, self.hidden_projection[...]).astype(jnp.float32)

    def scores(self, u: jax.Array, ids: jax.Array, z: jax.Array, pred: jax.Array) -> jax.Array:
        """S = U(b) + ⟨A[pred] ⊙ z, B[b]⟩ for candidates ids [..., K] with logits u [..., K]; z [..., r] = P h;
        pred [...] the predecessor token."""
        a = self.predecessor_codebook[...][pred].astype(jnp.float32)
        bb = self.successor_codebook[...][ids].astype(jnp.float32)
        return u.astype(jnp.float32) + jnp.einsum("...r,...kr->...k", a * z, bb)


def selector_walk(selector: CandidateSelector, anchor, u, ids, z, temperature=None, keys=None):
    """The chain walk. anchor [B]; per draft slot t: candidate logits u [B,T,K], ids [B,T,K], z = P h [B,T,r].
    temperature [B] (0 = argmax) with keys [B,T], or None for argmax everywhere.
    Returns (drafts [B,T] int32, q [B,T,K] f32: the distribution each draft was drawn from, over the K)."""
    b, t, k = ids.shape

    def step(pred, xs):
        u_t, ids_t, z_t, key_t = xs
        s = selector.scores(u_t, ids_t, z_t, pred)  # [B,K]
        best = jnp.argmax(s, axis=-1)
        choice, q = best, jax.nn.one_hot(best, k, dtype=jnp.float32)
        if temperature is not None:
            greedy = temperature <= 0
            scaled = s / jnp.where(greedy, 1.0, temperature)[:, None]
            drawn = jax.vmap(jax.random.categorical)(key_t, scaled)
            choice = jnp.where(greedy, best, drawn)
            q = jnp.where(greedy[:, None], q, jax.nn.softmax(scaled, axis=-1))
        tok = jnp.take_along_axis(ids_t, choice[:, None], axis=-1)[:, 0].astype(jnp.int32)
        return tok, (tok, q)

    no_keys = jnp.zeros((b, t), jnp.int32)  # placeholder scanned alongside when the walk is greedy
    tmajor = tuple(jnp.swapaxes(a, 0, 1) for a in (u, ids, z, no_keys if keys is None else keys))
    _, (drafts, q) = jax.lax.scan(step, anchor.astype(jnp.int32), tmajor)
    return jnp.swapaxes(drafts, 0, 1), jnp.swapaxes(q, 0, 1)


# ----------------------------------------------------------------------------------------------- the model
class Drafter2Model(DrafterModel):
    """DrafterModel with `Draft2Layer`s and a `candidate_selector`; `block_hidden` is inherited (the layers get
    the within-block shift mask through `layer_kwargs`)."""

    layer_cls = Draft2Layer

    def __init__(self, cfg: DrafterConfig, target_hidden: int, p: ParamBuilder):
        if cfg.arch != ARCH:
            raise ValueError(f"Drafter2Model needs a DrafterConfig with arch={ARCH!r}, got {cfg.arch!r}")
        if cfg.hidden_size % cfg.conv_group_size:
            raise CheckpointError(f"conv_group_size {cfg.conv_group_size} does not divide {cfg.hidden_size}")
        super().__init__(cfg, target_hidden, p)
        self.candidate_selector = CandidateSelector(cfg, p)

    def layer_kwargs(self, block_id, slot) -> dict:
        return {"shift_valid": shift_mask(block_id, slot, self.cfg.conv_kernel_size)}


def drafter_class(cfg: DrafterConfig) -> type[DrafterModel]:
    """DrafterModel, or Drafter2Model for `arch == "dflash2"`."""
    return Drafter2Model if cfg.arch == ARCH else DrafterModel


def identity_init(model: Drafter2Model, seed: int = 0, std: float = 0.02) -> Drafter2Model:
    """In place: base tap 0 = 1, other taps 0, kernel projections 0 (every conv is the identity), successor
    codebook 0 (selector scores = backbone logits), predecessor codebook ~ N(0, std). The hidden projection keeps
    its random init (with it and B both zero no gradient would reach either). Returns the model."""
    rng = np.random.default_rng([seed, 0xD2])
    for layer in model.layers:
        for conv in (layer.attention_conv, layer.mlp_conv):
            base = np.zeros(conv.base_kernel[...].shape, np.float32)
            base[:, 0] = 1.0
            conv.base_kernel.set_value(jnp.asarray(base, conv.base_kernel[...].dtype))
            conv.kernel_projection.set_value(jnp.zeros_like(conv.kernel_projection[...]))
    sel = model.candidate_selector
    sel.successor_codebook.set_value(jnp.zeros_like(sel.successor_codebook[...]))
    a = sel.predecessor_codebook[...]
    sel.predecessor_codebook.set_value(jnp.asarray(rng.normal(0.0, std, a.shape).astype(np.float32), a.dtype))
    return model


def propose_block2(drafter, embed, lm_head, cache, anchor, start, pages, *, temperature=None, seed=None, **kw):
    """DFlash2 `propose_block`: (drafts [B, width-1] int32, candidate ids [B, width-1, K], q [B, width-1, K]).

    Greedy (argmax walk, one-hot q) when `temperature` is None; else per row: temperature [B] (0 = argmax) and
    seed [B]; draft slot t's sample uses the key of (seed, absolute position start+t, `rng.DRAFT_SAMPLE`).
    `kw`: `width` and `kv_len` as for `propose_block`; `reduce` (see `draft_head`) and `top_k` (how the K candidates
    are picked from the LM-head logits, default `jax.lax.top_k`): under drafter TP a psum and the global top-K of
    the ranks' vocabulary slices."""
    cfg = drafter.cfg
    top_k: TopKFn = kw.pop("top_k", jax.lax.top_k)
    h, logits = draft_head(drafter, embed, lm_head, cache, anchor, start, pages, **kw)
    u, ids = top_k(logits, cfg.selector_top_k)
    u = candidate_logits(cfg, u)
    z = drafter.candidate_selector.project(h)
    keys = None
    if temperature is not None:
        positions = start[:, None] + jnp.arange(1, h.shape[1] + 1, dtype=start.dtype)[None, :]
        keys = row_keys(seed, positions, purpose=DRAFT_SAMPLE)
    ids = ids.astype(jnp.int32)
    drafts, q = selector_walk(drafter.candidate_selector, anchor, u, ids, z, temperature, keys)
    return drafts, ids, q
