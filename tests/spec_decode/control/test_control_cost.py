"""Cost tables for --dflash-adaptive-k: parsing, every validation rule, widths, calibration."""

from __future__ import annotations

import math

import pytest

from dflash_jax.errors import UserError
from dflash_jax.spec_decode.control.cost import (
    CostModel,
    bucket,
    format_cost_model,
    parse_cost_model,
    parse_cost_table,
)

FLAG = "--dflash-adaptive-k"


def test_a_table_with_the_plain_step():
    t = parse_cost_table("0:32,1:44,2:50,3:56")
    assert t.first == 0 and t.max_drafts == 3 and t.has_plain
    assert [t.cost(k) for k in range(-1, 5)] == [None, 32.0, 44.0, 50.0, 56.0, None]
    assert list(t.depths()) == [0, 1, 2, 3]
    assert t.to_flag() == "0:32,1:44,2:50,3:56"


def test_a_table_without_the_plain_step_never_prices_zero():
    t = parse_cost_table(" 1:44 , 2:50.5 ")
    assert t.first == 1 and t.max_drafts == 2 and not t.has_plain
    assert t.cost(0) is None and t.cost(2) == 50.5


@pytest.mark.parametrize(
    "text, fragment",
    [
        # not drafts:ms
        ("32", "is not drafts:ms"),
        ("0-32,1:44", "is not drafts:ms"),
        ("0:32,,1:44", "is not drafts:ms"),
        ("0:32:1,1:44", "is not drafts:ms"),
        ("0:,1:44", "is not drafts:ms"),
        ("", "is empty"),
        # a number that does not parse, reported with its pair
        ("x:32,1:44", "cost pair 'x:32': 'x' is not a whole number of drafts"),
        ("-1:32,1:44", "'-1' is not a whole number of drafts"),
        ("1.0:32", "'1.0' is not a whole number of drafts"),
        ("0:abc,1:44", "cost pair '0:abc': 'abc' is not a number of milliseconds"),
        # non-positive or non-finite cost
        ("0:0,1:44", "the cost must be positive"),
        ("0:32,1:-4", "the cost must be positive"),
        ("0:nan,1:44", "the cost must be positive"),
        ("0:32,1:inf", "the cost must be positive"),
        # must start at 0 or 1
        ("2:50,3:56", "must start at 0 or 1 drafts, not 2"),
        # consecutive
        ("0:32,2:50", "draft counts must be consecutive: 2 after 0"),
        ("0:32,1:44,1:45", "draft counts must be consecutive: 1 after 1"),
        ("1:44,0:32", "draft counts must be consecutive: 0 after 1"),
        # nothing priced at k >= 1
        ("0:32", "prices no draft count >= 1"),
    ],
)
def test_every_malformed_table_is_refused_naming_the_flag(text, fragment):
    with pytest.raises(UserError) as info:
        parse_cost_model(text)
    assert info.value.param == FLAG
    message = str(info.value)
    assert message.startswith(FLAG + ": ")
    assert fragment in message
    assert "\n" not in message


def test_the_error_names_whichever_flag_the_caller_parses():
    with pytest.raises(UserError) as info:
        parse_cost_table("0:32", param="--cost")
    assert info.value.param == "--cost" and str(info.value).startswith("--cost: ")


def test_tables_at_wider_batches_price_the_widest_measured_width_below_n():
    m = parse_cost_model("0:32,1:44,2:50;4=0:40,1:61")
    assert list(m.tables) == [1, 4]
    assert m.table_for(0) is m.tables[1] and m.table_for(3) is m.tables[1]
    assert m.table_for(4) is m.tables[4] and m.table_for(100) is m.tables[4]
    assert m.cost(3, 2) == 50.0
    assert m.cost(4, 1) == 61.0 and m.cost(4, 2) is None  # unpriced at width 4
    assert m.max_drafts(1) == 2 and m.max_drafts(8) == 1


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("4=0:40,1:50", "first cost table must be the one-stream table"),
        ("0:32,1:44;4=0:40,1:50;2=0:35,1:45", "batch widths must increase: 2 after 4"),
        ("0:32,1:44;1=0:35,1:45", "batch widths must increase: 1 after 1"),
        ("0:32,1:44;x=0:40,1:50", "'x' is not a batch width"),
        ("0:32,1:44;0=0:40,1:50", "'0' is not a batch width"),
        ("0:32,1:44;4=0:40", "prices no draft count >= 1"),
        ("0:32,1:44;", "group 2 is empty"),
        ("0:32,1:44;4=", "is not drafts:ms"),
    ],
)
def test_malformed_width_groups_are_refused(text, fragment):
    with pytest.raises(UserError) as info:
        parse_cost_model(text)
    assert info.value.param == FLAG and fragment in str(info.value)


def test_bench_output_format_round_trips():
    measured = {4: {0: 40.0, 1: 61.125}, 1: {0: 32.0, 1: 44.5, 2: 50.25}}
    text = format_cost_model(measured)
    assert text == "0:32,1:44.5,2:50.25;4=0:40,1:61.125"
    back = parse_cost_model(text)
    assert {w: dict(t.items()) for w, t in back.tables.items()} == {1: measured[1], 4: measured[4]}
    assert back.to_flag() == text
    with pytest.raises(ValueError):
        format_cost_model({2: {0: 1.0, 1: 2.0}})
    with pytest.raises(ValueError):
        format_cost_model({1: {0: 1.0, 2: 2.0}})


@pytest.mark.parametrize(
    "n, b", [(0, 0), (1, 0), (2, 1), (3, 2), (4, 2), (5, 3), (8, 3), (9, 4), (128, 7), (129, 8), (256, 8), (10**6, 8)]
)
def test_calibration_buckets_are_powers_of_two_up_to_256(n, b):
    assert bucket(n) == b


def test_steps_of_lookup_drafts_alone_are_calibrated_apart():
    m = parse_cost_model("0:30,1:40")
    m.observe(1, 1, 20.0, lookup=True)  # 1 + 0.1 * (20/40 - 1)
    assert m.scale(1, lookup=True) == pytest.approx(0.95) and m.scale(1) == 1.0
    assert m.cost(1, 1, lookup=True) == pytest.approx(38.0) and m.cost(1, 1) == pytest.approx(40.0)
    m.observe(1, 1, 60.0)  # a drafter step moves the drafter scale only
    assert m.scale(1) == pytest.approx(1.05) and m.scale(1, lookup=True) == pytest.approx(0.95)
    assert m.cost(1, 0, lookup=True) == pytest.approx(31.5)  # the plain step is the table's, at the drafter scale
    m.observe(1, 0, 60.0, lookup=True)  # and a plain step moves the drafter scale
    assert m.scale(1) == pytest.approx(1.145) and m.scale(1, lookup=True) == pytest.approx(0.95)


def test_one_measured_step_moves_the_scale_a_tenth_of_the_way():
    # Reference example: table 0:30,1:40, observing 60 ms at k=1 -> scale 1 + 0.1*(60/40 - 1) = 1.05.
    m = parse_cost_model("0:30,1:40")
    m.observe(1, 1, 60.0)
    assert m.scale(1) == pytest.approx(1.05)
    assert m.cost(1, 0) == pytest.approx(31.5)
    assert m.cost(1, 1) == pytest.approx(42.0)
    assert m.scale(2) == 1.0  # other buckets untouched
    m.observe(1, 1, 60.0)  # 1.05 + 0.1*(1.5 - 1.05)
    assert m.scale(1) == pytest.approx(1.095)
    m.observe(3, 0, 60.0)  # width 3 lands in the width-4 bucket: 1 + 0.1*(60/30 - 1)
    assert m.scale(4) == pytest.approx(1.1) and m.scale(3) == pytest.approx(1.1)


def test_bad_or_unpriced_samples_are_ignored_and_alpha_zero_is_exact():
    m = parse_cost_model("0:30,1:40")
    for k, ms in [(1, math.nan), (1, -5.0), (1, 0.0), (1, math.inf), (5, 60.0)]:
        m.observe(1, k, ms)
    assert m.scales == [1.0] * 9
    off = CostModel(parse_cost_table("0:30,1:40"), alpha=0.0)
    off.observe(1, 1, 60.0)
    assert off.cost(1, 1) == 40.0
