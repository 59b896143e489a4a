"""Random streams: every sample's key is a pure function of (seed, absolute position, stream id).

A sequence's samples therefore do not depend on how it was batched, and plain and speculative decoding draw from
the same stream layout. Each consumer of randomness has its own stream id, listed here so that no two collide.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

TOKEN_SAMPLE = 1  # a token sampled from the target: plain decoding, training-data generation
ACCEPT_UNIFORM = 2  # the uniforms of the speculative accept/reject test, one per draft slot
BONUS_SAMPLE = 3  # the token drawn from the residual (or the target) after the accepted drafts
DRAFT_SAMPLE = 4  # the DFlash2 selector walk's draft samples


def row_keys(seed: jax.Array, positions: jax.Array, purpose: int) -> jax.Array:
    """Keys [B, T] from per-row seeds [B] and absolute positions [B, T], in stream `purpose`."""
    base = jax.vmap(lambda s: jax.random.fold_in(jax.random.key(0), s))(seed.astype(jnp.uint32))
    base = jax.vmap(lambda k: jax.random.fold_in(k, purpose))(base)
    return jax.vmap(lambda k, ps: jax.vmap(lambda p: jax.random.fold_in(k, p))(ps))(base, positions)
