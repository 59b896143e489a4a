"""Offline generation: the serving engine driven from synchronous code, the way vLLM's `LLM.generate` works.

    llm = OfflineEngine(runner, tokenizer, max_num_seqs=4, controller=ctl)
    outs = llm.generate([ids_a, "some text"], SamplingParams(), max_tokens=64, on_output=print_delta)
    llm.stats.decode_s, llm.stats.steps, llm.stats.spec_results    # the last call's figures
    llm.close()

`generate` submits every prompt to one `Engine` (engine.py) on a private event loop, runs it until all have
finished and returns one collected `RequestOutput` per prompt, in order. Admission, stops (EOS, stop strings,
`max_tokens`), detokenization, the draft-count controller and the device thread are the engine's, exactly as
under `serve`. `on_output(index, event)` sees every streamed event as it comes (one step's text delta).

The engine, and with it the controller's state, lives as long as the `OfflineEngine`: a second `generate`
continues with what the controller learned in the first (a warm-up pass and a timed pass see one controller,
as one server would).
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from dflash_jax.engine.engine import DEFAULT_MAX_NUM_BATCHED_TOKENS, DEFAULT_STEP_TOKEN_BUDGET, Engine
from dflash_jax.engine.interface import StepRunner
from dflash_jax.engine.types import (
    DraftController,
    EngineObserver,
    GenerationRequest,
    RequestOutput,
    RequestRecord,
    TokenizerLike,
)
from dflash_jax.types import SamplingParams, StepResult

Prompt = str | Sequence[int]


@dataclass
class RunStats:
    """What one `generate` call measured (collected through the engine's `EngineObserver` hooks)."""

    wall_s: float = 0.0  # from the first submit to the last request's end
    prefill_s: float = 0.0  # total wall time of the prefills (`runner.add_many`)
    step_s: float = 0.0  # total wall time of the steps (`runner.step`)
    steps: int = 0
    prefill_batches: int = 0  # batched prefills (admissions); each takes up to `max_num_batched_tokens` tokens
    max_running: int = 0  # the most sequences one step advanced
    spec_results: list[StepResult] = field(default_factory=list)  # per sequence per step that verified drafts
    records: list[RequestRecord] = field(default_factory=list)  # per request, in finishing order

    @property
    def decode_s(self) -> float:
        """Wall time without the prefills: what the decode-speed figures divide by."""
        return max(self.wall_s - self.prefill_s, 0.0)


class _Recorder(EngineObserver):
    """Fills the current `RunStats` and forwards every hook to the caller's observer."""

    def __init__(self, inner: EngineObserver | None):
        self.inner = inner or EngineObserver()
        self.stats = RunStats()

    def request_finished(self, record: RequestRecord) -> None:
        self.stats.records.append(record)
        self.inner.request_finished(record)

    def spec_step(self, result: StepResult) -> None:
        self.stats.spec_results.append(result)
        self.inner.spec_step(result)

    def prefill_done(self, prompt_lens: Sequence[int], seconds: float) -> None:
        self.stats.prefill_s += seconds
        self.stats.prefill_batches += 1
        self.inner.prefill_done(prompt_lens, seconds)

    def step_done(self, num_running: int, seconds: float) -> None:
        self.stats.steps += 1
        self.stats.step_s += seconds
        self.stats.max_running = max(self.stats.max_running, num_running)
        self.inner.step_done(num_running, seconds)


class OfflineEngine:
    """Synchronous batch generation over a `StepRunner` through the serving engine (see the module docstring).

    max_num_seqs: the most sequences decoded at once (default: the runner's slots); the rest wait their turn.
    max_num_batched_tokens: the most prompt tokens prefilled together in one admission (see `Engine`).
    step_token_budget: the most prompt tokens a step carries while sequences decode (see `Engine`; 0: none).
    controller: the per-step draft-count policy (`spec_decode.control.Controller`), as for `serve`.
    observer: optional extra `EngineObserver` (the engine's hooks are also recorded into `stats`).
    """

    def __init__(
        self,
        runner: StepRunner,
        tokenizer: TokenizerLike,
        *,
        max_num_seqs: int | None = None,
        max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS,
        controller: DraftController | None = None,
        observer: EngineObserver | None = None,
        step_token_budget: int = DEFAULT_STEP_TOKEN_BUDGET,
        overlap: bool = False,
    ):
        self._recorder = _Recorder(observer)
        self.engine = Engine(
            runner,
            tokenizer,
            max_num_seqs=max_num_seqs,
            max_queued_requests=sys.maxsize,  # every prompt of a call is queued at once
            max_num_batched_tokens=max_num_batched_tokens,
            controller=controller,
            observer=self._recorder,
            log_interval_s=0,
            step_token_budget=step_token_budget,
            overlap=overlap,
        )
        self.tokenizer = tokenizer
        self._loop = asyncio.new_event_loop()
        try:
            self._loop.run_until_complete(self.engine.start())
            self._raise_if_dead()
        except BaseException:
            self.close()
            raise

    @property
    def stats(self) -> RunStats:
        """The figures of the last `generate` call."""
        return self._recorder.stats

    @property
    def max_num_seqs(self) -> int:
        return self.engine.max_num_seqs

    def generate(
        self,
        prompts: Sequence[Prompt],
        sampling: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        max_tokens: int | None = None,
        stop: Sequence[str] = (),
        ignore_eos: bool = False,
        on_output: Callable[[int, RequestOutput], object] | None = None,
    ) -> list[RequestOutput]:
        """Generate a completion for every prompt (text, or token ids); one collected output per prompt.

        sampling: one `SamplingParams` for all prompts or one per prompt (default greedy). max_tokens: the
        limit per request (None = the context left). Raises `ContextLengthError` before anything runs when a
        prompt does not fit, and the runner's exception if the engine fails.
        """
        if prompts and isinstance(prompts[0], int):
            raise TypeError("prompts is a list of prompts: wrap one prompt's token ids in a list")
        if sampling is None or isinstance(sampling, SamplingParams):
            samplings = [sampling or SamplingParams()] * len(prompts)
        else:
            samplings = list(sampling)
            if len(samplings) != len(prompts):
                raise ValueError(f"{len(samplings)} sampling params for {len(prompts)} prompts")
        self._raise_if_dead()
        requests = []
        for p, sp in zip(prompts, samplings, strict=True):
            ids = self.tokenizer.encode(p) if isinstance(p, str) else [int(t) for t in p]
            if not ids:
                raise ValueError("a prompt is empty")
            limit = self.engine.check_length(len(ids), max_tokens)
            requests.append(GenerationRequest(ids, limit, sp, tuple(stop), ignore_eos))
        self._recorder.stats = RunStats()
        t0 = time.perf_counter()
        outs = self._loop.run_until_complete(self._run(requests, on_output))
        self._recorder.stats.wall_s = time.perf_counter() - t0
        self._raise_if_dead()
        return outs

    async def _run(
        self, requests: list[GenerationRequest], on_output: Callable[[int, RequestOutput], object] | None
    ) -> list[RequestOutput]:
        streams = [self.engine.submit(r) for r in requests]

        def hook(i: int) -> Callable[[RequestOutput], object] | None:
            return None if on_output is None else (lambda out: on_output(i, out))

        return list(await asyncio.gather(*(s.collect(hook(i)) for i, s in enumerate(streams))))

    def _raise_if_dead(self) -> None:
        if self.engine.state == "dead":
            if self.engine.failure is not None:
                raise self.engine.failure
            raise RuntimeError(f"the engine failed: {self.engine.dead_reason}")

    def close(self) -> None:
        """Stop the engine and its device thread; the runner stays usable."""
        if self._loop.is_closed():
            return
        self._loop.run_until_complete(self.engine.stop(join_device=True))
        self._loop.close()

    def __enter__(self) -> OfflineEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
