"""Data shared by the engine's `StepRunner` protocol and the runners that implement it (plain Python, no JAX)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling. temperature 0 = greedy."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None


@dataclass
class StepResult:
    """What one `step()` (or `add()`) committed for one slot."""

    tokens: list[int]
    num_drafts: int = 0  # drafts the target verified for this slot this step (0 = plain decode / prefill)
    num_accepted: int = 0  # how many of them it accepted (tokens = accepted + 1 bonus)
    accepted_mask: list[bool] = field(default_factory=list)  # per draft position: accepted?
