"""Single-prompt generation used by `dflash-jax generate` (plain or speculative), streaming text as it comes."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from dflash_jax.spec_decode.runner import SpecRunner
from dflash_jax.types import SamplingParams


@dataclass
class GenerationStats:
    prompt_tokens: int
    tokens: list[int]
    steps: int
    drafts: int
    accepted: int
    seconds: float
    ttft_s: float

    @property
    def tau(self) -> float:
        """Mean tokens per verify step (accepted drafts + 1); 1.0 for plain decoding."""
        return (len(self.tokens) - 1) / max(self.steps, 1)


class IncrementalDetokenizer:
    """Emits only complete text: holds back a trailing partial UTF-8 character."""

    def __init__(self, decode: Callable[[list[int]], str]):
        self.decode = decode
        self.ids: list[int] = []
        self.sent = 0

    def push(self, ids: list[int]) -> str:
        self.ids.extend(ids)
        text = self.decode(self.ids)
        if text.endswith("\ufffd"):
            return ""
        new = text[self.sent :]
        self.sent = len(text)
        return new


def generate_one(
    runner: SpecRunner,
    prompt_ids: list[int],
    sampling: SamplingParams,
    max_tokens: int,
    stop_ids: set[int],
    on_tokens: Callable[[list[int]], None] | None = None,
) -> GenerationStats:
    t0 = time.perf_counter()
    first = runner.add(0, prompt_ids, sampling)
    ttft = time.perf_counter() - t0
    out: list[int] = []
    steps = drafts = accepted = 0

    def take(toks: list[int]) -> bool:
        for t in toks:
            if len(out) >= max_tokens:
                return True
            out.append(t)
            if t in stop_ids:
                return True
        return len(out) >= max_tokens

    done = take(first.tokens)
    if on_tokens:
        on_tokens(list(out))
    while not done:
        before = len(out)
        r = runner.step([0], {0: max_tokens - len(out)})[0]
        steps += 1
        drafts += r.num_drafts
        accepted += r.num_accepted
        done = take(r.tokens)
        if on_tokens:
            on_tokens(out[before:])
    runner.release(0)
    return GenerationStats(len(prompt_ids), out, steps, drafts, accepted, time.perf_counter() - t0, ttft)
