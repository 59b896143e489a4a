"""The device-side runner: owns params, caches and the jitted steps; implements `engine.interface.StepRunner`.

Every prefill and every step is one device call (`spec_decode.step`; a step whose rows have pending drafter
context, after plain steps, is preceded by the drafter's catch-up call; a step given `prefill` chunks runs them in
its own call, the `mixed` program): the slot state (anchor token, position,
drafter-context frontier, sampling parameters) lives on the device, the host sends the batch's slot ids and draft
counts, and reads back once per step: the accepted counts, bonus tokens and the verified drafts (and, when a row of
the step asks for them, the emitted tokens' log-probabilities, `spec_decode.logprobs`). The host mirrors each
slot's position and context frontier (they follow from the accepted counts) to pick the step's static shape: the
batch bucket, the KV length bucket and the verify width, the narrowest of `kv.sizing.verify_widths` that holds the
step's deepest row (each row verifies its own draft count inside it).

Ragged verify: a full-width speculative step in which some rows verify no drafts (the controller left them plain)
runs those rows at width 1 in the same call (`step._ragged_step`): the drafting rows first, then the plain ones,
each group padded to a batch bucket that fits the step's (`kv.sizing.ragged_split`), so a row that does not
speculate does not pay the others' verify width nor a drafter block. A plain row's target taps go to its pending
buffer, as in a plain step.

Deterministic mode (`deterministic=True`, `--deterministic`): greedy output does not depend on speculation. In
reduced precision a W-row verify and a one-row decode lower to differently shaped matmuls and attention whose
float rounding differs in the last bits, so where the target's two best logits are that close the paths can pick
different tokens. In this mode every step runs the target at one shape: the verify width γ (a plain step verifies
γ - 1 padding rows it never accepts), every `max_slots` row (padding rows are the scratch slot) and the whole
context as `kv_len`; a row's arithmetic is then the same whether its token was decoded alone or verified in a
block, at the price of computing the full-width, full-batch, full-context step every time.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import time
from collections import Counter
from collections.abc import Callable, Collection, Hashable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dflash_jax.compilation import CompileCounts, CompileMeter, Executable, Precompiler
from dflash_jax.config import TargetConfig
from dflash_jax.errors import UserError
from dflash_jax.kernels.backends import attention_backend_for
from dflash_jax.kv.pages import PAGE_SIZES, OutOfPages, PagePool
from dflash_jax.kv.sizing import dense_pool, pages_per_seq, ragged_split, verify_width, verify_widths
from dflash_jax.models.drafter import DrafterModel, init_drafter_cache
from dflash_jax.models.layers import dense_rows_state, resolve_dense_layout, to_dense_rows
from dflash_jax.models.target import TargetModel, init_kv_cache
from dflash_jax.parallel.rules import replicate
from dflash_jax.quant import DenseRows
from dflash_jax.spec_decode.draft_choice import choose_drafts
from dflash_jax.spec_decode.logprobs import Logprobs
from dflash_jax.spec_decode.placement import place_runner
from dflash_jax.spec_decode.plan import StepPlan
from dflash_jax.spec_decode.sampling import SamplingArrays
from dflash_jax.spec_decode.step import (
    MAX_BANNED,
    MIXED_STATIC,
    PENDING,
    DeviceState,
    StepModel,
    Weights,
    given_proposal,
    init_slot_state,
    programs,
    propose_program,
    step_program,
)
from dflash_jax.types import MAX_TOP_LOGPROBS, SamplingParams, StepResult, TokenLogprob

_T = TypeVar("_T")

DEFAULT_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
MIN_KV_BUCKET = 128
# A step that computes log-probabilities verifies at least this many rows (an unused row after the anchor when no
# row drafts): XLA lowers a one-row forward to other kernels than a block's, whose float rounding differs in the last
# bits, so without it a token's log-probability would depend on whether it was decoded alone or verified in a block.
LOGPROBS_MIN_WIDTH = 2


def _ready_at(out: Any) -> float:
    """Wait for a step's device outputs; the perf_counter time they were ready (`StepTimes`)."""
    jax.block_until_ready(out)
    return time.perf_counter()


def bucket(n: int, ladder: tuple[int, ...]) -> int:
    for b in ladder:
        if b >= n:
            return b
    return ladder[-1]


def host_logprobs(lp: Logprobs, row: int, cols: range, top: int) -> list[TokenLogprob]:
    """Row `row`'s entries at positions `cols` of a step's `Logprobs` (host numpy), keeping `top` alternatives."""
    chosen, ids, vals = (a[row] for a in lp)
    out = []
    for c in cols:
        alts = tuple((int(i), float(v)) for i, v in zip(ids[c, :top], vals[c, :top], strict=True))
        out.append(TokenLogprob(float(chosen[c]), alts))
    return out


def check_logprobs(sampling: SamplingParams) -> None:
    for name in ("logprobs", "prompt_logprobs"):
        n = getattr(sampling, name)
        if n is not None and not 0 <= n <= MAX_TOP_LOGPROBS:
            raise UserError(f"{name} must be between 0 and {MAX_TOP_LOGPROBS}, got {n}", param=name)


_SIGNATURES: dict[tuple, int] = {}


def _signature(tree: Any) -> int:
    """A small id of the shapes, dtypes and shardings of `tree`'s arrays (equal trees, equal ids)."""
    leaves, treedef = jax.tree.flatten(tree)
    sig = (str(treedef), *((x.shape, x.dtype.str, str(x.sharding)) for x in leaves))
    return _SIGNATURES.setdefault(sig, len(_SIGNATURES))


def kv_ladder(capacity: int) -> tuple[int, ...]:
    out, b = [], MIN_KV_BUCKET
    while b < capacity:
        out.append(b)
        b *= 2
    out.append(capacity)
    return tuple(out)


@dataclass
class _Slot:
    sampling: SamplingParams
    anchor: int  # the last emitted token (the device holds it too)
    start: int  # absolute position of the anchor (its target KV is not written yet)
    ctx_end: int  # the drafter context holds positions < ctx_end; [ctx_end, start) wait in the pending buffer
    prompt_len: int
    min_pos: int  # positions p with p + 1 < min_pos never emit a banned id (the request's min_tokens)
    tokens: list[int]  # prompt + emitted tokens: position p of the cache holds tokens[p]
    # Overlap (`SpecRunner.dispatch`): what the dispatched steps not collected yet may add to `start` at most, and
    # `start - ctx_end` once they are all done (known at dispatch: a speculative step ends with it 0, a plain step
    # adds 1, a catch-up sets it to 0).
    ahead: int = 0
    lag: int = 0


@dataclass
class _Prefill:
    """A sequence whose prompt is being prefilled chunk by chunk."""

    ids: list[int]
    sampling: SamplingParams
    done: int  # prompt positions whose K/V are written (cached prefix pages included)


@dataclass
class _PrefillCall:
    """One prefill call's rows (`slots`, in row order; padding rows follow) and its host inputs."""

    slots: list[int]
    arrays: dict[str, np.ndarray]
    static: dict[str, Any]
    done: list[int] = field(default_factory=list)  # per row, the prompt positions written once the call ran


# The prefill part's arrays and static arguments in a mixed step's plan carry this prefix.
MIXED_PREFILL = "p_"
# The warm-up compiles the ragged verifies of batches up to this many rows, at its longest warmed length only: a
# ragged step's program maps about twice the executable memory regions of a one-width step's (two row groups), and
# an XLA:CPU process may map at most `vm.max_map_count` (65,530 by default), which a server's programs approach.
# Other ragged shapes run every row at one width (`_ragged_ready`).
RAGGED_WARM_ROWS = 4

# A mixed step's chunk width below the context buckets (a step's token budget is often smaller than a bucket; one
# width, so that the warm-up can compile the mixed programs a server runs).
MIXED_CHUNK = 64


@dataclass
class StepTimes:
    """Wall-clock times (ms) of each device call, host read included, collected when `timing=True` (benchmarks)."""

    plain_ms: list[float] = field(default_factory=list)  # steps without drafter work
    spec_ms: list[float] = field(default_factory=list)  # speculative steps (propose + verify + context write)
    prefill_ms: list[float] = field(default_factory=list)
    # Per step (`dispatch` + `collect`): perf_counter seconds when its last device call was launched and when its
    # outputs were ready on the device (a watcher thread waits for them), for the host-wait fraction.
    launched: list[float] = field(default_factory=list)
    ready: list[float] = field(default_factory=list)

    # host work of steps with a constrained row: masks and drafts chosen under the grammar (`_grammar_masks`), and
    # of it the part done while the drafter's proposal ran on the device
    grammar_ms: list[float] = field(default_factory=list)
    grammar_overlapped_ms: list[float] = field(default_factory=list)


@dataclass
class StepHandle:
    """A dispatched step (`SpecRunner.dispatch`): its device outputs, not read yet, and what `collect` needs."""

    slot_list: list[int]  # decode rows, in row order
    slots: list[_Slot]  # their host state when dispatched (a slot released meanwhile is skipped at collect)
    k: dict[int, int]  # drafts verified per slot
    spec: bool
    lag: dict[int, int]  # per slot, `start - ctx_end` after this step
    out: Any = None  # device outputs: (accepted, bonus, drafts, Logprobs | None), a mixed step's with the prefill's
    call: _PrefillCall | None = None  # a mixed step's prefill rows
    pre: dict[int, StepResult] = field(default_factory=dict)  # results already read (prefill calls of their own)
    t0: float = 0.0
    launched: float = 0.0
    ready: Future | None = None  # timing: when `out` was ready
    lookup: dict[int, int] = field(default_factory=dict)  # slots that verified prompt-lookup drafts: how many
    rows: list[int] | None = None  # each slot's row of the outputs (None: row i is slot_list[i])


def banned_ids(sampling: SamplingParams) -> np.ndarray:
    """The row of `SlotState.banned` for a request: its stop token ids while `min_tokens` is not reached."""
    ids = sorted(set(sampling.stop_token_ids)) if sampling.min_tokens > 0 else []
    if len(ids) > MAX_BANNED:
        raise UserError(
            f"min_tokens with more than {MAX_BANNED} stop token ids (EOS included) is not supported, got {len(ids)}",
            param="stop_token_ids",
        )
    row = np.full((MAX_BANNED,), -1, np.int32)
    row[: len(ids)] = ids
    return row


class SpecRunner:
    """Batched DFlash speculative decoding (or plain decoding when `drafter` is None), one device call per step
    (see the module docstring for the catch-up).

    Overlap: `dispatch` launches a step and returns without reading it, `collect` reads it (`step` does both). The
    slot state lives on the device, so the next step can be dispatched before this one is collected: the host
    plans it from bounds (each slot's position at most `ahead` past the last collected one; its pages grown for
    that) and reads the tokens one step later. A row with a grammar needs its matcher at the current token, so a
    constrained step is dispatched only after the previous one is collected."""

    supports_overlap = True  # `dispatch` may run while a step is in flight (`engine.Engine(overlap=True)`)
    ragged_verify = True  # a full-width step's non-drafting rows decode at width 1 in the same call (`_ragged_step`)

    def __init__(
        self,
        target: TargetModel,
        drafter: DrafterModel | None = None,
        *,
        max_slots: int = 8,
        max_model_len: int = 2048,
        gamma: int | None = None,
        batch_buckets: tuple[int, ...] = DEFAULT_BATCH_BUCKETS,
        timing: bool = False,
        draft_lm_head=None,
        mesh=None,  # tensor parallelism (dflash_jax.parallel): a "tp" mesh, or None
        draft_tp: str | int | None = "auto",  # --draft-tp-size: auto (= world) | 1 | world
        pool: PagePool | None = None,
        max_num_batched_tokens: int = 2048,
        attention_backend: str = "auto",
        deterministic: bool = False,
        dense_layout: str = "auto",
    ):
        """KV memory: `pool`, the host page pool (`kv.pages.PagePool`, page 0 the null page) shared by every
        sequence, for the target's K/V and the drafter's context K/V alike (one page table per sequence), made by
        the builder from the flags (`kv.sizing`); None = `kv.sizing.dense_pool` (`max_slots` full-length
        sequences in pages of 16 tokens, prefix caching on). Prompts prefill in
        chunks of at most `max_num_batched_tokens` tokens (`prefill_step` continues them). `attention_backend`:
        the attention over the pages, `xla` or `pallas` (`kernels.paged_attention`; `kernels.backends` runs Pallas
        interpreted off a GPU). `deterministic`: every step runs one shape (module docstring), so greedy output does
        not depend on speculation; without a drafter `gamma` names the verify width to match. `dense_layout`: the
        matmul weights' layout in the steps (`--dense-layout`, `models.layers.resolve_dense_layout`: `out-in` =
        `DenseRows` copies of the target's and drafter's weights, the fast one for XLA:CPU's dots of a few
        tokens; `auto` picks it on CPU without tensor parallelism)."""
        self.cfg: TargetConfig = target.cfg
        self.max_slots = max_slots
        self.max_model_len = max_model_len
        self.speculative = drafter is not None
        asked_gamma = gamma
        gamma = verify_width(gamma, drafter.cfg.block_size if drafter is not None else None)
        if drafter is not None:
            if gamma < 2:
                raise UserError(
                    "--dflash-gamma must be at least 2 (1 anchor + at least one draft)", param="--dflash-gamma"
                )
        self.gamma = gamma
        self.widths = verify_widths(gamma)  # a step of k drafts runs at the narrowest of these holding k + 1
        self.deterministic = deterministic
        if deterministic and not asked_gamma and drafter is None:
            raise UserError(
                "--deterministic makes speculative output bit-identical to plain decoding and needs a drafter: give "
                "--draft-model, or drop --deterministic",
                param="--deterministic",
            )
        self.min_width = (gamma if drafter is not None else asked_gamma) if deterministic else 1
        attention = attention_backend_for(attention_backend, 1 if mesh is None else mesh.size)
        self.attention_backend = attention  # xla | pallas | interpret (`kernels.backends`)
        width = max(self.gamma, self.min_width)
        if pool is None:
            pool = dense_pool(max_slots, max_model_len, width)
        page_size = pool.page_size
        if page_size not in PAGE_SIZES:
            raise UserError(f"--block-size must be one of {PAGE_SIZES}, got {page_size}", param="--block-size")
        if max_num_batched_tokens < 1:
            raise UserError("--max-num-batched-tokens must be at least 1", param="--max-num-batched-tokens")
        self.page_size = page_size
        self.pages_per_seq = pages_per_seq(max_model_len, width, page_size)
        self.capacity = self.pages_per_seq * page_size  # positions one sequence can address
        self.kv_buckets = kv_ladder(self.capacity)
        self.prefill_chunk = max_num_batched_tokens
        self.pages = pool
        num_pages = pool.num_pages
        # Page tables as per-slot rows (the scratch slot's all null), refreshed when a slot's table grows.
        self._table_rows = np.zeros((max_slots + 1, self.pages_per_seq), np.int32)
        self._table_len = np.zeros((max_slots + 1,), np.int64)
        self._watch: ThreadPoolExecutor | None = None  # timing: waits for each step's outputs
        self.batch_buckets = tuple(b for b in batch_buckets if b < max_slots and not deterministic) + (max_slots,)
        self.timing = timing
        self.times = StepTimes()
        self.device_calls: Counter[str] = Counter()  # jitted calls made, by plan kind (prefill, step, catch_up)
        self.tgraph, self.tstate = nnx.split(target)
        self.embed = target.embed[...]
        self.lm_head = target.lm_head[...]
        # The drafter's copy of the LM head: quantized per --draft-weight-quantization, else the target's.
        self.draft_lm_head = draft_lm_head if draft_lm_head is not None else self.lm_head
        self.dtype = self.embed.dtype  # caches, activations and pending taps
        self._warmed = False  # a warm-up ran: ragged verifies only from its programs (`_ragged_ready`)
        self.pending_size = PENDING
        n = max_slots + 1  # + one scratch slot for batch padding
        self.scratch = max_slots
        tcache = init_kv_cache(self.cfg, num_pages, page_size, self.dtype)  # a page pool: [pages, H, P, d]
        if drafter is not None:
            self.dgraph, self.dstate = nnx.split(drafter)
            self.capture = tuple(drafter.cfg.target_layer_ids)
            dcache = init_drafter_cache(drafter.cfg, num_pages, page_size, self.dtype)
            taps = len(self.capture) * self.cfg.hidden_size
            pending = jnp.zeros((n, self.pending_size, taps), self.dtype)
        else:
            self.dgraph, self.dstate, self.capture, dcache, pending = None, None, (), None, None
        self.slots: dict[int, _Slot] = {}
        self.prefilling: dict[int, _Prefill] = {}  # slots whose prompt is not fully prefilled yet
        self._cached: dict[int, int] = {}  # per reserved slot, the prompt tokens its cached prefix pages hold
        self._warming = False
        self.last_drafts: dict[int, np.ndarray] = {}  # per slot, the drafts the last step verified
        # --- tensor parallelism (dflash_jax.parallel): weights and caches onto the mesh ------------------------
        self.mesh, self.draft_tp, self.draft_mesh = mesh, 1, None
        slot_state = init_slot_state(n)
        self.dense_layout = "in-out"
        if mesh is not None:
            resolve_dense_layout(dense_layout, tp=mesh.size)
            weights = (self.tgraph, self.tstate), (self.dgraph, self.dstate), (self.lm_head, self.draft_lm_head)
            p = place_runner(mesh, draft_tp, self.cfg, *weights, (tcache, dcache))
            self.tstate, self.dstate, self.embed, self.lm_head = p.tstate, p.dstate, p.embed, p.lm_head
            self.draft_lm_head, self.draft_tp, self.draft_mesh = p.draft_lm_head, p.draft_tp, p.draft_mesh
            tcache, dcache = p.tcache, p.dcache
            slot_state = replicate(slot_state, mesh)
            pending = None if pending is None else replicate(pending, mesh)
        else:
            self.dense_layout = resolve_dense_layout(dense_layout, tp=1)
            if self.dense_layout == "out-in":
                self.tstate = dense_rows_state(self.tstate)
                self.dstate = None if self.dstate is None else dense_rows_state(self.dstate)
                head = self.tstate["lm_head"].get_value()
                if self.cfg.tie_word_embeddings:  # the rows of a tied head are the embedding itself: one copy
                    head = DenseRows(self.embed, head.out_shape)
                    self.tstate["lm_head"].set_value(head)
                shared = draft_lm_head is None or draft_lm_head is self.lm_head  # the target's own head
                self.draft_lm_head = head if shared else to_dense_rows(draft_lm_head)
            # committed to the device as every step's outputs are, so the first call's program serves the later
            # calls too (an uncommitted argument is a different sharding, compiled again on the second call)
            dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
            tcache, dcache, pending, slot_state = jax.device_put((tcache, dcache, pending, slot_state), dev)
        # --- end tensor parallelism ---------------------------------------------------------------------------
        self.state = DeviceState(tcache, dcache, pending, slot_state)  # donated at every step
        tleaves, ttree = jax.tree.flatten(self.tstate)
        dleaves, dtree = jax.tree.flatten(self.dstate) if drafter is not None else (None, None)
        self.weights = Weights(tleaves, dleaves, self.embed, self.draft_lm_head)
        self.step_model = StepModel(
            self.tgraph, ttree, self.dgraph, dtree, self.capture, self.scratch, self.draft_mesh, attention
        )
        self.programs = programs(self.step_model)
        # Precompiled executables are shared by the runners whose weights and state have the same shapes.
        self._signature = _signature((self.weights, self.state))
        self._planner: Precompiler | None = None  # set while `warmup` plans its calls
        self._deferred: Iterator[int] | None = None  # a background warm-up's rest (`warm_more`)
        self._deferred_threads: int | None = None
        self._deferred_keys: list = []  # the programs `warm_more` planned (`_narrow`)
        # Constrained decoding (`engine.grammar`): `grammar_compiler` (set by the builder from the tokenizer) makes
        # the matcher of every sequence whose `SamplingParams.grammar` is set; its masks are the calls' runtime
        # `mask` inputs (rows without a grammar: all ones, a cached device array per shape).
        self.grammar_compiler: Any = None
        self.grammars: dict[int, Any] = {}  # per slot, its matcher (`engine.grammar.SlotGrammar`)
        self.mask_words = (self.cfg.vocab_size + 31) // 32
        self._open_masks: dict[tuple[int, int], Any] = {}
        # Multi-host (dflash_jax.spec_decode.multihost): every jitted step goes through `_run(plan)`; on rank 0 the
        # hook broadcasts the plan to the followers, which `apply_plan` it to their own runner.
        self.plan_hook: Callable[[StepPlan, Callable[[StepPlan], Any]], Any] | None = None

    # ------------------------------------------------------------------------------------------- helpers
    @property
    def tcache(self):
        """The target's K/V cache (part of `state`)."""
        return self.state.tcache

    @property
    def dcache(self):
        """The drafter's context K/V cache (part of `state`), or None."""
        return self.state.dcache

    @staticmethod
    def _sampling(sps: list[SamplingParams]) -> dict[str, np.ndarray]:
        """Host arrays of `SamplingArrays` (by field name)."""
        return {
            "temperature": np.asarray([sp.temperature for sp in sps], np.float32),
            "top_k": np.asarray([sp.top_k for sp in sps], np.int32),
            "top_p": np.asarray([sp.top_p for sp in sps], np.float32),
            "seed": np.asarray([(sp.seed or 0) & 0xFFFFFFFF for sp in sps], np.uint32),
        }

    @property
    def ragged_buckets(self) -> tuple[int, ...] | None:
        """The batch buckets of its ragged verifies (`kv.sizing.ragged_split`), or None when it runs none."""
        if not (self.speculative and self.ragged_verify) or self.deterministic:
            return None
        return self.batch_buckets

    def _pad(self, slots: list[int]) -> list[int]:
        b = bucket(len(slots), self.batch_buckets)
        return slots + [self.scratch] * (b - len(slots))

    def _sampled_rows(self, sps: list[SamplingParams], rows: int) -> int:
        """The step's static count of leading rows that may sample (`step._choose`): 0 for an all-greedy batch,
        else the sampling rows' count rounded up to a batch bucket (callers put those rows first)."""
        n = sum(sp.temperature > 0 for sp in sps)
        return 0 if n == 0 else min(bucket(n, self.batch_buckets), rows)

    # ------------------------------------------------------------------------------------------- StepRunner
    def reserve(self, slot: int, prompt_ids: list[int], sampling: SamplingParams) -> bool:
        """Take the pages of a new sequence's prompt (reusing cached prefix pages); False when the pool cannot
        hold it now (nothing taken). `add_many` reserves the slots not reserved before."""
        if slot in self.pages:
            return True
        self._table_len[slot] = -1
        use_cache = sampling.prompt_logprobs is None and not self._warming  # prompt log-probs need every position
        try:
            self._cached[slot] = self.pages.allocate(slot, prompt_ids, len(prompt_ids), use_cache=use_cache)
        except OutOfPages:
            return False
        return True

    def grow(self, slots: list[int]) -> list[int]:
        """Take the pages each slot's next step may write (up to γ positions past its anchor, not past its context);
        returns the slots the pool could not grow (nothing taken for them)."""
        width = max(self.gamma, LOGPROBS_MIN_WIDTH, self.min_width)
        return [s for s in slots if not self.pages.ensure(s, min(self._hi(s) + width, self.capacity))]

    def _hi(self, slot: int) -> int:
        """The slot's anchor position once its dispatched steps are done, at most (exact when none is in flight)."""
        x = self.slots[slot]
        return x.start + x.ahead

    def add(self, slot: int, prompt_ids: list[int], sampling: SamplingParams) -> StepResult:
        """Prefill one sequence to the end (every chunk) and return its first generated token."""
        out = self.add_many([(slot, prompt_ids, sampling)])[slot]
        while slot in self.prefilling:
            out = self.prefill_step([slot])[slot]
        return out

    def add_many(self, items: list[tuple[int, list[int], SamplingParams]]) -> dict[int, StepResult]:
        """Start several new sequences and prefill the first chunk of each in one call (see `prefill_step`); a
        sequence whose prompt is done yields its first generated token, one still prefilling an empty result."""
        self.admit(items)
        return self.prefill_step([slot for slot, _, _ in items])

    def admit(self, items: list[tuple[int, list[int], SamplingParams]]) -> None:
        """Start several new sequences without a device call: their prompt pages are reserved and they join
        `prefilling`; `prefill_step` or a step's `prefill` runs their chunks."""
        for slot, ids, spar in items:
            check_logprobs(spar)
            if not 0 <= slot < self.max_slots:
                raise ValueError(f"slot {slot} out of range")
            if slot in self.slots or slot in self.prefilling:
                raise ValueError(f"slot {slot} is in use")
            if not ids:
                raise UserError("the prompt is empty", param="prompt")
            if len(ids) >= self.max_model_len:
                raise UserError(
                    f"the prompt has {len(ids)} tokens; the maximum context length is {self.max_model_len}",
                    param="prompt",
                )
            banned_ids(spar)
            if spar.grammar is not None and self.grammar_compiler is None:
                raise UserError("this runner has no tokenizer for constrained decoding", param="response_format")
        for slot, ids, spar in items:
            if not self.reserve(slot, ids, spar):
                raise OutOfPages(
                    f"the KV pool has {self.pages.free} free pages of {self.page_size} tokens; the prompt of slot "
                    f"{slot} needs {self.pages.pages_for(len(ids))}"
                )
        for slot, ids, spar in items:
            if spar.grammar is not None:
                g = self.grammar_compiler.matcher(spar.grammar)
                g.consume(list(ids[len(ids) - spar.grammar_done :]) if spar.grammar_done else [])
                self.grammars[slot] = g
            self.prefilling[slot] = _Prefill(list(ids), spar, self._cached.pop(slot, 0))

    def prompt_left(self, slot: int) -> int:
        """The prompt tokens of a prefilling slot not prefilled yet."""
        p = self.prefilling[slot]
        return len(p.ids) - p.done

    def prefill_step(self, slots: list[int] | None = None) -> dict[int, StepResult]:
        """The next prompt chunk of each prefilling slot (default: all of them) in one call: at most
        `max_num_batched_tokens` tokens per row (a request with prompt log-probabilities is prefilled whole).
        Per slot, the first generated token when its prompt is done, else an empty result."""
        slots = list(self.prefilling) if slots is None else slots
        if not slots:
            return {}
        return self._prefill(self._prefill_call({s: self.prefill_chunk for s in slots}))

    def _prefill(self, call: _PrefillCall) -> dict[int, StepResult]:
        """Run one prefill call and return its results (`_prefill_results`)."""
        t0 = time.perf_counter()
        out = jax.device_get(self._run(StepPlan("prefill", call.arrays, call.static)))
        self._advance(call)
        if self.timing:
            self.times.prefill_ms.append((time.perf_counter() - t0) * 1e3)
        return self._prefill_results(call, out)

    def _prefill_call(self, chunks: Mapping[int, int], widths: tuple[int, ...] | None = None) -> _PrefillCall:
        """The arrays and static arguments of one prefill call over the slots of `chunks`, each with at most that
        many of its prompt's next tokens (and at most `max_num_batched_tokens`; a request with prompt
        log-probabilities takes its whole prompt); the chunk width is a bucket of `widths` (default: the context
        buckets)."""
        # sampling rows first (`_sampled_rows`)
        slots = sorted(chunks, key=lambda s: self.prefilling[s].sampling.temperature <= 0)
        pf = [self.prefilling[s] for s in slots]
        counts = [
            len(p.ids) - p.done
            if p.sampling.prompt_logprobs is not None
            else max(1, min(len(p.ids) - p.done, self.prefill_chunk, chunks[s]))
            for s, p in zip(slots, pf, strict=True)
        ]
        t = bucket(max(counts), widths or self.kv_buckets)
        kv_len = bucket(max(p.done + c for p, c in zip(pf, counts, strict=True)), self.kv_buckets)
        padded = self._pad(list(slots))
        b = len(padded)
        tokens = np.zeros((b, t), np.int32)
        offsets = np.zeros((b,), np.int32)
        nums = np.ones((b,), np.int32)
        final = np.zeros((b,), bool)
        sps = [p.sampling for p in pf] + [SamplingParams()] * (b - len(slots))
        banned = np.stack([banned_ids(sp) for sp in sps])
        min_pos = np.zeros((b,), np.int32)
        for i, (p, c) in enumerate(zip(pf, counts, strict=True)):
            tokens[i, :c] = p.ids[p.done : p.done + c]
            offsets[i], nums[i] = p.done, c
            final[i] = p.done + c == len(p.ids)
            min_pos[i] = len(p.ids) + p.sampling.min_tokens
        static = {
            "kv_len": kv_len,
            "sampled": self._sampled_rows(sps, b),
            "prompt_logprobs": any(x.prompt_logprobs is not None for x in sps),
        }
        arrays = {
            "slot_ids": np.asarray(padded, np.int32),
            "page_table": self._tables(padded, kv_len),
            "tokens": tokens,
            "offsets": offsets,
            "counts": nums,
            "final": final,
        }
        want_lp = np.asarray(any(x.logprobs is not None for x in sps))
        arrays.update(self._sampling(sps), min_pos=min_pos, banned=banned, want_logprobs=want_lp)
        gram = {i: self.grammars[s] for i, s in enumerate(slots) if final[i] and s in self.grammars}
        arrays.update(self._mask_inputs(b, 1, {i: g.mask()[None] for i, g in gram.items()}))
        done = [p.done + c for p, c in zip(pf, counts, strict=True)]
        return _PrefillCall(slots, arrays, static, done)

    def _advance(self, call: _PrefillCall) -> None:
        """Count a launched prefill call's chunks as prefilled (the next chunk of a prompt follows them)."""
        for slot, d in zip(call.slots, call.done, strict=True):
            self.prefilling[slot].done = d

    def _prefill_results(self, call: _PrefillCall, out) -> dict[int, StepResult]:
        """The host side of a prefill call's outputs (`out`: first tokens, their and the prompt's `Logprobs`)."""
        first, first_lp, prompt_lp = out
        final, min_pos = call.arrays["final"], call.arrays["min_pos"]
        res = {}
        for i, slot in enumerate(call.slots):
            p = self.prefilling[slot]
            if not self._warming:
                self.pages.commit(slot, p.ids, call.done[i])
            if not final[i]:
                res[slot] = StepResult([])
                continue
            del self.prefilling[slot]
            if slot in self.grammars:
                self.grammars[slot].consume([int(first[i])])
            n = len(p.ids)
            self.slots[slot] = _Slot(p.sampling, int(first[i]), n, n, n, int(min_pos[i]), [*p.ids, int(first[i])])
            res[slot] = StepResult([int(first[i])])
            if p.sampling.logprobs is not None:
                res[slot].logprobs = host_logprobs(first_lp, i, range(1), p.sampling.logprobs)
            if p.sampling.prompt_logprobs is not None:
                res[slot].prompt_logprobs = host_logprobs(prompt_lp, i, range(n - 1), p.sampling.prompt_logprobs)
        return res

    def _mask_inputs(self, b: int, width: int, rows: dict[int, np.ndarray]) -> dict[str, np.ndarray]:
        """A call's `masked` flag and, when some row follows a grammar, its `mask` [b, width, words]: `rows[i]` is row
        i's masks [width, words], the other rows allow every token (`program_call` gives an unconstrained call the
        cached all-ones mask, so its plan carries none)."""
        if not rows:
            return {"masked": np.asarray(False)}
        mask = np.full((b, width, self.mask_words), -1, np.int32)
        for i, m in rows.items():
            mask[i] = m
        return {"masked": np.asarray(True), "mask": mask}

    def _open_mask(self, b: int, width: int) -> Any:
        """The all-ones mask [b, width, words] on the device (made once per shape)."""
        m = self._open_masks.get((b, width))
        if m is None:
            m = jax.device_put(np.full((b, width, self.mask_words), -1, np.int32))  # a copy, no program
            if self.mesh is not None:
                m = replicate(m, self.mesh)
            m = self._open_masks[(b, width)] = m
        return m

    def _tables(self, padded: list[int], kv_len: int) -> np.ndarray:
        """The page tables [B, kv_len / P] of a step's rows (the scratch rows' are all the null page), from the
        per-slot rows (a slot's row is rewritten only when its page count changed or it was reserved anew)."""
        rows, lens, size = self._table_rows, self._table_len, self.page_size
        for s in set(padded):
            if s != self.scratch:
                n = self.pages.capacity(s) // size
                if lens[s] != n:
                    rows[s] = 0
                    rows[s, :n] = self.pages.table(s)
                    lens[s] = n
        return rows[np.asarray(padded), : kv_len // size]

    # ------------------------------------------------------------------------------------------- jitted steps
    def _run(self, plan: StepPlan) -> Any:
        """Every jitted step goes through here (rank 0 of a multi-host run broadcasts `plan` in `plan_hook`).
        While `warmup` plans, the call is traced and queued for compilation instead, and zeros of its outputs'
        shapes come back."""
        if self._planner is not None:
            program, args, static = self.program_call(plan)
            info = self._planner.plan(self._plan_key(plan), program, args, static)
            out = info if plan.kind == "propose" else info[0]  # (outputs, state) but for the stateless propose
            return jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), out)
        self.device_calls[plan.kind] += 1
        if self.plan_hook is not None:
            return self.plan_hook(plan, self.apply_plan)
        return self.apply_plan(plan)

    def apply_plan(self, plan: StepPlan) -> Any:
        """Run one jitted step from its host inputs: update the device state and return the step's device outputs
        (prefill: first tokens and the `Logprobs` asked for (else None); step: accepted, bonus, drafts, `Logprobs`
        or None). Pure replay: it reads no host slot state, so a multi-host follower calls it with rank 0's plans."""
        program, args, static = self.program_call(plan)
        exe = self.programs.executables.get(self._plan_key(plan)) if self.programs.executables else None
        if exe is not None:  # compiled ahead: the static arguments are part of it, the runtime keywords are not
            runtime = {k: v for k, v in static.items() if k not in plan.static and k not in MIXED_STATIC}
            program = functools.partial(exe.compiled, **runtime)
            static = {}
        if plan.kind == "propose":  # reads the state, writes nothing
            return program(*args, **static)
        out, self.state = program(*args, **static)
        return out

    def _plan_key(self, plan: StepPlan) -> tuple:
        """What selects a precompiled executable: the runner's signature, the plan's kind, static arguments and
        host input shapes."""
        shapes = tuple((k, v.shape, v.dtype.str) for k, v in sorted(plan.arrays.items()))
        return self._signature, plan.kind, tuple(sorted(plan.static.items())), shapes

    def program_call(self, plan: StepPlan) -> tuple[Any, tuple, dict]:
        """The jitted program a plan runs, its positional arguments (weights and the current device state first)
        and its static arguments (benchmarks `lower` it to read its memory use)."""
        a, st = plan.arrays, dict(plan.static)
        if plan.kind == "prefill":
            args = self._prefill_args(a)
            if "masked" in a:
                args = (*args, self._call_mask(a, 1), a["masked"])
            return self.programs.prefill, (self.weights, self.state, *args), st
        if plan.kind == "step":
            args = self._step_args(a)
            if "masked" in a:
                st.update(mask=self._call_mask(a, int(st["width"])), masked=a["masked"])
            if "proposal" in a:  # a constrained speculative step's verify: the drafts `propose` made
                q = (a["proposal_ids"], a["proposal_q"]) if "proposal_q" in a else None
                program = step_program(self.step_model, given_proposal)
                return program, (self.weights, self.state, *args, a["proposal"], q), st
            return self.programs.step, (self.weights, self.state, *args), st
        if plan.kind == "propose":
            args = (self.weights, self.state, a["slot_ids"], a["page_table"])
            return propose_program(self.step_model), args, st
        if plan.kind == "mixed":  # no grammar row (`step` runs those as separate calls)
            n = len(MIXED_PREFILL)
            pa = {k[n:]: v for k, v in a.items() if k.startswith(MIXED_PREFILL)}
            sst = tuple(sorted((k, v) for k, v in st.items() if not k.startswith(MIXED_PREFILL)))
            pst = tuple(sorted((k[n:], v) for k, v in st.items() if k.startswith(MIXED_PREFILL)))
            args = (self.weights, self.state, self._step_args(a), self._prefill_args(pa))
            return self.programs.mixed, args, {"step_static": sst, "prefill_static": pst}
        if plan.kind == "catch_up":
            return self.programs.catch_up, (self.weights, self.state, a["slot_ids"], a["page_table"]), st
        raise ValueError(f"unknown step plan kind {plan.kind!r}")

    def _call_mask(self, a: dict, width: int) -> Any:
        return a["mask"] if "mask" in a else self._open_mask(len(a["slot_ids"]), width)

    @staticmethod
    def _prefill_args(a: Mapping[str, np.ndarray]) -> tuple:
        sp = SamplingArrays(a["temperature"], a["top_k"], a["top_p"], a["seed"])
        names = ("slot_ids", "page_table", "tokens", "offsets", "counts", "final")
        return (*(a[n] for n in names), sp, a["min_pos"], a["banned"], a["want_logprobs"])

    @staticmethod
    def _step_args(a: Mapping[str, np.ndarray]) -> tuple:
        return (a["slot_ids"], a["page_table"], a["num_drafts"], a["want_logprobs"])

    def num_drafts(
        self, slot_list: list[int], max_new: dict[int, int], requested: dict[int, int] | None = None
    ) -> dict[int, int]:
        """Drafts to verify per slot this step: the requested count (default γ-1), capped by γ-1, by what is
        wanted and by the room left in the context."""
        if not self.speculative:
            return {s: 0 for s in slot_list}
        chosen = requested or {}
        out = {}
        for s in slot_list:
            k = chosen.get(s, self.gamma - 1)
            want = max_new.get(s, self.gamma)
            room = self.max_model_len - self.slots[s].start - 1
            out[s] = int(max(0, min(k, self.gamma - 1, want - 1, room)))
        return out

    def step(
        self,
        slot_list: list[int],
        max_new: dict[int, int] | None = None,
        num_drafts: dict[int, int] | None = None,
        no_propose: Collection[int] = (),
        prefill: Mapping[int, int] | None = None,
    ) -> dict[int, StepResult]:
        """One step over `slot_list` (see `engine.interface.StepRunner.step`) in one device call (see the module
        docstring for the catch-up): a speculative step (propose, verify, accept, context write) when any slot
        verifies drafts, else a plain decode step with no drafter work. Slots in `no_propose` decode plainly.
        `prefill`: prefilling slots and the most prompt tokens each prefills in the same call (a mixed step,
        `step._mixed`); their results are those of `prefill_step` (the first token once the prompt is done).
        `collect(dispatch(...))`."""
        return self.collect(self.dispatch(slot_list, max_new, num_drafts, no_propose, prefill))

    def dispatch(
        self,
        slot_list: list[int],
        max_new: dict[int, int] | None = None,
        num_drafts: dict[int, int] | None = None,
        no_propose: Collection[int] = (),
        prefill: Mapping[int, int] | None = None,
    ) -> StepHandle:
        """Plan and launch the step `step` describes without reading its outputs (`collect` does). It may run while
        earlier steps are not collected: a slot's position is then only bounded (`_Slot.ahead`), so its drafts are
        capped by the room its position may have left, the step's KV bucket covers the bound and its pages were grown
        for it (`grow`). `max_new` may overstate what a slot still wants (extra tokens are the caller's to drop).
        A prompt whose chunks were all dispatched waits for its first token (`collect`) before it decodes."""
        prefill = {
            s: n for s, n in (prefill or {}).items() if s in self.prefilling and n > 0 and self.prompt_left(s) > 0
        }
        if not slot_list:
            if not prefill:
                return StepHandle([], [], {}, False, {})
            return StepHandle([], [], {}, False, {}, pre=self.prefill_step(list(prefill)))
        max_new = max_new or {}
        # sampling rows first (`_sampled_rows`); results are keyed by slot
        slot_list = sorted(slot_list, key=lambda s: self.slots[s].sampling.temperature <= 0)
        k = self.num_drafts(slot_list, max_new, num_drafts)
        for s in no_propose:
            if s in k:
                k[s] = 0
        depth = max(k.values())
        spec = self.speculative and depth > 0
        gram = {i: self.grammars[s] for i, s in enumerate(slot_list) if s in self.grammars}
        narrow = self._narrow()
        # the mixed program applies no token masks: with a grammar row the chunks go in a call of their own
        separate = bool(prefill) and (not narrow or bool(gram or any(s in self.grammars for s in prefill)))
        # a mixed step verifies at the full width (its rows' own draft counts inside): two decode widths to compile
        full = not narrow or (prefill and not separate)
        width = (self.gamma if full else bucket(1 + depth, self.widths)) if spec else 1
        st = [self.slots[s] for s in slot_list]
        want_lp = any(x.sampling.logprobs is not None for x in st)
        if want_lp:
            width = max(width, LOGPROBS_MIN_WIDTH)
        width = max(width, self.min_width)
        short = self.grow(list(slot_list))
        if short:
            raise OutOfPages(
                f"the KV pool cannot grow slots {short} ({self.pages.free} free pages); the engine preempts a "
                "sequence before this (`grow`)"
            )
        kv_len = bucket(max(x.start + x.ahead for x in st) + width, self.kv_buckets)
        if self.deterministic:
            kv_len = self.capacity
        static = {"width": width, "kv_len": kv_len, "speculative": spec}
        # at the full width only: narrower ragged steps measured no cheaper on CPU (`benchmarks/ragged_verify_cost.py`)
        ragged_ok = spec and width == self.gamma and narrow and not (prefill or gram or want_lp)
        split = None
        if ragged_ok and self.ragged_buckets is not None:
            split = ragged_split(len(slot_list), sum(k[s] > 0 for s in slot_list), self.batch_buckets)
        rows = None
        if split is not None:  # the drafting rows first, then the plain ones, each group padded (`ragged_split`)
            drafting, plain = [s for s in slot_list if k[s] > 0], [s for s in slot_list if k[s] == 0]
            ragged = {
                **static,
                "sampled": self._sampled_rows([self.slots[s].sampling for s in drafting], split[0]),
                "plain_rows": split[1],
                "plain_sampled": self._sampled_rows([self.slots[s].sampling for s in plain], split[1]),
            }
            padded = drafting + [self.scratch] * (split[0] - len(drafting)) + plain
            padded += [self.scratch] * (sum(split) - len(padded))
            placed = [*range(len(drafting)), *range(split[0], split[0] + len(plain))]
            arrays = self._step_arrays(padded, placed, [k[s] for s in drafting + plain], kv_len, want_lp)
            # keyed as the step plan will run: with the unconstrained mask inputs `_grammar_masks` adds below
            if self._ragged_ready(StepPlan("step", {**arrays, **self._mask_inputs(len(padded), width, {})}, ragged)):
                static, slot_list, slots, rows = ragged, drafting + plain, padded, placed
                st = [self.slots[s] for s in slot_list]
            else:
                split = None
        if split is None:
            slots = self._pad(list(slot_list))
            static["sampled"] = self._sampled_rows([x.sampling for x in st], len(slots))
            arrays = self._step_arrays(slots, range(len(slot_list)), [k[s] for s in slot_list], kv_len, want_lp)
        late = [s for s in slot_list if s in self.grammars and self.slots[s].ahead]
        if late:
            raise RuntimeError(f"constrained slots {late} step before their previous step is collected")
        t0 = time.perf_counter()  # a step's time includes its catch-up
        # a drafting row's pending taps go into the drafter context first; a plain row's once its buffer is full
        drafts_now = [spec and (split is None or k[s] > 0) for s in slot_list]  # rows the drafter context follows
        if self.speculative and any(
            x.lag > 0 if d else x.lag >= self.pending_size for x, d in zip(st, drafts_now, strict=True)
        ):
            # the pending taps into the drafter context first (`step._catch_up`)
            self._run(StepPlan("catch_up", {k: arrays[k] for k in ("slot_ids", "page_table")}))
            for x in st:
                x.lag = 0
        h = StepHandle(slot_list, st, k, spec, {}, t0=t0, rows=rows)
        if separate:
            h.pre = self._prefill(self._prefill_call(prefill))
            prefill = {}
        if prefill:
            call = self._prefill_call(prefill, (MIXED_CHUNK, *(b for b in self.kv_buckets if b > MIXED_CHUNK)))
            plan = StepPlan(
                "mixed",
                {**arrays, **{MIXED_PREFILL + k: v for k, v in call.arrays.items()}},
                {**static, **{MIXED_PREFILL + k: v for k, v in call.static.items()}},
            )
            h.out, h.call = self._run(plan), call
            self._advance(call)
        else:
            arrays.update(self._grammar_masks(gram, slot_list, k, arrays, width, kv_len, spec))
            h.out = self._run(StepPlan("step", arrays, static))
        h.launched = time.perf_counter()
        for s, x, d in zip(slot_list, st, drafts_now, strict=True):
            x.ahead += k[s] + 1
            x.lag = 0 if d else x.lag + 1
            h.lag[s] = x.lag
        if self._planner is None:
            for leaf in jax.tree.leaves(h.out):
                if isinstance(leaf, jax.Array):
                    leaf.copy_to_host_async()  # the read `collect` makes starts when the step is done
            if self.timing:
                if self._watch is None:
                    self._watch = ThreadPoolExecutor(1, thread_name_prefix="dflash-step-watch")
                h.ready = self._watch.submit(_ready_at, h.out)
        return h

    def collect(self, h: StepHandle) -> dict[int, StepResult]:
        """Read a dispatched step's outputs (the one host read of a step: accepted counts, bonus tokens, drafts and
        the log-probabilities asked for), bring the host's slot mirrors up to date and return the step's results.
        Steps are collected in the order they were dispatched. Rows of slots released since are skipped."""
        if h.out is None:
            return h.pre
        if h.call is not None:
            (accepted, bonus, drafts, lp), pout = jax.device_get(h.out)
            pre = self._prefill_results(h.call, pout)
        else:
            accepted, bonus, drafts, lp = jax.device_get(h.out)
            pre = h.pre
        if self.timing:
            (self.times.spec_ms if h.spec else self.times.plain_ms).append((time.perf_counter() - h.t0) * 1e3)
            if h.ready is not None:
                self.times.launched.append(h.launched)
                self.times.ready.append(h.ready.result())
        rows = h.rows or range(len(h.slot_list))
        self.last_drafts = {s: drafts[r] for r, s in zip(rows, h.slot_list, strict=True)}
        out = {}
        for i, (r, s) in enumerate(zip(rows, h.slot_list, strict=True)):
            slot = self.slots.get(s)
            if slot is not h.slots[i]:
                continue
            a, k = int(accepted[r]), h.lookup.get(s, h.k[s])
            toks = [int(x) for x in drafts[r, :a]] + [int(bonus[r])]
            slot.ahead -= h.k[s] + 1
            slot.start += a + 1
            slot.ctx_end = slot.start - h.lag[s]
            slot.anchor = int(bonus[r])
            slot.tokens.extend(toks)
            if s in self.grammars:
                self.grammars[s].consume(toks)
            out[s] = StepResult(
                toks,
                num_drafts=k,
                num_accepted=a,
                accepted_mask=[j < a for j in range(k)],
                lookup=s in h.lookup,
                ragged=h.rows is not None,
            )
            if slot.sampling.logprobs is not None:
                out[s].logprobs = host_logprobs(lp, r, range(a + 1), slot.sampling.logprobs)
        out.update(pre)
        return out

    def _grammar_masks(self, gram: dict[int, Any], slot_list, k, arrays, width: int, kv_len: int, spec: bool):
        """The step's mask inputs (`_mask_inputs`) for its constrained rows `gram` (row -> matcher). A speculative
        step with such a row first runs the drafter alone (`propose`); while it runs on the device the host computes
        each constrained row's first mask (it depends only on the committed tokens); then each such row's drafts are
        re-chosen under its grammar (`draft_choice.choose_drafts`) and the step verifies that proposal under the
        walk's masks. A row whose walk ends early verifies fewer drafts: its entries of `k` and
        `arrays["num_drafts"]` are lowered in place. With `timing`, the host's grammar time goes to `times`."""
        b = len(arrays["slot_ids"])
        if not gram:
            return self._mask_inputs(b, width, {})
        if not spec:
            t0 = time.perf_counter()
            rows = {i: np.broadcast_to(g.mask(), (width, self.mask_words)) for i, g in gram.items()}
            self._grammar_time(time.perf_counter() - t0, 0.0)
            return self._mask_inputs(b, width, rows)
        plan = StepPlan(
            "propose", {n: arrays[n] for n in ("slot_ids", "page_table")}, {"width": width, "kv_len": kv_len}
        )
        proposal = self._run(plan)  # dispatched: the device proposes while the host computes the first masks
        t0 = time.perf_counter()
        first = {i: g.mask() for i, g in gram.items()}
        overlapped = time.perf_counter() - t0
        drafts, q, extra = jax.device_get(proposal)
        t1 = time.perf_counter()
        drafts = np.array(drafts, np.int32)
        ids, qs = (np.asarray(q[0]), np.array(q[1])) if q is not None else (None, None)
        rows = {}
        for i, g in gram.items():
            s = slot_list[i]
            row_q = None if q is None else (ids[i], qs[i])
            sampled = self.slots[s].sampling.temperature > 0
            c = choose_drafts(g, k[s], width, first[i], drafts[i], np.asarray(extra[i]), row_q, sampled)
            drafts[i], rows[i] = c.drafts, c.masks
            if c.q is not None:
                qs[i] = c.q
            k[s] = min(k[s], c.n)
            arrays["num_drafts"][i] = k[s]
        out = {"proposal": drafts}
        if q is not None:
            out.update(proposal_ids=ids, proposal_q=qs)
        self._grammar_time(overlapped + time.perf_counter() - t1, overlapped)
        return {**out, **self._mask_inputs(b, width, rows)}

    def _grammar_time(self, total_s: float, overlapped_s: float) -> None:
        if self.timing:
            self.times.grammar_ms.append(total_s * 1e3)
            self.times.grammar_overlapped_ms.append(overlapped_s * 1e3)

    def lookup_slots(self, slots: list[int]) -> set[int]:
        """No prompt lookup: every draft is the drafter's (`HybridRunner` overrides this)."""
        return set()

    def release(self, slot: int) -> None:
        """Free the slot and its pages; the full pages of its committed tokens stay findable by the prefix cache
        until evicted."""
        s = self.slots.pop(slot, None)
        self.prefilling.pop(slot, None)
        self.grammars.pop(slot, None)
        self._cached.pop(slot, None)
        if s is not None and not self._warming:
            self.pages.commit(slot, s.tokens, min(s.start, s.ctx_end))
        self.pages.free_seq(slot)

    # ------------------------------------------------------------------------------------------- start-up
    def warmup(self, kv_levels: int = 2, threads: int | None = None, background: bool = False) -> CompileCounts:
        """Compile the common shapes: every batch bucket x the first `kv_levels` length buckets, for the prefill,
        the plain step, the drafter's catch-up, the speculative step at each verify width (`self.widths`), the
        ragged verifies of the bucket (`ragged_split`: a drafting group at the full width, the other rows plain; up
        to `RAGGED_WARM_ROWS` rows, the last length only), and the mixed steps (a decode step carrying the chunks of
        one or of two prompts, plain and at the full width) of each batch bucket below `max_slots`. A planning pass
        drives the calls of dummy prompts without running them, smallest batch bucket first; each call is traced
        and lowered as it comes and compiled on `threads` threads (default: every CPU,
        `compilation.compile_threads`) while the next is traced; later calls of those shapes run the compiled
        executables.

        With `background`, only the prefill, plain and full-width programs are planned here, and it returns once
        the smallest batch bucket's are compiled; the other buckets' go on compiling in the background (a step that
        needs one of those waits for its compile; `CompileCounts.background` counts them), and the narrower widths
        and the mixed steps are left to `warm_more`, which the engine calls while it has nothing to run (until
        they are compiled, a step runs at the full width and a prompt's chunks prefill in calls of their own, so
        no step waits for them). Under a multi-host `plan_hook` the warm-up makes the real calls instead (the
        followers compile as they replay them). Rarer shapes compile on first use: the log-probability steps'
        width, batches with sampling rows, mixed steps carrying more than two prompts or a prompt past the first
        length bucket, whole-prompt prefills for prompt log-probabilities. Returns what it compiled."""
        self._warming = self._warmed = True
        waiting = 0
        deferred = background and self.plan_hook is None
        try:
            with CompileMeter() as meter:
                if self.plan_hook is not None:
                    self._warmup(kv_levels)
                else:
                    first: list[set] = []  # the smallest batch bucket's programs

                    def plan(planner: Precompiler) -> None:
                        def bucket_done(_: int) -> None:
                            if not first:
                                first.append(set(planner.planned))

                        self._warmup(kv_levels, bucket_done, rest=not deferred)

                    _, ready = self._plan(plan, threads, lambda key: not (background and first) or key in first[0])
                    waiting = sum(not e.ready for e in ready.values())
        finally:
            self._warming = False
        if deferred:
            self._deferred = self._warmup_units(kv_levels, first=False)
            self._deferred_threads = threads
        return dataclasses.replace(meter.counts, background=waiting)

    def warm_more(self) -> bool:
        """Plan one more part of a background warm-up's narrower widths and mixed steps (one batch bucket and
        length), their compiles queued in the background; the engine calls it while no sequence runs. False once
        nothing is left."""
        units = self._deferred
        if units is None or self.slots or self.prefilling:
            return False
        self._warming = True
        try:
            more, ready = self._plan(lambda _: next(units, None) is not None, self._deferred_threads, lambda _: False)
            self._deferred_keys += list(ready)
        finally:
            self._warming = False
        if not more:
            self._deferred = None
        return more

    def _plan(
        self, calls: Callable[[Precompiler], _T], threads: int | None, wait: Callable[[Hashable], bool]
    ) -> tuple[_T, dict[Hashable, Executable]]:
        """Plan the warm-up calls `calls(planner)` makes (traced, lowered and compiled on `threads` threads, not run)
        and record their executables, waiting for the compiles whose keys `wait` accepts (the others go on in the
        background). Returns (what `calls` returned, the new executables)."""
        with Precompiler(self.programs.executables, threads) as planner:
            self._planner = planner
            try:
                out = calls(planner)
            finally:
                self._planner = None
            ready = planner.finish(wait)
        self.programs.executables.update(ready)
        return out, ready

    def _narrow(self) -> bool:
        """May a step run at a narrower verify width, as a ragged verify or carry prompt chunks? Not until a
        background warm-up's rest (`warm_more`) is planned and compiled: until then steps run every row at the full
        width and chunks prefill apart."""
        if self._warming:
            return True
        if self._deferred is not None:
            return False
        if self._deferred_keys:
            if not all(self.programs.executables[k].ready for k in self._deferred_keys):
                return False
            self._deferred_keys = []
        return True

    def _warmup(self, kv_levels: int, bucket_done: Callable[[int], object] | None = None, rest: bool = True) -> None:
        """Every batch bucket's prefill, plain and full-width steps (`bucket_done` after each bucket), then, with
        `rest`, every bucket's narrower widths and mixed steps."""
        for _ in self._warmup_units(kv_levels, first=True, bucket_done=bucket_done):
            pass
        for _ in self._warmup_units(kv_levels, first=False) if rest else ():
            pass

    def _step_arrays(self, slots: list[int], rows, drafts: list[int], kv_len: int, want_lp: bool) -> dict:
        """A step's host inputs for the padded row list `slots`: `drafts[j]` drafts for the row at `rows[j]`."""
        nd = np.zeros((len(slots),), np.int32)
        nd[list(rows)] = drafts
        return {
            "slot_ids": np.asarray(slots, np.int32),
            "page_table": self._tables(slots, kv_len),
            "num_drafts": nd,
            "want_logprobs": np.asarray(want_lp),
        }

    def _ragged_ready(self, plan: StepPlan) -> bool:
        """May this ragged verify run? After a planned warm-up, only from a program it compiled (a server never
        stalls on one: the step then runs every row at one width); without one (or under a multi-host `plan_hook`,
        whose warm-up makes real calls), as every shape, compiled on first use."""
        if not self._warmed or self._warming or self.plan_hook is not None:
            return True
        return all(self._plan_key(p) in self.programs.executables for p in self._variants(plan))

    def _variants(self, plan: StepPlan) -> list[StepPlan]:
        """The plans a step plan may run as (a subclass that adds draft inputs in `_run` names its forms)."""
        return [plan]

    def _ragged_units(self, b: int) -> list[int]:
        """Drafting-row counts of a batch of `b` rows, one per ragged verify layout of its bucket (`ragged_split`),
        for buckets up to `RAGGED_WARM_ROWS` rows."""
        if self.ragged_buckets is None or b > RAGGED_WARM_ROWS:
            return []
        layouts = {ragged_split(b, d, self.batch_buckets): d for d in range(b - 1, 0, -1)}
        return sorted(d for split, d in layouts.items() if split is not None)

    def _warmup_units(
        self, kv_levels: int, first: bool, bucket_done: Callable[[int], object] | None = None
    ) -> Iterator[int]:
        """The warm-up's calls for each batch bucket and prompt length in turn (yielding after each): the prefill,
        plain and full-width steps (`first`), else the narrower widths, the ragged verifies and the mixed steps."""
        plens = [4] + [self.kv_buckets[level] + 1 for level in range(min(kv_levels, len(self.kv_buckets)) - 1)]
        full = self.widths[-1:] if self.speculative else ()
        for b in self.batch_buckets:
            for plen in plens:
                if plen + 2 * self.gamma + 4 >= self.max_model_len:
                    break
                slots = list(range(b))
                self.add_many([(s, [1] * plen, SamplingParams()) for s in slots])
                while self.prefilling:
                    self.prefill_step()
                self.step(slots, {s: 2 for s in slots}, {s: 0 for s in slots})  # plain: one pending row
                widths = full if first else self.widths[1:-1] if self.speculative else ()
                for w in widths:  # catch-up, then the speculative widths
                    self.step(slots, {s: w for s in slots}, {s: w - 1 for s in slots})
                ragged = () if first or plen != plens[-1] else self._ragged_units(b)
                for d in ragged:  # d rows drafting, the others plain
                    self.step(slots, {s: self.gamma for s in slots}, {s: self.gamma - 1 if s < d else 0 for s in slots})
                mixed = () if first or b == self.max_slots else sorted({0, self.gamma - 1})
                for depth, arriving in itertools.product(mixed, (1, 2)):
                    # one or two prompts arrive: their chunks carried by a plain and a speculative step
                    if b + arriving > self.max_slots:
                        continue
                    new = list(range(b, b + arriving))
                    self.admit([(s, [1] * 4, SamplingParams()) for s in new])
                    chunks = {s: 4 for s in new}
                    self.step(slots, {s: depth + 1 for s in slots}, {s: depth for s in slots}, prefill=chunks)
                    for s in new:
                        self.release(s)
                for s in slots:
                    self.release(s)
                yield b
            if first and bucket_done is not None:
                bucket_done(b)
