"""Jitted, pure step functions of the speculative decoding loop (device side).

All functions take the slot-indexed caches and a batch of `slot_ids` (a static batch bucket; padding rows
point at a spare scratch slot), and are jitted once per static (batch bucket, width, kv bucket). Caches are
donated. Nothing here syncs with the host.

  prefill  — target forward over the padded prompts with hidden capture; context K/V for the drafter;
             the first generated token (with `logprobs`, its log-probability; with `prompt_logprobs`, those of
             the prompt's tokens).
  verify   — target forward over [anchor, d_1..d_{W-1}] with hidden capture; acceptance (greedy or lossless
             sampling, with a per-row draft count); the drafter's context K/V for the verified rows (only rows
             < the new start are ever visible, so rejected rows are masked and later overwritten); with
             `logprobs`, the log-probability of the token each row emits, from the same logits.
  propose  — the drafter's block forward; drafts are written into a per-slot device buffer for the next verify
             (`propose_tp`: the same with the drafter in `shard_map` over a mesh, drafter tensor parallelism).
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from flax import nnx

from dflash_jax.models.drafter import propose_block, write_context
from dflash_jax.parallel.drafter_tp import propose_block_tp
from dflash_jax.spec_decode import logprobs as lps
from dflash_jax.spec_decode.sampling import SamplingArrays, greedy_accept, speculative_accept, speculative_accept_q


def _choose(logits, drafts, num_drafts, sp, positions, greedy: bool, draft_q=None):
    if greedy:
        return greedy_accept(drafts, jnp.argmax(logits, axis=-1).astype(jnp.int32), num_drafts)
    if draft_q is not None:  # DFlash2: drafts sampled from the selector's q over its top-K
        return speculative_accept_q(drafts, logits, num_drafts, sp, positions, *draft_q)
    return speculative_accept(drafts, logits, num_drafts, sp, positions)


@partial(
    jax.jit,
    static_argnames=("tgraph", "dgraph", "capture", "greedy", "logprobs", "prompt_logprobs"),
    donate_argnames=("tcache", "dcache"),
)
def prefill(
    tgraph,
    tstate,
    dgraph,
    dstate,
    tcache,
    dcache,
    slot_ids,
    tokens,
    lengths,
    sp: SamplingArrays,
    *,
    capture,
    greedy,
    logprobs=False,
    prompt_logprobs=False,
):
    """tokens [B,T] (padded prompts), lengths [B]. Returns (first token [B], first-token `Logprobs` [B,1] or None,
    prompt `Logprobs` [B,T] or None (see `logprobs.prompt_logprobs`), tcache, dcache)."""
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32)[None, :], (b, t))
    target = nnx.merge(tgraph, tstate)
    h, hidden, tcache = target(tokens, positions, tcache, slot_ids, capture=capture, kv_len=t)
    last = lengths - 1
    h_last = jnp.take_along_axis(h, last[:, None, None], axis=1)
    logits = target.logits(h_last)
    no_drafts = jnp.zeros((b, 0), jnp.int32)
    _, first = _choose(logits, no_drafts, jnp.zeros((b,), jnp.int32), sp, last[:, None], greedy)
    first_lp = lps.token_logprobs(logits, first[:, None]) if logprobs else None
    prompt_lp = lps.prompt_logprobs(target.logits, h, tokens) if prompt_logprobs else None
    if dgraph is not None:
        drafter = nnx.merge(dgraph, dstate)
        dcache = write_context(drafter, dcache, hidden, positions, slot_ids)
    return first, first_lp, prompt_lp, tcache, dcache


@partial(
    jax.jit,
    static_argnames=("tgraph", "dgraph", "capture", "kv_len", "width", "greedy", "logprobs"),
    donate_argnames=("tcache", "dcache"),
)
def verify(
    tgraph,
    tstate,
    dgraph,
    dstate,
    tcache,
    dcache,
    drafts_buf,
    slot_ids,
    anchor,
    start,
    num_drafts,
    sp: SamplingArrays,
    *,
    capture,
    kv_len,
    width,
    greedy,
    logprobs=False,
    draft_q=None,
):
    """One verify over width W = 1 + drafts. Returns (accepted [B], bonus [B], drafts [B,W-1], `Logprobs` [B,W] of
    the token each row emits (or None without `logprobs`), tcache, dcache).

    Row b emits drafts[b, :accepted[b]] followed by bonus[b]; its next start is start + accepted + 1.
    """
    drafts = drafts_buf[slot_ids, : width - 1]
    tokens = jnp.concatenate([anchor[:, None], drafts], axis=1)
    positions = start[:, None] + jnp.arange(width, dtype=jnp.int32)[None, :]
    target = nnx.merge(tgraph, tstate)
    h, hidden, tcache = target(tokens, positions, tcache, slot_ids, capture=capture, kv_len=kv_len)
    logits = target.logits(h)
    q = None if draft_q is None else jax.tree.map(lambda a: a[slot_ids, : width - 1], draft_q)  # DFlash2
    accepted, bonus = _choose(logits, drafts, jnp.minimum(num_drafts, width - 1), sp, positions, greedy, q)
    lp = lps.token_logprobs(logits, lps.emitted_tokens(drafts, accepted, bonus)) if logprobs else None
    if dgraph is not None:
        drafter = nnx.merge(dgraph, dstate)
        dcache = write_context(drafter, dcache, hidden, positions, slot_ids)
    return accepted, bonus, drafts, lp, tcache, dcache


def _propose(embed, lm_head, dgraph, dstate, dcache, drafts_buf, slot_ids, anchor, start, *, kv_len, width, mesh):
    """Drafter block forward for [anchor, MASK×(width-1)] at `start`; drafts land in drafts_buf[slot, :width-1].
    `mesh`: None (one device, or the drafter replicated), or the mesh of the drafter's `shard_map` (drafter TP)."""
    drafter = nnx.merge(dgraph, dstate)
    args = (drafter, embed, lm_head, dcache, anchor, start, slot_ids)
    if mesh is None:
        drafts, _ = propose_block(*args, width=width, kv_len=kv_len)
    else:
        drafts, _ = propose_block_tp(*args, width=width, kv_len=kv_len, mesh=mesh)
    return drafts_buf.at[slot_ids, : width - 1].set(drafts)


_PROPOSE_JIT = dict(static_argnames=("dgraph", "kv_len", "width", "mesh"), donate_argnames=("drafts_buf",))
propose = jax.jit(partial(_propose, mesh=None), **_PROPOSE_JIT)
propose_tp = jax.jit(_propose, **_PROPOSE_JIT)  # the same with the drafter in `shard_map` over `mesh`
