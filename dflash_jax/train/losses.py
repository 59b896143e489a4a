"""Training pieces that are pure functions: anchor sampling, the block attention layout, position-decay weights,
chunked cross-entropy through the frozen LM head, teacher-forced acceptance length.
"""

from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np


def decay_gamma(block_size: int) -> float:
    """The decay constant of the position-weighted loss: 7 for B=16, 5 for B=10, 4 for B=8 (else B/2)."""
    return {16: 7.0, 10: 5.0, 8: 4.0}.get(block_size, block_size / 2)


def decay_weights(block_size: int, gamma: float | None = None) -> np.ndarray:
    """w_k for block slots k = 0..B-1: 0 for the anchor slot, exp(-(k-1)/γ) for k >= 1."""
    g = decay_gamma(block_size) if gamma is None else gamma
    k = np.arange(block_size, dtype=np.float64)
    return np.where(k >= 1, np.exp(-(k - 1) / g), 0.0).astype(np.float32)


def sample_anchors(
    loss_mask: np.ndarray, lengths: np.ndarray, num_anchors: int, block_size: int, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Per row, up to `num_anchors` distinct anchors drawn uniformly from loss-masked positions p with
    p + block_size <= length (no block past the end), sorted. Returns (anchors [R,N] i32, keep [R,N] bool);
    rows with fewer valid positions are padded with position 0 and keep=False."""
    r = loss_mask.shape[0]
    anchors = np.zeros((r, num_anchors), np.int32)
    keep = np.zeros((r, num_anchors), bool)
    for i in range(r):
        valid = np.flatnonzero(loss_mask[i, : max(int(lengths[i]) - block_size + 1, 0)])
        n = min(num_anchors, valid.size)
        if n:
            anchors[i, :n] = np.sort(rng.choice(valid, size=n, replace=False))
            keep[i, :n] = True
    return anchors, keep


def block_layout(num_blocks: int, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """(block_id [N*B], slot [N*B]) for N blocks packed end to end."""
    return np.repeat(np.arange(num_blocks), block_size), np.tile(np.arange(block_size), num_blocks)


def training_mask(anchors: np.ndarray, seq_len: int, block_size: int) -> np.ndarray:
    """The dense attention mask of one row, [N*B, L + N*B] (True = visible), for inspection and tests.

    A block sees context keys strictly before its anchor and the keys of its own block (bidirectionally),
    never other blocks. (The model builds the same mask on the fly from anchors, block ids and slots.)"""
    n = anchors.shape[0]
    block_id, _ = block_layout(n, block_size)
    limit = anchors[block_id]
    ctx = np.arange(seq_len)[None, :] < limit[:, None]
    blk = block_id[:, None] == block_id[None, :]
    return np.concatenate([ctx, blk], axis=1)


def _lm_head_logits(hc: jax.Array, w: jax.Array, dtype) -> jax.Array:
    """f32 logits of a row chunk. With `dtype` (bfloat16) both operands are cast and the dot accumulates in f32:
    on this CPU (AVX512-BF16) that LM-head GEMM runs ~1.8x faster, and it is the bulk of a training step."""
    if dtype is None:
        return (hc @ w).astype(jnp.float32)
    return jnp.dot(hc.astype(dtype), w.astype(dtype), preferred_element_type=jnp.float32)


@partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def chunked_ce(
    h: jax.Array, w: jax.Array, labels: jax.Array, weights: jax.Array, chunk: int = 256, topk: int = 0, dtype=None
):
    """(Σ weights · CE(h @ w, labels), argmax(h @ w) == labels per row), computed in row chunks so the full
    [R, V] logits never exist.

    The backward pass is produced in the same chunked pass (d h = weights · (softmax - onehot) @ wᵀ), so logits
    are computed once per step, for the loss, the gradient and the accuracy. `w` is treated as frozen (its
    cotangent is zero). With `topk` > 0 the same pass also returns the ids [R, topk] of the top logits (DFlash2's
    selector candidates), so the LM head is read once per chunk. `dtype`: the GEMM input type (None: h's)."""
    loss, correct, ids, _ = _ce_fwd_impl(h, w, labels, weights, chunk, topk, dtype)
    return (loss, correct) if not topk else (loss, correct, ids)


def _ce_fwd_impl(h, w, labels, weights, chunk, topk, dtype):
    r, d = h.shape
    nc = math.ceil(r / chunk)
    pad = nc * chunk - r
    hp = jnp.pad(h, ((0, pad), (0, 0))).reshape(nc, chunk, d)
    lp = jnp.pad(labels, (0, pad)).reshape(nc, chunk)
    wp = jnp.pad(weights, (0, pad)).reshape(nc, chunk)
    wd = w if dtype is None else w.astype(dtype)  # cast the LM head once, not per chunk

    def body(args):
        hc, lc, wc = args
        logits = _lm_head_logits(hc, wd, dtype)
        lse = jax.nn.logsumexp(logits, axis=-1)
        tl = jnp.take_along_axis(logits, lc[:, None], axis=-1)[:, 0]
        correct = jnp.argmax(logits, axis=-1) == lc
        p = jnp.exp(logits - lse[:, None])
        g = (p - jax.nn.one_hot(lc, logits.shape[-1], dtype=p.dtype)) * wc[:, None]
        dh = _lm_head_logits(g, wd.T, dtype).astype(hc.dtype)
        ids = jax.lax.top_k(logits, topk)[1].astype(jnp.int32) if topk else jnp.zeros((chunk, 0), jnp.int32)
        return jnp.sum((lse - tl) * wc), correct, ids, dh

    losses, correct, ids, dh = jax.lax.map(body, (hp, lp, wp))
    return jnp.sum(losses), correct.reshape(-1)[:r], ids.reshape(r + pad, -1)[:r], dh.reshape(-1, d)[:r]


def _ce_fwd(h, w, labels, weights, chunk, topk, dtype):
    loss, correct, ids, dh = _ce_fwd_impl(h, w, labels, weights, chunk, topk, dtype)
    return ((loss, correct) if not topk else (loss, correct, ids)), (dh, w)


def _ce_bwd(chunk, topk, dtype, res, ct):
    dh, w = res
    return ct[0] * dh, jnp.zeros_like(w), None, None


chunked_ce.defvjp(_ce_fwd, _ce_bwd)


def teacher_forced_tau(correct: jax.Array, valid: jax.Array) -> jax.Array:
    """correct/valid [R, N, B-1] -> mean over kept blocks of 1 + (leading run of correct, valid slots)."""
    run = jnp.cumprod((correct & valid).astype(jnp.int32), axis=-1).sum(-1)
    kept = valid[..., 0]
    return jnp.sum((1 + run) * kept) / jnp.maximum(jnp.sum(kept), 1)


def decode_chain(accepted: np.ndarray) -> list[int]:
    """The steps greedy speculative decoding takes through one response, from the drafts each anchor would have
    accepted: `accepted[j]` is the leading run of teacher-forced correct drafts with the block anchored at the
    response's token j (token 0 comes from the prefill; drafts past the response's end are never correct). A step at
    anchor j emits accepted[j] + 1 tokens and the next one is anchored at the last of them, until the response's last
    token is the anchor. Returns the tokens each step emitted, counted as the engine counts a step's accepted drafts:
    their mean is the τ `bench decode` measures on this response at T = 0. A teacher-forced τ over uniformly drawn
    anchors reads higher, since a step that follows a rejection starts where the drafter just failed."""
    steps, j, n = [], 0, len(accepted)
    while j < n - 1:
        a = min(int(accepted[j]), n - 1 - j)
        steps.append(a + 1)
        j += a + 1
    return steps


# ------------------------------------------------------------------------------------------- DFlash2 selector
def selector_topk_loss(h, w, pred_codebook, succ_codebook, hidden_proj, pred, labels, weights, ids, u_transform=None):
    """DFlash2's selector loss: a K-way CE over the backbone's top-K candidates at each row, scored with the
    teacher-forced predecessor, `S(b) = U(b) + ⟨A[pred] ⊙ P h, B[b]⟩`, targeted at the true token's slot.
    Rows whose true token is not among the K are excluded.

    h [R,H] (final-normed hidden), w [H,V] frozen LM head, A/B [V,r], P [H,r], pred/labels [R], weights [R]
    (the decay weights × validity), ids [R,K] the backbone's top-K (from the CE's own pass:
    `chunked_ce(..., topk=K)`); `u_transform` maps the candidates' logits to U (the checkpoint's multiplier and
    softcap, as at inference). Returns (loss = Σ w·CE / Σ w over included rows, metrics, correct [R]: whether the
    selector's pick is the true token, i.e. what a greedy draft at that row would be judged by)."""
    ids = jax.lax.stop_gradient(ids)
    cols = jnp.take(jax.lax.stop_gradient(w), ids, axis=1)  # [H,R,K]: the candidates' LM-head columns
    u = jnp.einsum("rh,hrk->rk", h, cols).astype(jnp.float32)  # backbone logits of the candidates (grad -> h)
    if u_transform is not None:
        u = u_transform(u)
    z = (h @ hidden_proj).astype(jnp.float32)
    s = u + jnp.einsum(
        "rq,rkq->rk", pred_codebook[pred].astype(jnp.float32) * z, succ_codebook[ids].astype(jnp.float32)
    )
    hit = ids == labels[:, None]
    inside = jnp.any(hit, axis=-1)
    ce = jax.nn.logsumexp(s, axis=-1) - jnp.sum(jnp.where(hit, s, 0.0), axis=-1)
    wi = weights * inside
    loss = jnp.sum(ce * wi) / jnp.maximum(jnp.sum(wi), 1e-6)
    valid = weights > 0
    n = jnp.maximum(jnp.sum(valid), 1)
    correct = jnp.take_along_axis(ids, jnp.argmax(s, axis=-1)[:, None], axis=-1)[:, 0] == labels
    metrics = {
        "sel_loss": loss,
        "candidate_recall": jnp.sum(inside & valid) / n,  # the selector's ceiling
        "sel_acc": jnp.sum(correct & valid) / n,  # teacher-forced top-1 of the selector path
        "base_acc": jnp.sum((ids[:, 0] == labels) & valid) / n,  # the backbone's argmax
    }
    return loss, metrics, correct
