"""The per-step speculation controller the engine calls: how many drafts each active sequence verifies.

Host-side, pure Python, deterministic. Build it once at start-up and drive it from the engine loop::

    ctl = Controller.from_flags(
        adaptive_k=args.dflash_adaptive_k,      # "0:32,1:44,2:50,3:56" or None
        draft_ladder=args.dflash_draft_ladder,  # "1:7,2:5,4:3" or None
        gamma=args.dflash_gamma,                # pinned γ or None
        block_size=drafter_cfg.block_size,      # γ defaults to min(block + 2, 15)
        has_drafter=drafter is not None,        # the flags are refused without a drafter
    )                                           # every bad value raises UserError naming its flag
    # compile draft-count buckets 0..ctl.max_drafts (γ - 1)
    while running:
        plan = ctl.decide(active_ids)           # {seq_id: drafts}; 0 = plain decode for that sequence
        ... run the step: sequence s verifies plan[s] drafts (the step's depth is max(plan.values())) ...
        for s in active_ids:
            ctl.observe(s, plan[s], accepted[s])   # accepted count, or the per-draft accept mask
        ctl.observe_step_time(len(active_ids), max(plan.values()), step_ms)   # calibration
        for s in finished_ids:
            ctl.release(s)

Call `observe` for *every* sequence of every step, plain steps included (``num_drafts = 0``): plain steps are
how a suspended sequence counts its way back to speculation. Only a `decide` that returns 0 suspends; a plain
step the engine runs on its own (e.g. to measure the step cost) does not. Sequence ids are any hashable.

Who decides (`Controller.mode`):

* ``"adaptive-k"`` (``--dflash-adaptive-k`` set): the cost model below.
* ``"ladder"`` (only ``--dflash-draft-ladder``): every sequence gets ``ladder(n_active)`` drafts.
* ``"rung"`` (neither): the rung resolver of `gamma.RungResolver` (``γ - 1`` when γ was pinned).

The adaptive-k cost model, per step of ``n`` active sequences:

* cap = the ladder rung for ``n`` (if a ladder is set) else ``γ - 1``; ``top = min(cap, priced max at n)``.
* Suspended sequences get 0. The others ("participants") share one depth ``k`` chosen among the priced depths
  ``lo..top`` (``lo = 1`` while any participant is in its re-probe window, else 0; with ``depths`` set, only those
  depths: the runner's compiled verify widths less one, so ``top`` is the deepest of them within the cap) by
  ``v(k) = agg_s E_s[tokens | k] / cost_ms(n, k)`` with ``agg = min`` (objective ``"latency"``, the reference's
  DFlash setting; at one sequence it is plain tokens per ms) or ``sum`` (``"throughput"``: the step's tokens per
  ms, so the rows decoding plainly in the step, suspended or not participating, add their one token each and a
  depth that slows them more than it gains on the others is not chosen; ``--dflash-objective``). Plain decode
  (``k = 0``, only with a ``0:`` entry) must beat every speculative depth by the 3% suspend margin
  (`choice.choose`). With no acceptance data at all the choice is ``top``.
* Full width (``decide(active, full_width=True)``: the engine's step carries prompt chunks, and such a step
  verifies at the runner's full width whatever its depth): the candidates are plain decoding and ``top`` alone,
  and a plain choice there holds for that step only (no suspension, no decision counted).
* Ragged verify (`use_ragged_verify(batch_buckets)`, the runner's ragged layouts): a full-width step whose
  drafting rows leave room in the batch bucket for the others (`kv.sizing.ragged_split`) runs those others at width 1,
  so it is priced as the plain step plus a share of the full-width step's extra cost, per layout (drafting group,
  plain group): ``sqrt(drafting group / batch)`` until that layout's steps are measured (``observe_step_time(...,
  drafting=)``), then learned with the calibration's ``alpha``; such steps do not move the table's scale.
* Exploration: each sequence counts its decisions; the first exploration is due at decision
  ``explore_every - 1`` and then verifies the next candidate depth above ``k`` (at most ``top``) for that
  sequence. The next one comes ``explore_every`` decisions later if the explored-from choice changed since the
  last exploration, else after ``min(2 * gap, explore_max)`` (back-off). ``k = 0`` never explores.
* Suspension: a chosen ``k = 0`` suspends the sequence: it gets 0 drafts until it has plain-decoded
  ``resume_after_tokens`` (256) tokens. Then it resumes: incumbent cleared, exploration reset, its counts
  multiplied by ``soften`` (0.25, so new evidence outweighs old) and ``probe_steps`` (16) observed steps of
  re-probe during which plain decode is not a candidate.
* Calibration: `observe_step_time` moves the cost model's per-width-bucket scale (alpha 0.1); steps of prompt-lookup
  drafts alone (no drafter block) have scales of their own, and a step whose participants are all lookup rows is
  priced with them.
* Prompt lookup (``decide(active, lookup=ids)``): a sequence whose drafts this step come from prompt lookup
  (`spec_decode.ngram`) instead of the drafter is priced with its own lookup acceptance (a second
  `AcceptanceModel`, fed by ``observe(..., lookup=True)``) and takes part even while its drafter is suspended: a
  copied span is worth speculating on in a sequence whose drafter does not pay. Its lookup steps explore deeper
  on their own schedule (``lookup_explore_every``, 4). A lookup sequence whose own best depth (its curve alone at
  this batch width) is plain decoding is not a participant: it gets 0 without holding the others back, and is
  never suspended. Instead its lookup counts age (multiplied by ``decay``) at each such step, so the serve-wide
  lookup prior weighs more again, and after ``lookup_explore_every`` such steps it probes: one step at the cap,
  the gap doubling after each probe (to ``explore_max``) and reset once its lookups pay. Without probes a
  serve-wide prior that learned "lookups do not pay" (from prose, where short suffixes recur by chance) would
  never see another lookup step.

Acceptance (`acceptance.AcceptanceModel`) is tracked in every mode: decay 0.95, serve-wide prior weight 4.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection, Hashable, Iterable, Sequence
from dataclasses import dataclass

from dflash_jax.errors import UserError
from dflash_jax.kv.sizing import ragged_split, verify_width_of, verify_widths

from .acceptance import AcceptanceModel, expected_tokens_curve, leading_accepts
from .choice import SUSPEND_MARGIN, choose
from .cost import DEFAULT_ALPHA, CostModel, parse_cost_model
from .gamma import RungResolver, require_drafter, resolve_gamma, validate_against_gamma
from .ladder import DraftLadder, parse_draft_ladder

OBJECTIVES = ("latency", "throughput")
OBJECTIVE_FLAG = "--dflash-objective"


@dataclass(frozen=True)
class ControlParams:
    """Controller settings; the defaults are the reference's DFlash controller configuration.

    `ControlParams.exact_port()` is the older fixed-cadence configuration (``explore_max = 16``, no re-probe
    window).
    """

    decay: float = 0.95
    prior_weight: float = 4.0
    cold_weight: float = 0.0
    cold_rates: tuple[float, ...] | None = None  # conditional rates of a fixed prior (used if cold_weight > 0)
    suspend_margin: float = SUSPEND_MARGIN
    deeper_margin: float = 0.0
    shallower_margin: float = 0.0
    explore_every: int = 16  # 0 = never explore
    explore_max: int = 256
    lookup_explore_every: int = 4  # the same for prompt-lookup steps (short copies: sooner; back-off to explore_max)
    resume_after_tokens: int = 256
    probe_steps: int = 16
    soften: float = 0.25
    calibration_alpha: float = DEFAULT_ALPHA
    objective: str = "latency"

    def __post_init__(self) -> None:
        if self.objective not in OBJECTIVES:
            raise ValueError(f"objective must be one of {OBJECTIVES}, not {self.objective!r}")
        if self.explore_every < 0 or (self.explore_every and self.explore_max < self.explore_every):
            raise ValueError("need explore_every >= 0 and explore_max >= explore_every")
        if self.lookup_explore_every < 0:
            raise ValueError("need lookup_explore_every >= 0")
        if self.resume_after_tokens < 1 or self.probe_steps < 0:
            raise ValueError("need resume_after_tokens >= 1 and probe_steps >= 0")
        if not 0.0 < self.soften <= 1.0:
            raise ValueError(f"soften must be in (0, 1], not {self.soften}")
        if min(self.suspend_margin, self.deeper_margin, self.shallower_margin) < 0:
            raise ValueError("margins must be >= 0")

    @classmethod
    def exact_port(cls, **overrides: object) -> ControlParams:
        settings: dict[str, object] = {"explore_max": 16, "probe_steps": 0}
        settings.update(overrides)
        return cls(**settings)  # type: ignore[arg-type]


@dataclass
class _SeqState:
    decisions: int = 0
    next_explore: float = math.inf
    gap: int = 0
    explored_from: int | None = None
    incumbent: int | None = None
    suspended: bool = False
    plain_tokens: int = 0
    probe_left: int = 0
    probe_gap: int = 0  # prompt lookup: plain lookup decisions between probes (doubles after each, to explore_max)


class Controller:
    """Per-step draft counts for the active sequences; see the module docstring for the protocol."""

    def __init__(
        self,
        gamma: int,
        *,
        cost: CostModel | None = None,
        ladder: DraftLadder | None = None,
        gamma_pinned: bool = False,
        params: ControlParams | None = None,
        rung: RungResolver | None = None,
        depths: Collection[int] | None = None,
    ):
        validate_against_gamma(gamma, ladder=ladder, cost=cost)
        self.gamma = gamma
        # adaptive-k's candidate depths: those the runner compiles a verify width for (None: every priced depth)
        self.depths = None if depths is None else frozenset(depths) | {0, 1}
        self.cost = cost
        self.ladder = ladder
        self.params = params or ControlParams()
        p = self.params
        self.acceptance = AcceptanceModel(
            decay=p.decay, prior_weight=p.prior_weight, cold_weight=p.cold_weight, cold_rates=p.cold_rates
        )
        self.lookup_acceptance = AcceptanceModel(decay=p.decay, prior_weight=p.prior_weight)
        if cost is None and ladder is None:
            self.rung: RungResolver | None = rung or RungResolver(gamma, pinned=gamma_pinned)
        else:
            self.rung = None
        self._seqs: dict[Hashable, _SeqState] = {}
        self._lookup_seqs: dict[Hashable, _SeqState] = {}
        self.last_width = 0
        # ragged verify (`use_ragged_verify`): the runner's batch buckets, and per layout (drafting group, plain
        # group) the share of a full-width step's extra cost over the plain step that a ragged step pays
        self.ragged_buckets: tuple[int, ...] | None = None
        self.ragged_share: dict[tuple[int, int], float] = {}

    @classmethod
    def from_flags(
        cls,
        *,
        adaptive_k: str | None = None,
        objective: str | None = None,
        draft_ladder: str | None = None,
        gamma: int | None = None,
        block_size: int,
        has_drafter: bool = True,
        params: ControlParams | None = None,
        compiled_depths: bool = False,
    ) -> Controller:
        """Parse and validate the speculation flags; raises `UserError` naming the offending flag.
        `compiled_depths`: adaptive-k chooses only among the depths of the runner's verify widths
        (`kv.sizing.verify_widths`), the steps it runs without padding."""
        require_drafter(
            has_drafter,
            dflash_adaptive_k=adaptive_k,
            dflash_objective=objective,
            dflash_draft_ladder=draft_ladder,
            dflash_gamma=gamma,
        )
        params = params or ControlParams()
        if objective is not None:
            if objective not in OBJECTIVES:
                raise UserError(
                    f"{OBJECTIVE_FLAG}: {objective!r} is not an objective (use {' or '.join(OBJECTIVES)})",
                    param=OBJECTIVE_FLAG,
                )
            if adaptive_k is None:
                raise UserError(
                    f"{OBJECTIVE_FLAG} is what --dflash-adaptive-k maximises: give a cost table too, or drop it",
                    param=OBJECTIVE_FLAG,
                )
            params = dataclasses.replace(params, objective=objective)
        resolved = resolve_gamma(gamma, block_size)
        cost = parse_cost_model(adaptive_k, alpha=params.calibration_alpha) if adaptive_k is not None else None
        ladder = parse_draft_ladder(draft_ladder) if draft_ladder is not None else None
        depths = [w - 1 for w in verify_widths(resolved)] if compiled_depths else None
        return cls(resolved, cost=cost, ladder=ladder, gamma_pinned=gamma is not None, params=params, depths=depths)

    @property
    def mode(self) -> str:
        if self.cost is not None:
            return "adaptive-k"
        return "ladder" if self.ladder is not None else "rung"

    @property
    def max_drafts(self) -> int:
        """The most drafts any step verifies: ``γ - 1``."""
        return self.gamma - 1

    # --- per-sequence state -------------------------------------------------------------------------

    def _state(self, seq_id: Hashable) -> _SeqState:
        st = self._seqs.get(seq_id)
        if st is None:
            st = self._seqs[seq_id] = _SeqState()
            self._reset_exploration(st)
        return st

    def _lookup_state(self, seq_id: Hashable) -> _SeqState:
        """The sequence's exploration state for its prompt-lookup steps (never suspended)."""
        st = self._lookup_seqs.get(seq_id)
        if st is None:
            st = self._lookup_seqs[seq_id] = _SeqState(probe_gap=self.params.lookup_explore_every)
            self._reset_exploration(st, self.params.lookup_explore_every)
        return st

    def _reset_exploration(self, st: _SeqState, every: int | None = None) -> None:
        every = self.params.explore_every if every is None else every
        st.decisions = 0
        st.next_explore = every - 1 if every > 0 else math.inf
        st.gap = every
        st.explored_from = None

    def is_suspended(self, seq_id: Hashable) -> bool:
        st = self._seqs.get(seq_id)
        return bool(st and st.suspended)

    def rates(self, seq_id: Hashable) -> list[float] | None:
        """The sequence's conditional acceptance rates (positions 1..16), or None without data."""
        return self.acceptance.rates(seq_id)

    def release(self, seq_id: Hashable) -> None:
        """Forget a finished sequence (the serve-wide prior keeps what it learned)."""
        self._seqs.pop(seq_id, None)
        self._lookup_seqs.pop(seq_id, None)
        self.acceptance.release(seq_id)
        self.lookup_acceptance.release(seq_id)

    # --- the decision -------------------------------------------------------------------------------

    def use_ragged_verify(self, batch_buckets: tuple[int, ...] | None) -> bool:
        """The runner runs a full-width step whose rows do not all draft as a ragged verify over these batch buckets
        (`kv.sizing.ragged_split`; None: it runs every row at the step's width): adaptive-k prices such steps as
        ragged. Returns whether it does (only with a cost table)."""
        self.ragged_buckets = tuple(batch_buckets) if batch_buckets and self.cost is not None else None
        return self.ragged_buckets is not None

    def _ragged_layout(self, n: int, drafting: int, k: int) -> tuple[int, int] | None:
        """The ragged verify layout of a step of `n` rows, `drafting` of them verifying up to `k` drafts, or None
        when it runs every row at one width (not at the full verify width, or no layout fits)."""
        if self.ragged_buckets is None or k <= 0 or verify_width_of(k, self.gamma) != self.gamma:
            return None
        return ragged_split(n, drafting, self.ragged_buckets)

    def _price(self, n: int, drafting: int, k: int, *, lookup: bool, ragged: bool = True) -> float | None:
        """The cost (ms) of a step of `n` rows where `drafting` rows verify `k` drafts: the table's, or for a ragged
        verify the plain step plus the layout's share of the full-width step's extra cost."""
        assert self.cost is not None
        ms = self.cost.cost(n, k, lookup=lookup)
        layout = self._ragged_layout(n, drafting, k) if ragged else None
        plain = self.cost.cost(n, 0) if layout is not None else None
        if ms is None or layout is None or plain is None:
            return ms
        return plain + max(ms - plain, 0.0) * self._share(layout)

    def _share(self, layout: tuple[int, int]) -> float:
        """A ragged layout's share of a full-width step's extra cost: learned from its measured steps, starting
        at sqrt(drafting group / batch) (measured on CPU at batch 4: 0.60 for (1 | 3), 0.65 for (2 | 2);
        `benchmarks/ragged_verify_cost.py`)."""
        return self.ragged_share.get(layout, math.sqrt(layout[0] / sum(layout)))

    def cap(self, n_active: int) -> int:
        """The ladder rung for ``n_active`` (if a ladder is set), never above ``γ - 1``."""
        cap = self.gamma - 1
        if self.ladder is not None:
            cap = min(cap, self.ladder.drafts_for(n_active))
        return cap

    def decide(
        self, active_seq_ids: Sequence[Hashable], lookup: Collection[Hashable] = (), *, full_width: bool = False
    ) -> dict[Hashable, int]:
        """Draft counts for this step's active sequences (0 = plain decode for that sequence); `lookup`: the
        sequences whose drafts this step come from prompt lookup; `full_width`: a speculative step runs at the full
        verify width whatever its depth (a step that carries prompt chunks), so adaptive-k chooses between plain
        decoding and the deepest candidate (see the module docstring)."""
        n = len(active_seq_ids)
        self.last_width = n
        if n == 0:
            return {}
        if self.cost is not None:
            return self._decide_adaptive(active_seq_ids, lookup, full_width)
        if self.ladder is not None:
            k = max(self.cap(n), 1)
        else:
            assert self.rung is not None
            k = self.rung.drafts(n)
        return {s: k for s in active_seq_ids}

    def _decide_adaptive(
        self, active: Sequence[Hashable], lookup: Collection[Hashable], full_width: bool
    ) -> dict[Hashable, int]:
        assert self.cost is not None
        p = self.params
        n = len(active)
        top = self._floor(min(self.cap(n), self.cost.max_drafts(n)))
        # at the full width a shallower depth costs what the deepest does: only plain decoding and `top` compete
        depths = (0, top) if full_width else None
        out: dict[Hashable, int] = {}
        parts: list[tuple[Hashable, _SeqState]] = []
        looked: list[Hashable] = []
        looked_rates: list[list[float] | None] = []
        for s in active:
            st = self._state(s)
            if s in lookup:
                rates = self.lookup_acceptance.rates(s)
                if rates is None or self._best_alone(rates, n, top, depths) > 0:
                    self._lookup_state(s).probe_gap = p.lookup_explore_every
                    looked.append(s)
                    looked_rates.append(rates)
                    continue
                # its copies do not pay: plain for this step without holding the others back, its lookup evidence
                # ageing, and now and then (a doubling gap) one probe at the cap, since the serve-wide prior only
                # learns from lookup steps that are run
                self.lookup_acceptance.soften(s, p.decay)
                lst = self._lookup_state(s)
                lst.plain_tokens += 1
                if p.lookup_explore_every and lst.plain_tokens >= lst.probe_gap:
                    lst.plain_tokens = 0
                    lst.probe_gap = min(2 * lst.probe_gap, p.explore_max)
                    out[s] = top
                else:
                    out[s] = 0
                continue
            if st.suspended:
                out[s] = 0
            else:
                parts.append((s, st))
        if not parts and not looked:
            return out
        all_rates = [self.acceptance.rates(s) for s, _ in parts]
        all_rates += looked_rates
        if any(r is None for r in all_rates):
            k = top  # no data: start at the cap
        else:
            lo = 1 if any(st.probe_left > 0 for _, st in parts) else 0
            curves = [expected_tokens_curve(r, top) for r in all_rates if r is not None]
            others = n - len(curves)  # the step's rows decoding plainly whatever k: one token each
            values: dict[int, float] = {}
            for d in self._candidates(lo, top, depths):
                # no drafter row: a step of lookup drafts alone; a step carrying prompt chunks is never ragged
                ms = self._price(n, len(curves), d, lookup=not parts, ragged=not full_width)
                if ms is not None:
                    if p.objective == "latency":
                        values[d] = min(c[d] for c in curves) / ms
                    else:
                        values[d] = (sum(c[d] for c in curves) + others) / ms
            incumbents = {st.incumbent for _, st in parts}
            k = choose(
                values,
                suspend_margin=p.suspend_margin,
                incumbent=incumbents.pop() if len(incumbents) == 1 else None,
                deeper_margin=p.deeper_margin,
                shallower_margin=p.shallower_margin,
            )
        if full_width and k == 0:  # plain for this step only: the chunks' width, not the drafts, priced it out
            return {**out, **{s: 0 for s, _ in parts}, **{s: 0 for s in looked}}
        for s, st in parts:
            out[s] = self._commit(st, k, top)
        for s in looked:
            if k == 0:
                out[s] = 0
                self.lookup_acceptance.soften(s, p.decay)
            else:
                out[s] = self._commit(self._lookup_state(s), k, top, self.params.lookup_explore_every)
        return out

    def _best_alone(self, rates: Sequence[float], n: int, top: int, depths: Collection[int] | None = None) -> int:
        """The depth one sequence with these rates would choose for itself in a step of `n` sequences."""
        assert self.cost is not None
        curve = expected_tokens_curve(rates, top)
        values = {
            d: curve[d] / ms
            for d in self._candidates(0, top, depths)
            if (ms := self._price(n, 1, d, lookup=True, ragged=depths is None)) is not None
        }
        return choose(values, suspend_margin=self.params.suspend_margin)

    def _commit(self, st: _SeqState, k: int, top: int, every: int | None = None) -> int:
        index = st.decisions
        st.decisions += 1
        st.incumbent = k
        if k == 0:
            st.suspended = True
            st.plain_tokens = 0
            return 0
        if index < st.next_explore:
            return k
        every = self.params.explore_every if every is None else every
        if st.explored_from is None or st.explored_from != k:
            st.gap = every
        else:
            st.gap = min(2 * st.gap, self.params.explore_max)
        st.next_explore = index + st.gap
        st.explored_from = k
        return next(iter(self._candidates(k + 1, top)), top)

    def _candidates(self, lo: int, top: int, depths: Collection[int] | None = None) -> list[int]:
        """The candidate depths ``lo..top``, ascending (only the compiled ones when `self.depths` is set, and only
        those of `depths` when given)."""
        return [
            d
            for d in range(lo, top + 1)
            if (self.depths is None or d in self.depths) and (depths is None or d in depths)
        ]

    def _floor(self, k: int) -> int:
        """The deepest candidate depth ``<= k``."""
        return max(d for d in self._candidates(0, k)) if k > 0 else k

    # --- feedback -----------------------------------------------------------------------------------

    def observe(
        self, seq_id: Hashable, num_drafts: int, accepted: int | Iterable[object] = 0, *, lookup: bool = False
    ) -> None:
        """Record one step of ``seq_id``: ``num_drafts`` verified, ``accepted`` of them accepted; ``lookup``:
        the drafts came from prompt lookup, not the drafter.

        ``accepted`` is a count or a per-draft accept mask (its leading true entries count). A plain step
        (``num_drafts = 0``), or one of prompt-lookup drafts, counts its emitted tokens as plain-decoded toward a
        suspended sequence's resume.
        """
        st = self._state(seq_id)
        if num_drafts <= 0 or lookup:
            if num_drafts > 0:
                self.lookup_acceptance.observe(seq_id, num_drafts, leading_accepts(accepted))
            if st.suspended:
                st.plain_tokens += 1 + (leading_accepts(accepted) if num_drafts > 0 else 0)
                if st.plain_tokens >= self.params.resume_after_tokens:
                    self._resume(seq_id, st)
            return
        a = leading_accepts(accepted)
        self.acceptance.observe(seq_id, num_drafts, a)
        if st.probe_left > 0:
            st.probe_left -= 1
        if self.rung is not None and self.last_width == 1:
            self.rung.observe(a >= 1)

    def _resume(self, seq_id: Hashable, st: _SeqState) -> None:
        st.suspended = False
        st.plain_tokens = 0
        st.incumbent = None
        self._reset_exploration(st)
        st.probe_left = self.params.probe_steps
        self.acceptance.soften(seq_id, self.params.soften)

    def observe_step_time(
        self, batch_width: int, num_drafts: int, ms: float, *, lookup: bool = False, drafting: int | None = None
    ) -> None:
        """Calibrate the cost model with one measured step (``num_drafts`` = the most drafts a row verified, so
        the step ran at the first candidate depth at or above it; ``lookup``: every row's drafts came from prompt
        lookup, no drafter block ran; ``drafting``: how many rows verified drafts, when not all of them did). A
        ragged verify calibrates its layout's share instead of the table's scale."""
        if self.cost is None:
            return
        depth = next(iter(self._candidates(num_drafts, self.gamma - 1)), num_drafts)
        layout = None if drafting is None else self._ragged_layout(batch_width, drafting, depth)
        if layout is None:
            self.cost.observe(batch_width, depth, ms, lookup=lookup)
            return
        full, plain = self.cost.cost(batch_width, depth, lookup=lookup), self.cost.cost(batch_width, 0)
        if full is None or plain is None or full <= plain or not (math.isfinite(ms) and ms > 0):
            return
        share = self._share(layout)
        measured = min(max((ms - plain) / (full - plain), 0.0), 2.0)
        self.ragged_share[layout] = share + self.cost.alpha * (measured - share)
