"""The draft ladder, `--dflash-draft-ladder "1:7,2:5,3:4,4:3,5:2,6:7"`.

Each pair is ``min_active:drafts``: from ``min_active`` active sequences upward, verify ``drafts`` drafts per
step (the anchor row not counted). Thresholds start at 1 and strictly increase; the last rung covers every
wider batch, and ``n = 0`` maps to the first rung. The resolved γ must cover the largest rung
(``γ - 1 >= max_drafts``), checked by `dflash_jax.spec_decode.control.gamma.validate_against_gamma`.
"""

from __future__ import annotations

from dataclasses import dataclass

from dflash_jax.errors import UserError

LADDER_FLAG = "--dflash-draft-ladder"


@dataclass(frozen=True)
class DraftLadder:
    """Rungs ``(min_active, drafts)`` with strictly increasing ``min_active`` starting at 1."""

    rungs: tuple[tuple[int, int], ...]

    def __post_init__(self) -> None:
        if not self.rungs or self.rungs[0][0] != 1:
            raise ValueError("a ladder starts at 1 active sequence")
        for (a, _), (b, _) in zip(self.rungs, self.rungs[1:], strict=False):
            if b <= a:
                raise ValueError("ladder thresholds must strictly increase")
        if any(d < 1 for _, d in self.rungs):
            raise ValueError("every rung verifies at least one draft")

    def drafts_for(self, n_active: int) -> int:
        """Drafts of the last rung whose ``min_active <= max(n_active, 1)``."""
        n = max(n_active, 1)
        drafts = self.rungs[0][1]
        for min_active, d in self.rungs:
            if min_active > n:
                break
            drafts = d
        return drafts

    @property
    def max_drafts(self) -> int:
        return max(d for _, d in self.rungs)

    def to_flag(self) -> str:
        return ",".join(f"{a}:{d}" for a, d in self.rungs)


def _err(message: str, param: str) -> UserError:
    return UserError(f"{param}: {message}", param=param)


def _whole(text: str, what: str, pair: str, param: str) -> int:
    text = text.strip()
    if not text.isdigit():
        raise _err(f"ladder pair {pair!r}: {text!r} is not a whole number of {what}", param)
    return int(text)


def parse_draft_ladder(text: str, *, param: str = LADDER_FLAG) -> DraftLadder:
    """Parse ``min_active:drafts[,...]``; every malformed form raises `UserError` naming ``param``."""
    if not text.strip():
        raise _err("the ladder is empty (write min_active:drafts pairs like 1:7,2:5,4:3)", param)
    rungs: list[tuple[int, int]] = []
    for raw in text.split(","):
        pair = raw.strip()
        parts = pair.split(":")
        if len(parts) != 2:
            raise _err(f"ladder pair {pair!r} is not min_active:drafts (write pairs like 1:7,2:5,4:3)", param)
        min_active = _whole(parts[0], "active sequences", pair, param)
        drafts = _whole(parts[1], "drafts", pair, param)
        if drafts < 1:
            raise _err(f"ladder pair {pair!r}: a rung needs at least one draft per step", param)
        if rungs and min_active <= rungs[-1][0]:
            raise _err(
                f"ladder thresholds must increase: {min_active} after {rungs[-1][0]} "
                "(list each active-sequence count once, smallest first)",
                param,
            )
        rungs.append((min_active, drafts))
    if rungs[0][0] != 1:
        raise _err(
            f"the ladder must start at 1 active sequence, not {rungs[0][0]} (begin with a 1:drafts rung)",
            param,
        )
    return DraftLadder(tuple(rungs))
