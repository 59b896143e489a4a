"""--dflash-draft-ladder: lookup and refusal of every malformed form."""

from __future__ import annotations

import pytest

from dflash_jax.errors import UserError
from dflash_jax.spec_decode.control.ladder import DraftLadder, parse_draft_ladder

FLAG = "--dflash-draft-ladder"


def test_the_reference_ladder_maps_every_concurrency():
    ladder = parse_draft_ladder("1:7,2:5,3:4,4:3,5:2,6:7")
    assert [ladder.drafts_for(n) for n in range(9)] == [7, 7, 5, 4, 3, 2, 7, 7, 7]
    assert ladder.drafts_for(64) == 7
    assert ladder.max_drafts == 7
    assert ladder.to_flag() == "1:7,2:5,3:4,4:3,5:2,6:7"


def test_sparse_thresholds_hold_until_the_next_rung():
    ladder = parse_draft_ladder(" 1:6, 4:3 ,16:1")
    assert [ladder.drafts_for(n) for n in (1, 3, 4, 15, 16, 1000)] == [6, 6, 3, 3, 1, 1]
    assert ladder.max_drafts == 6


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("", "the ladder is empty"),
        ("2:5", "must start at 1 active sequence, not 2"),
        ("1:0", "at least one draft per step"),
        ("1:7,1:5", "thresholds must increase: 1 after 1"),
        ("1:7,3:4,2:5", "thresholds must increase: 2 after 3"),
        ("1-7", "'1-7' is not min_active:drafts"),
        ("1:x", "'x' is not a whole number of drafts"),
    ],
)
def test_a_malformed_ladder_is_refused(text, fragment):
    with pytest.raises(UserError) as info:
        parse_draft_ladder(text)
    assert info.value.param == FLAG
    assert str(info.value).startswith(FLAG + ": ")
    assert fragment in str(info.value)


@pytest.mark.parametrize("text", ["0:5", "1:-2", "a:3", "1:7,2:5:1"])
def test_more_malformed_ladders(text):
    with pytest.raises(UserError):
        parse_draft_ladder(text)


def test_the_dataclass_rejects_what_the_parser_rejects():
    with pytest.raises(ValueError):
        DraftLadder(((2, 5),))
    with pytest.raises(ValueError):
        DraftLadder(((1, 5), (1, 4)))
    with pytest.raises(ValueError):
        DraftLadder(((1, 0),))
