"""Acceptance measurement and expected tokens per step.

Rates are *conditional*: ``c_i = P(draft i accepted | drafts 1..i-1 accepted)`` for positions ``1..16``. A step
verifying ``K`` drafts then emits on average ``E[K] = 1 + sum_{i=1..K} prod_{j<=i} c_j`` tokens (the bonus token
plus the surviving drafts). Positions past the end of a rate list reuse its last rate; an empty list means 0.

Measurement: each sequence keeps decayed per-position counts ``acc[i]`` / ``obs[i]``, and a serve-wide prior
is updated by every sequence. A verify of ``d`` drafts that accepted ``a`` folds an accept at positions
``1..a`` and, if ``a < d``, one reject at ``a + 1`` (``min(d, a+1, 16)`` positions; only those decay):
``acc = acc*decay + x``, ``obs = obs*decay + 1``. The sequence's rate at position ``i`` is

    (acc_i + pw * g_acc_i / g_obs_i + cw * cold_i) / (obs_i + pw + cw)

with the prior term only where the serve-wide counts have data, and the cold term only when a cold prior is
configured. A zero denominator reuses the previous position's rate; nothing at position 1 means "no data".
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence

from dflash_jax.errors import UserError

MAX_POSITIONS = 16
DEFAULT_DECAY = 0.95
DEFAULT_PRIOR_WEIGHT = 4.0


def rate_at(rates: Sequence[float], i: int) -> float:
    """Conditional rate at 1-based position ``i``; past the end the last rate, for an empty list 0."""
    if not rates:
        return 0.0
    return float(rates[min(i, len(rates)) - 1])


def expected_tokens(rates: Sequence[float], k: int) -> float:
    """``1 + sum_{i=1..k} prod_{j<=i} c_j``, summed in draft order."""
    return expected_tokens_curve(rates, k)[k]


def expected_tokens_curve(rates: Sequence[float], max_k: int) -> list[float]:
    """``[E[0], E[1], ..., E[max_k]]`` for conditional ``rates``."""
    out = [1.0]
    total = 1.0
    survive = 1.0
    for i in range(1, max_k + 1):
        survive *= rate_at(rates, i)
        total += survive
        out.append(total)
    return out


def conditional_from_marginals(marginals: Iterable[float]) -> list[float]:
    """``c_j = clamp(m_j / m_{j-1}, 0, 1)`` with ``m_0 = 1``; a position after a zero marginal gets 0."""
    out: list[float] = []
    prev = 1.0
    for m in marginals:
        m = float(m)
        c = 0.0 if prev <= 0.0 else min(max(m / prev, 0.0), 1.0)
        out.append(c)
        prev = m
    return out


def marginals_from_conditional(rates: Sequence[float], n: int) -> list[float]:
    """``m_j = prod_{i<=j} c_i`` for ``j = 1..n`` (the chance that at least ``j`` drafts are accepted)."""
    out: list[float] = []
    survive = 1.0
    for i in range(1, n + 1):
        survive *= rate_at(rates, i)
        out.append(survive)
    return out


def leading_accepts(accepted: int | Iterable[object]) -> int:
    """An accepted count, or the number of leading true entries of a per-draft accepted mask."""
    if isinstance(accepted, int):
        return accepted
    count = 0
    for x in accepted:
        if not x:
            break
        count += 1
    return count


class DecayedCounts:
    """Per-position decayed accept/observe counts (positions 1..16 stored at 0..15)."""

    __slots__ = ("acc", "obs")

    def __init__(self) -> None:
        self.acc = [0.0] * MAX_POSITIONS
        self.obs = [0.0] * MAX_POSITIONS

    def fold(self, drafts: int, accepted: int, decay: float, weight: float = 1.0) -> None:
        if drafts < 0 or not 0 <= accepted <= drafts:
            raise ValueError(f"a verify of {drafts} drafts cannot accept {accepted}")
        for i in range(min(drafts, accepted + 1, MAX_POSITIONS)):
            x = 1.0 if i < accepted else 0.0
            self.acc[i] = self.acc[i] * decay + x * weight
            self.obs[i] = self.obs[i] * decay + weight

    def scale(self, factor: float) -> None:
        self.acc = [v * factor for v in self.acc]
        self.obs = [v * factor for v in self.obs]

    def raw_rates(self) -> list[float | None]:
        return [a / o if o > 0 else None for a, o in zip(self.acc, self.obs, strict=True)]


class AcceptanceModel:
    """Per-sequence acceptance blended with a serve-wide prior (and optionally a fixed cold prior)."""

    def __init__(
        self,
        *,
        decay: float = DEFAULT_DECAY,
        prior_weight: float = DEFAULT_PRIOR_WEIGHT,
        cold_weight: float = 0.0,
        cold_rates: Sequence[float] | None = None,
    ):
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"decay must be in (0, 1], not {decay}")
        if prior_weight < 0 or cold_weight < 0:
            raise ValueError("prior and cold weights must be >= 0")
        self.decay = decay
        self.prior_weight = prior_weight
        self.cold_weight = cold_weight
        self.cold_rates = list(cold_rates) if cold_rates else None
        self.serve = DecayedCounts()
        self._seqs: dict[Hashable, DecayedCounts] = {}

    def counts(self, seq_id: Hashable) -> DecayedCounts:
        counts = self._seqs.get(seq_id)
        if counts is None:
            counts = self._seqs[seq_id] = DecayedCounts()
        return counts

    def observe(self, seq_id: Hashable, drafts: int, accepted: int) -> None:
        """Fold one verify of ``drafts`` drafts with ``accepted`` accepted into the sequence and the prior."""
        self.counts(seq_id).fold(drafts, accepted, self.decay)
        self.serve.fold(drafts, accepted, self.decay)

    def soften(self, seq_id: Hashable, factor: float) -> None:
        """Multiply the sequence's counts by ``factor`` (same rate, new evidence weighs more)."""
        self.counts(seq_id).scale(factor)

    def release(self, seq_id: Hashable) -> None:
        self._seqs.pop(seq_id, None)

    def rates(self, seq_id: Hashable) -> list[float] | None:
        """Conditional rates at positions 1..16, or None when there is no data at position 1."""
        own = self._seqs.get(seq_id) or DecayedCounts()
        out: list[float] = []
        use_cold = self.cold_weight > 0 and self.cold_rates is not None
        for i in range(MAX_POSITIONS):
            num = own.acc[i]
            den = own.obs[i]
            if self.serve.obs[i] > 0 and self.prior_weight > 0:
                num += self.prior_weight * self.serve.acc[i] / self.serve.obs[i]
                den += self.prior_weight
            if use_cold:
                num += self.cold_weight * rate_at(self.cold_rates, i + 1)
                den += self.cold_weight
            if den > 0:
                out.append(num / den)
            elif i == 0:
                return None
            else:
                out.append(out[-1])
        return out


def parse_rates(text: str, *, param: str, marginal: bool = True) -> list[float]:
    """Parse ``r1,r2,...`` acceptance rates in [0, 1] into conditional rates.

    ``marginal=True``: the values are ``m_j = P(at least j drafts accepted)`` and must not increase; they are
    converted with `conditional_from_marginals`. Otherwise they already are conditional rates.
    """
    what = "marginal" if marginal else "conditional"
    values: list[float] = []
    for raw in text.split(","):
        item = raw.strip()
        try:
            value = float(item)
        except ValueError:
            raise UserError(
                f"{param}: {item!r} is not a {what} acceptance rate (write rates in [0, 1] like 0.6,0.3,0.1)",
                param=param,
            ) from None
        if not 0.0 <= value <= 1.0:
            raise UserError(f"{param}: acceptance rate {item} is outside [0, 1]", param=param)
        values.append(value)
    if marginal:
        for j, (prev, m) in enumerate(zip(values, values[1:], strict=False), start=2):
            if m > prev:
                raise UserError(
                    f"{param}: marginal rates must not increase (m{j} = {m} > m{j - 1} = {prev}): m_j is "
                    "P(at least j drafts accepted)",
                    param=param,
                )
        return conditional_from_marginals(values)
    return values
