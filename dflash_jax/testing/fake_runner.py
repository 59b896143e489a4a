"""A deterministic fake `StepRunner` and a tiny real tokenizer, for testing the engine and the server
without a model (and for `python -m dflash_jax.testing.server`).

The fake "model" continues a fixed token script: a request starts at an offset that is a function of its
prompt (and of its seed when sampling), then emits the script's tokens in order, wrapping around; the script
ends with EOS, so a request that runs long enough stops on EOS. Speculative steps commit `a + 1` tokens where
`a` (accepted drafts) comes from a seeded per-position coin with probability `acceptance` — so the committed
sequence is identical with and without speculation, exactly like a lossless speculative decoder.
Log-probabilities (`SamplingParams.logprobs` / `prompt_logprobs`) are fake but deterministic (`fake_logprob`): a
function of the script index (generated tokens) or of the prompt position and tokens, so they too are identical
with and without speculation; the chosen token is always the most likely one.

The tokenizer is a byte-level BPE trained (in milliseconds, deterministically) on a small corpus with
accented letters, CJK and emoji, so many characters span several tokens: good for UTF-8 streaming tests.
"""

from __future__ import annotations

import random
import threading
import time
import zlib
from collections import OrderedDict
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from dflash_jax.checkpoints.tokenizer import TokenBytes
from dflash_jax.kv.pages import OutOfPages, PagePool
from dflash_jax.kv.sizing import dense_pool_pages, ragged_split, seq_positions
from dflash_jax.types import SamplingParams, StepResult, TokenLogprob

SCRIPT_TEXT = (
    "The quick brown fox jumps over the lazy dog. Crème brûlée, naïve café, résumé; "
    "Grüße aus Köln! 你好，世界。今天天气很好。 Emoji time: 🚀🌍✨ and 👩‍💻 codes. "
    "Speculative decoding drafts a block of tokens and the target verifies them in one pass; "
    "the longest agreeing prefix is kept plus one bonus token. Ελληνικά και русский текст. "
    "Numbers 0123456789 and symbols ~!@#$%^&*() stay intact. Ünïcödé ends here. "
)

_CORPUS = [
    SCRIPT_TEXT,
    "Hello world! How are you today? I am fine, thank you.",
    "User: what is the capital of France? Assistant: Paris is the capital of France.",
    "The cat sat on the mat. The dog ran in the park. The bird sang in the tree.",
    "Crème brûlée is a French dessert. 你好 means hello. 🚀 is a rocket.",
]

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


class ByteBPETokenizer:
    """A small byte-level BPE (HF `tokenizers`) with a ChatML template; satisfies `TokenizerLike`."""

    def __init__(self, vocab_size: int = 320):
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=SPECIAL_TOKENS,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tok.train_from_iterator(_CORPUS, trainer)
        self._tok = tok
        self.vocab_size = tok.get_vocab_size()
        self.bos_token_id = tok.token_to_id("<|endoftext|>")
        self.bos_token, self.eos_token = "<|endoftext|>", "<|im_end|>"  # as text (GET /tokenizer_info)
        self.eos_token_ids = {tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")}
        self.im_end_id = tok.token_to_id("<|im_end|>")
        self.token_bytes = TokenBytes(tok)  # token id -> its raw bytes

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        """ChatML; `chat_template_kwargs={"enable_thinking": False}` opens the answer with an empty think block,
        as Qwen3's template does."""
        out = []
        for m in messages:
            content = m.get("content") or ""
            if not isinstance(content, str):
                raise ValueError("content must be a string")
            out.append(f"<|im_start|>{m['role']}\n{content}<|im_end|>\n")
        if add_generation_prompt:
            out.append("<|im_start|>assistant\n")
            if (chat_template_kwargs or {}).get("enable_thinking") is False:
                out.append("<think>\n\n</think>\n\n")
        return "".join(out)


def fake_logprob(key: int, token: int, top: int, vocab_size: int) -> TokenLogprob:
    """A deterministic fake log-probability for `token` (a function of `key`, in (-1, 0)) and `top` alternatives:
    the token itself first, then the next ids up, each 1 nat less likely than the one before."""
    lp = -((zlib.crc32(key.to_bytes(8, "little", signed=True)) % 997) + 1) / 1000.0
    alts = [(token, lp)] + [((token + 1 + j) % vocab_size, lp - 1.0 - j) for j in range(max(0, top - 1))]
    return TokenLogprob(lp, tuple(alts[:top]))


def fake_prompt_logprobs(prompt_ids: Sequence[int], top: int, vocab_size: int) -> list[TokenLogprob]:
    """The fake runner's prompt log-probabilities: one per prompt token after the first."""
    keys = [zlib.crc32(bytes(str([t, prompt_ids[t - 1], tok]), "ascii")) for t, tok in enumerate(prompt_ids)]
    return [fake_logprob(k + (1 << 40), tok, top, vocab_size) for k, tok in zip(keys, prompt_ids, strict=True)][1:]


@dataclass
class _SlotState:
    prompt_len: int
    pos: int  # next script index to emit
    generated: int = 0
    seed: int = 0
    logprobs: int | None = None  # alternatives per generated token, None = no log-probabilities
    tokens: list[int] = field(default_factory=list)  # prompt + emitted tokens


class FakeRunner:
    """Deterministic `StepRunner`: continues `script` from a prompt-dependent offset.

    gamma: verify width (gamma-1 drafts per step; 1 = plain decode). acceptance: per-position accept
    probability. respect_max_new: draft fewer when `max_new` is small (like a real runner); False drafts
    gamma-1 regardless, so the engine must cut the overshoot. A step's `num_drafts` (the engine's controller)
    caps the drafts per slot either way. step_delay: seconds slept per step and per (batched) prefill
    (device time). fail_after_steps: raise on that step (fatal-error tests). starts: the script indices a
    request may start at (default: all). vocab_size: the id range of the fake log-probabilities' alternatives
    (default: past the script's largest id). record: keep `step_log`, `add_log`, `drafts_log`, `no_propose_log` and
    `released` (a long-running server turns it off, so its memory stays flat).

    KV pages: a real `PagePool` (`num_pages`, default: `max_slots` full-length sequences; `page_size`) is reserved
    and grown as the real runner does, so the engine's admission waits and preemptions can be tested.
    `prefill_chunk`: a prompt of n tokens (less its cached prefix) takes ceil(n / prefill_chunk) prefill calls
    (None: one). Like a real model, a continuation is a function of the context: a prompt that equals a released
    sequence's prompt + emitted tokens (a preempted request resuming) continues where that one stopped.

    Overlap: `dispatch` runs the step at once and `collect` hands its results over (`dispatch_log` records the
    dispatches and collects in order). A dispatched step may carry a slot that the step before ended at
    `max_model_len` (the engine learns of it one step late): it emits nothing for that slot.

    `ragged_buckets` (None: off): a step whose rows do not all draft is reported as a ragged verify
    (`StepResult.ragged`) where `kv.sizing.ragged_split` gives it a layout over these buckets, as a real runner's.
    """

    supports_overlap = True
    ragged_buckets: tuple[int, ...] | None = None

    def __init__(
        self,
        script: Sequence[int],
        *,
        max_slots: int = 4,
        max_model_len: int = 256,
        gamma: int = 4,
        acceptance: float = 0.7,
        respect_max_new: bool = True,
        step_delay: float = 0.0,
        fail_after_steps: int | None = None,
        starts: Sequence[int] | None = None,
        vocab_size: int | None = None,
        record: bool = True,
        num_pages: int | None = None,
        page_size: int = 16,
        prefill_chunk: int | None = None,
    ):
        if not script:
            raise ValueError("script must not be empty")
        self.script = [int(t) for t in script]
        self.vocab_size = vocab_size or max(self.script) + 1
        self.max_slots = max_slots
        self.max_model_len = max_model_len
        self.gamma = max(1, gamma)
        self.speculative = self.gamma > 1
        self.acceptance = acceptance
        self.respect_max_new = respect_max_new
        self.step_delay = step_delay
        self.fail_after_steps = fail_after_steps
        self.starts = list(starts) if starts else list(range(len(self.script)))
        self.slots: dict[int, _SlotState] = {}
        self.num_steps = 0
        self.num_adds = 0  # requests prefilled
        self.num_add_calls = 0  # `add` / `add_many` calls (batched prefills)
        self.record = record
        self.released: list[int] = []
        self.add_log: list[list[int]] = []  # each prefill call's slots
        self.step_log: list[tuple[list[int], dict[int, int]]] = []
        self.drafts_log: list[dict[int, int] | None] = []  # each step's `num_drafts` argument
        self.no_propose_log: list[set[int]] = []  # each step's `no_propose` argument
        self.prefill_log: list[dict[int, int]] = []  # each step's `prefill` argument (a mixed step's chunks)
        self.admit_log: list[list[int]] = []  # each `admit` call's slots
        self.dispatch_log: list[tuple[str, int]] = []  # ("dispatch" | "collect", step number), in call order
        self._dispatching = False
        self._uncollected: list[tuple[int, set[int]]] = []  # dispatched steps not collected: (step, slots)
        self._rng = random.Random(0)
        self.pages = PagePool(
            num_pages or dense_pool_pages(max_slots, seq_positions(max_model_len, self.gamma), page_size), page_size
        )
        self.prefill_chunk = prefill_chunk
        self.prefilling: dict[int, int] = {}  # slot -> prompt tokens still to prefill
        self._pending_add: dict[int, tuple[list[int], SamplingParams]] = {}
        self._contexts: OrderedDict[tuple[int, ...], tuple[int, int]] = OrderedDict()  # released: (pos, seed)
        self._lock = threading.Lock()  # detects concurrent calls (the engine must never make them)

    # -- the fake model ------------------------------------------------------------------------------

    def offset_for(self, prompt_ids: Sequence[int], sampling: SamplingParams | None = None) -> int:
        """Script index of the first generated token for this prompt (sampling with a seed shifts it)."""
        h = zlib.crc32(bytes(str(list(prompt_ids)), "ascii"))
        if sampling is not None and sampling.temperature > 0:
            h = zlib.crc32(str(sampling.seed).encode(), h) if sampling.seed is not None else self._rng.getrandbits(32)
        return self.starts[h % len(self.starts)]

    def continuation(self, prompt_ids: Sequence[int], n: int, sampling: SamplingParams | None = None) -> list[int]:
        """The first `n` tokens this runner generates for `prompt_ids` (greedy)."""
        off = self.offset_for(prompt_ids, sampling)
        return [self.script[(off + i) % len(self.script)] for i in range(n)]

    # -- StepRunner ----------------------------------------------------------------------------------

    def reserve(self, slot: int, prompt_ids: list[int], sampling: SamplingParams) -> bool:
        if slot in self.pages:
            return True
        try:
            self.pages.allocate(slot, prompt_ids, len(prompt_ids), use_cache=sampling.prompt_logprobs is None)
        except OutOfPages:
            return False
        return True

    def grow(self, slots: list[int]) -> list[int]:
        return [s for s in slots if not self.pages.ensure(s, len(self.slots[s].tokens) - 1 + max(self.gamma, 2))]

    def add(self, slot: int, prompt_ids: list[int], sampling: SamplingParams) -> StepResult:
        out = self.add_many([(slot, prompt_ids, sampling)])[slot]
        while slot in self.prefilling:
            out = self.prefill_step([slot])[slot]
        return out

    def prefill_step(self, slots: list[int] | None = None) -> dict[int, StepResult]:
        with self._guard():
            slots = list(self.prefilling) if slots is None else slots
            self._sleep()
            return {slot: self._prefill(slot, self.prefill_chunk) for slot in slots}

    def prompt_left(self, slot: int) -> int:
        return self.prefilling[slot]

    def _prefill(self, slot: int, n: int | None) -> StepResult:
        """Prefill up to `n` more prompt tokens of a prefilling slot (None: the rest)."""
        left = self.prefilling[slot]
        self.prefilling[slot] = left - min(left, n or left, self.prefill_chunk or left)
        if self.prefilling[slot] > 0:
            return StepResult([])
        del self.prefilling[slot]
        return self._start(slot, *self._pending_add.pop(slot))

    def _check_items(self, items: list[tuple[int, list[int], SamplingParams]], what: str) -> None:
        if not items:
            raise ValueError(f"{what}() of nothing")
        if len({slot for slot, _, _ in items}) != len(items):
            raise ValueError(f"{what}() names a slot twice")
        for slot, prompt_ids, _ in items:
            if not 0 <= slot < self.max_slots:
                raise ValueError(f"slot {slot} out of range")
            if slot in self.slots or slot in self.prefilling:
                raise RuntimeError(f"{what}() into busy slot {slot}")
            if not prompt_ids or len(prompt_ids) >= self.max_model_len:
                raise RuntimeError(f"bad prompt length {len(prompt_ids)}")
        for slot, prompt_ids, sampling in items:
            if not self.reserve(slot, prompt_ids, sampling):
                raise OutOfPages(f"no KV pages for slot {slot}")

    def _to_prefill(self, prompt_ids: list[int], sampling: SamplingParams) -> int:
        return len(prompt_ids) - self.pages.lookup(prompt_ids) * (sampling.prompt_logprobs is None)

    def admit(self, items: list[tuple[int, list[int], SamplingParams]]) -> None:
        with self._guard():
            self._check_items(items, "admit")
            if self.record:
                self.admit_log.append([slot for slot, _, _ in items])
            for slot, prompt_ids, sampling in items:
                self.num_adds += 1
                self.prefilling[slot] = max(1, self._to_prefill(prompt_ids, sampling))
                self._pending_add[slot] = (list(prompt_ids), sampling)

    def add_many(self, items: list[tuple[int, list[int], SamplingParams]]) -> dict[int, StepResult]:
        with self._guard():
            self._check_items(items, "add_many")
            if self.record:
                self.add_log.append([slot for slot, _, _ in items])
            self.num_add_calls += 1
            self._sleep()
            out: dict[int, StepResult] = {}
            for slot, prompt_ids, sampling in items:
                self.num_adds += 1
                n = self._to_prefill(prompt_ids, sampling)
                if self.prefill_chunk is not None and n > self.prefill_chunk:
                    self.prefilling[slot] = n - self.prefill_chunk
                    self._pending_add[slot] = (list(prompt_ids), sampling)
                    out[slot] = StepResult([])
                    continue
                out[slot] = self._start(slot, list(prompt_ids), sampling)
            return out

    def _start(self, slot: int, prompt_ids: list[int], sampling: SamplingParams) -> StepResult:
        """The prompt is prefilled: the slot's state and its first token."""
        seen = self._contexts.pop(tuple(prompt_ids), None)
        off, seed = seen if seen is not None else (self.offset_for(prompt_ids, sampling),) * 2
        st = _SlotState(prompt_len=len(prompt_ids), pos=off, seed=seed, logprobs=sampling.logprobs)
        st.tokens = list(prompt_ids)
        self.slots[slot] = st
        res = self._result(st, 1)
        if sampling.prompt_logprobs is not None:
            res.prompt_logprobs = fake_prompt_logprobs(prompt_ids, sampling.prompt_logprobs, self.vocab_size)
        return res

    def step(
        self,
        slots: list[int],
        max_new: dict[int, int],
        num_drafts: dict[int, int] | None = None,
        no_propose: Collection[int] = (),
        prefill: Mapping[int, int] | None = None,
    ) -> dict[int, StepResult]:
        with self._guard():
            self.num_steps += 1
            prefill = dict(prefill or {})
            if self.record:
                self.step_log.append((list(slots), dict(max_new)))
                self.drafts_log.append(None if num_drafts is None else dict(num_drafts))
                self.no_propose_log.append(set(no_propose))
                self.prefill_log.append(prefill)
            if set(prefill) & set(slots) or not set(prefill) <= set(self.prefilling):
                raise RuntimeError(f"step(prefill={prefill}) names a slot that is not prefilling or also steps")
            if self.fail_after_steps is not None and self.num_steps >= self.fail_after_steps:
                raise RuntimeError("injected device failure")
            self._sleep()
            out: dict[int, StepResult] = {}
            for slot in slots:
                st = self.slots.get(slot)
                if st is None:
                    raise RuntimeError(f"step() on free slot {slot}")
                if st.prompt_len + st.generated >= self.max_model_len:
                    if self._dispatching:
                        out[slot] = StepResult([])
                        continue
                    raise RuntimeError(f"slot {slot} stepped past max_model_len {self.max_model_len}")
                want = max_new.get(slot, self.gamma)
                k = self.gamma - 1
                if self.respect_max_new:
                    k = max(0, min(k, want - 1))
                if num_drafts is not None and slot in num_drafts:
                    k = max(0, min(k, int(num_drafts[slot])))
                if k == 0:
                    out[slot] = self._result(st, 1)
                    continue
                coin = random.Random(st.seed * 1_000_003 + st.generated)
                a = 0
                while a < k and coin.random() < self.acceptance:
                    a += 1
                res = self._result(st, a + 1)
                res.num_drafts, res.num_accepted, res.accepted_mask = k, a, [i < a for i in range(k)]
                out[slot] = res
            if self.ragged_buckets is not None and not prefill:
                drafting = sum(r.num_drafts > 0 for r in out.values())
                ragged = ragged_split(len(slots), drafting, self.ragged_buckets) is not None
                for r in out.values():
                    r.ragged = ragged
            for slot, n in prefill.items():
                out[slot] = self._prefill(slot, n)
            return out

    def dispatch(
        self,
        slots: list[int],
        max_new: dict[int, int],
        num_drafts: dict[int, int] | None = None,
        no_propose: Collection[int] = (),
        prefill: Mapping[int, int] | None = None,
    ) -> _Handle:
        self._dispatching = True
        try:
            results = self.step(slots, max_new, num_drafts, no_propose, prefill)
        finally:
            self._dispatching = False
        self._uncollected.append((self.num_steps, {*slots, *(prefill or {})}))
        if self.record:
            self.dispatch_log.append(("dispatch", self.num_steps))
        return _Handle(self.num_steps, results)

    def collect(self, handle: _Handle) -> dict[int, StepResult]:
        if not self._uncollected or self._uncollected[0][0] != handle.step:
            raise RuntimeError(f"collect() of step {handle.step} out of order (uncollected: {self._uncollected})")
        self._uncollected.pop(0)
        if self.record:
            self.dispatch_log.append(("collect", handle.step))
        return handle.results

    def lookup_slots(self, slots: list[int]) -> set[int]:
        """The fake's drafts never come from prompt lookup."""
        return set()

    def release(self, slot: int) -> None:
        if any(slot in held for _, held in self._uncollected):
            raise RuntimeError(f"release() of slot {slot} while a step that holds it is not collected")
        with self._guard():
            self.prefilling.pop(slot, None)
            pending = self._pending_add.pop(slot, None)
            st = self.slots.pop(slot, None)
            if st is None and pending is None:
                raise RuntimeError(f"release() of free slot {slot}")
            if st is not None:
                self.pages.commit(slot, st.tokens, min(len(st.tokens) - 1, self.pages.capacity(slot)))
                self._contexts[tuple(st.tokens)] = (st.pos, st.seed)
                while len(self._contexts) > 4096:
                    self._contexts.popitem(last=False)
            self.pages.free_seq(slot)
            if self.record:
                self.released.append(slot)

    # -- helpers -------------------------------------------------------------------------------------

    def _result(self, st: _SlotState, n: int) -> StepResult:
        """The next `n` script tokens of a slot (with their fake log-probabilities when the slot asks)."""
        first = st.pos
        res = StepResult(tokens=self._emit(st, n))
        if st.logprobs is not None:
            res.logprobs = [fake_logprob(first + i, t, st.logprobs, self.vocab_size) for i, t in enumerate(res.tokens)]
        return res

    def _emit(self, st: _SlotState, n: int) -> list[int]:
        toks = [self.script[(st.pos + i) % len(self.script)] for i in range(n)]
        st.pos += n
        st.generated += n
        st.tokens.extend(toks)
        return toks

    def _sleep(self) -> None:
        if self.step_delay > 0:
            time.sleep(self.step_delay)

    def _guard(self):
        if not self._lock.acquire(blocking=False):
            raise RuntimeError("FakeRunner called concurrently")
        return _Release(self._lock)


@dataclass
class _Handle:
    step: int
    results: dict[int, StepResult]


class _Release:
    def __init__(self, lock: threading.Lock):
        self._lock = lock

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._lock.release()


def make_fake(
    *, max_slots: int = 4, max_model_len: int = 256, gamma: int = 4, acceptance: float = 0.7, **kw: Any
) -> tuple[FakeRunner, ByteBPETokenizer]:
    """A tokenizer and a fake runner whose script is `SCRIPT_TEXT` (twice) followed by EOS; requests start
    only at character boundaries, so every output is valid UTF-8 unless cut by max_tokens."""
    tok = ByteBPETokenizer()
    script = tok.encode(SCRIPT_TEXT * 2) + [tok.im_end_id]
    starts = [i for i in range(len(script)) if not tok.decode(script[:i]).endswith("\ufffd")]
    kw.setdefault("starts", starts)
    kw.setdefault("vocab_size", tok.vocab_size)
    runner = FakeRunner(
        script, max_slots=max_slots, max_model_len=max_model_len, gamma=gamma, acceptance=acceptance, **kw
    )
    return runner, tok
