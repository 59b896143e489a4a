"""Drafts chosen under a grammar (`spec_decode.draft_choice`): the packed-mask test, the greedy pick, and the sampled
re-draw, whose drafts verified by the lossless rule with the renormalised q emit the masked target distribution
(chi-square against numpy), while verifying them with the walk's unmasked q does not."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from dflash_jax.spec_decode.draft_choice import allowed, best_allowed, choose_drafts, greedy_pick, masked_sample
from dflash_jax.spec_decode.sampling import SamplingArrays, speculative_accept_q
from dflash_jax.spec_decode.step import apply_token_mask


def pack(allow: np.ndarray) -> np.ndarray:
    """bool [..., V] -> packed int32 [..., ceil(V/32)] (bit t % 32 of word t // 32)."""
    v = allow.shape[-1]
    words = (v + 31) // 32
    bits = np.zeros((*allow.shape[:-1], words * 32), bool)
    bits[..., :v] = allow
    return np.packbits(bits.reshape(*allow.shape[:-1], words, 32), axis=-1, bitorder="little").view("<i4")[..., 0]


def chi2_ok(samples, probs, what):
    probs = np.asarray(probs, np.float64) / np.sum(probs, dtype=np.float64)
    counts = np.bincount(samples, minlength=len(probs))
    support = probs > 0
    assert counts[~support].sum() == 0, f"{what}: samples outside the support"
    res = stats.chisquare(counts[support], probs[support] * counts.sum())
    assert res.pvalue > 1e-3, f"{what}: counts {counts} vs {np.round(probs * counts.sum())} (p={res.pvalue})"


def test_allowed_reads_the_packed_bits():
    rng = np.random.default_rng(0)
    allow = rng.random(100) < 0.4
    allow[[0, 31, 32, 63, 99]] = True
    mask = pack(allow)
    ids = np.arange(-3, 130)
    want = np.zeros(ids.shape, bool)
    inside = (ids >= 0) & (ids < 100)
    want[inside] = allow[ids[inside]]
    np.testing.assert_array_equal(allowed(mask, ids), want)


def test_greedy_picks_the_best_allowed_candidate():
    allow = np.zeros(40, bool)
    allow[[3, 7, 33]] = True
    mask = pack(allow)
    assert best_allowed(np.asarray([9, 33, 7]), mask) == 33
    assert best_allowed(np.asarray([9, 10]), mask) is None
    t, q = greedy_pick(np.asarray([9, 7, 3]), mask, drawn=3)  # the walk's own draft is allowed: kept
    assert t == 3 and q.tolist() == [0, 0, 1]
    t, q = greedy_pick(np.asarray([9, 7, 3]), mask, drawn=9)  # forbidden: the first allowed candidate
    assert t == 7 and q.tolist() == [0, 1, 0]


class _Regex:
    """A matcher over tokens 0..V-1 allowing, at step i of the walk, the set `sets[i]` (done after the last)."""

    def __init__(self, sets, v):
        self.sets, self.v, self.i, self.eos = sets, v, 0, frozenset({v - 1})

    @property
    def done(self):
        return self.i >= len(self.sets)

    def mask(self):
        allow = np.zeros(self.v, bool)
        if self.done:
            allow[self.v - 1] = True
        else:
            allow[list(self.sets[self.i])] = True
        return pack(allow)

    def advance(self, t):
        assert t in self.sets[self.i]
        self.i += 1
        return True

    def rollback(self, n):
        self.i -= n


def test_walk_masks_and_early_end():
    v = 16
    g = _Regex([{1, 2}, {3}, {4, 5}], v)
    cands = np.asarray([[2, 1], [9, 3], [6, 7]])  # position 2 has no allowed candidate: the draft ends there
    c = choose_drafts(g, 3, 4, g.mask(), np.asarray([9, 9, 9]), cands)
    assert c.n == 2 and c.drafts.tolist() == [2, 3, 9] and g.i == 0  # rolled back
    want = [{1, 2}, {3}, {4, 5}, {4, 5}]  # the last position repeats the last mask (never reached)
    for row, s in zip(c.masks, want, strict=True):
        assert set(np.flatnonzero(allowed(row, np.arange(v)))) == s
    g = _Regex([{1}], v)  # complete after one token: end-of-sequence drafts follow under its mask
    c = choose_drafts(g, 3, 4, g.mask(), np.zeros(3, np.int32), np.asarray([[1, 0], [v - 1, 0], [v - 1, 2]]))
    assert c.n == 3 and c.drafts.tolist() == [1, v - 1, v - 1]


def test_sampled_redraw_under_the_mask_is_lossless():
    """A proposal q over K candidates, a grammar that forbids some of them: the re-drawn drafts follow q masked and
    renormalised, and the lossless rule given that q emits the masked target distribution. Given the walk's own q
    instead, it does not (the check has power)."""
    v, k, n, temp = 12, 6, 20000, 1.0
    rng = np.random.default_rng(3)
    ids = rng.permutation(v)[:k].astype(np.int32)
    q = np.exp(1.5 * rng.standard_normal(k))
    q = (q / q.sum()).astype(np.float32)
    allow = np.zeros(v, bool)
    allow[ids[np.argsort(q)[:3]]] = True  # the 3 candidates q likes least: most of its mass is forbidden
    allow[[t for t in range(v) if t not in ids][:4]] = True  # allowed tokens outside the candidates too
    mask = pack(allow)
    noise = rng.gumbel(size=(n, k)).astype(np.float32)
    drawn = ids[np.argmax(np.log(q) + noise, axis=-1)]  # the walk's draws
    picks = [masked_sample(ids, q, noise[i], mask, int(drawn[i])) for i in range(n)]
    drafts = np.asarray([t for t, _ in picks], np.int32)
    q_new = np.stack([r for _, r in picks])
    kept = allowed(mask, drawn)
    assert (drafts[kept] == drawn[kept]).all()  # an allowed walk draw is kept
    qm = np.where(allowed(mask, ids), q, 0)
    full = np.zeros(v)
    full[ids] = qm / qm.sum()
    chi2_ok(drafts, full, "drafts ~ masked q")
    np.testing.assert_allclose(q_new[0], qm / qm.sum(), rtol=1e-6)

    logits = (2.0 * rng.standard_normal((2, v))).astype(np.float32)
    masked = np.asarray(
        apply_token_mask(
            jnp.asarray(np.broadcast_to(logits, (n, 2, v))), jnp.asarray(pack(np.broadcast_to(allow, (n, 2, v))))
        )
    )
    z = np.where(allow, logits[0] / temp, -np.inf)
    p0 = np.exp(z - z.max())
    p0 /= p0.sum()
    sp = SamplingArrays(
        jnp.full((n,), temp, jnp.float32),
        jnp.zeros((n,), jnp.int32),
        jnp.ones((n,), jnp.float32),
        jnp.arange(n, dtype=jnp.uint32) * 7 + 1,
    )
    pos = jnp.broadcast_to(jnp.arange(5, 7, dtype=jnp.int32), (n, 2))
    nd = jnp.ones((n,), jnp.int32)
    cand = jnp.asarray(np.broadcast_to(ids, (n, 1, k)))
    accept = jax.jit(speculative_accept_q)

    def first_tokens(qs):
        acc, bonus = accept(jnp.asarray(drafts[:, None]), jnp.asarray(masked), nd, sp, pos, cand, jnp.asarray(qs))
        acc, bonus = np.asarray(acc), np.asarray(bonus)
        return np.where(acc >= 1, drafts, bonus)

    chi2_ok(first_tokens(q_new[:, None]), p0, "emitted ~ masked p")
    with pytest.raises(AssertionError):  # the walk's own q (mass on forbidden candidates) biases the output
        chi2_ok(first_tokens(np.broadcast_to(q, (n, 1, k))), p0, "unmasked q")
