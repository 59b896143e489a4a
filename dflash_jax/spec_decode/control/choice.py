"""The choice rule: the draft count with the most expected tokens per ms, with margins.

For each candidate ``k`` (ascending) the value ``v(k)`` is expected tokens per ms. A candidate's adjusted value
is ``v(k) / (1 + m)`` with ``m = suspend_margin`` for ``k = 0`` (plain decode), ``deeper`` / ``shallower`` for
depths above / below an incumbent, and 0 otherwise. A challenger replaces the best only with a strictly larger
adjusted value, so ties keep the shallower depth. With the DFlash margins (0, 0, 0.03) plain decode wins only
if ``v(0) / 1.03 >= v(k)`` for every ``k >= 1``.

`plan` is the single-sequence planner behind `dflash-jax spec plan`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .acceptance import expected_tokens_curve
from .cost import CostTable

SUSPEND_MARGIN = 0.03


def choose(
    values: Mapping[int, float],
    *,
    suspend_margin: float = SUSPEND_MARGIN,
    incumbent: int | None = None,
    deeper_margin: float = 0.0,
    shallower_margin: float = 0.0,
) -> int:
    """The best depth of ``values`` (``{k: tokens per ms}``) under the margins."""
    if not values:
        raise ValueError("no candidate depth")
    best_k = -1
    best = float("-inf")
    for k in sorted(values):
        if k == 0:
            margin = suspend_margin
        elif incumbent is not None and k > incumbent:
            margin = deeper_margin
        elif incumbent is not None and k < incumbent:
            margin = shallower_margin
        else:
            margin = 0.0
        adjusted = values[k] / (1.0 + margin)
        if adjusted > best:
            best_k, best = k, adjusted
    return best_k


@dataclass(frozen=True)
class PlanRow:
    drafts: int
    expected_tokens: float
    cost_ms: float
    tokens_per_ms: float


@dataclass(frozen=True)
class Plan:
    rows: tuple[PlanRow, ...]
    choice: int
    top: int

    def to_dict(self) -> dict:
        return {
            "rows": [
                {
                    "drafts": r.drafts,
                    "expected_tokens": r.expected_tokens,
                    "cost_ms": r.cost_ms,
                    "tokens_per_ms": r.tokens_per_ms,
                }
                for r in self.rows
            ],
            "choice": self.choice,
            "top": self.top,
        }


def plan(
    table: CostTable,
    rates: Sequence[float],
    *,
    cap: int | None = None,
    suspend_margin: float = SUSPEND_MARGIN,
) -> Plan:
    """Expected tokens and tokens/ms for every priced depth up to ``min(cap, table.max_drafts)``, and the choice.

    ``rates`` are conditional acceptance rates (see `acceptance.conditional_from_marginals`).
    """
    if cap is not None and cap < 1:
        raise ValueError(f"the cap is at least 1 draft, not {cap}")
    top = table.max_drafts if cap is None else min(cap, table.max_drafts)
    curve = expected_tokens_curve(rates, top)
    rows = []
    for k in range(table.first, top + 1):
        ms = table.cost(k)
        assert ms is not None
        rows.append(PlanRow(k, curve[k], ms, curve[k] / ms))
    choice = choose({r.drafts: r.tokens_per_ms for r in rows}, suspend_margin=suspend_margin)
    return Plan(tuple(rows), choice, top)
