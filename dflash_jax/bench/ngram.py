"""Prompt-lookup (n-gram) drafting, measured on greedy outputs: the baseline `bench decode` reports beside the
drafter.

The proposer is the one vLLM calls `ngram`: take the last n tokens of the context (prompt and everything generated
so far), find their latest earlier occurrence in the context, and propose the tokens that followed it; n runs from
`max_n` down to `min_n` and the first n that matches wins; no match proposes nothing.

Under greedy verification the emitted sequence does not depend on the drafts (each step keeps the drafts that equal
the target's argmax, then the target's own next token), so a speculative run with these drafts emits exactly the
plain greedy output. Its τ and acceptance by position therefore follow from the plain output alone: each step
proposes from the context so far, accepts the longest prefix of the drafts that equals the next tokens of the plain
output, and emits that prefix plus one token. `simulate` replays that, step by step, and returns the emitted tokens
(equal to the plain output by construction, which the tests check against a step-by-step greedy loop).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def propose(context: Sequence[int], k: int, *, min_n: int = 1, max_n: int = 4) -> list[int]:
    """Up to `k` draft tokens: what followed the latest earlier occurrence of the context's last n tokens."""
    if k <= 0 or min_n < 1 or max_n < min_n:
        raise ValueError(f"propose: need k >= 1 and 1 <= min_n <= max_n, got k={k}, min_n={min_n}, max_n={max_n}")
    ctx = list(context)
    size = len(ctx)
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        suffix = ctx[size - n :]
        for start in range(size - n - 1, -1, -1):  # latest occurrence that ends before the suffix does
            if ctx[start : start + n] == suffix:
                return ctx[start + n : start + n + k]
    return []


def step_through(
    prompt: Sequence[int], output: Sequence[int], gamma: int, *, min_n: int = 1, max_n: int = 4
) -> tuple[list[int], list[int], list[list[bool]]]:
    """Greedy speculative decoding of `output` (the plain greedy continuation of `prompt`, its first token from
    the prefill) with n-gram drafts at verify width `gamma`: (emitted tokens, tokens emitted per step, per step the
    acceptance of each of the `gamma - 1` draft positions)."""
    if gamma < 2:
        raise ValueError(f"gamma must be >= 2 (drafts + 1), got {gamma}")
    out = list(output)
    emitted = out[:1]
    per_step: list[int] = []
    accepted: list[list[bool]] = []
    while len(emitted) < len(out):
        g = len(emitted)
        drafts = propose(list(prompt) + emitted, gamma - 1, min_n=min_n, max_n=max_n)
        n_ok = 0
        while n_ok < len(drafts) and g + n_ok < len(out) and drafts[n_ok] == out[g + n_ok]:
            n_ok += 1
        take = min(n_ok + 1, len(out) - g)  # the accepted drafts, then the target's own token
        emitted += out[g : g + take]
        per_step.append(take)
        accepted.append([i < n_ok for i in range(gamma - 1)])
    return emitted, per_step, accepted


def simulate(
    prompts: Sequence[Sequence[int]],
    outputs: Sequence[Sequence[int]],
    gamma: int,
    *,
    min_n: int = 1,
    max_n: int = 4,
) -> dict:
    """τ (tokens per verify step), its histogram and acceptance by position of n-gram drafting over a set of
    greedy outputs; `outputs_identical` confirms the replay emitted every plain output unchanged."""
    steps: list[int] = []
    acc: list[list[bool]] = []
    identical = True
    for p, o in zip(prompts, outputs, strict=True):
        emitted, per_step, accepted = step_through(p, o, gamma, min_n=min_n, max_n=max_n)
        identical &= emitted == list(o)
        steps += per_step
        acc += accepted
    al = np.array(steps)
    a = np.array(acc, bool).reshape(-1, gamma - 1)
    return {
        "method": "ngram",
        "min_n": min_n,
        "max_n": max_n,
        "gamma": gamma,
        "steps": int(al.size),
        "tau_mean": float(al.mean()) if al.size else 1.0,
        "tau_histogram": {str(k): int((al == k).sum()) for k in range(1, gamma + 1)},
        "acceptance_by_position": [float(x) for x in a.mean(0)] if a.size else [None] * (gamma - 1),
        "outputs_identical": bool(identical),
    }
