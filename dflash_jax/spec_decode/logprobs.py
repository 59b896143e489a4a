"""Log-probabilities of tokens under the target's own distribution, computed inside the jitted steps.

The distribution is the raw one: log_softmax of the target's f32 logits at the position, before temperature,
top-k and top-p (vLLM's default `logprobs-mode`, `raw_logprobs`). A step computes them only when one of its rows
asks (a runtime flag: one compiled program serves calls with and without them), always `MAX_TOP_LOGPROBS`
alternatives per token; the host keeps the number each request asked for.

Speculation does not change them: a verify row's logits are the target's logits at that position, so a token
emitted from an accepted draft or as the bonus gets the same log-probability as under plain decoding.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from dflash_jax.types import MAX_TOP_LOGPROBS

PROMPT_CHUNK = 128  # prompt rows turned into logits at once (bounds the [B, chunk, vocab] buffer)


class Logprobs(NamedTuple):
    """Per row and position: the chosen token's log-probability and the `MAX_TOP_LOGPROBS` most likely tokens."""

    chosen: jax.Array  # f32 [B,T]
    top_ids: jax.Array  # i32 [B,T,N], most likely first
    top_logprobs: jax.Array  # f32 [B,T,N]


def token_logprobs(logits: jax.Array, tokens: jax.Array, top_n: int = MAX_TOP_LOGPROBS) -> Logprobs:
    """logits [B,T,V], tokens [B,T] -> the log-probability of tokens[b,t] at row (b,t) and the top `top_n`."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    chosen = jnp.take_along_axis(logp, tokens[..., None].astype(jnp.int32), axis=-1)[..., 0]
    top_lp, top_ids = jax.lax.top_k(logp, min(top_n, logp.shape[-1]))
    return Logprobs(chosen, top_ids.astype(jnp.int32), top_lp)


def emitted_tokens(drafts: jax.Array, accepted: jax.Array, bonus: jax.Array) -> jax.Array:
    """The token each verify row emits: drafts [B,W-1], accepted [B], bonus [B] -> [B,W]. Row j < accepted emits
    draft j, row `accepted` the bonus; later rows emit nothing (their entry repeats the bonus, and is ignored)."""
    b, k = drafts.shape
    rows = jnp.arange(k + 1)[None, :]
    padded = jnp.concatenate([drafts, jnp.zeros((b, 1), drafts.dtype)], axis=1)
    return jnp.where(rows < accepted[:, None], padded, bonus[:, None]).astype(jnp.int32)


def prompt_logprobs(
    logits_of: Callable[[jax.Array], jax.Array], h: jax.Array, tokens: jax.Array, chunk: int = PROMPT_CHUNK
) -> Logprobs:
    """Log-probabilities of each prompt token given the ones before it.

    h [B,T,H] (the target's final-normed hidden states over the padded prompt), tokens [B,T]; `logits_of` maps
    hidden states to logits. Position t holds the log-probability of tokens[b, t+1] (and the top alternatives at
    row t); the last position and the padding are meaningless. The logits are formed `chunk` rows at a time.
    """
    b, t, d = h.shape
    nxt = jnp.concatenate([tokens[:, 1:], jnp.zeros((b, 1), tokens.dtype)], axis=1)
    c = min(chunk, t)
    pad = (-t) % c
    h = jnp.pad(h, ((0, 0), (0, pad), (0, 0)))
    nxt = jnp.pad(nxt, ((0, 0), (0, pad)))
    n = (t + pad) // c
    hs = h.reshape(b, n, c, d).swapaxes(0, 1)
    ns = nxt.reshape(b, n, c).swapaxes(0, 1)
    out = jax.lax.map(lambda x: token_logprobs(logits_of(x[0]), x[1]), (hs, ns))

    def unchunk(a: jax.Array) -> jax.Array:  # [n, B, c, ...] -> [B, T, ...]
        a = a.swapaxes(0, 1)
        return a.reshape(b, n * c, *a.shape[3:])[:, :t]

    return Logprobs(*(unchunk(a) for a in out))
