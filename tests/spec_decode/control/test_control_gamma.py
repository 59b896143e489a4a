"""γ resolution, validation against γ, the drafter requirement, and the rung resolver."""

from __future__ import annotations

import pytest

from dflash_jax.errors import UserError
from dflash_jax.spec_decode.control.cost import parse_cost_model
from dflash_jax.spec_decode.control.gamma import (
    RungResolver,
    default_gamma,
    require_drafter,
    resolve_gamma,
    validate_against_gamma,
)
from dflash_jax.spec_decode.control.ladder import parse_draft_ladder


def test_a_pinned_gamma_wins_and_an_unpinned_one_is_the_block_plus_two():
    assert resolve_gamma(8, 8) == 8
    assert resolve_gamma(3, 16) == 3
    assert resolve_gamma(None, 8) == 10
    assert [default_gamma(b) for b in (1, 12, 13, 16)] == [3, 14, 15, 15]


@pytest.mark.parametrize("bad", [1, 0, -3, True])
def test_a_pinned_gamma_must_allow_one_draft(bad):
    with pytest.raises(UserError) as info:
        resolve_gamma(bad, 8)
    assert info.value.param == "--dflash-gamma" and ">= 2" in str(info.value)


def test_gamma_minus_one_must_cover_the_largest_rung():
    ladder = parse_draft_ladder("1:7,2:5,3:4,4:3,5:2,6:7")
    validate_against_gamma(8, ladder=ladder)  # γ - 1 = 7 covers 7
    with pytest.raises(UserError) as info:
        validate_against_gamma(7, ladder=ladder)
    assert info.value.param == "--dflash-draft-ladder"
    assert "asks for 7 drafts but γ = 7 verifies at most 6" in str(info.value)
    assert "--dflash-gamma 8" in str(info.value)
    # a cost table pricing past γ - 1 is accepted: deeper depths are simply never candidates
    validate_against_gamma(3, cost=parse_cost_model("0:32,1:44,2:50,3:56,4:62"))


def test_speculation_flags_need_a_drafter():
    with pytest.raises(UserError) as info:
        require_drafter(False, dflash_gamma=None, dflash_adaptive_k="0:32,1:44")
    assert info.value.param == "--dflash-adaptive-k"
    assert "no drafter is in use" in str(info.value) and "--draft-model" in str(info.value)
    with pytest.raises(UserError) as info:
        require_drafter(False, dflash_draft_ladder="1:3")
    assert info.value.param == "--dflash-draft-ladder"
    require_drafter(False, dflash_adaptive_k=None, dflash_draft_ladder=None)
    require_drafter(True, dflash_adaptive_k="0:32,1:44")


# --- the rung resolver -------------------------------------------------------------------------------------


def _feed(rung: RungResolver, hits: int, total: int = 64) -> None:
    for i in range(total):
        rung.observe(i < hits)


def test_concurrency_rungs_land_the_records():
    rung = RungResolver(10)
    assert rung.armed and rung.state == "wide"
    assert [rung.block_width(n) for n in (1, 2, 16)] == [10, 4, 4]
    assert [rung.drafts(n) for n in (1, 2)] == [9, 3]
    _feed(rung, 0)
    assert rung.state == "narrow" and rung.block_width(1) == 5 and rung.drafts(1) == 4


def test_widths_never_exceed_the_cap_and_tiny_caps_pin_at_two():
    three = RungResolver(3)
    assert (three.multi, three.narrow, three.wide) == (3, 3, 3)
    assert three.drafts(1) == 2 and three.drafts(4) == 2
    two = RungResolver(2)
    assert (two.multi, two.narrow, two.wide) == (2, 2, 2)
    assert not two.armed and two.drafts(1) == 1


def test_a_pinned_gamma_returns_gamma_minus_one_unchanged():
    rung = RungResolver(10, pinned=True)
    assert not rung.armed
    _feed(rung, 0, 200)
    assert rung.state == "wide" and rung.register == 0
    assert rung.drafts(1) == 9 and rung.drafts(5) == 9


@pytest.mark.parametrize(
    "hits, state",
    [
        (40, "narrow"),
        (46, "narrow"),
        (47, "wide"),
        (49, "wide"),
        (56, "wide"),
        (58, "wide"),
        (60, "wide"),
        (62, "wide"),
    ],
)
def test_hysteresis_from_wide(hits, state):
    rung = RungResolver(10)
    _feed(rung, hits, 63)
    assert rung.state == "wide"  # no decision before 64 scored steps
    rung.observe(False)
    assert rung.hits == hits and rung.state == state


@pytest.mark.parametrize(
    "hits, state",
    [
        (40, "narrow"),
        (46, "narrow"),
        (47, "narrow"),
        (49, "narrow"),
        (56, "narrow"),
        (58, "narrow"),
        (59, "narrow"),
        (60, "wide"),
        (62, "wide"),
    ],
)
def test_hysteresis_from_narrow(hits, state):
    rung = RungResolver(10)
    _feed(rung, 0)
    assert rung.state == "narrow"
    _feed(rung, hits)
    assert rung.hits == hits and rung.state == state


def test_the_shift_register_is_exactly_one_window():
    rung = RungResolver(10)
    _feed(rung, 64)
    assert rung.hits == 64
    rung.observe(False)
    assert rung.hits == 63
    _feed(rung, 0, 64)
    assert rung.hits == 0 and rung.register == 0


def test_dwell_holds_one_full_window_after_a_switch():
    rung = RungResolver(10)
    _feed(rung, 0)  # switch to narrow at the 64th scored step
    assert rung.state == "narrow" and rung.switches == 1
    for _ in range(63):
        rung.observe(True)
    # 63 hits in the window (>= 60 since the 60th) but only 63 steps since the switch: hold
    assert rung.hits == 63 and rung.state == "narrow"
    rung.observe(True)
    assert rung.state == "wide" and rung.switches == 2
    for _ in range(63):
        rung.observe(False)
    assert rung.state == "wide"  # 1 hit in the window, still dwelling
    rung.observe(False)
    assert rung.state == "narrow"


def _lcg_run(rates: list[tuple[float, int]], seed: int) -> RungResolver:
    """Score steps whose first draft is accepted with probability p, from the reference's 64-bit LCG."""
    rung = RungResolver(10)
    x = seed
    for p, steps in rates:
        for _ in range(steps):
            x = (x * 6364136223846793005 + 1442695040888963407) % (1 << 64)
            rung.observe((x >> 11) / float(1 << 53) < p)
    return rung


def test_steady_workloads_rarely_flip_and_transitions_land_in_the_matching_state():
    for seed in range(20):
        assert _lcg_run([(0.76, 2000)], seed).switches <= 6
        assert _lcg_run([(0.97, 2000)], seed).switches <= 2
        assert _lcg_run([(0.875, 2000)], seed).switches <= 16
        to_code = _lcg_run([(0.76, 1000), (0.97, 1000)], seed)
        assert to_code.state == "wide" and to_code.switches <= 46
        to_prose = _lcg_run([(0.97, 1000), (0.76, 1000)], seed)
        assert to_prose.state == "narrow" and to_prose.switches <= 46
