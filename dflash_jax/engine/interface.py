"""The contract between the host-side engine (scheduler) and the device-side step runner.

The engine (host, numpy, plain Python) owns requests, queues, stop conditions, detokenization and streaming.
The runner owns the device: params, KV caches, jitted step functions. The engine only talks to the runner
through this interface, so it can be tested with a fake runner and the real runner can be tested alone.

Slots: the runner has `max_slots` sequence slots. The engine assigns free slots to the requests it admits, calls
`add_many()` once for them (one batched prefill, which also yields each one's first generated token; `add()` is
the same for one request), then calls `step()` with the slots that are
running; each call returns the tokens newly committed per slot (1 for plain decode, 1..k+1 for a speculative
step). Tokens past a stop condition are the engine's to drop; the runner never needs to know about stops,
except `max_new` (a hint: the runner may draft fewer tokens when fewer are wanted). `num_drafts` carries the
engine's draft-count controller: how many drafts each slot verifies this step (the runner caps it by its
verify width, by `max_new` and by the context left; a slot it does not name gets the full width). The runner
has no controller of its own. `release()` frees a slot and its KV pages at once.

KV pages: the runner's `pages` (`kv.pages.PagePool`) holds every sequence's K/V. The engine takes a new
sequence's prompt pages with `reserve()` before `add_many()` (False: the pool is short now, the request waits) and,
before each step, the pages the step may write with `grow()` (the slots it could not grow: the engine preempts a
sequence and retries). A prompt longer than the runner's `prefill_chunk` is prefilled over several calls:
`add_many()` returns an empty result for it, it stays in `prefilling` until `prefill_step()` returns its first
token, and it is not stepped meanwhile. Mixed steps: `admit()` starts sequences without a device call, and
`step(..., prefill={slot: tokens})` runs the next chunk of those prefilling slots in the step's own device call
(their results are `prefill_step()`'s), so decoding never waits for a separate prefill call.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Protocol

from dflash_jax.kv.pages import PagePool
from dflash_jax.types import SamplingParams, StepResult

__all__ = ["SamplingParams", "StepResult", "StepRunner"]


class StepRunner(Protocol):
    max_slots: int
    max_model_len: int  # prompt + generated tokens per slot
    speculative: bool
    pages: PagePool
    prefill_chunk: int | None  # the most prompt tokens of one sequence one prefill call takes (None: all)
    prefilling: Mapping[int, object]  # slots whose prompt is not fully prefilled

    def reserve(self, slot: int, prompt_ids: list[int], sampling: SamplingParams) -> bool:
        """Take the KV pages of a new sequence's prompt (reusing cached prefix pages); False if the pool cannot."""
        ...

    def grow(self, slots: list[int]) -> list[int]:
        """Take the pages each slot's next step may write; returns the slots the pool could not grow."""
        ...

    def prefill_step(self, slots: list[int] | None = None) -> dict[int, StepResult]:
        """The next prompt chunk of each prefilling slot; per slot its first token when the prompt is done, else
        an empty result."""
        ...

    def admit(self, items: list[tuple[int, list[int], SamplingParams]]) -> None:
        """Start several `(slot, prompt_ids, sampling)` as prefilling without a device call (their pages reserved);
        `prefill_step()` or a step's `prefill` prefills them."""
        ...

    def prompt_left(self, slot: int) -> int:
        """The prompt tokens of a prefilling slot still to prefill."""
        ...

    def add(self, slot: int, prompt_ids: list[int], sampling: SamplingParams) -> StepResult:
        """Prefill `prompt_ids` into `slot` and return the first generated token."""
        ...

    def add_many(self, items: list[tuple[int, list[int], SamplingParams]]) -> dict[int, StepResult]:
        """Prefill several `(slot, prompt_ids, sampling)` together in one device call; per slot the first generated
        token, exactly as `add` would give it for that request alone."""
        ...

    def step(
        self,
        slots: list[int],
        max_new: dict[int, int],
        num_drafts: dict[int, int] | None = None,
        no_propose: Collection[int] = (),
        prefill: Mapping[int, int] | None = None,
    ) -> dict[int, StepResult]:
        """Advance every slot in `slots` by one iteration (one decode or one draft+verify); `num_drafts`: the
        drafts to verify per slot (0 = plain decode), None = as many as fit; `no_propose`: slots whose sequence
        decodes plainly for now (the controller suspended it): 0 drafts this step, and when no slot of the step
        drafts, no drafter work at all. `prefill`: prefilling slots (not in `slots`) and the most prompt tokens
        each prefills in the same call; their results are as `prefill_step()` gives them."""
        ...

    def lookup_slots(self, slots: list[int]) -> set[int]:
        """The slots of `slots` whose next step would verify prompt-lookup drafts instead of the drafter's (for the
        controller's pricing); empty for a runner whose drafts all come from its drafter."""
        ...

    def release(self, slot: int) -> None:
        """Forget the slot; its cache space is free for the next `add()` / `add_many()`."""
        ...
