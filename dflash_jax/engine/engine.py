"""The engine: continuous batching over a `StepRunner`'s slots, driven by one asyncio task.

One loop iteration:
  1. drop aborted requests (their slots are released at once),
  2. admit waiting requests into free slots (FIFO) in one batched prefill (`runner.add_many`, which also yields
     each one's first token), as many as fit the free slots and `max_num_batched_tokens` prompt tokens (the
     first waiting request always goes in, however long, so none starves; the rest wait for the next iteration,
     after a step),
  3. if anything is running: ask the optional draft controller for per-sequence draft counts, call
     `runner.step(slots, max_new, num_drafts)` once, report the step back to the controller, and feed every
     slot's tokens through its `OutputState`
     (EOS / stop strings / max_tokens / max_model_len cut exactly, even inside a multi-token step),
     With a `step_token_budget` > 0, prompts admitted while sequences decode are not prefilled in calls of their
     own: the runner starts them with `admit` (no device call) and each step carries the next chunks of the
     prefilling prompts, at most `step_token_budget` prompt tokens in all (a mixed step, FIFO), so the decoding
     sequences keep their pace while a long prompt prefills. With nothing decoding, prompts prefill as above.
  4. emit one `RequestOutput` per request that produced text, finish and release the ones that stopped.

Overlap (`overlap=True`, `serve --async-scheduling`, with a runner whose `supports_overlap`): step 3 dispatches
step n+1 (`runner.dispatch`, which returns once the step is launched) before it collects step n (`runner.collect`,
the step's one read) and does step n's output work (controller, detokenizing, stop strings, streaming) while n+1
runs, so the device does not wait for that host work. Step n+1 is planned before step n's tokens are known: its
`max_new` may overstate what a sequence still wants and it carries the sequences that step n ends. The settled
rule: a sequence's output is what it had when it finished; tokens a later in-flight step made for it are dropped,
and its slot (pages, runner state) is released, and free for a new request, only once that step is collected. A
step whose rows follow a grammar needs its matchers at the current token, so the step before it is collected first,
as it is before a prefill call of its own (an admission's `add_many`, `prefill_step`) and before a preemption.

Device calls (`warmup`, `add_many`, `step`) run on one dedicated worker thread, so the event loop (HTTP) keeps
serving while the device works, and the runner is never called from two threads at once; `release` is
called from the loop between steps (never while a step is in flight). All engine state lives on the event
loop thread, so there are no locks. An exception from the runner is fatal: every in-flight request gets an
error event and the engine reports itself dead (the server turns that into /health 503).

Capacity: at most `max_num_seqs` running and `max_queued_requests` waiting; `submit` beyond that raises
`QueueFullError` at once (HTTP 429). `begin_drain()` stops admission (`EngineUnavailableError`) while what
is running or queued finishes; `abort_all()` cancels the rest.

`offline.OfflineEngine` drives this same loop from synchronous code (`dflash-jax generate`, `bench decode`).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field, replace

from dflash_jax.engine.interface import StepRunner
from dflash_jax.engine.output import OutputState
from dflash_jax.engine.types import (
    FINISH_ABORT,
    FINISH_ERROR,
    FINISH_LENGTH,
    ContextLengthError,
    DraftController,
    EngineObserver,
    EngineUnavailableError,
    GenerationRequest,
    QueueFullError,
    RequestOutput,
    RequestRecord,
    SpecStats,
    TokenizerLike,
)
from dflash_jax.errors import UserError
from dflash_jax.types import MAX_ENDING_TOKENS, SamplingParams, StepResult, TokenLogprob

log = logging.getLogger("dflash_jax.engine")

# Prompt tokens prefilled together in one admission (vLLM's `--max-num-batched-tokens` default for its chunked
# prefill). One admission pauses the running sequences' decoding for its prefill.
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
# Prompt tokens one mixed step carries besides its decode rows (`--step-token-budget`; 0: prompts prefill in calls of
# their own, between steps). `builder.default_step_token_budget` picks it by platform for `serve`.
DEFAULT_STEP_TOKEN_BUDGET = 0

_ids = itertools.count()


def check_context_length(prompt_len: int, max_tokens: int | None, max_model_len: int, *, where: str = "prompt") -> int:
    """Resolve `max_tokens` (None = all the room left) or raise `ContextLengthError` in OpenAI's wording.

    `where` is "prompt" (completions) or "messages" (chat); it is also the error's `param`.
    """
    if max_tokens is None:
        if prompt_len >= max_model_len:
            raise ContextLengthError(
                f"This model's maximum context length is {max_model_len} tokens. However, your {where} "
                f"resulted in {prompt_len} tokens, which leaves no room for the completion. "
                f"Please reduce the length of the {where}.",
                param=where,
            )
        return max_model_len - prompt_len
    if max_tokens == 0 and prompt_len >= max_model_len:  # prompt scoring: the prefill still emits one token
        raise ContextLengthError(
            f"This model's maximum context length is {max_model_len} tokens. However, your {where} resulted in "
            f"{prompt_len} tokens; a {where} scored with max_tokens 0 must be shorter than that. "
            f"Please reduce the length of the {where}.",
            param=where,
        )
    if prompt_len + max_tokens > max_model_len:
        raise ContextLengthError(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{prompt_len + max_tokens} tokens ({prompt_len} in the {where}, {max_tokens} in the "
            "completion). "
            f"Please reduce the length of the {where} or completion.",
            param=where,
        )
    return max_tokens


class DeviceThread:
    """One daemon worker thread for every device call (so the runner is never called concurrently, and a
    long warm-up cannot hold the process at exit the way a ThreadPoolExecutor's joined worker would)."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._work, name="dflash-engine-device", daemon=True)
        self._thread.start()

    def submit(self, fn: Callable, *args) -> Future:
        fut: Future = Future()
        self._jobs.put((fut, fn, args))
        return fut

    def close(self) -> None:
        self._jobs.put(None)

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            fut, fn, args = job
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(*args))
            except BaseException as e:  # noqa: BLE001 - handed to the awaiting coroutine
                fut.set_exception(e)


class RequestStream:
    """The caller's handle on a submitted request: `async for out in stream` yields `RequestOutput`s."""

    def __init__(self, engine: Engine, request_id: str, num_prompt_tokens: int):
        self._engine = engine
        self.request_id = request_id
        self.num_prompt_tokens = num_prompt_tokens
        self._queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self.finished = False

    def _put(self, out: RequestOutput) -> None:
        self._queue.put_nowait(out)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        out = await self._queue.get()
        if out.finished:
            self.finished = True
        return out

    def abort(self) -> None:
        """Cancel the request (no-op once it finished). Its slot is freed before the next step."""
        if not self.finished:
            self._engine.abort(self.request_id)

    async def collect(self, on_output: Callable[[RequestOutput], object] | None = None) -> RequestOutput:
        """Wait for the end; return one output with all the text and tokens (`on_output` sees every event)."""
        text: list[str] = []
        tokens: list[int] = []
        logprobs: list[TokenLogprob] | None = None
        prompt_logprobs: list[TokenLogprob] | None = None
        last: RequestOutput | None = None
        async for out in self:
            if on_output is not None:
                on_output(out)
            text.append(out.text)
            tokens.extend(out.token_ids)
            if out.logprobs is not None:
                logprobs = [] if logprobs is None else logprobs
                logprobs.extend(out.logprobs)
            if out.prompt_logprobs is not None:
                prompt_logprobs = out.prompt_logprobs
            last = out
        assert last is not None
        return RequestOutput(
            request_id=self.request_id,
            text="".join(text),
            token_ids=tokens,
            finished=True,
            finish_reason=last.finish_reason,
            num_prompt_tokens=last.num_prompt_tokens,
            num_completion_tokens=last.num_completion_tokens,
            spec=last.spec,
            error=last.error,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
        )


@dataclass
class _Seq:
    request: GenerationRequest
    stream: RequestStream
    out: OutputState
    arrival: float
    slot: int | None = None
    first_token_time: float | None = None
    spec: SpecStats = field(default_factory=SpecStats)
    aborted: bool = False
    done: bool = False
    prompt_logprobs: list[TokenLogprob] | None = None  # from the prefill, until the next event carries them
    admitted: int = 0  # admission order (the newest running sequence is preempted first)

    def prefill_input(self) -> tuple[list[int], SamplingParams]:
        """What the runner prefills: the prompt, and after a preemption the prompt + the tokens generated so far
        (the continuation is the same: a function of the context), with the min_tokens still to go, no prompt
        log-probabilities (they were sent) and a grammar that has matched the tokens so far."""
        sp = self.request.sampling
        done = self.out.token_ids
        if not done:
            return list(self.request.prompt_ids), sp
        sp = replace(sp, min_tokens=max(0, sp.min_tokens - len(done)), prompt_logprobs=None)
        if sp.grammar is not None:  # the grammar resumes after the tokens it matched
            sp = replace(sp, grammar_done=len(done))
        return [*self.request.prompt_ids, *done], sp


@dataclass
class _InFlight:
    """A dispatched step (overlap): the runner's handle and what the engine asked of it."""

    handle: object
    slots: list[int]
    rids: dict[int, str]
    prefill: dict[int, int]
    dispatched: float

    def holds(self, slot: int) -> bool:
        return slot in self.prefill or slot in self.slots


@dataclass
class EngineStats:
    """Cumulative totals over the engine's life (read by the periodic log line and by tests)."""

    steps: int = 0
    prefills: int = 0  # requests prefilled
    prefill_batches: int = 0  # `runner.add_many` calls
    finished: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    preemptions: int = 0  # running sequences whose KV pages were taken back for others (they resume later)
    spec: SpecStats = field(default_factory=SpecStats)


class Engine:
    """Continuous batching over a `StepRunner`.

    Create it, `await start()`, then `submit()` from the same event loop. `max_num_batched_tokens`: the most
    prompt tokens one admission prefills together (a longer first prompt still goes in, alone).
    `step_token_budget`: the most prompt tokens a step carries while sequences decode (0: none; see the module
    docstring). `overlap`: dispatch each step before the previous one is collected (module docstring); ignored
    (steps run one by one) for a runner whose `supports_overlap` is false or missing.
    """

    def __init__(
        self,
        runner: StepRunner,
        tokenizer: TokenizerLike,
        *,
        max_num_seqs: int | None = None,
        max_queued_requests: int = 64,
        max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS,
        controller: DraftController | None = None,
        observer: EngineObserver | None = None,
        log_interval_s: float = 10.0,
        step_token_budget: int = DEFAULT_STEP_TOKEN_BUDGET,
        overlap: bool = False,
    ):
        if max_num_seqs is not None and max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if step_token_budget < 0:
            raise ValueError("step_token_budget must be >= 0")
        if max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        if max_queued_requests < 0:
            raise ValueError("max_queued_requests must be >= 0")
        self.runner = runner
        self.tokenizer = tokenizer
        self.max_num_seqs = min(max_num_seqs or runner.max_slots, runner.max_slots)
        if max_num_seqs is not None and max_num_seqs > runner.max_slots:
            log.warning(
                "max_num_seqs %d > the runner's %d slots: using %d",
                max_num_seqs,
                runner.max_slots,
                runner.max_slots,
            )
        self.max_queued_requests = max_queued_requests
        self.max_num_batched_tokens = max_num_batched_tokens
        self.step_token_budget = step_token_budget
        self.overlap = bool(overlap) and bool(getattr(runner, "supports_overlap", False))
        self._inflight: _InFlight | None = None  # the dispatched step not collected yet (overlap)
        self._settling: set[int] = set()  # slots of finished sequences still in the in-flight step
        self._last_collect = 0.0
        self.max_model_len = int(runner.max_model_len)
        self.controller = controller
        # the runner's ragged verifies priced as such: the controller is then told how many rows of a step drafted
        ragged = getattr(runner, "ragged_buckets", None)
        self._ragged_priced = controller is not None and controller.use_ragged_verify(ragged)
        self.observer = observer or EngineObserver()
        self.log_interval_s = log_interval_s
        self.eos_token_ids = frozenset(int(t) for t in tokenizer.eos_token_ids)
        self.stats = EngineStats()

        self._free_slots: list[int] = list(range(self.max_num_seqs - 1, -1, -1))  # pop() -> lowest first
        self._admissions = 0
        self._waiting: deque[_Seq] = deque()
        self._running: dict[int, _Seq] = {}
        self._seqs: dict[str, _Seq] = {}
        self._device = DeviceThread()
        self._wake: asyncio.Event | None = None
        self._event_loop: asyncio.AbstractEventLoop | None = None
        self._idle: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._warm_more: Callable[[], bool] | None = None  # a background warm-up's rest, run while idle
        self._warmed_more = False  # has it planned a part?
        self._state = "created"  # created | starting | ready | draining | stopped | dead
        self.dead_reason: str | None = None
        self.failure: BaseException | None = None  # the exception that killed the engine
        self._last_log = time.monotonic()
        self._logged_spec = SpecStats()

    # ------------------------------------------------------------------ state

    @property
    def state(self) -> str:
        return self._state

    @property
    def ready(self) -> bool:
        """Serving normally (warm-up done, not draining, not dead)."""
        return self._state == "ready"

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_slots_in_use(self) -> int:
        """Slots not in the free list (a slot returns to it when its request finishes or is aborted)."""
        return self.max_num_seqs - len(self._free_slots)

    # ------------------------------------------------------------------ lifecycle

    async def start(self, warmup: Callable[[], object] | None = None) -> None:
        """Start the loop; run `warmup` (on the device thread) first if given. Returns when ready."""
        if self._task is not None:
            raise RuntimeError("engine already started")
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._event_loop = asyncio.get_running_loop()
        self._state = "starting"
        if warmup is not None:
            t0 = time.monotonic()
            try:
                await self._on_device(warmup)
            except Exception as e:  # a failed warm-up is a dead engine, not a crash of the server
                log.exception("warm-up failed")
                self.failure = e
                self._die(f"warm-up failed: {type(e).__name__}: {e}")
                return
            log.info("warm-up done in %.1f s", time.monotonic() - t0)
        # what a background warm-up left for idle moments (`SpecRunner.warm_more`)
        self._warm_more = getattr(self.runner, "warm_more", None)
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="dflash-engine-loop")
        if self._state == "starting":  # not drained or stopped meanwhile
            self._state = "ready"

    def fail(self, reason: str) -> None:
        """Declare the engine dead from any thread (e.g. a lost multi-host process while the device thread waits
        in a collective for it): every queued and running request gets an error event, /health turns 503."""
        loop = self._event_loop
        if loop is None or loop.is_closed():
            self._die(reason)
            return
        loop.call_soon_threadsafe(self._die, reason)

    def begin_drain(self) -> None:
        """Stop admitting new requests; running and queued ones continue."""
        if self._state in ("ready", "starting"):
            self._state = "draining"

    async def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until nothing is running or queued; False on timeout."""
        if self._idle is None or self._idle.is_set():
            return True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except TimeoutError:
            return False

    def abort_all(self) -> None:
        for rid in list(self._seqs):
            self.abort(rid)

    async def stop(self, *, join_device: bool = False) -> None:
        """Abort everything, stop the loop and the device thread (`join_device`: wait until it has exited;
        a server does not, so that a hung device call cannot hold the process)."""
        if self._state != "dead":
            self._state = "stopped"
        self.abort_all()
        if self._wake is not None:
            self._wake.set()
        if self._task is not None:
            try:
                await self._task
            except Exception:  # the loop records its own failure
                pass
        self._device.close()
        if join_device:
            self._device.join()

    # ------------------------------------------------------------------ requests

    def check_length(self, prompt_len: int, max_tokens: int | None, *, where: str = "prompt") -> int:
        return check_context_length(prompt_len, max_tokens, self.max_model_len, where=where)

    def submit(self, request: GenerationRequest) -> RequestStream:
        """Queue a request. Raises `EngineUnavailableError`, `QueueFullError`, `ContextLengthError`."""
        return self.submit_many([request])[0]

    def submit_many(self, requests: list[GenerationRequest]) -> list[RequestStream]:
        """Queue several requests together (all or none: one that cannot be queued queues none), so they are
        admitted into free slots in one go. Raises like `submit`."""
        if self._state != "ready":
            raise self.unavailable_error()
        seqs: list[_Seq] = []
        for request in requests:
            if not request.prompt_ids:
                raise ValueError("prompt_ids must not be empty")
            limit = self.check_length(len(request.prompt_ids), request.max_tokens)
            if limit < 0:
                raise ValueError("max_tokens must be >= 0")
            if request.min_tokens > 0:  # the runner masks the ending tokens from sampling until min_tokens
                ending = set(request.stop_token_ids) | (set() if request.ignore_eos else set(self.eos_token_ids))
                if len(ending) > MAX_ENDING_TOKENS:
                    raise UserError(
                        f"min_tokens with more than {MAX_ENDING_TOKENS} stop token ids (end-of-sequence included) "
                        f"is not supported, got {len(ending)}",
                        param="stop_token_ids",
                    )
                sampling = replace(
                    request.sampling, min_tokens=request.min_tokens, stop_token_ids=tuple(sorted(ending))
                )
                request = replace(request, sampling=sampling)
            rid = request.request_id or f"req-{next(_ids)}"
            if rid in self._seqs or any(s.stream.request_id == rid for s in seqs):
                raise ValueError(f"duplicate request_id {rid!r}")
            out = OutputState(
                self.tokenizer,
                request.prompt_ids,
                limit=max(limit, 1),  # 0: prefill only, the output is never fed
                stop=request.stop,
                ignore_eos=request.ignore_eos,
                eos_token_ids=self.eos_token_ids,
                stop_token_ids=request.stop_token_ids,
                min_tokens=request.min_tokens,
            )
            stream = RequestStream(self, rid, len(request.prompt_ids))
            seqs.append(_Seq(request=request, stream=stream, out=out, arrival=time.monotonic()))
        if len(self._waiting) + len(self._running) + len(seqs) > self.max_num_seqs + self.max_queued_requests:
            raise QueueFullError(
                f"server is at capacity ({self.max_num_seqs} running, {self.max_queued_requests} queued); retry later"
            )
        for seq in seqs:
            self._seqs[seq.stream.request_id] = seq
            self._waiting.append(seq)
        self._poke()
        return [seq.stream for seq in seqs]

    def abort(self, request_id: str) -> None:
        """Cancel a request: a queued one ends now, a running one before the next step (slot released)."""
        seq = self._seqs.get(request_id)
        if seq is None or seq.done:
            return
        seq.aborted = True
        if seq.slot is None:
            try:
                self._waiting.remove(seq)
            except ValueError:
                pass
            self._finish(seq, FINISH_ABORT)
        self._poke()

    # ------------------------------------------------------------------ loop

    def unavailable_error(self) -> EngineUnavailableError:
        if self._state == "dead":
            return EngineUnavailableError(f"the engine failed: {self.dead_reason}", reason="dead")
        if self._state == "draining":
            return EngineUnavailableError("the server is shutting down", reason="draining")
        if self._state in ("created", "starting"):
            return EngineUnavailableError("the server is starting up (warm-up)", reason="starting")
        return EngineUnavailableError("the engine is stopped", reason="stopped")

    def _poke(self) -> None:
        if self._wake is not None:
            self._wake.set()
        if self._idle is not None:
            if self._seqs:
                self._idle.clear()
            else:
                self._idle.set()

    async def _on_device(self, fn: Callable, *args):
        return await asyncio.wrap_future(self._device.submit(fn, *args))

    async def _loop(self) -> None:
        assert self._wake is not None
        try:
            while True:
                self._reap_aborted()
                await self._admit()
                if self.runner.prefilling and not self._mixing():
                    await self._flush()
                    await self._prefill_chunks()
                if any(s not in self.runner.prefilling for s in self._running):
                    await (self._step_overlapped() if self.overlap else self._step())
                    self._maybe_log()
                    continue
                if self._inflight is not None:
                    await self._flush()
                    continue
                if self._running:
                    continue
                if self._state in ("stopped", "dead") and not self._waiting:
                    return
                if not self._waiting:
                    if self._warm_more is not None:  # idle: the rest of a background warm-up, a part at a time
                        if await self._on_device(self._warm_more):
                            self._warmed_more = True
                        else:
                            self._warm_more = None
                            if self._warmed_more:
                                log.info("warm-up: every shape queued; the last compiles finish in the background")
                        continue  # requests may have come meanwhile: look again before waiting
                    self._wake.clear()
                    await self._wake.wait()
        except asyncio.CancelledError:
            raise
        except Exception as e:
            log.exception("engine loop failed")
            self.failure = e
            self._die(f"{type(e).__name__}: {e}")

    def _decoding(self) -> list[int]:
        return [s for s in self._running if s not in self.runner.prefilling]

    def _mixing(self) -> bool:
        """Do the steps carry the prompts' prefill chunks now (a budget, and sequences decoding)?"""
        return self.step_token_budget > 0 and bool(self._decoding())

    def _reap_aborted(self) -> None:
        for seq in [s for s in self._running.values() if s.aborted]:
            self._finish(seq, FINISH_ABORT)

    def _next_batch(self) -> list[tuple[_Seq, list[int], SamplingParams]]:
        """Take the waiting requests of the next admission (FIFO) with the slots and KV pages they need: as many
        as there are free slots, pages in the pool (`runner.reserve`; a request that does not fit waits, and those
        behind it too) and room in the first prefill chunk, one rectangle of rows x the longest chunk (the batch is
        padded to it) of at most `max_num_batched_tokens` tokens; the first one always (a prompt over the budget
        goes alone)."""
        batch: list[tuple[_Seq, list[int], SamplingParams]] = []
        longest = 0
        chunk = self.runner.prefill_chunk or self.max_num_batched_tokens
        while self._waiting and self._free_slots:
            seq = self._waiting[0]
            if seq.aborted or seq.done:
                self._waiting.popleft()
                continue
            ids, sampling = seq.prefill_input()
            n = min(len(ids), chunk)
            if batch and (len(batch) + 1) * max(longest, n) > self.max_num_batched_tokens:
                break
            slot = self._free_slots[-1]
            if not self.runner.reserve(slot, ids, sampling):
                break
            self._free_slots.pop()
            self._waiting.popleft()
            seq.slot = slot
            batch.append((seq, ids, sampling))
            longest = max(longest, n)
        return batch

    async def _admit(self) -> None:
        decoding = [s for s in self._running if s not in self.runner.prefilling]
        if decoding and self.runner.grow(decoding):
            return  # running sequences come first: nothing is admitted while their next step lacks pages
        batch = self._next_batch()
        if not batch:
            return
        items = []
        for seq, ids, sampling in batch:
            self._admissions += 1
            seq.admitted = self._admissions
            self._running[seq.slot] = seq
            items.append((seq.slot, ids, sampling))
        if self.step_token_budget > 0 and decoding:  # the next steps prefill them (`_step`)
            self.runner.admit(items)
            self.stats.prefills += len(batch)
            self.stats.prompt_tokens += sum(len(ids) for _, ids, _ in batch)
            return
        await self._flush()
        t0 = time.monotonic()
        results = await self._on_device(self.runner.add_many, items)
        prompt_lens = [len(ids) for _, ids, _ in batch]
        self.observer.prefill_done(prompt_lens, time.monotonic() - t0)
        self.stats.prefills += len(batch)
        self.stats.prefill_batches += 1
        self.stats.prompt_tokens += sum(prompt_lens)
        self._consume_prefill([seq for seq, _, _ in batch], results)

    async def _prefill_chunks(self) -> None:
        """The next chunk of every prompt still prefilling (one call)."""
        slots = [s for s in self.runner.prefilling if s in self._running]
        if not slots:
            return
        results = await self._on_device(self.runner.prefill_step, slots)
        self._consume_prefill([self._running[s] for s in slots if s in self._running], results)

    def _consume_prefill(self, seqs: list[_Seq], results: dict[int, StepResult]) -> None:
        for seq in seqs:
            if seq.done:  # the engine failed meanwhile (`fail`)
                continue
            if seq.aborted:
                self._finish(seq, FINISH_ABORT)
                continue
            if seq.slot not in self.runner.prefilling:
                self._consume(seq, results[seq.slot])

    def _make_room(self, slots: list[int]) -> list[int]:
        """Give every decoding slot the pages its next step may write (`runner.grow`), preempting the newest
        running sequences while the pool is short: their pages go back, they wait at the front of the queue and
        resume (prefilling prompt + generated tokens, much of it from the prefix cache) with the same output.
        Returns the slots that still step."""
        short = self.runner.grow(slots)
        while short:
            victim = max(self._running.values(), key=lambda q: q.admitted)
            if len(self._running) == 1:  # cannot happen with a pool that holds one full-length sequence
                raise RuntimeError(f"the KV pool cannot hold one sequence of {len(victim.out.token_ids)} tokens")
            gone = victim.slot
            self._preempt(victim)
            slots = [s for s in slots if s != gone]
            short = self.runner.grow([s for s in short if s in slots])
        return slots

    def _preempt(self, seq: _Seq) -> None:
        slot = seq.slot
        assert slot is not None
        self._running.pop(slot, None)
        self.runner.release(slot)
        self._free_slots.append(slot)
        self._free_slots.sort(reverse=True)
        seq.slot = None
        self.stats.preemptions += 1
        self._waiting.appendleft(seq)
        log.info(
            "preempted %s (%d tokens generated): the KV pool is full", seq.stream.request_id, len(seq.out.token_ids)
        )

    async def _step(self) -> None:
        slots = self._make_room(sorted(s for s in self._running if s not in self.runner.prefilling))
        if not slots:
            return
        args, rids, prefill = self._plan_step(slots)
        t0 = time.monotonic()
        results = await self._on_device(self.runner.step, *args)
        self._step_results(slots, rids, prefill, results, time.monotonic() - t0)

    def _plan_step(self, slots: list[int]) -> tuple:
        """The runner's step arguments for `slots` (the controller's draft counts, the prefill chunks) and the
        slots' request ids (for the controller)."""
        max_new = {s: self._running[s].out.remaining for s in slots}
        ctl = self.controller
        num_drafts: dict[int, int] | None = None
        no_propose: set[int] = set()
        rids: dict[int, str] = {}
        prefill = self._step_prefill()
        if ctl is not None:
            rids = {s: self._running[s].stream.request_id for s in slots}
            looked = self.runner.lookup_slots(slots) if self.runner.speculative else set()
            # drafts from prompt lookup: priced apart from the drafter's, even where it is suspended
            kw: dict[str, object] = {"lookup": {rids[s] for s in looked}} if looked else {}
            if prefill:  # a step carrying prompt chunks verifies at the full width (`StepRunner.step`)
                kw["full_width"] = True
            plan = ctl.decide(list(rids.values()), **kw)
            num_drafts = {s: int(plan[rid]) for s, rid in rids.items() if plan.get(rid) is not None}
            no_propose = {s for s, rid in rids.items() if ctl.is_suspended(rid) and s not in looked}
        return (slots, max_new, num_drafts, no_propose) + ((prefill,) if prefill else ()), rids, prefill

    def _needs_sync(self, slots: list[int]) -> bool:
        """Does a step over `slots` (and the prompts it may prefill) need the previous step collected first?"""
        return any(
            seq.request.sampling.grammar is not None
            for s, seq in self._running.items()
            if s in slots or s in self.runner.prefilling
        )

    async def _step_overlapped(self) -> None:
        """Dispatch the next step, then collect the one in flight (module docstring, overlap)."""
        slots = sorted(s for s in self._running if s not in self.runner.prefilling)
        if self._inflight is not None and (self._needs_sync(slots) or self.runner.grow(slots)):
            await self._flush()  # then, with nothing in flight, the next iteration may preempt (`_make_room`)
            return
        slots = self._make_room(slots)
        if not slots:
            return
        args, rids, prefill = self._plan_step(slots)
        handle = await self._on_device(self.runner.dispatch, *args)
        prev, self._inflight = self._inflight, _InFlight(handle, slots, rids, prefill, time.monotonic())
        if prev is not None:
            await self._collect(prev)

    async def _flush(self) -> None:
        """Collect the step in flight, if any (overlap)."""
        f, self._inflight = self._inflight, None
        if f is not None:
            await self._collect(f)

    async def _collect(self, f: _InFlight) -> None:
        results = await self._on_device(self.runner.collect, f.handle)
        now = time.monotonic()
        # a step's time: since the previous step's results were read, or since its dispatch when later
        dt = now - max(f.dispatched, self._last_collect)
        self._last_collect = now
        self._step_results(f.slots, f.rids, f.prefill, results, dt)
        for slot in [s for s in self._settling if self._inflight is None or not self._inflight.holds(s)]:
            self._settling.discard(slot)
            self._release_slot(slot)

    def _step_results(
        self, slots: list[int], rids: dict[int, str], prefill: dict[int, int], results: dict, dt: float
    ) -> None:
        """A step's results to its sequences (a sequence finished meanwhile gets none: the settled rule)."""
        ctl = self.controller
        if prefill:
            self._consume_prefill([self._running[s] for s in prefill if s in self._running], results)
        self.stats.steps += 1
        if ctl is not None and rids:
            depth, lookup_only, drafting, ragged = 0, True, 0, False
            for s, rid in rids.items():
                res = results.get(s)
                seq = self._running.get(s)
                if res is not None and seq is not None and seq.stream.request_id == rid:  # not finished meanwhile
                    kw = {"lookup": True} if res.lookup else {}  # controllers without prompt lookup take no flag
                    ctl.observe(rid, res.num_drafts, res.accepted_mask or res.num_accepted, **kw)
                    depth = max(depth, res.num_drafts)
                    lookup_only &= res.lookup or res.num_drafts == 0
                    drafting += res.num_drafts > 0
                    ragged |= res.ragged
            if not prefill:  # a mixed step's time is not a decode step's
                kw = {"lookup": True} if depth and lookup_only else {}
                if self._ragged_priced and ragged and 0 < drafting < len(slots):
                    kw["drafting"] = drafting
                ctl.observe_step_time(len(slots), depth, 1000.0 * dt, **kw)
        for slot in slots:
            seq = self._running.get(slot)
            res = results.get(slot)
            if seq is None or res is None:
                continue
            if seq.aborted:
                self._finish(seq, FINISH_ABORT)
                continue
            self._consume(seq, res)
        self.observer.step_done(len(slots), dt)

    def _step_prefill(self) -> dict[int, int]:
        """The prompt tokens each prefilling sequence prefills in this step: up to `step_token_budget` in all,
        oldest admission first."""
        left = self.step_token_budget
        out: dict[int, int] = {}
        seqs = [self._running[s] for s in self.runner.prefilling if s in self._running]
        seqs.sort(key=lambda q: q.admitted)
        for seq in seqs:
            if left <= 0:
                break
            assert seq.slot is not None
            n = min(left, self.runner.prompt_left(seq.slot))
            if n <= 0:  # every chunk dispatched: its first token comes with the step in flight
                continue
            out[seq.slot] = n
            left -= n
        return out

    def _consume(self, seq: _Seq, res: StepResult) -> None:
        """Feed one step's tokens to a sequence; emit its new text; finish it if it stopped."""
        if res.num_drafts > 0:
            seq.spec.add(res)
            self.stats.spec.add(res)
            self.observer.spec_step(res)
        if res.prompt_logprobs is not None:
            seq.prompt_logprobs = res.prompt_logprobs
        if seq.request.max_tokens == 0:  # prompt scoring: the prefill was all
            self._finish(seq, FINISH_LENGTH)
            return
        if not res.tokens:
            return
        if seq.first_token_time is None:
            seq.first_token_time = time.monotonic()
        text, consumed = seq.out.append(res.tokens)
        self.stats.generation_tokens += len(consumed)
        logprobs = None if res.logprobs is None else res.logprobs[: len(consumed)]
        if seq.out.finished:
            self._finish(seq, seq.out.finish_reason or FINISH_ABORT, text=text, token_ids=consumed, logprobs=logprobs)
        elif text or consumed:
            seq.stream._put(
                RequestOutput(
                    request_id=seq.stream.request_id,
                    text=text,
                    token_ids=consumed,
                    num_prompt_tokens=len(seq.request.prompt_ids),
                    num_completion_tokens=len(seq.out.token_ids),
                    logprobs=logprobs,
                    prompt_logprobs=self._take_prompt_logprobs(seq),
                )
            )

    def _finish(
        self,
        seq: _Seq,
        reason: str,
        *,
        text: str = "",
        token_ids: list[int] | None = None,
        error: str | None = None,
        logprobs: list[TokenLogprob] | None = None,
    ) -> None:
        if seq.done:
            return
        seq.done = True
        if seq.slot is not None:
            self._running.pop(seq.slot, None)
            if self.controller is not None:
                self.controller.release(seq.stream.request_id)
            if self._inflight is not None and self._inflight.holds(seq.slot):
                self._settling.add(seq.slot)  # released once the in-flight step is collected (the settled rule)
            else:
                self._release_slot(seq.slot)
        self._seqs.pop(seq.stream.request_id, None)
        now = time.monotonic()
        seq.stream._put(
            RequestOutput(
                request_id=seq.stream.request_id,
                text=text,
                token_ids=list(token_ids or []),
                finished=True,
                finish_reason=reason,
                num_prompt_tokens=len(seq.request.prompt_ids),
                num_completion_tokens=len(seq.out.token_ids),
                spec=seq.spec,
                error=error,
                logprobs=logprobs,
                prompt_logprobs=self._take_prompt_logprobs(seq),
            )
        )
        self.stats.finished += 1
        try:
            self.observer.request_finished(
                RequestRecord(
                    request_id=seq.stream.request_id,
                    num_prompt_tokens=len(seq.request.prompt_ids),
                    num_completion_tokens=len(seq.out.token_ids),
                    finish_reason=reason,
                    arrival_time=seq.arrival,
                    first_token_time=seq.first_token_time,
                    finish_time=now,
                    spec=seq.spec,
                )
            )
        except Exception:  # noqa: BLE001 - metrics must never break serving
            log.exception("observer.request_finished failed")
        self._poke()

    def _release_slot(self, slot: int) -> None:
        if self._state != "dead":
            try:
                self.runner.release(slot)
            except Exception:  # noqa: BLE001 - a failing release must not take the loop down twice
                log.exception("runner.release(%d) failed", slot)
        self._free_slots.append(slot)
        self._free_slots.sort(reverse=True)

    @staticmethod
    def _take_prompt_logprobs(seq: _Seq) -> list[TokenLogprob] | None:
        """The prompt's log-probabilities go out once, on the first event after the prefill."""
        out, seq.prompt_logprobs = seq.prompt_logprobs, None
        return out

    def _die(self, reason: str) -> None:
        self._state = "dead"
        self.dead_reason = reason
        for seq in list(self._seqs.values()):
            self._finish(seq, FINISH_ERROR, error=f"the engine failed: {reason}")
        self._waiting.clear()

    def _maybe_log(self) -> None:
        now = time.monotonic()
        if self.log_interval_s <= 0 or now - self._last_log < self.log_interval_s:
            return
        elapsed = now - self._last_log
        self._last_log = now
        cur, prev = self.stats.spec, self._logged_spec
        drafts = cur.num_drafts - prev.num_drafts
        draft_toks = cur.num_draft_tokens - prev.num_draft_tokens
        acc = cur.num_accepted_tokens - prev.num_accepted_tokens
        self._logged_spec = SpecStats(
            cur.num_drafts, cur.num_draft_tokens, cur.num_accepted_tokens, list(cur.accepted_per_pos)
        )
        if drafts == 0:
            return
        per_pos = [
            (c - (prev.accepted_per_pos[i] if i < len(prev.accepted_per_pos) else 0)) / drafts
            for i, c in enumerate(cur.accepted_per_pos)
        ]
        log.info(
            "SpecDecoding metrics: mean acceptance length %.2f, accepted %.1f tok/s, drafted %.1f tok/s, "
            "accepted %d, drafted %d, acceptance rate %.1f%%, per-position acceptance %s; "
            "running %d, waiting %d",
            1 + acc / drafts,
            acc / elapsed,
            draft_toks / elapsed,
            acc,
            draft_toks,
            100.0 * acc / max(draft_toks, 1),
            ", ".join(f"{r:.3f}" for r in per_pos),
            len(self._running),
            len(self._waiting),
        )
