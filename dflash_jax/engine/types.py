"""Host-side request types of the engine: what a caller submits, what it gets back, and the small protocols
the engine needs from a tokenizer and (optionally) from a per-step draft-count controller.

Nothing here touches the device; the device contract is `interface.py`.
"""

from __future__ import annotations

from collections.abc import Collection, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from dflash_jax.errors import UserError
from dflash_jax.types import SamplingParams, StepResult, TokenLogprob

# Finish reasons (OpenAI's `stop`/`length`, plus `abort` for a request the client or a shutdown cancelled).
FINISH_STOP = "stop"
FINISH_LENGTH = "length"
FINISH_ABORT = "abort"
FINISH_ERROR = "error"


class TokenizerLike(Protocol):
    """What the engine and the server need from a tokenizer (the lead's checkpoint tokenizer satisfies it).

    Optional extras, used when present: `vocab_size: int` (token-id prompts and /detokenize are
    range-checked against it); `token_bytes(id) -> bytes` (a token's raw bytes, for log-probabilities; without it
    a token's bytes are those of its decoded text).
    """

    eos_token_ids: set[int]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> str: ...


@runtime_checkable
class DraftController(Protocol):
    """Per-step draft-count policy: `dflash_jax.spec_decode.control.Controller` implements it; a policy that needs
    no suspension, step times or per-request state subclasses it and keeps the no-op defaults.

    Sequences are identified by their request id (a string). Each step the engine calls
    `decide(active_ids)` -> {id: drafts} (0 = plain decode; an id missing from the answer gets no limit from
    the controller) and passes it to the runner's `step` as `num_drafts` (the runner caps it by its verify
    width and by what the request still may generate), with the sequences `is_suspended(id)` names as
    `no_propose` (no drafter work for them). Where the runner names sequences whose drafts come from prompt lookup
    (`StepRunner.lookup_slots`), the engine passes them as `decide(active_ids, lookup=ids)` and keeps them out of
    `no_propose`, and observes their steps with `lookup=True`. A speculative step that carries prompt chunks
    verifies at the runner's full width whatever its depth; the engine says so with `decide(..., full_width=True)`.
    After the step it calls `observe(id, num_drafts, accepted_mask_or_count)` for every sequence of the step (plain
    steps included, num_drafts = 0), then `observe_step_time(batch_width, depth, ms)` (depth = the most drafts any
    sequence verified; with `lookup=True` when every sequence that verified drafts had prompt-lookup drafts; with
    `drafting=` the count of sequences that verified drafts when not all did and the runner ran the step as a ragged
    verify (`StepResult.ragged`), for a controller whose `use_ragged_verify` returned True; not for a step that
    carried prompt chunks). At start-up the engine calls
    `use_ragged_verify(batch_buckets)` with the runner's `ragged_buckets` (None when it runs every row of a step at
    one width). `release(id)` is called when a request finishes.
    """

    def decide(
        self, active_seq_ids: Sequence[Hashable], lookup: Collection[Hashable] = (), *, full_width: bool = False
    ) -> Mapping[Hashable, int]: ...

    def observe(
        self, seq_id: Hashable, num_drafts: int, accepted: int | Iterable[object] = 0, *, lookup: bool = False
    ) -> None: ...

    def is_suspended(self, seq_id: Hashable) -> bool:
        """Whether the sequence decodes plainly for now (no drafter work)."""
        return False

    def observe_step_time(
        self, batch_width: int, num_drafts: int, ms: float, *, lookup: bool = False, drafting: int | None = None
    ) -> None:
        """The wall-clock time of one step of `batch_width` sequences verifying at most `num_drafts` drafts;
        `lookup`: every draft of the step came from prompt lookup; `drafting`: how many sequences verified drafts."""

    def use_ragged_verify(self, batch_buckets: tuple[int, ...] | None) -> bool:
        """The runner runs a full-width step whose rows do not all draft as a ragged verify over these batch buckets
        (`kv.sizing.ragged_split`), or None: it does not. True to be told `drafting` in `observe_step_time`."""
        return False

    def release(self, seq_id: Hashable) -> None:
        """Forget a finished request."""


class QueueFullError(Exception):
    """The engine has `max_num_seqs` running and `max_queued_requests` waiting: retry later (HTTP 429)."""


class EngineUnavailableError(Exception):
    """The engine is not accepting requests (starting up, draining for shutdown, or dead). HTTP 503."""

    def __init__(self, message: str, *, reason: str):
        super().__init__(message)
        self.reason = reason  # "starting" | "draining" | "dead" | "stopped"


class ContextLengthError(UserError):
    """prompt + max_tokens does not fit in the model's context (HTTP 400, code context_length_exceeded)."""


@dataclass(frozen=True)
class GenerationRequest:
    """One request as the engine sees it: token ids in, limits and stops, sampling.

    `max_tokens` 0 runs only the prefill (prompt scoring with `sampling.prompt_logprobs`): the request finishes
    with `length` and no tokens.
    `stop_token_ids` end the request like EOS (also with `ignore_eos`); before `min_tokens` tokens the engine has
    the runner mask EOS (unless `ignore_eos`) and the stop token ids from sampling (`SamplingParams.min_tokens`),
    and no stop string ends the request.
    """

    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    request_id: str = ""
    stop_token_ids: tuple[int, ...] = ()
    min_tokens: int = 0


@dataclass
class SpecStats:
    """Speculation statistics (vLLM's definitions): a *draft* is one speculative step of one sequence."""

    num_drafts: int = 0  # steps that verified at least one draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def add(self, res: StepResult) -> None:
        if res.num_drafts <= 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += res.num_drafts
        self.num_accepted_tokens += res.num_accepted
        if len(self.accepted_per_pos) < res.num_drafts:
            self.accepted_per_pos.extend([0] * (res.num_drafts - len(self.accepted_per_pos)))
        for i in accepted_positions(res):
            self.accepted_per_pos[i] += 1

    @property
    def mean_acceptance_length(self) -> float | None:
        """1 + accepted/drafts (the bonus token included), None before any speculative step."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else None

    @property
    def acceptance_rate(self) -> float | None:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "mean_acceptance_length": self.mean_acceptance_length,
            "draft_acceptance_rate": self.acceptance_rate,
            "accepted_per_position": list(self.accepted_per_pos),
        }


def accepted_positions(res: StepResult) -> list[int]:
    """Draft positions (0-based) accepted in one step: from the mask when given, else the prefix."""
    if res.accepted_mask:
        return [i for i, ok in enumerate(res.accepted_mask[: res.num_drafts]) if ok]
    return list(range(min(res.num_accepted, res.num_drafts)))


@dataclass
class RequestOutput:
    """One event on a request's stream: text/tokens new since the last event; the last has `finished`."""

    request_id: str
    text: str
    token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_completion_tokens: int = 0  # cumulative
    spec: SpecStats | None = None  # set on the final event
    error: str | None = None  # set when the engine failed under this request
    logprobs: list[TokenLogprob] | None = None  # with `sampling.logprobs`: one per token of `token_ids`
    prompt_logprobs: list[TokenLogprob] | None = None  # with `sampling.prompt_logprobs`: on the first event


@dataclass
class RequestRecord:
    """What the engine knows about a finished request (handed to observers for metrics)."""

    request_id: str
    num_prompt_tokens: int
    num_completion_tokens: int
    finish_reason: str
    arrival_time: float
    first_token_time: float | None
    finish_time: float
    spec: SpecStats

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first."""
        if self.first_token_time is None or self.num_completion_tokens < 2:
            return None
        return (self.finish_time - self.first_token_time) / (self.num_completion_tokens - 1)

    @property
    def e2e(self) -> float:
        return self.finish_time - self.arrival_time


class EngineObserver:
    """Hooks the engine calls from its loop (metrics live in the server). Override what you need."""

    def request_finished(self, record: RequestRecord) -> None:
        pass

    def spec_step(self, result: StepResult) -> None:
        """Called once per sequence per step that verified drafts."""

    def prefill_done(self, prompt_lens: Sequence[int], seconds: float) -> None:
        """Called after each admission's batched prefill (`runner.add_many`) with the prompt length of every
        request in it and its wall time."""

    def step_done(self, num_running: int, seconds: float) -> None:
        """Called after each step (`runner.step`) with the number of sequences in it and its wall time."""
