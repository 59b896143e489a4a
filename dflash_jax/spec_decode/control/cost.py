"""Step-cost tables for `--dflash-adaptive-k` and their online calibration.

A cost table prices one whole decode step (propose + verify) in milliseconds by the number of drafts ``k``
it verifies: ``"0:32,1:44,2:50,3:56"``. Entry ``0``, when present, is the plain-decode step; without it the
controller never chooses plain decode. Counts must be consecutive and start at 0 or 1.

The flag may carry tables measured at wider batches too, as ``;``-separated groups with a ``WIDTH=`` prefix:
``"0:32,1:44,2:50;4=0:40,1:61,2:75"``. The first group is the one-stream table (no prefix, or ``1=``); a step of
``n`` active sequences is priced by the group with the largest width ``<= n``. This is the format that
`dflash-jax bench spec-cost` prints (`format_cost_model`).

Calibration: the cost used is ``table_ms(n, k) * scale[bucket(n)]`` with ``bucket(n) = min(log2(next_pow2(n)),
8)`` (nine buckets: 1, 2, 4, ..., 256+). Each measured step moves its bucket's scale ``alpha`` of the way toward
``measured / table_ms``; ``alpha = 0`` leaves the table exact. A uniform scale leaves the choice between depths
as it is; what it changes is the price of steps whose drafts all come from prompt lookup, which run no drafter
block: their speculative depths have scales of their own (starting at 1, the table's), their plain step the
table's scale, so the controller learns how much cheaper than the table those steps are.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from dflash_jax.errors import UserError

ADAPTIVE_K_FLAG = "--dflash-adaptive-k"
NUM_BUCKETS = 9
DEFAULT_ALPHA = 0.1


@dataclass(frozen=True)
class CostTable:
    """Whole-step cost in ms for ``first, first+1, ..., max_drafts`` drafts, at one batch width."""

    first: int
    ms: tuple[float, ...]

    def __post_init__(self) -> None:
        if self.first not in (0, 1):
            raise ValueError(f"a cost table starts at 0 or 1 drafts, not {self.first}")
        if self.first + len(self.ms) - 1 < 1:
            raise ValueError("a cost table must price at least one draft count >= 1")
        if any(not (math.isfinite(v) and v > 0) for v in self.ms):
            raise ValueError("costs must be finite and positive")

    @property
    def max_drafts(self) -> int:
        return self.first + len(self.ms) - 1

    @property
    def has_plain(self) -> bool:
        """True when the table prices the plain-decode step (a ``0:`` entry)."""
        return self.first == 0

    def cost(self, k: int) -> float | None:
        """The table's ms for ``k`` drafts, or None when ``k`` is not priced."""
        if self.first <= k <= self.max_drafts:
            return self.ms[k - self.first]
        return None

    def depths(self) -> range:
        return range(self.first, self.max_drafts + 1)

    def items(self) -> Iterator[tuple[int, float]]:
        return zip(self.depths(), self.ms, strict=True)

    def to_flag(self) -> str:
        return ",".join(f"{k}:{_fmt_ms(v)}" for k, v in self.items())


def _fmt_ms(ms: float) -> str:
    return f"{ms:.6g}"


def _err(message: str, param: str) -> UserError:
    return UserError(f"{param}: {message}", param=param)


def parse_cost_table(text: str, *, param: str = ADAPTIVE_K_FLAG) -> CostTable:
    """Parse one ``drafts:ms`` list; every malformed form raises `UserError` naming ``param``."""
    pairs = text.split(",")
    ks: list[int] = []
    ms: list[float] = []
    for raw in pairs:
        pair = raw.strip()
        parts = pair.split(":")
        if len(parts) != 2 or not parts[0].strip() or not parts[1].strip():
            raise _err(f"adaptive-K cost pair {pair!r} is not drafts:ms (write pairs like 0:32,1:44,2:50)", param)
        k_text, ms_text = parts[0].strip(), parts[1].strip()
        if not k_text.isdigit():
            raise _err(f"cost pair {pair!r}: {k_text!r} is not a whole number of drafts (use 0, 1, 2, ...)", param)
        try:
            value = float(ms_text)
        except ValueError:
            raise _err(
                f"cost pair {pair!r}: {ms_text!r} is not a number of milliseconds (e.g. 44 or 43.5)", param
            ) from None
        if not (math.isfinite(value) and value > 0):
            raise _err(f"cost pair {pair!r}: the cost must be positive (a step time in ms, > 0)", param)
        ks.append(int(k_text))
        ms.append(value)
    if ks[0] > 1:
        raise _err(
            f"the cost table must start at 0 or 1 drafts, not {ks[0]} (add the 0: plain-decode step or a 1: entry)",
            param,
        )
    for prev, k in zip(ks, ks[1:], strict=False):
        if k != prev + 1:
            raise _err(
                f"draft counts must be consecutive: {k} after {prev} (price every count from the first "
                "to the last, in order)",
                param,
            )
    if ks[-1] < 1:
        raise _err("the cost table prices no draft count >= 1 (add at least a 1:ms entry)", param)
    return CostTable(first=ks[0], ms=tuple(ms))


def bucket(n: int) -> int:
    """Calibration bucket of a batch width: ``min(log2(next_pow2(max(n, 1))), 8)``."""
    n = max(int(n), 1)
    return min((n - 1).bit_length(), NUM_BUCKETS - 1)


class CostModel:
    """Cost tables by batch width, with per-bucket calibration toward measured step times.

    ``cost(n, k)`` is the calibrated ms of a step of ``n`` active sequences verifying ``k`` drafts each, or
    None when that depth is not priced at that width (unpriced depths are never candidates).
    """

    def __init__(self, tables: CostTable | Mapping[int, CostTable], *, alpha: float = DEFAULT_ALPHA):
        if isinstance(tables, CostTable):
            tables = {1: tables}
        if not tables or 1 not in tables:
            raise ValueError("a cost model needs the one-stream table (width 1)")
        if any(w < 1 for w in tables):
            raise ValueError("batch widths start at 1")
        if not (0.0 <= alpha <= 1.0):
            raise ValueError(f"calibration alpha must be in [0, 1], not {alpha}")
        self.tables: dict[int, CostTable] = dict(sorted(tables.items()))
        self.alpha = float(alpha)
        self.scales: list[float] = [1.0] * NUM_BUCKETS
        self.lookup_scales: list[float] = [1.0] * NUM_BUCKETS  # steps of prompt-lookup drafts alone (no drafter)

    def table_for(self, n: int) -> CostTable:
        """The table measured at the largest width ``<= n`` (the one-stream table for ``n <= 1``)."""
        chosen = self.tables[1]
        for width, table in self.tables.items():
            if width <= n:
                chosen = table
        return chosen

    def table_ms(self, n: int, k: int) -> float | None:
        return self.table_for(n).cost(k)

    def scale(self, n: int, *, lookup: bool = False) -> float:
        return (self.lookup_scales if lookup else self.scales)[bucket(n)]

    def cost(self, n: int, k: int, *, lookup: bool = False) -> float | None:
        """With `lookup`, a step whose drafts all come from prompt lookup: no drafter block, so cheaper than the
        table's steps; it is calibrated apart (its plain step is the table's)."""
        ms = self.table_ms(n, k)
        return None if ms is None else ms * self.scale(n, lookup=lookup and k > 0)

    def max_drafts(self, n: int) -> int:
        return self.table_for(n).max_drafts

    def has_plain(self, n: int) -> bool:
        return self.table_for(n).has_plain

    def observe(self, n: int, k: int, measured_ms: float, *, lookup: bool = False) -> None:
        """Move bucket(n)'s scale ``alpha`` of the way toward ``measured / table`` (the prompt-lookup steps' scale
        with `lookup`); bad samples are ignored."""
        if self.alpha == 0.0:
            return
        if not (isinstance(measured_ms, int | float) and math.isfinite(measured_ms) and measured_ms > 0):
            return
        ms = self.table_ms(n, k)
        if ms is None:
            return
        b = bucket(n)
        scales = self.lookup_scales if lookup and k > 0 else self.scales
        scales[b] += self.alpha * (measured_ms / ms - scales[b])

    def to_flag(self) -> str:
        return format_cost_model({w: dict(t.items()) for w, t in self.tables.items()})


def parse_cost_model(text: str, *, param: str = ADAPTIVE_K_FLAG, alpha: float = DEFAULT_ALPHA) -> CostModel:
    """Parse ``--dflash-adaptive-k``: a one-stream table, optionally followed by ``;WIDTH=table`` groups."""
    if not text.strip():
        raise _err("the cost table is empty (write drafts:ms pairs like 0:32,1:44,2:50)", param)
    tables: dict[int, CostTable] = {}
    prev_width = 0
    for index, raw in enumerate(text.split(";")):
        group = raw.strip()
        if not group:
            raise _err(f"cost table group {index + 1} is empty (remove the stray ';')", param)
        width = 1
        if "=" in group:
            width_text, group = (p.strip() for p in group.split("=", 1))
            if not width_text.isdigit() or int(width_text) < 1:
                raise _err(
                    f"{width_text!r} is not a batch width (write WIDTH=drafts:ms,... with WIDTH >= 1, "
                    "e.g. 4=0:40,1:61)",
                    param,
                )
            width = int(width_text)
        if index == 0 and width != 1:
            raise _err(
                f"the first cost table must be the one-stream table (width 1), not width {width} "
                "(put the table measured at one sequence first)",
                param,
            )
        if index > 0 and width <= prev_width:
            raise _err(
                f"batch widths must increase: {width} after {prev_width} (give each width once, "
                "narrowest first, e.g. 0:32,1:44;4=0:40,1:61)",
                param,
            )
        tables[width] = parse_cost_table(group, param=param)
        prev_width = width
    return CostModel(tables, alpha=alpha)


def format_cost_model(measured: Mapping[int, Mapping[int, float]]) -> str:
    """Format measured step times ``{width: {drafts: ms}}`` as a ``--dflash-adaptive-k`` value.

    `bench spec-cost` calls this with its measurements (width 1 required; each width's draft counts
    consecutive from 0); the result parses back with `parse_cost_model` to the same tables.
    """
    if 1 not in measured:
        raise ValueError("measurements must include batch width 1")
    groups = []
    for width in sorted(measured):
        row = measured[width]
        ks = sorted(row)
        table = CostTable(first=ks[0], ms=tuple(float(row[k]) for k in ks))
        if list(ks) != list(table.depths()):
            raise ValueError(f"draft counts at width {width} are not consecutive: {ks}")
        text = table.to_flag()
        groups.append(text if width == 1 else f"{width}={text}")
    return ";".join(groups)
