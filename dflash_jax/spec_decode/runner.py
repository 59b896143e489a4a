"""The device-side runner: owns params, caches and the jitted steps; implements `engine.interface.StepRunner`.

Host state per slot is tiny (anchor token, start position, sampling params); drafts stay on device between
propose and verify. One host sync per step: reading the accepted counts, bonus tokens and the verified drafts (and,
when a row of the step asks for them, the emitted tokens' log-probabilities, `spec_decode.logprobs`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dflash_jax.config import TargetConfig
from dflash_jax.errors import UserError
from dflash_jax.models.drafter import DrafterModel, init_drafter_cache
from dflash_jax.models.target import TargetModel, init_kv_cache
from dflash_jax.spec_decode import step as steps
from dflash_jax.spec_decode.dflash2 import init_draft_q, propose2
from dflash_jax.spec_decode.logprobs import Logprobs
from dflash_jax.spec_decode.placement import place_runner
from dflash_jax.spec_decode.plan import StepPlan
from dflash_jax.spec_decode.sampling import SamplingArrays
from dflash_jax.types import MAX_TOP_LOGPROBS, SamplingParams, StepResult, TokenLogprob

DEFAULT_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
MIN_KV_BUCKET = 128
# A step that computes log-probabilities verifies at least this many rows (an unused row after the anchor when no
# row drafts): XLA lowers a one-row forward to other kernels than a block's, whose float rounding differs in the last
# bits, so without it a token's log-probability would depend on whether it was decoded alone or verified in a block.
LOGPROBS_MIN_WIDTH = 2


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


def _to_host(lp: Logprobs | None) -> Logprobs | None:
    return None if lp is None else Logprobs(*(np.asarray(a) for a in lp))


def check_logprobs(sampling: SamplingParams) -> None:
    for name in ("logprobs", "prompt_logprobs"):
        n = getattr(sampling, name)
        if n is not None and not 0 <= n <= MAX_TOP_LOGPROBS:
            raise UserError(f"{name} must be between 0 and {MAX_TOP_LOGPROBS}, got {n}", param=name)


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
    anchor: int
    start: int  # absolute position of the anchor (its target KV is not written yet)
    prompt_len: int


@dataclass
class StepTimes:
    """Wall-clock phase times (ms) collected when `timing=True` (benchmarks only: it adds syncs)."""

    verify_ms: list[float] = field(default_factory=list)
    draft_ms: list[float] = field(default_factory=list)
    prefill_ms: list[float] = field(default_factory=list)


class SpecRunner:
    """Batched DFlash speculative decoding (or plain decoding when `drafter` is None)."""

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
    ):
        self.cfg: TargetConfig = target.cfg
        self.max_slots = max_slots
        self.max_model_len = max_model_len
        self.speculative = drafter is not None
        if drafter is not None:
            gamma = gamma or drafter.cfg.block_size
            if gamma < 2:
                raise UserError(
                    "--dflash-gamma must be at least 2 (1 anchor + at least one draft)", param="--dflash-gamma"
                )
        self.gamma = gamma if drafter is not None else 1
        self.capacity = max_model_len + self.gamma + 1
        self.kv_buckets = kv_ladder(self.capacity)
        self.batch_buckets = tuple(b for b in batch_buckets if b < max_slots) + (max_slots,)
        self.skip_propose = False  # benchmarks: time plain steps without the drafter
        self.timing = timing
        self.times = StepTimes()
        self.tgraph, self.tstate = nnx.split(target)
        self.embed = target.embed[...]
        self.lm_head = target.lm_head[...]
        # The drafter's copy of the LM head: quantized per --draft-weight-quantization, else the target's.
        self.draft_lm_head = draft_lm_head if draft_lm_head is not None else self.lm_head
        n = max_slots + 1  # + one scratch slot for batch padding
        self.scratch = max_slots
        self.tcache = init_kv_cache(self.cfg, n, self.capacity)
        if drafter is not None:
            self.dgraph, self.dstate = nnx.split(drafter)
            self.capture = tuple(drafter.cfg.target_layer_ids)
            self.dcache = init_drafter_cache(drafter.cfg, n, self.capacity)
            self.drafts_buf = jnp.zeros((n, self.gamma - 1), jnp.int32)
        else:
            self.dgraph, self.dstate, self.capture, self.dcache = None, None, (), None
            self.drafts_buf = jnp.zeros((n, 1), jnp.int32)  # one padding column (see `LOGPROBS_MIN_WIDTH`)
        self.draft_q = init_draft_q(drafter, n, self.gamma)  # DFlash2: the walk's q per draft, or None
        self.slots: dict[int, _Slot] = {}
        # --- tensor parallelism (dflash_jax.parallel): weights and caches onto the mesh ------------------------
        self.mesh, self.draft_tp, self.propose_fn = mesh, 1, steps.propose
        self.propose2_fn = propose2  # DFlash2; drafter TP swaps in dflash2.propose2_tp
        if mesh is not None:
            place_runner(self, mesh, draft_tp)
        # --- end tensor parallelism ---------------------------------------------------------------------------
        # Multi-host (dflash_jax.spec_decode.multihost): every jitted step goes through `_run(plan)`; on rank 0 the
        # hook broadcasts the plan to the followers, which `apply_plan` it to their own runner.
        self.plan_hook: Callable[[StepPlan, Callable[[StepPlan], Any]], Any] | None = None

    # ------------------------------------------------------------------------------------------- helpers
    def _sampling(self, sps: list[SamplingParams]) -> tuple[dict[str, np.ndarray], bool]:
        """Host arrays of `SamplingArrays` (by field name) and whether every row is greedy."""
        greedy = all(sp.temperature <= 0 for sp in sps)
        arr = {
            "temperature": np.asarray([sp.temperature for sp in sps], np.float32),
            "top_k": np.asarray([sp.top_k for sp in sps], np.int32),
            "top_p": np.asarray([sp.top_p for sp in sps], np.float32),
            "seed": np.asarray([(sp.seed or 0) & 0xFFFFFFFF for sp in sps], np.uint32),
        }
        return arr, greedy

    def _pad(self, slots: list[int]) -> tuple[list[int], int]:
        b = bucket(len(slots), self.batch_buckets)
        return slots + [self.scratch] * (b - len(slots)), b

    def _sync(self, x):
        if self.timing:
            jax.block_until_ready(x)

    # ------------------------------------------------------------------------------------------- StepRunner
    def add(self, slot: int, prompt_ids: list[int], sampling: SamplingParams) -> StepResult:
        return self.add_many([(slot, prompt_ids, sampling)])[slot]

    def add_many(self, items: list[tuple[int, list[int], SamplingParams]]) -> dict[int, StepResult]:
        """Prefill several new sequences in one call (padded to a common length bucket)."""
        for slot, ids, spar in items:
            check_logprobs(spar)
            if not 0 <= slot < self.max_slots:
                raise ValueError(f"slot {slot} out of range")
            if not ids:
                raise UserError("the prompt is empty", param="prompt")
            if len(ids) >= self.max_model_len:
                raise UserError(
                    f"the prompt has {len(ids)} tokens; the maximum context length is {self.max_model_len}",
                    param="prompt",
                )
        t = bucket(max(len(ids) for _, ids, _ in items), self.kv_buckets)
        slots, _ = self._pad([s for s, _, _ in items])
        tokens = np.zeros((len(slots), t), np.int32)
        lengths = np.ones((len(slots),), np.int32)
        sps = [sp for _, _, sp in items] + [SamplingParams()] * (len(slots) - len(items))
        for i, (_, ids, _) in enumerate(items):
            tokens[i, : len(ids)] = ids
            lengths[i] = len(ids)
        sp, greedy = self._sampling(sps)
        want_lp = any(x.logprobs is not None for x in sps)
        want_plp = any(x.prompt_logprobs is not None for x in sps)
        t0 = time.perf_counter()
        first, first_lp, prompt_lp = self._run(
            StepPlan(
                "prefill",
                {"slot_ids": np.asarray(slots, np.int32), "tokens": tokens, "lengths": lengths, **sp},
                {"greedy": greedy, "logprobs": want_lp, "prompt_logprobs": want_plp},
            )
        )
        first = np.asarray(first)
        first_lp, prompt_lp = _to_host(first_lp), _to_host(prompt_lp)
        if self.timing:
            self.times.prefill_ms.append((time.perf_counter() - t0) * 1e3)
        out = {}
        for i, (slot, ids, spar) in enumerate(items):
            self.slots[slot] = _Slot(spar, int(first[i]), len(ids), len(ids))
            out[slot] = StepResult([int(first[i])])
            if spar.logprobs is not None:
                out[slot].logprobs = host_logprobs(first_lp, i, range(1), spar.logprobs)
            if spar.prompt_logprobs is not None:
                out[slot].prompt_logprobs = host_logprobs(prompt_lp, i, range(len(ids) - 1), spar.prompt_logprobs)
        if self.speculative:
            self._propose([s for s, _, _ in items])
        return out

    def _propose(self, slot_list: list[int]) -> None:
        slots, _ = self._pad(slot_list)
        anchor = [self.slots[s].anchor if s in self.slots else 0 for s in slots]
        start = [self.slots[s].start if s in self.slots else 0 for s in slots]
        kv_len = bucket(max(start) + 1, self.kv_buckets)
        t0 = time.perf_counter()
        arrays = {
            "slot_ids": np.asarray(slots, np.int32),
            "anchor": np.asarray(anchor, np.int32),
            "start": np.asarray(start, np.int32),
        }
        if self.draft_q is not None:  # --- DFlash2: the selector walk samples at each row's T ---
            sp, _ = self._sampling([self.slots[s].sampling if s in self.slots else SamplingParams() for s in slots])
            arrays.update(sp)
        self._run(StepPlan("propose", arrays, {"kv_len": kv_len}))
        if self.timing:
            self._sync(self.drafts_buf)
            self.times.draft_ms.append((time.perf_counter() - t0) * 1e3)

    # ------------------------------------------------------------------------------------------- jitted steps
    def _run(self, plan: StepPlan) -> Any:
        """Every jitted step goes through here (rank 0 of a multi-host run broadcasts `plan` in `plan_hook`)."""
        if self.plan_hook is not None:
            return self.plan_hook(plan, self.apply_plan)
        return self.apply_plan(plan)

    def apply_plan(self, plan: StepPlan) -> Any:
        """Run one jitted step from its host inputs: update the device state (caches, drafts) and return the step's
        device outputs (prefill: first tokens and the `Logprobs` asked for (else None); verify: accepted, bonus,
        drafts, `Logprobs` or None; propose: None). Pure replay: it
        reads no host slot state, so a multi-host follower calls it with rank 0's plans."""
        a = {k: jnp.asarray(v) for k, v in plan.arrays.items()}
        st = plan.static
        sp = SamplingArrays(a["temperature"], a["top_k"], a["top_p"], a["seed"]) if "seed" in a else None
        if plan.kind == "prefill":
            first, first_lp, prompt_lp, self.tcache, self.dcache = steps.prefill(
                self.tgraph,
                self.tstate,
                self.dgraph,
                self.dstate,
                self.tcache,
                self.dcache,
                a["slot_ids"],
                a["tokens"],
                a["lengths"],
                sp,
                capture=self.capture,
                greedy=bool(st["greedy"]),
                logprobs=bool(st.get("logprobs", False)),
                prompt_logprobs=bool(st.get("prompt_logprobs", False)),
            )
            return first, first_lp, prompt_lp
        if plan.kind == "propose" and self.draft_q is not None:  # DFlash2
            self.drafts_buf, self.draft_q = self.propose2_fn(
                self.embed,
                self.draft_lm_head,
                self.dgraph,
                self.dstate,
                self.dcache,
                self.drafts_buf,
                self.draft_q,
                a["slot_ids"],
                a["anchor"],
                a["start"],
                sp,
                kv_len=int(st["kv_len"]),
                width=self.gamma,
            )
            return None
        if plan.kind == "propose":
            self.drafts_buf = self.propose_fn(
                self.embed,
                self.draft_lm_head,
                self.dgraph,
                self.dstate,
                self.dcache,
                self.drafts_buf,
                a["slot_ids"],
                a["anchor"],
                a["start"],
                kv_len=int(st["kv_len"]),
                width=self.gamma,
            )
            return None
        if plan.kind == "verify":
            accepted, bonus, drafts, lp, self.tcache, self.dcache = steps.verify(
                self.tgraph,
                self.tstate,
                self.dgraph,
                self.dstate,
                self.tcache,
                self.dcache,
                self.drafts_buf,
                a["slot_ids"],
                a["anchor"],
                a["start"],
                a["num_drafts"],
                sp,
                capture=self.capture,
                kv_len=int(st["kv_len"]),
                width=int(st["width"]),
                greedy=bool(st["greedy"]),
                logprobs=bool(st.get("logprobs", False)),
                draft_q=self.draft_q,  # DFlash2
            )
            return accepted, bonus, drafts, lp
        raise ValueError(f"unknown step plan kind {plan.kind!r}")

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
    ) -> dict[int, StepResult]:
        """One verify step over `slot_list` (see `engine.interface.StepRunner.step`), then the next block's
        drafts for every slot with room left, except those in `no_propose`."""
        if not slot_list:
            return {}
        max_new = max_new or {}
        k = self.num_drafts(slot_list, max_new, num_drafts)
        width = 1 + max(k.values())
        slots, _ = self._pad(list(slot_list))
        st = [self.slots.get(s) for s in slots]
        anchor = [x.anchor if x else 0 for x in st]
        start = [x.start if x else 0 for x in st]
        nd = [k.get(s, 0) for s in slots]
        sp, greedy = self._sampling([x.sampling if x else SamplingParams() for x in st])
        want_lp = any(x is not None and x.sampling.logprobs is not None for x in st)
        if want_lp:
            width = max(width, LOGPROBS_MIN_WIDTH)
        kv_len = bucket(max(start) + width, self.kv_buckets)
        t0 = time.perf_counter()
        accepted, bonus, drafts, lp = self._run(
            StepPlan(
                "verify",
                {
                    "slot_ids": np.asarray(slots, np.int32),
                    "anchor": np.asarray(anchor, np.int32),
                    "start": np.asarray(start, np.int32),
                    "num_drafts": np.asarray(nd, np.int32),
                    **sp,
                },
                {"kv_len": kv_len, "width": width, "greedy": greedy, "logprobs": want_lp},
            )
        )
        accepted, bonus, drafts, lp = np.asarray(accepted), np.asarray(bonus), np.asarray(drafts), _to_host(lp)
        verify_ms = (time.perf_counter() - t0) * 1e3
        if self.timing:
            self.times.verify_ms.append(verify_ms)
        out = {}
        for i, s in enumerate(slot_list):
            a = int(accepted[i])
            toks = [int(x) for x in drafts[i, :a]] + [int(bonus[i])]
            slot = self.slots[s]
            slot.start += a + 1
            slot.anchor = int(bonus[i])
            out[s] = StepResult(toks, num_drafts=nd[i], num_accepted=a, accepted_mask=[j < a for j in range(nd[i])])
            if slot.sampling.logprobs is not None:
                out[s].logprobs = host_logprobs(lp, i, range(a + 1), slot.sampling.logprobs)
        if self.speculative and not self.skip_propose:
            live = [s for s in slot_list if self.slots[s].start < self.max_model_len and s not in no_propose]
            if live:
                self._propose(live)
        return out

    def release(self, slot: int) -> None:
        self.slots.pop(slot, None)

    # ------------------------------------------------------------------------------------------- start-up
    def warmup(self, kv_levels: int = 2) -> None:
        """Compile the common shapes (every batch bucket x the first `kv_levels` length buckets, the full verify
        width and the plain width) by driving real calls with dummy prompts; other shapes compile on first use."""
        plen = 4
        for level in range(min(kv_levels, len(self.kv_buckets))):
            for b in self.batch_buckets:
                if plen + self.gamma + 2 >= self.max_model_len:
                    break
                slots = list(range(b))
                self.add_many([(s, [1] * plen, SamplingParams()) for s in slots])
                self.step(slots, {s: self.gamma for s in slots})
                self.step(slots, {s: 1 for s in slots})
                for s in slots:
                    self.release(s)
            plen = self.kv_buckets[level] + 1
