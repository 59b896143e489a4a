"""γ (block width) resolution, the rung resolver, and validation of the speculation flags against γ.

γ is the verify block width: one anchor token plus ``γ - 1`` drafts. A pinned ``--dflash-gamma`` wins;
unset, ``γ = min(block + 2, 15)`` where ``block`` is the drafter's trained block size (drafters chain usefully
past their trained block, and 15 keeps the verify width γ + 1 <= 16).

The rung resolver decides the draft count when neither ``--dflash-adaptive-k`` nor a ladder is set. It has
three block widths ("rungs", each clamped to ``2..max(γ, 2)``): ``multi`` (default 4) for two or more active
sequences, and ``wide`` (default γ) or ``narrow`` (default 5) at one sequence. At one sequence it scores
each verify by whether the first draft was accepted, in a shift register of the last 64 scored steps: at
``>= 60`` hits it goes wide, at ``<= 46`` narrow, in between it holds, and it decides at most once per 64
scored steps (counted from arming and from each switch). It starts wide. It is unarmed (always ``γ - 1``
drafts) when γ was pinned or γ < 3. Drafts per step = ``clamp(rung - 1, 1, γ - 1)``.
"""

from __future__ import annotations

from dflash_jax.errors import UserError

from .cost import ADAPTIVE_K_FLAG, CostModel
from .ladder import LADDER_FLAG, DraftLadder

GAMMA_FLAG = "--dflash-gamma"
MAX_DEFAULT_GAMMA = 15

RUNG_WINDOW = 64
RUNG_ENTER = 60
RUNG_LEAVE = 46
RUNG_DWELL = 64
RUNG_MULTI = 4
RUNG_NARROW = 5


def default_gamma(block_size: int) -> int:
    """``min(block_size + 2, 15)``."""
    if block_size < 1:
        raise ValueError(f"a drafter block size is at least 1, not {block_size}")
    return min(block_size + 2, MAX_DEFAULT_GAMMA)


def resolve_gamma(pinned: int | None, block_size: int) -> int:
    """A pinned ``--dflash-gamma`` wins (it must allow one draft: γ >= 2); else `default_gamma(block_size)`."""
    if pinned is None:
        return default_gamma(block_size)
    if isinstance(pinned, bool) or not isinstance(pinned, int) or pinned < 2:
        raise UserError(
            f"{GAMMA_FLAG}: γ must be a whole number >= 2 (one anchor plus at least one draft), got {pinned!r}",
            param=GAMMA_FLAG,
        )
    return pinned


def validate_against_gamma(gamma: int, *, ladder: DraftLadder | None = None, cost: CostModel | None = None) -> None:
    """Refuse a ladder whose largest rung γ - 1 cannot cover.

    A cost table may price more drafts than ``γ - 1``; those depths are simply never candidates (the
    controller caps every choice at ``γ - 1``), so it is accepted as long as it prices a count in
    ``1..γ - 1`` at every width, which the table rules already guarantee.
    """
    if gamma < 2:
        raise UserError(f"{GAMMA_FLAG}: γ must be >= 2, got {gamma}", param=GAMMA_FLAG)
    if ladder is not None and ladder.max_drafts > gamma - 1:
        raise UserError(
            f"{LADDER_FLAG}: the largest rung asks for {ladder.max_drafts} drafts but γ = {gamma} verifies at "
            f"most {gamma - 1} (γ - 1); pass {GAMMA_FLAG} {ladder.max_drafts + 1} or lower the ladder",
            param=LADDER_FLAG,
        )
    if cost is not None:
        for width, table in cost.tables.items():
            if table.first > gamma - 1:  # pragma: no cover - impossible with first in (0, 1) and γ >= 2
                raise UserError(
                    f"{ADAPTIVE_K_FLAG}: the width-{width} table prices no draft count within γ - 1 = {gamma - 1}",
                    param=ADAPTIVE_K_FLAG,
                )


def require_drafter(has_drafter: bool, **flags: object) -> None:
    """Refuse speculation flags (given as ``flag_name=value``; None = unset) when no drafter is in use.

    Example: ``require_drafter(False, dflash_adaptive_k="0:32,1:44")`` raises naming ``--dflash-adaptive-k``.
    """
    if has_drafter:
        return
    for name, value in flags.items():
        if value is not None:
            flag = "--" + name.replace("_", "-")
            raise UserError(
                f"{flag} controls speculative decoding, but no drafter is in use; pass --draft-model "
                f"(a DFlash drafter) or drop {flag}",
                param=flag,
            )


class RungResolver:
    """The γ resolver used without a cost table or ladder: wide/narrow at one sequence by first-draft hit rate,
    multi at two or more."""

    def __init__(
        self,
        gamma: int,
        *,
        pinned: bool = False,
        multi: int = RUNG_MULTI,
        narrow: int = RUNG_NARROW,
        wide: int | None = None,
        enter: int = RUNG_ENTER,
        leave: int = RUNG_LEAVE,
        dwell: int = RUNG_DWELL,
    ):
        if gamma < 2:
            raise ValueError(f"γ must be >= 2, not {gamma}")
        if not 0 <= leave < enter <= RUNG_WINDOW:
            raise ValueError("rung thresholds need 0 <= leave < enter <= 64")
        self.gamma = gamma
        self.num_drafts = gamma - 1
        hi = max(gamma, 2)
        clamp = lambda v: min(max(v, 2), hi)
        self.multi = clamp(multi)
        self.narrow = clamp(narrow)
        self.wide = clamp(gamma if wide is None else wide)
        self.enter = enter
        self.leave = leave
        self.dwell = dwell
        self.armed = not pinned and gamma >= 3
        self.state = "wide"
        self.register = 0
        self.since_switch = 0
        self.switches = 0

    @property
    def hits(self) -> int:
        """First-draft hits among the last 64 scored steps."""
        return self.register.bit_count()

    def block_width(self, n_active: int) -> int:
        """The rung (block width K) for ``n_active`` sequences."""
        if n_active >= 2:
            return self.multi
        return self.wide if self.state == "wide" else self.narrow

    def drafts(self, n_active: int) -> int:
        """``clamp(K - 1, 1, γ - 1)``; unarmed, ``γ - 1``."""
        if not self.armed:
            return self.num_drafts
        return min(max(self.block_width(n_active) - 1, 1), self.num_drafts)

    def observe(self, first_draft_accepted: bool) -> None:
        """Score one verify step that ran at one active sequence (the caller skips wider steps)."""
        if not self.armed:
            return
        mask = (1 << RUNG_WINDOW) - 1
        self.register = ((self.register << 1) | int(bool(first_draft_accepted))) & mask
        self.since_switch += 1
        if self.since_switch < self.dwell:
            return
        hits = self.hits
        if self.state == "wide" and hits <= self.leave:
            self._switch("narrow")
        elif self.state == "narrow" and hits >= self.enter:
            self._switch("wide")

    def _switch(self, state: str) -> None:
        self.state = state
        self.since_switch = 0
        self.switches += 1
