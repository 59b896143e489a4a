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
