"""On-device sampling: temperature, top-k, top-p with per-sequence parameters, and the lossless
speculative acceptance rule.

Order (as HF): temperature, then top-k, then top-p (nucleus over the top-k-renormalized distribution).
Per-sequence parameters are arrays `[B]`; temperature 0 means greedy for that row.

Randomness is a pure function of (seed, absolute position, stream id); the streams are listed in `dflash_jax.rng`.

Cost: the vocabulary is sorted only in a batch where a sampled row sets top-k or top-p, and random bits are drawn
only in a batch with a sampled row (each a `lax.cond` on the batch's parameters); greedy rows never depend on them.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from dflash_jax.rng import ACCEPT_UNIFORM, BONUS_SAMPLE, TOKEN_SAMPLE, row_keys

NEG_INF = -1e30


class SamplingArrays(NamedTuple):
    temperature: jax.Array  # f32 [B]; 0 = greedy
    top_k: jax.Array  # i32 [B]; 0 = off
    top_p: jax.Array  # f32 [B]; 1 = off
    seed: jax.Array  # u32 [B]


def filters_active(sp: SamplingArrays, vocab_size: int) -> jax.Array:
    """Whether a sampled row of the batch sets top-k (< V) or top-p (< 1): only then is the vocabulary sorted."""
    cuts = ((sp.top_k > 0) & (sp.top_k < vocab_size)) | (sp.top_p < 1.0)
    return jnp.any((sp.temperature > 0.0) & cuts)


def any_sampled(sp: SamplingArrays) -> jax.Array:
    """Whether a row of the batch samples (temperature > 0): only then are random bits drawn."""
    return jnp.any(sp.temperature > 0.0)


def _top_k_top_p(scaled: jax.Array, sp: SamplingArrays) -> jax.Array:
    """Mask (to NEG_INF) what top-k, then top-p over the top-k-renormalized distribution, cut from `scaled`
    [B,T,V]; rows with top_k 0 and top_p 1 come back unchanged."""
    v = scaled.shape[-1]
    srt = jnp.sort(scaled, axis=-1)[..., ::-1]  # descending
    # top-k threshold
    k = jnp.where(sp.top_k > 0, jnp.minimum(sp.top_k, v), v)[:, None, None]
    kth = jnp.take_along_axis(srt, k - 1, axis=-1)
    masked = jnp.where(scaled >= kth, scaled, NEG_INF)
    # top-p over the top-k renormalized distribution: keep the smallest prefix of the sorted probs with mass >= p
    srt_k = jnp.where(jnp.arange(v)[None, None, :] < k, srt, NEG_INF)
    probs_sorted = jax.nn.softmax(srt_k, axis=-1)
    cum = jnp.cumsum(probs_sorted, axis=-1)
    p = sp.top_p[:, None, None]
    # number kept = 1 + count of positions whose preceding mass < p
    n_keep = jnp.sum((cum - probs_sorted) < p, axis=-1, keepdims=True)
    n_keep = jnp.clip(n_keep, 1, v)
    pth = jnp.take_along_axis(srt_k, n_keep - 1, axis=-1)
    # top_p >= 1 is off: the whole top-k set stays (the float cumulative mass may round to 1 before its end)
    return jnp.where((masked >= pth) | (p >= 1.0), masked, NEG_INF)


def processed_logprobs(logits: jax.Array, sp: SamplingArrays) -> jax.Array:
    """logits [B, T, V] -> log-probabilities of the processed distribution [B, T, V] (masked entries -inf-ish).

    Rows with temperature 0 get a one-hot distribution on the argmax, so the same acceptance rule serves
    greedy rows too. The vocabulary is sorted only when a sampled row of the batch sets top-k or top-p (a
    `lax.cond`); the other rows' results are the same either way.
    """
    logits = logits.astype(jnp.float32)
    t = sp.temperature[:, None, None]
    greedy = t <= 0.0
    scaled = logits / jnp.where(greedy, 1.0, t)
    v = logits.shape[-1]
    masked = jax.lax.cond(filters_active(sp, v), lambda x: _top_k_top_p(x, sp), lambda x: x, scaled)
    logp = jax.nn.log_softmax(masked, axis=-1)
    onehot = jax.nn.one_hot(jnp.argmax(logits, axis=-1), v, dtype=jnp.float32)
    return jnp.where(greedy, jnp.where(onehot > 0, 0.0, NEG_INF), logp)


def sample_from_logprobs(logp: jax.Array, keys: jax.Array) -> jax.Array:
    """logp [B,T,V], keys [B,T] -> tokens [B,T] (categorical)."""
    return jax.vmap(jax.vmap(lambda k, lp: jax.random.categorical(k, lp)))(keys, logp).astype(jnp.int32)


def sample_tokens(logits: jax.Array, sp: SamplingArrays, positions: jax.Array) -> jax.Array:
    """Plain decoding: one token per (row, position). Greedy rows take the argmax; a batch without a sampled
    row draws no random bits (a `lax.cond`)."""
    top = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def draw():
        logp = processed_logprobs(logits, sp)
        keys = row_keys(sp.seed, positions, purpose=TOKEN_SAMPLE)
        return jnp.where(sp.temperature[:, None] > 0.0, sample_from_logprobs(logp, keys), top)

    return jax.lax.cond(any_sampled(sp), draw, lambda: top)


def _accept_uniforms(sp: SamplingArrays, positions: jax.Array) -> jax.Array:
    """The accept/reject uniforms [B,K] of the draft slots at `positions` [B,K]. A batch without a sampled row
    draws none: its rows have one-hot p (p(d) is 0 or 1), so u = 0 decides as any u in [0, 1) would."""

    def draw():
        ukeys = row_keys(sp.seed, positions, purpose=ACCEPT_UNIFORM)
        return jax.vmap(jax.vmap(lambda kk: jax.random.uniform(kk)))(ukeys)

    return jax.lax.cond(any_sampled(sp), draw, lambda: jnp.zeros(positions.shape, jnp.float32))


def _bonus(sp: SamplingArrays, pos_at: jax.Array, logp: jax.Array) -> jax.Array:
    """The emitted token [B] drawn from `logp` [B,V] (the residual or p at each row's deciding position `pos_at`).
    Greedy rows (whose `logp` has one finite entry) take its argmax, and a batch without a sampled row draws no
    random bits."""
    top = jnp.argmax(logp, axis=-1).astype(jnp.int32)

    def draw():
        bkeys = row_keys(sp.seed, pos_at[:, None], purpose=BONUS_SAMPLE)[:, 0]
        drawn = jax.vmap(lambda kk, lp: jax.random.categorical(kk, lp))(bkeys, logp).astype(jnp.int32)
        return jnp.where(sp.temperature > 0.0, drawn, top)

    return jax.lax.cond(any_sampled(sp), draw, lambda: top)


def greedy_accept(drafts: jax.Array, target_choice: jax.Array, num_drafts: jax.Array):
    """Greedy verification.

    drafts [B, K] (d_1..d_K), target_choice [B, K+1] (the target's token after each verify row),
    num_drafts [B] (only the first num_drafts[b] drafts count). Returns (accepted [B], bonus [B]).
    """
    k = drafts.shape[1]
    match = (drafts == target_choice[:, :k]) & (jnp.arange(k)[None, :] < num_drafts[:, None])
    accepted = jnp.sum(jnp.cumprod(match.astype(jnp.int32), axis=1), axis=1)
    bonus = jnp.take_along_axis(target_choice, accepted[:, None], axis=1)[:, 0]
    return accepted, bonus


def speculative_accept(
    drafts: jax.Array,
    logits: jax.Array,
    num_drafts: jax.Array,
    sp: SamplingArrays,
    positions: jax.Array,
):
    """Lossless verification of deterministic (greedy) drafts against the processed target distribution.

    The rule (standard speculative sampling with a one-hot proposal q = δ_d):
      * draft d_i at verify row i-1 is accepted with probability p_{i-1}(d_i);
      * at the first rejection the emitted token is sampled from the residual max(p - δ_d, 0)/Z, i.e. p with
        d removed and renormalized (Z = 1 - p(d) > 0, since rejection has probability 1 - p(d));
      * if every counted draft is accepted, the bonus is sampled from p at the next row.
    Each emitted token is then distributed exactly as the target's processed distribution.
    Greedy rows (temperature 0) have a one-hot p, which reduces to exact-match acceptance and the argmax bonus.

    drafts [B,K], logits [B,K+1,V] (verify rows), positions [B,K+1] absolute positions of the verify rows.
    Returns (accepted [B], bonus [B]).
    """
    b, k = drafts.shape
    logp = processed_logprobs(logits, sp)  # [B, K+1, V]
    p_d = jnp.exp(jnp.take_along_axis(logp[:, :k, :], drafts[:, :, None], axis=-1)[..., 0])  # [B,K]
    u = _accept_uniforms(sp, positions[:, :k])
    ok = (u < p_d) & (jnp.arange(k)[None, :] < num_drafts[:, None])
    accepted = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1)
    # Row `accepted` decides the emitted token: residual if a draft was rejected there, else p itself.
    row_logp = jnp.take_along_axis(logp, accepted[:, None, None], axis=1)[:, 0]  # [B,V]
    rejected_here = accepted < num_drafts
    d_at = jnp.take_along_axis(drafts, jnp.minimum(accepted, k - 1)[:, None], axis=1)[:, 0]
    remove = jax.nn.one_hot(d_at, logp.shape[-1], dtype=bool) & rejected_here[:, None]
    resid = jnp.where(remove, NEG_INF, row_logp)
    pos_at = jnp.take_along_axis(positions, accepted[:, None], axis=1)[:, 0]
    return accepted, _bonus(sp, pos_at, resid)


def speculative_accept_q(
    drafts: jax.Array,
    logits: jax.Array,
    num_drafts: jax.Array,
    sp: SamplingArrays,
    positions: jax.Array,
    cand_ids: jax.Array,
    cand_q: jax.Array,
    min_residual: float = 1e-6,
):
    """Lossless verification of drafts drawn from a proposal q with small support (DFlash2's selector walk).

    cand_ids/cand_q [B,K,C]: draft i was drawn from q_i, which puts mass cand_q[b,i,c] on token cand_ids[b,i,c]
    (distinct ids; q_i may depend on the drafts before i). The rule (standard speculative sampling):
      * draft d_i is accepted with probability min(1, p_{i-1}(d_i) / q_i(d_i)) (drawn as u·q < p);
      * at the first rejection the emitted token is sampled from max(p - q, 0) renormalized (p itself if that
        residual has less than `min_residual` mass, which only float rounding can produce);
      * if every counted draft is accepted, the bonus is sampled from p at the next row.
    A one-hot q gives exactly `speculative_accept`; greedy rows (one-hot p) stay exact-match + argmax.
    Same random streams as `speculative_accept` (ACCEPT_UNIFORM and BONUS_SAMPLE). Returns (accepted [B], bonus [B]).
    """
    b, k = drafts.shape
    if k == 0:
        return speculative_accept(drafts, logits, num_drafts, sp, positions)
    logp = processed_logprobs(logits, sp)  # [B, K+1, V]
    v = logp.shape[-1]
    p_d = jnp.exp(jnp.take_along_axis(logp[:, :k, :], drafts[:, :, None], axis=-1)[..., 0])  # [B,K]
    q_d = jnp.sum(jnp.where(cand_ids[:, :k] == drafts[:, :, None], cand_q[:, :k], 0.0), axis=-1)  # [B,K]
    u = _accept_uniforms(sp, positions[:, :k])
    ok = (u * q_d < p_d) & (jnp.arange(k)[None, :] < num_drafts[:, None])
    accepted = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1)
    p_row = jnp.exp(jnp.take_along_axis(logp, accepted[:, None, None], axis=1)[:, 0])  # [B,V]
    rejected_here = accepted < num_drafts
    at = jnp.minimum(accepted, k - 1)[:, None, None]
    ids_at = jnp.take_along_axis(cand_ids, at, axis=1)[:, 0]  # [B,C]
    q_at = jnp.take_along_axis(cand_q, at, axis=1)[:, 0] * rejected_here[:, None]
    q_row = jnp.zeros((b, v), jnp.float32).at[jnp.arange(b)[:, None], ids_at].add(q_at.astype(jnp.float32))
    resid = jnp.maximum(p_row - q_row, 0.0)
    dist = jnp.where((jnp.sum(resid, axis=-1) >= min_residual)[:, None], resid, p_row)
    pos_at = jnp.take_along_axis(positions, accepted[:, None], axis=1)[:, 0]
    lp = jnp.where(dist > 0, jnp.log(jnp.maximum(dist, 1e-38)), NEG_INF)
    return accepted, _bonus(sp, pos_at, lp)
