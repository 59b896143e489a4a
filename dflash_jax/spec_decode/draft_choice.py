"""Drafts chosen under a grammar (host, numpy): a constrained row's proposal is re-chosen position by position as
its matcher walks the drafts, so the verify spends its rows on tokens the grammar allows.

The walk (`choose_drafts`) starts from the matcher's state after the committed tokens: position 0's mask is the
tokens allowed next. At each position j it picks draft j+1 among the drafter's candidates that mask allows, advances
the matcher by it and computes the next position's mask; with no allowed candidate the draft ends there (the row
verifies fewer drafts). The masks are the verify rows' masks: the target's distribution at each row is masked by the
same grammar state the draft was chosen in. The matcher is rolled back at the end (the tokens the verify emits are
consumed after the step).

How a position picks:
  * DFlash (greedy drafts): the drafter's best candidate the grammar allows (its top-`CANDIDATES` tokens, best
    first). The drafts stay deterministic, so the one-hot acceptance rule stays lossless.
  * DFlash2, sampled rows: the selector walk drew draft j+1 from q_j over its K candidates as
    argmax(scaled scores + Gumbel noise g_j). The draft is re-drawn with the same g_j as the argmax over the
    allowed candidates of (log q_j + g_j): a sample of q_j masked to the allowed candidates and renormalised, which
    is the q the acceptance rule (`sampling.speculative_accept_q`) gets, so the verify stays distribution-exact.
    Where the walk's own draft is allowed it is that argmax already and is kept.
  * DFlash2, greedy rows (one-hot q): the walk's draft where allowed, else the first allowed candidate (the
    backbone's order); q becomes one-hot on it.
The walk's q at position j+1 was computed with the walk's own draft j+1 as the predecessor; where the grammar
changed that draft, q_{j+1} is still fixed before draft j+2 is drawn (with noise of its own), so acceptance stays
lossless; only its agreement with the target can suffer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np


class Matcher(Protocol):
    """What the walk needs of a sequence's grammar (`engine.grammar.SlotGrammar`)."""

    @property
    def done(self) -> bool: ...  # complete or failed: only end-of-sequence is allowed from here

    def mask(self) -> np.ndarray: ...  # [words] packed int32: the tokens allowed next

    def advance(self, token: int) -> bool: ...  # consume one draft; False when the matcher cannot go on

    def rollback(self, n: int) -> None: ...  # undo the last n `advance`s


def allowed(mask: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """Whether the packed mask [words] (bit t % 32 of word t // 32) allows each token of `ids` (any shape)."""
    ids = np.asarray(ids, np.int64)
    inside = (ids >= 0) & (ids < 32 * mask.shape[-1])
    safe = np.where(inside, ids, 0)
    words = mask.view(np.uint32)[safe >> 5]
    return inside & (((words >> (safe & 31).astype(np.uint32)) & 1) == 1)


def best_allowed(cands: np.ndarray, mask: np.ndarray) -> int | None:
    """The first of `cands` [C] (best first) the mask allows, or None."""
    ok = np.flatnonzero(allowed(mask, cands))
    return int(cands[ok[0]]) if ok.size else None


def masked_sample(
    ids: np.ndarray, q: np.ndarray, noise: np.ndarray, mask: np.ndarray, drawn: int
) -> tuple[int | None, np.ndarray]:
    """A sampled walk's draft re-drawn under the mask: (token or None when no allowed candidate has mass under q, the
    masked and renormalised q [K]). `ids` [K] the candidates, `q` [K] the walk's distribution over them, `noise` [K]
    its Gumbel noise, `drawn` the walk's draft (argmax of the scaled scores + noise)."""
    ok = allowed(mask, ids) & (q > 0)
    qm = np.where(ok, q, 0.0).astype(np.float64)
    z = qm.sum()
    if z <= 0:
        return None, np.zeros_like(q)
    keep = np.flatnonzero(ok & (ids == drawn))
    if keep.size:
        i = int(keep[0])
    else:
        with np.errstate(divide="ignore"):
            i = int(np.argmax(np.where(ok, np.log(qm) + noise, -np.inf)))
    return int(ids[i]), (qm / z).astype(q.dtype)


def greedy_pick(ids: np.ndarray, mask: np.ndarray, drawn: int) -> tuple[int | None, np.ndarray]:
    """A greedy walk's draft under the mask: the walk's own where allowed, else the first allowed candidate; q one-hot
    on it (zeros and None when none is allowed)."""
    ok = allowed(mask, ids)
    hit = np.flatnonzero(ok & (ids == drawn))
    first = np.flatnonzero(ok)
    q = np.zeros(ids.shape, np.float32)
    if not first.size:
        return None, q
    i = int(hit[0] if hit.size else first[0])
    q[i] = 1.0
    return int(ids[i]), q


@dataclass
class RowChoice:
    drafts: np.ndarray  # [width-1] int32: the chosen drafts (the proposal's past `n`)
    q: np.ndarray | None  # [width-1, K]: the DFlash2 proposal's q, masked and renormalised where chosen
    masks: np.ndarray  # [width, words] the verify rows' masks
    n: int  # drafts chosen (<= the asked count)


def walk(grammar: Matcher, n: int, width: int, first: np.ndarray, pick: Callable[[int, np.ndarray], int | None]):
    """Walk up to `n` drafts on `grammar`: `pick(j, mask_j)` is draft j+1 (None: the draft ends). Returns (the
    drafts chosen, masks [width, words]); the matcher is left as it was. Once the matcher is done (the grammar is
    complete, or failed) its mask (end-of-sequence only) stays, as `consume` leaves it; positions past the last
    chosen draft get the last mask (the verify never reaches them)."""
    masks = np.empty((width, first.shape[-1]), np.int32)
    masks[0] = first
    chosen: list[int] = []
    advanced = filled = 0  # matcher steps to undo; masks set up to index `filled`
    try:
        for j in range(min(n, width - 1)):
            t = pick(j, masks[j])
            if t is None:
                break
            chosen.append(t)
            if grammar.done:
                masks[j + 1] = masks[j]
            elif grammar.advance(t):
                advanced += 1
                masks[j + 1] = grammar.mask()
            else:
                break
            filled = j + 1
    finally:
        if advanced:
            grammar.rollback(advanced)
    masks[filled + 1 :] = masks[filled]
    return chosen, masks


def choose_drafts(
    grammar: Matcher,
    n: int,
    width: int,
    first: np.ndarray,
    drafts: np.ndarray,
    extra: np.ndarray,
    q: tuple[np.ndarray, np.ndarray] | None = None,
    sampled: bool = False,
) -> RowChoice:
    """One row's drafts chosen under its grammar (module docstring). `drafts` [width-1]: the proposal; `first`: the
    mask after the committed tokens. DFlash (`q` None): `extra` [width-1, C] the drafter's candidates, best first.
    DFlash2: `q` = (candidate ids, q) [width-1, K] of the walk, `extra` [width-1, K] its Gumbel noise, `sampled`
    whether the row samples (temperature > 0)."""
    out = np.array(drafts, np.int32, copy=True)
    if q is None:
        chosen, masks = walk(grammar, n, width, first, lambda j, m: best_allowed(extra[j], m))
        out[: len(chosen)] = chosen
        return RowChoice(out, None, masks, len(chosen))
    ids, qs = q
    new_q = np.array(qs, copy=True)

    def pick(j: int, m: np.ndarray) -> int | None:
        if sampled:
            t, row = masked_sample(ids[j], qs[j], extra[j], m, int(drafts[j]))
        else:
            t, row = greedy_pick(ids[j], m, int(drafts[j]))
        if t is not None:
            new_q[j] = row
        return t

    chosen, masks = walk(grammar, n, width, first, pick)
    out[: len(chosen)] = chosen
    return RowChoice(out, new_q, masks, len(chosen))
