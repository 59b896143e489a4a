"""Acceptance: expected tokens, marginal -> conditional, decayed counts, the serve-wide prior."""

from __future__ import annotations

import pytest

from dflash_jax.errors import UserError
from dflash_jax.spec_decode.control.acceptance import (
    MAX_POSITIONS,
    AcceptanceModel,
    DecayedCounts,
    conditional_from_marginals,
    expected_tokens,
    expected_tokens_curve,
    leading_accepts,
    marginals_from_conditional,
    parse_rates,
)


def test_expected_tokens_is_one_plus_the_survival_sum():
    # c = [0.6, 0.5, 0.4]: 1, 1+.6, +.3, +.12, +.048 (position 4 reuses 0.4)
    assert expected_tokens_curve([0.6, 0.5, 0.4], 4) == pytest.approx([1, 1.6, 1.9, 2.02, 2.068])
    assert expected_tokens([0.6, 0.5, 0.4], 2) == pytest.approx(1.9)
    assert expected_tokens_curve([], 3) == [1.0, 1.0, 1.0, 1.0]


def test_marginal_gains_are_running_products_and_never_increase():
    c = [0.9, 0.5, 0.8, 0.3]
    curve = expected_tokens_curve(c, 6)
    gains = [b - a for a, b in zip(curve, curve[1:], strict=False)]
    assert gains == pytest.approx(marginals_from_conditional(c, 6))
    assert gains == pytest.approx([0.9, 0.45, 0.36, 0.108, 0.0324, 0.00972])
    assert all(b <= a for a, b in zip(gains, gains[1:], strict=False))


def test_the_reference_marginals_give_the_worked_example():
    c = conditional_from_marginals([0.611, 0.312, 0.117, 0.028])
    assert c == pytest.approx([0.611, 0.312 / 0.611, 0.117 / 0.312, 0.028 / 0.117])
    assert expected_tokens_curve(c, 4) == pytest.approx([1, 1.611, 1.923, 2.040, 2.068])


def test_marginal_conversion_clamps_and_zeroes_after_a_zero():
    assert conditional_from_marginals([0.5, 0.0, 0.2]) == [0.5, 0.0, 0.0]
    assert conditional_from_marginals([0.5, 0.6]) == [0.5, 1.0]
    assert conditional_from_marginals([]) == []


def test_accepted_masks_count_their_leading_accepts():
    assert leading_accepts(3) == 3
    assert leading_accepts([True, True, False, True]) == 2
    assert leading_accepts([1, 1, 1]) == 3
    assert leading_accepts([0, 1]) == 0


def test_a_verify_folds_accepts_then_one_reject_and_decays_only_observed_positions():
    c = DecayedCounts()
    c.fold(3, 1, 0.95)  # accept at 1, reject at 2, nothing at 3
    assert c.acc[:4] == [1.0, 0.0, 0.0, 0.0] and c.obs[:4] == [1.0, 1.0, 0.0, 0.0]
    c.fold(3, 3, 0.95)  # accepts at 1..3
    assert c.acc[:4] == pytest.approx([1.95, 1.0, 1.0, 0.0])
    assert c.obs[:4] == pytest.approx([1.95, 1.95, 1.0, 0.0])
    c.fold(2, 0, 0.95)  # one reject at position 1 only
    assert c.acc[:3] == pytest.approx([1.8525, 1.0, 1.0])
    assert c.obs[:3] == pytest.approx([2.8525, 1.95, 1.0])
    deep = DecayedCounts()
    deep.fold(20, 20, 0.95)
    assert deep.obs == [1.0] * MAX_POSITIONS
    with pytest.raises(ValueError):
        deep.fold(2, 3, 0.95)


def test_rates_blend_own_counts_with_the_serve_wide_prior_of_weight_4():
    m = AcceptanceModel()
    assert m.rates("s") is None  # nothing anywhere: no data
    m.observe("s", 2, 1)
    m.observe("t", 2, 2)
    m.observe("t", 2, 0)
    # serve-wide counts (see the fold test): acc [1.8525, 1], obs [2.8525, 1.95]; own s: acc [1, 0], obs [1, 1]
    r = m.rates("s")
    assert r is not None and len(r) == MAX_POSITIONS
    assert r[0] == pytest.approx((1 + 4 * 1.8525 / 2.8525) / 5)
    assert r[1] == pytest.approx((0 + 4 * (1 / 1.95)) / 5)
    assert r[2:] == pytest.approx([r[1]] * 14)  # nothing at 3+: reuse the shallower rate
    # t: own acc [0.95, 1], obs [1.95, 1]
    rt = m.rates("t")
    assert rt[0] == pytest.approx((0.95 + 4 * 1.8525 / 2.8525) / (1.95 + 4))
    assert rt[1] == pytest.approx((1 + 4 / 1.95) / 5)
    # a fresh sequence sees the prior alone
    assert m.rates("new")[:2] == pytest.approx([1.8525 / 2.8525, 1 / 1.95])
    m.release("t")
    assert m.rates("t") == m.rates("new")


def test_a_cold_prior_fills_in_without_any_observation():
    m = AcceptanceModel(cold_weight=8, cold_rates=[0.5, 0.25])
    assert m.rates("s") == pytest.approx([0.5] + [0.25] * 15)
    m.observe("s", 1, 1)
    # position 1: (1 + 4*1 + 8*0.5) / (1 + 4 + 8); position 2: cold only
    assert m.rates("s")[:2] == pytest.approx([9 / 13, 0.25])


def test_softening_scales_the_counts():
    m = AcceptanceModel(prior_weight=0.0)
    m.observe("s", 1, 1)
    m.observe("s", 1, 0)
    before = m.rates("s")[0]
    m.soften("s", 0.25)
    assert m.counts("s").obs[0] == pytest.approx(0.25 * 1.95)
    assert m.rates("s")[0] == pytest.approx(before)


def test_parse_rates_converts_marginals_and_refuses_bad_values():
    assert parse_rates("0.6,0.3", param="--acceptance") == pytest.approx([0.6, 0.5])
    assert parse_rates("0.6,0.3", param="--acceptance", marginal=False) == [0.6, 0.3]
    for bad, fragment in [
        ("0.5,x", "'x' is not a marginal acceptance rate"),
        ("1.5", "outside [0, 1]"),
        ("-0.1", "outside [0, 1]"),
        ("0.4,0.5", "marginal rates must not increase"),
        ("", "is not a marginal acceptance rate"),
    ]:
        with pytest.raises(UserError) as info:
            parse_rates(bad, param="--acceptance")
        assert info.value.param == "--acceptance" and fragment in str(info.value)
