"""DFlash2 in the speculative loop: the jitted propose (backbone + selector walk) and the per-slot proposal buffer.

The walk's proposal q (over the selector's top-K candidates per draft) stays on device next to the drafts, so
`step.verify` can accept losslessly at T > 0 with `sampling.speculative_accept_q`. Greedy rows walk by argmax
(one-hot q), so greedy verification is unchanged.
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from dflash_jax.models.drafter2 import ARCH, propose_block2
from dflash_jax.parallel.drafter_tp import propose_block2_tp
from dflash_jax.spec_decode.sampling import SamplingArrays


class DraftQ(NamedTuple):
    """Per slot and draft index: the candidates ids [slots, γ-1, K] (int32) and q over them [slots, γ-1, K]."""

    ids: jax.Array
    probs: jax.Array


def init_draft_q(drafter, slots: int, gamma: int) -> DraftQ | None:
    """The proposal buffer for a DFlash2 drafter; None for DFlash (its drafts are argmax: one-hot q)."""
    if drafter is None or drafter.cfg.arch != ARCH:
        return None
    shape = (slots, gamma - 1, drafter.cfg.selector_top_k)
    return DraftQ(jnp.zeros(shape, jnp.int32), jnp.zeros(shape, jnp.float32))


def _propose2(
    embed,
    lm_head,
    dgraph,
    dstate,
    dcache,
    drafts_buf,
    draft_q: DraftQ,
    slot_ids,
    anchor,
    start,
    sp: SamplingArrays,
    *,
    kv_len,
    width,
    mesh,
):
    """`step.propose` for DFlash2: drafts land in drafts_buf[slot, :width-1] and their proposal in draft_q.
    Rows walk at their own temperature (0 = argmax) with their seed; `mesh` as for `step.propose_tp` (None: no
    drafter TP). Returns (drafts_buf, draft_q)."""
    drafter = nnx.merge(dgraph, dstate)
    args = (drafter, embed, lm_head, dcache, anchor, start, slot_ids)
    kw = dict(width=width, kv_len=kv_len, temperature=sp.temperature, seed=sp.seed)
    drafts, ids, q = propose_block2(*args, **kw) if mesh is None else propose_block2_tp(*args, mesh=mesh, **kw)
    n = width - 1
    return (
        drafts_buf.at[slot_ids, :n].set(drafts),
        DraftQ(draft_q.ids.at[slot_ids, :n].set(ids), draft_q.probs.at[slot_ids, :n].set(q)),
    )


_PROPOSE2_JIT = dict(static_argnames=("dgraph", "kv_len", "width", "mesh"), donate_argnames=("drafts_buf", "draft_q"))
propose2 = jax.jit(partial(_propose2, mesh=None), **_PROPOSE2_JIT)
propose2_tp = jax.jit(_propose2, **_PROPOSE2_JIT)  # the same with the drafter in `shard_map` over `mesh`
