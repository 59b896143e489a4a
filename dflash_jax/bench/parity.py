"""Parity of speculative and plain greedy output, per prompt: identical, a near tie, or something else.

Greedy speculative decoding emits exactly the target's argmax at every position, so in exact arithmetic it equals
plain greedy decoding. In floating point the two paths compute each position's logits in differently shaped calls
(a W-row verify against a one-row decode), and their last bits may differ; where the target's two best tokens are
closer than that rounding, the paths can pick different tokens and continue differently from there. `judge` tells
such a near tie from a real divergence (a bug).

The bound. At the first differing position i, let `h` be the target's final-normed hidden state (stored in the
activation dtype, unit roundoff `u`: 2^-8 for bfloat16, 2^-11 for float16, 2^-24 for float32), `w_x` the LM-head
column of token x, and `z_x = h . w_x` the logit (accumulated in f32, unit roundoff `u32` = 2^-24, over `n` =
hidden-size terms). Each computation of `h` ends in one rounding to the activation dtype, so two computations of
the same exact `h*` give `h* + d` with `|d_k| <= u |h_k|` per component. For tokens a, b the logit gap
`g = z_a - z_b = h . (w_a - w_b)` then moves by at most `u * S(a, b)`, `S(a, b) = sum_k |h_k| |w_a,k - w_b,k|`,
per computation. If one path picked a (its gap >= 0) and the other b (its gap <= 0), the exact gap is within
`u S` of zero and an independent third computation's within `2 u S`. Adding the f32 accumulation error of the two
dot products (`gamma_n = n u32 / (1 - n u32)` times `sum_k |h_k| (|w_a,k| + |w_b,k|)`):

    bound(a, b) = 2 u S(a, b) + gamma_n * sum_k |h_k| (|w_a,k| + |w_b,k|)

computed from the reference's `h` and the LM head at that position. The reference is an independent
computation: one fresh full-sequence forward of the target over prompt + the common prefix (its own fresh
pages, no drafter, no serving state), in the serving dtype. A divergence is a `near_tie` when both paths' tokens
lie within the bound of the reference's best logit (`z_top - z_x <= bound(top, x)` for x = each path's token),
else `other`.
"""

from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dflash_jax.models.layers import contiguous_pages
from dflash_jax.models.target import TargetModel, init_kv_cache

F32_ROUNDOFF = 2.0**-24
KINDS = ("identical", "near_tie", "other")


def unit_roundoff(dtype) -> float:
    """Half an ulp at 1 of a float dtype: 2^-8 (bfloat16), 2^-11 (float16), 2^-24 (float32)."""
    return float(2.0 ** -(jnp.finfo(dtype).nmant + 1))


def rounding_bound(h: np.ndarray, lm_head: np.ndarray, a: int, b: int, u: float) -> float:
    """The rounding bound of the logit gap between tokens a and b at final hidden state `h` [H] with LM head
    [H, V] and activation unit roundoff `u` (module docstring)."""
    h = np.abs(np.asarray(h, np.float64))
    wa, wb = (np.asarray(lm_head[:, t], np.float64) for t in (a, b))
    n = h.shape[0]
    gamma_n = n * F32_ROUNDOFF / (1 - n * F32_ROUNDOFF)
    return float(2 * u * h @ np.abs(wa - wb) + gamma_n * h @ (np.abs(wa) + np.abs(wb)))


@dataclass(frozen=True)
class Divergence:
    """The first differing position of one prompt's two outputs and its verdict."""

    prompt: int
    position: int  # index into the generated tokens
    spec_token: int
    plain_token: int
    reference_token: int  # the reference forward's argmax
    gap: float  # z_top - z_x for the path token x farther from the reference's top
    bound: float  # bound(top, x) for that token
    kind: str  # near_tie | other

    def to_json(self) -> dict:
        return asdict(self)


def judge(logits: np.ndarray, h: np.ndarray, lm_head: np.ndarray, spec: int, plain: int, u: float):
    """(kind, gap, bound, top) for two path tokens given the reference `logits` [V] and final hidden `h` [H]."""
    logits = np.asarray(logits, np.float64)
    top = int(np.argmax(logits))
    others = [x for x in (spec, plain) if x != top]  # one token when the reference agrees with a path
    checks = [(float(logits[top] - logits[x]), rounding_bound(h, lm_head, top, x, u)) for x in others]
    near = all(gap <= bound for gap, bound in checks)
    gap, bound = max(checks)  # the token farther from the top
    return ("near_tie" if near else "other"), gap, bound, top


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first index where `a` and `b` differ (a length difference counts), None when equal."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def reference_last(target: TargetModel, ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """(logits [V] f32, final-normed hidden [H] as f32) at the last position of one fresh forward over `ids`."""
    n = len(ids)
    tokens = np.zeros((1, -(-n // 64) * 64), np.int32)  # one compiled shape per 64 positions
    tokens[0, :n] = ids
    graph, state = nnx.split(target)
    logits, h = _reference_forward(graph, state, jnp.asarray(tokens), jnp.int32(n - 1))
    return np.asarray(logits), np.asarray(h)


REFERENCE_PAGE_SIZE = 16  # positions per page of the reference forward's KV pool


@functools.partial(jax.jit, static_argnames=("graph",))
def _reference_forward(graph, state, tokens, last):
    """The target over one row of `tokens` at positions 0.. with a fresh cache; logits and h at `last`."""
    model = nnx.merge(graph, state)
    t = tokens.shape[1]
    pages, num_pages = contiguous_pages(1, t, REFERENCE_PAGE_SIZE)
    cache = init_kv_cache(model.cfg, num_pages, REFERENCE_PAGE_SIZE, model.dtype)
    positions = jnp.arange(t, dtype=jnp.int32)[None, :]
    h, _, _ = model(tokens, positions, cache, pages, kv_len=t)
    h_last = h[0, last]
    return model.logits(h_last), h_last.astype(jnp.float32)


def classify(
    target: TargetModel,
    prompts: list[list[int]],
    spec_outputs: list[list[int]],
    plain_outputs: list[list[int]],
    ending_ids: tuple[int, ...] = (),
) -> tuple[dict[str, int], list[Divergence]]:
    """Per prompt: identical, near tie or other (module docstring). Returns the counts by kind and the first
    divergence of each prompt that is not identical. Where one output ended before the other (`ending_ids`: the
    ids that end a sequence), its token at that position is the reference's best-scoring ending id."""
    counts = dict.fromkeys(KINDS, 0)
    out: list[Divergence] = []
    u = unit_roundoff(target.dtype)
    lm_head = None
    for p, (ids, s, q) in enumerate(zip(prompts, spec_outputs, plain_outputs, strict=True)):
        i = first_difference(s, q)
        if i is None:
            counts["identical"] += 1
            continue
        if lm_head is None:
            lm_head = np.asarray(target.lm_head[...].astype(jnp.float32))
        logits, h = reference_last(target, [*ids, *s[:i]])
        ends = [t for t in ending_ids if t < logits.shape[0]]
        best_end = max(ends, key=lambda t: logits[t]) if ends else -1

        st, pt = (x[i] if i < len(x) else best_end for x in (s, q))
        if st < 0 or pt < 0:
            kind, gap, bound, top = "other", math.inf, 0.0, int(np.argmax(logits))
        else:
            kind, gap, bound, top = judge(logits, h, lm_head, st, pt, u)
        counts[kind] += 1
        out.append(Divergence(p, i, st, pt, top, gap, bound, kind))
    return counts, out
