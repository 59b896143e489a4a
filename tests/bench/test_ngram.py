"""Prompt-lookup (n-gram) drafting (`bench.ngram`): proposals by hand, and the replay on a plain greedy output
against an independent greedy speculative loop that verifies the drafts with a deterministic toy target."""

from __future__ import annotations

import numpy as np
import pytest

from dflash_jax.bench.ngram import propose, simulate, step_through


def test_propose_takes_the_longest_suffix_match_and_its_latest_occurrence():
    # the 3-gram [1, 2, 3] occurred at the start: what followed it
    assert propose([1, 2, 3, 9, 1, 2, 3], 3) == [9, 1, 2]
    # only the 1-gram [1] matches; its latest earlier occurrence (index 3) wins over index 1
    assert propose([5, 1, 7, 1, 8, 1], 2) == [8, 1]
    # a longer match beats a later shorter one: [4, 5] at 0 (-> 6) over [5] at 4 (-> 7)
    assert propose([4, 5, 6, 0, 5, 7, 4, 5], 1) == [6]
    # min_n 2 refuses the 1-gram match; no match at all proposes nothing
    assert propose([5, 1, 7, 1, 8, 1], 2, min_n=2) == []
    assert propose([1, 2, 3], 4) == []
    # the continuation stops at the end of the context
    assert propose([7, 8, 7], 5) == [8, 7]
    with pytest.raises(ValueError, match="min_n"):
        propose([1, 2], 2, min_n=0)


def _target(ctx: list[int]) -> int:
    """A deterministic toy target's greedy next token: mostly repeats the context 5 tokens back, sometimes not."""
    s = sum(ctx[-3:])
    return ctx[-5] if (len(ctx) >= 5 and s % 7) else (s * 31 + len(ctx)) % 11


def _speculative_greedy(prompt: list[int], n: int, gamma: int):
    """Greedy speculative decoding with n-gram drafts verified by `_target` (the reference): returns the emitted
    tokens, the tokens emitted per verify step and per step (drafts verified, drafts accepted)."""
    out = [_target(prompt)]  # the prefill's token
    per_step, verified = [], []
    while len(out) < n:
        ctx = prompt + out
        k = min(gamma - 1, n - len(out) - 1)  # the engine verifies no draft past the last token
        if k == 0:
            out.append(_target(ctx))  # a plain step
            continue
        drafts = propose(ctx, k)
        emitted = []
        for d in [*drafts, None]:
            t = _target(ctx + emitted)  # the target's argmax after the tokens accepted so far
            emitted.append(t)
            if d != t:
                break
        out += emitted
        per_step.append(len(emitted))
        verified.append((k, len(emitted) - 1))
    return out, per_step, verified


@pytest.mark.parametrize("gamma", [2, 4, 8])
def test_replay_on_the_plain_output_matches_greedy_verification(gamma):
    rng = np.random.default_rng(gamma)
    prompts = [list(rng.integers(0, 11, size=int(rng.integers(3, 12)))) for _ in range(6)]
    plain = []
    for p in prompts:
        o = [_target(p)]
        while len(o) < 40:
            o.append(_target(p + o))
        plain.append(o)
    steps = []
    hits, seen = np.zeros(gamma - 1), np.zeros(gamma - 1)
    for p, o in zip(prompts, plain, strict=True):
        spec, per_step, verified = _speculative_greedy(p, 40, gamma)
        for k, ok in verified:
            seen[:k] += 1
            hits[:ok] += 1
        assert spec == o  # lossless: greedy speculative output equals plain
        emitted, mine, acc = step_through(p, o, gamma)
        assert emitted == o and mine == per_step
        assert all(sum(a) == k - 1 for a, k in zip(acc, mine, strict=True))  # accepted + the target's token
        steps += per_step
    r = simulate(prompts, plain, gamma)
    assert r["outputs_identical"] is True and r["steps"] == len(steps)
    assert r["tau_mean"] == pytest.approx(np.mean(steps)) and r["tau_mean"] > 1.0  # the toy target repeats itself
    assert sum(r["tau_histogram"].values()) == len(steps) and len(r["acceptance_by_position"]) == gamma - 1
    assert r["acceptance_by_position"] == pytest.approx(list(hits / seen))


def test_hybrid_drafts_give_ngram_rows_a_one_hot_proposal(monkeypatch):
    # rows with `use` verify the n-gram drafts; a DFlash2 walk's (ids, q) becomes one-hot on each such draft, for
    # which the sampled rule with q is the rule for deterministic drafts; the other rows keep the drafter's
    import jax
    import jax.numpy as jnp

    from dflash_jax.spec_decode import ngram
    from dflash_jax.spec_decode.sampling import SamplingArrays, speculative_accept, speculative_accept_q

    b, k, c, v = 3, 4, 5, 11
    keys = jax.random.split(jax.random.key(0), 3)
    drafts = jax.random.randint(keys[0], (b, k), 0, v)
    ids = jax.random.randint(keys[1], (b, k, c), 0, v)
    q = jax.nn.softmax(jax.random.normal(keys[2], (b, k, c)), axis=-1)
    monkeypatch.setattr(ngram, "_propose", lambda *a, **kw: (drafts, (ids, q)))
    given = jnp.array([[7, 7, 3, 0], [1, 2, 3, 4], [0, 5, 5, 5]], jnp.int32)
    use = jnp.array([True, False, True])
    out, (ids2, q2) = ngram.hybrid_drafts(None, None, None, None, None, None, None, None, given, use, width=k + 1,
                                          kv_len=0)  # fmt: skip
    np.testing.assert_array_equal(out, np.where(np.asarray(use)[:, None], given, drafts))
    np.testing.assert_array_equal(ids2[1], ids[1])
    np.testing.assert_array_equal(q2[1], q[1])
    rows = jnp.array([0, 2])
    np.testing.assert_array_equal(ids2[rows], np.broadcast_to(np.asarray(given)[[0, 2], :, None], (2, k, c)))
    np.testing.assert_array_equal(q2[rows], np.broadcast_to(np.eye(c)[0], (2, k, c)))
    # the n-gram rows' sampled acceptance equals the deterministic-draft rule, draw for draw
    sp = SamplingArrays(
        jnp.full((2,), 0.9, jnp.float32), jnp.zeros((2,), jnp.int32), jnp.ones((2,), jnp.float32),
        jnp.arange(2, dtype=jnp.uint32),
    )  # fmt: skip
    accept_q, accept = jax.jit(speculative_accept_q), jax.jit(speculative_accept)  # one compile each, 20 calls
    taken = 0
    for seed in range(20):
        logits = jax.random.normal(jax.random.key(100 + seed), (2, k + 1, v)) * 2.0
        # the drafts made likely, so that some are accepted
        logits = logits.at[jnp.arange(2)[:, None], jnp.arange(k)[None, :], out[rows]].add(2.0)
        pos = jnp.broadcast_to(jnp.arange(k + 1, dtype=jnp.int32), (2, k + 1)) + 9 * seed
        n = jnp.full((2,), k, jnp.int32)
        a_q, b_q = accept_q(out[rows], logits, n, sp, pos, ids2[rows], q2[rows])
        a_d, b_d = accept(out[rows], logits, n, sp, pos)
        np.testing.assert_array_equal(a_q, a_d)
        np.testing.assert_array_equal(b_q, b_d)
        taken += int(jnp.sum(a_d))
    assert 0 < taken < 20 * 2 * k  # some drafts accepted, some rejected
