"""The per-step controller: choice, margins, cap, exploration, suspension/re-probe, batches, modes."""

from __future__ import annotations

import pytest

from dflash_jax.errors import UserError
from dflash_jax.spec_decode.control.acceptance import conditional_from_marginals
from dflash_jax.spec_decode.control.choice import choose, plan
from dflash_jax.spec_decode.control.controller import Controller, ControlParams
from dflash_jax.spec_decode.control.cost import CostModel, parse_cost_model, parse_cost_table
from dflash_jax.spec_decode.control.ladder import parse_draft_ladder

TABLE = "0:32,1:44,2:50,3:56,4:62"
MARGINALS = [0.611, 0.312, 0.117, 0.028]


def fixed_rates(rates, **overrides) -> ControlParams:
    """Acceptance pinned to `rates` (a cold prior with nothing else observed)."""
    return ControlParams(cold_weight=1.0, cold_rates=tuple(rates), **overrides)


def exact_counts(**overrides) -> ControlParams:
    """Rates equal to the sequence's own accept/observe ratio (no decay, no prior)."""
    return ControlParams(decay=1.0, prior_weight=0.0, **overrides)


def ctl(table: str = TABLE, gamma: int = 16, **kwargs) -> Controller:
    return Controller(gamma, cost=parse_cost_model(table), **kwargs)


# --- the choice ----------------------------------------------------------------------------------------------


def test_the_choice_maximises_tokens_per_ms_and_suspends_at_a_loss():
    p = plan(parse_cost_table(TABLE), conditional_from_marginals(MARGINALS))
    assert [r.expected_tokens for r in p.rows] == pytest.approx([1, 1.611, 1.923, 2.040, 2.068])
    assert [r.tokens_per_ms for r in p.rows] == pytest.approx([0.03125, 0.03661, 0.03846, 0.03643, 0.03335], abs=1e-5)
    assert p.choice == 2

    c = ctl(params=fixed_rates(conditional_from_marginals(MARGINALS)))
    assert c.mode == "adaptive-k"
    assert c.decide(["a"]) == {"a": 2}
    assert ctl(params=fixed_rates([0.2])).decide(["a"]) == {"a": 0}  # flat 0.2: plain decode
    assert ctl("1:44,2:50,3:56,4:62", params=fixed_rates([0.2])).decide(["a"]) == {"a": 1}  # no 0: entry
    assert ctl(params=fixed_rates([0.95])).decide(["a"]) == {"a": 4}  # capped at the widest priced depth


def test_a_near_tie_keeps_speculating():
    # one draft 2% below the plain rate keeps speculating; 4% below suspends
    assert choose({0: 1.0, 1: 0.98}) == 1
    assert choose({0: 1.0, 1: 0.96}) == 0
    # v(0) = 1/100; v(1) = 1.47/150 = 0.0098 (2% below) and 1.44/150 = 0.0096 (4% below)
    assert ctl("0:100,1:150", params=fixed_rates([0.47])).decide(["a"]) == {"a": 1}
    suspended = ctl("0:100,1:150", params=fixed_rates([0.44]))
    assert suspended.decide(["a"]) == {"a": 0} and suspended.is_suspended("a")


def test_ties_keep_the_shallower_depth_and_margins_bias_against_moves():
    assert choose({1: 0.5, 2: 0.5, 3: 0.4}) == 1
    assert choose({1: 0.50, 2: 0.52}, incumbent=1, deeper_margin=0.05) == 1
    assert choose({1: 0.50, 2: 0.52}, incumbent=1, deeper_margin=0.03) == 2
    assert choose({1: 0.52, 2: 0.50}, incumbent=2, shallower_margin=0.05) == 2


def test_the_cap_is_the_ladder_rung_or_gamma_minus_one():
    rates = fixed_rates([0.95])
    assert ctl(gamma=4, params=rates).decide(["a"]) == {"a": 3}  # γ - 1 = 3
    laddered = Controller(16, cost=parse_cost_model(TABLE), ladder=parse_draft_ladder("1:2,3:4"), params=rates)
    assert laddered.decide(["a"]) == {"a": 2}
    assert laddered.decide(["a", "b", "c"]) == {"a": 4, "b": 4, "c": 4}


# --- no data, exploration ------------------------------------------------------------------------------------


def test_the_controller_starts_at_the_cap_and_explores_one_deeper():
    table = parse_cost_model("0:10,1:11,2:20,3:30,4:40,5:50,6:60,7:70")
    c = Controller(6, cost=table, params=ControlParams.exact_port())
    assert c.rates("s") is None
    assert c.decide(["s"]) == {"s": 5}  # no data: the cap (γ - 1 = 5)
    c.observe("s", 5, 2)  # c = [1, 1, 0] -> v(1) = 2/11 beats v(2) = 3/20
    seen = []
    for _ in range(16):
        k = c.decide(["s"])["s"]
        seen.append(k)
        c.observe("s", k, k)
    assert seen == [1] * 14 + [2, 1]  # decision 15 (0-based, counting the first) explores


def test_exploration_adds_one_draft_on_its_cadence_within_the_cap():
    c = ctl(params=fixed_rates(conditional_from_marginals(MARGINALS), explore_every=4, explore_max=4))
    assert [c.decide(["a"])["a"] for _ in range(12)] == [2, 2, 2, 3] * 3
    capped = ctl(params=fixed_rates([0.95], explore_every=4, explore_max=4))
    assert [capped.decide(["a"])["a"] for _ in range(8)] == [4] * 8


def _explored_at(outputs, choices):
    return [i for i, (o, k) in enumerate(zip(outputs, choices, strict=True)) if o == k + 1]


def test_exploration_backs_off_on_a_stable_choice():
    c = ctl(params=fixed_rates(conditional_from_marginals(MARGINALS), explore_every=4, explore_max=16))
    outputs = [c.decide(["a"])["a"] for _ in range(50)]
    assert _explored_at(outputs, [2] * 50) == [3, 7, 15, 31, 47]
    assert set(outputs) == {2, 3}


def test_exploration_resets_its_gap_when_the_choice_changes():
    c = ctl(params=exact_counts(explore_every=4, explore_max=16))
    c.observe("a", 3, 2)  # c = [1, 1, 0]: E = 1, 2, 3, 3, 3 -> choice 2
    outputs = []
    for step in range(40):
        if step == 20:
            for _ in range(10):
                c.observe("a", 2, 1)  # c2 = 1/11: E(2) = 2.09 and 2.09/50 < 2/44 -> choice 1
        outputs.append(c.decide(["a"])["a"])
    choices = [2] * 20 + [1] * 20
    assert _explored_at(outputs, choices) == [3, 7, 15, 31, 35]


def test_plain_decode_never_explores():
    c = ctl(params=fixed_rates([0.2], explore_every=1, explore_max=1))
    assert c.decide(["a"]) == {"a": 0}


# --- suspension and re-probe ---------------------------------------------------------------------------------


def _suspend(c: Controller, seq="a") -> None:
    c.observe(seq, 4, 0)
    c.observe(seq, 4, 0)  # first drafts rejected: every E is 1 -> plain decode wins
    assert c.decide([seq]) == {seq: 0}
    assert c.is_suspended(seq)


def test_a_suspended_sequence_resumes_after_256_plain_tokens():
    c = ctl()
    _suspend(c)
    c.observe("a", 0)  # the plain token of the step that suspended it
    for _ in range(254):
        assert c.decide(["a"]) == {"a": 0}
        c.observe("a", 0)
    assert c.is_suspended("a")  # 255 plain tokens so far
    assert c.decide(["a"]) == {"a": 0}
    c.observe("a", 0)
    assert not c.is_suspended("a")  # resumed on the 256th
    # the re-probe window: plain decode is not a candidate, so the cheapest draft count is verified
    assert c.decide(["a"]) == {"a": 1}


def test_a_suspended_stream_resumes_with_softened_counts():
    params = ControlParams(resume_after_tokens=4)
    c = ctl(params=params)
    never = ctl("1:44,2:50,3:56,4:62", params=params)  # same evidence, can never suspend
    for x in (c, never):
        x.observe("a", 4, 0)
        x.observe("a", 4, 1)
        x.observe("a", 4, 0)
    rate_before = c.rates("a")
    obs_before = list(c.acceptance.counts("a").obs)
    assert c.decide(["a"]) == {"a": 0}
    for _ in range(4):
        assert c.is_suspended("a")
        c.observe("a", 0)
    assert not c.is_suspended("a")  # resumed on the 4th plain token
    assert c.acceptance.counts("a").obs == pytest.approx([0.25 * o for o in obs_before])
    assert c.rates("a") == pytest.approx(rate_before)  # softening keeps the rate ...
    assert never.rates("a") == pytest.approx(rate_before)
    c.observe("a", 1, 1)
    never.observe("a", 1, 1)
    # ... but new evidence weighs more
    assert c.rates("a")[0] - rate_before[0] > never.rates("a")[0] - rate_before[0] > 0


def test_a_re_probe_lasts_its_window():
    c = ctl(params=ControlParams(resume_after_tokens=4, probe_steps=3))
    _suspend(c)
    for _ in range(4):
        c.observe("a", 0)
    seen = []
    for _ in range(4):
        k = c.decide(["a"])["a"]
        seen.append(k)
        if k:
            c.observe("a", k, 0)
    assert seen == [1, 1, 1, 0]
    assert c.is_suspended("a")


def test_the_exact_port_has_no_re_probe_window():
    c = ctl(params=ControlParams.exact_port(resume_after_tokens=2))
    _suspend(c)
    c.observe("a", 0)
    c.observe("a", 0)
    assert not c.is_suspended("a")
    assert c.decide(["a"]) == {"a": 0}


def test_release_forgets_a_sequence():
    c = ctl()
    _suspend(c)
    c.release("a")
    assert not c.is_suspended("a")
    assert c.decide(["a"])["a"] == 0  # the serve-wide prior still says plain decode pays more


# --- batches ---------------------------------------------------------------------------------------------------


BATCH_TABLE = "0:32,1:44;2=0:40,1:50,2:60,3:70"


def _two_streams(objective: str) -> Controller:
    c = Controller(8, cost=parse_cost_model(BATCH_TABLE), params=exact_counts(objective=objective))
    c.observe("a", 3, 3)  # a: c = [1, 1, 1] -> E = 1 + k
    c.observe("b", 3, 0)  # b: c = [0, ...]  -> E = 1
    return c


def test_a_batch_decision_maximises_the_sum_over_streams():
    # throughput: (2 + k) / cost(2, k) = 2/40, 3/50, 4/60, 5/70 -> 3
    assert _two_streams("throughput").decide(["a", "b"]) == {"a": 3, "b": 3}


def test_a_latency_batch_decision_follows_the_slowest_stream():
    # latency: min E = 1 -> 1/40 beats 1/50 by more than 3%: plain decode, both suspended
    c = _two_streams("latency")
    assert c.decide(["a", "b"]) == {"a": 0, "b": 0}
    assert c.is_suspended("a") and c.is_suspended("b")


def test_suspended_sequences_plain_decode_while_the_others_speculate():
    c = _two_streams("latency")
    assert c.decide(["b"]) == {"b": 0}  # b alone: 1/32 vs 1/44 -> suspended
    # a at width 2: (1 + k) / cost(2, k) = 1/40, 2/50, 3/60, 4/70 -> 3
    assert c.decide(["a", "b"]) == {"a": 3, "b": 0}


def test_a_throughput_decision_counts_the_rows_decoding_plainly():
    # a alone at width 2 gains from 3 drafts (latency: (1 + k) / cost = 1/40, 2/70, 3/90, 4/110 -> 3), but b,
    # suspended, still takes one token per step: (2 + k) / cost = 2/40 = 0.05 beats 5/110 = 0.045 by more than 3%
    table = "0:32,1:44;2=0:40,1:70,2:90,3:110"
    for objective, want in (("latency", 3), ("throughput", 0)):
        c = Controller(8, cost=parse_cost_model(table), params=exact_counts(objective=objective))
        c.observe("a", 3, 3)
        c.observe("b", 3, 0)
        assert c.decide(["b"]) == {"b": 0} and c.is_suspended("b")
        assert c.decide(["a", "b"]) == {"a": want, "b": 0}, objective


def test_compiled_depths_are_the_only_candidates_and_exploration_steps_between_them():
    # rate 1: E = 1 + k; 3/45 at 2 drafts is the best priced depth, 4/79 at 3 the best of the compiled ones 0, 1, 3, 7
    table = "0:30,1:40,2:45,3:79,4:100,5:120,6:140,7:200"
    assert ctl(table, gamma=8, params=fixed_rates([1.0])).decide(["a"]) == {"a": 2}
    c = ctl(table, gamma=8, params=fixed_rates([1.0], explore_every=4, explore_max=4), depths=(0, 1, 3, 7))
    assert [c.decide(["a"])["a"] for _ in range(8)] == [3, 3, 3, 7] * 2  # explores the next compiled depth
    # the cap: the deepest compiled depth within it (a table priced to 5 drafts: 3)
    short = ctl(table.rsplit(",", 2)[0], gamma=8, params=fixed_rates([1.0], explore_every=0), depths=(0, 1, 3, 7))
    assert short.decide(["a"]) == {"a": 3}
    built = Controller.from_flags(adaptive_k=table, gamma=8, block_size=8, compiled_depths=True)
    assert built.depths == {0, 1, 3, 7}
    assert Controller.from_flags(adaptive_k=table, gamma=10, block_size=8, compiled_depths=True).depths == {
        0,
        1,
        3,
        7,
        9,
    }


def test_a_step_at_the_full_width_chooses_between_plain_decoding_and_the_deepest_depth():
    # rate 1: the compiled depth 3 (4 tokens / 79 ms) is best, but at the full width every depth costs 200 ms: 8
    # tokens at depth 7 beat 1 / 30 ms plain; at rate 0.5, 1.99 / 200 ms loses to plain, for that step only
    table = "0:30,1:40,2:45,3:79,4:100,5:120,6:140,7:200"
    c = ctl(table, gamma=8, params=fixed_rates([1.0], explore_every=0), depths=(0, 1, 3, 7))
    assert c.decide(["a"]) == {"a": 3}
    assert c.decide(["a"], full_width=True) == {"a": 7}
    low = ctl(table, gamma=8, params=fixed_rates([0.5], explore_every=0), depths=(0, 1, 3, 7))
    assert low.decide(["a"], full_width=True) == {"a": 0} and not low.is_suspended("a")
    assert low.decide(["a"]) == {"a": 1}
    # a lookup row whose copies pay at depth 3 alone is priced at the full width too
    looked = ctl(table, gamma=8, params=exact_counts(explore_every=0), depths=(0, 1, 3, 7))
    looked.observe("b", 7, 7, lookup=True)
    assert looked.decide(["b"], lookup={"b"}) == {"b": 3}
    assert looked.decide(["b"], lookup={"b"}, full_width=True) == {"b": 7}


def test_calibration_through_the_controller():
    c = Controller(4, cost=parse_cost_model("0:30,1:40"))
    c.observe_step_time(1, 1, 60.0)
    assert c.cost.scale(1) == pytest.approx(1.05)
    assert c.cost.cost(1, 0) == pytest.approx(31.5)
    Controller(4, ladder=parse_draft_ladder("1:3")).observe_step_time(1, 1, 60.0)  # no cost model: a no-op


def test_a_step_of_lookup_rows_alone_is_priced_and_calibrated_with_the_lookup_scale():
    # acceptance 0.5: E = 1, 1.5, 1.75, 1.875 over "0:30,1:60,2:70,3:95" -> 1/30 beats 1.5/60 and 1.875/95: plain
    c = Controller(4, cost=parse_cost_model("0:30,1:60,2:70,3:95"), params=exact_counts(), depths=(0, 1, 3))
    for seq, kw in (("a", {"lookup": True}), ("d", {})):
        c.observe(seq, 1, 1, **kw)
        c.observe(seq, 1, 0, **kw)
    assert c.decide(["a"], lookup={"a"}) == {"a": 0}
    for _ in range(30):  # lookup steps measured at 28.5 ms: their scale falls toward 28.5/95 = 0.3
        c.observe_step_time(1, 2, 28.5, lookup=True)  # 2 drafts verified: the step ran at the compiled depth 3
    assert c.cost.scale(1, lookup=True) == pytest.approx(0.3 + 0.7 * 0.9**30) and c.cost.scale(1) == 1.0
    # now 1.5 / (60 * 0.33) beats 1/30 (the plain step keeps the table's price) and 1.875 / (95 * 0.33)
    assert c.decide(["a"], lookup={"a"}) == {"a": 1}
    assert c.decide(["d"]) == {"d": 0}  # a drafter row is priced with the drafter's scale


def test_an_accept_mask_counts_like_its_leading_accepts():
    a = ctl(params=exact_counts())
    b = ctl(params=exact_counts())
    a.observe("s", 3, [True, True, False])
    b.observe("s", 3, 2)
    assert a.rates("s") == b.rates("s") == pytest.approx([1.0, 1.0] + [0.0] * 14)


# --- the other modes, and building from flags ----------------------------------------------------------------


def test_a_ladder_alone_decides_by_the_number_of_active_sequences():
    c = Controller(8, ladder=parse_draft_ladder("1:7,2:5,3:4,4:3,5:2,6:7"))
    assert c.mode == "ladder"
    ids = [f"s{i}" for i in range(8)]
    assert [set(c.decide(ids[:n]).values()) for n in range(1, 8)] == [{7}, {5}, {4}, {3}, {2}, {7}, {7}]
    assert c.decide([]) == {}


def test_without_adaptive_k_or_a_ladder_the_rung_resolver_decides():
    c = Controller.from_flags(block_size=8)  # γ = 10, armed
    assert c.mode == "rung" and c.gamma == 10 and c.max_drafts == 9
    assert c.decide(["a"]) == {"a": 9} and c.decide(["a", "b"]) == {"a": 3, "b": 3}
    for _ in range(200):  # multi-sequence steps are not scored
        c.observe("a", 3, 0)
    assert c.rung.state == "wide" and c.rung.register == 0
    for _ in range(64):
        assert c.decide(["a"])["a"] == 9
        c.observe("a", 9, 0)
    assert c.rung.state == "narrow"
    assert c.decide(["a"]) == {"a": 4}
    pinned = Controller.from_flags(gamma=6, block_size=8)
    assert pinned.decide(["a"]) == {"a": 5} and pinned.decide(["a", "b"]) == {"a": 5, "b": 5}


def test_from_flags_parses_validates_and_names_the_flag():
    c = Controller.from_flags(adaptive_k="0:32,1:44,2:50", draft_ladder="1:4,2:2", block_size=8)
    assert c.mode == "adaptive-k" and c.gamma == 10 and c.ladder.max_drafts == 4
    assert c.cost.alpha == 0.1
    cases = [
        (dict(adaptive_k="0:32"), "--dflash-adaptive-k"),
        (dict(draft_ladder="2:5"), "--dflash-draft-ladder"),
        (dict(draft_ladder="1:7", gamma=6), "--dflash-draft-ladder"),
        (dict(gamma=1), "--dflash-gamma"),
        (dict(adaptive_k="0:32,1:44", has_drafter=False), "--dflash-adaptive-k"),
        (dict(draft_ladder="1:3", has_drafter=False), "--dflash-draft-ladder"),
        (dict(gamma=4, has_drafter=False), "--dflash-gamma"),
        (dict(adaptive_k="0:32,1:44", objective="fastest"), "--dflash-objective"),
        (dict(objective="throughput"), "--dflash-objective"),
        (dict(adaptive_k="0:32,1:44", objective="throughput", has_drafter=False), "--dflash-adaptive-k"),
        (dict(objective="throughput", has_drafter=False), "--dflash-objective"),
    ]
    for kwargs, flag in cases:
        with pytest.raises(UserError) as info:
            Controller.from_flags(block_size=8, **kwargs)
        assert info.value.param == flag, kwargs
    Controller.from_flags(block_size=8, has_drafter=False)  # nothing set: fine without a drafter
    assert Controller.from_flags(adaptive_k="0:32,1:44", block_size=8).params.objective == "latency"
    assert Controller.from_flags(adaptive_k="0:32,1:44", objective="throughput", block_size=8).params.objective == (
        "throughput"
    )


def test_params_are_validated():
    for bad in [
        dict(objective="speed"),
        dict(explore_every=16, explore_max=8),
        dict(soften=0.0),
        dict(resume_after_tokens=0),
        dict(suspend_margin=-0.1),
    ]:
        with pytest.raises(ValueError):
            ControlParams(**bad)
    with pytest.raises(ValueError):
        CostModel({2: parse_cost_table("0:1,1:2")})


# --- prompt-lookup drafts ----------------------------------------------------------------------------------------


def test_prompt_lookup_drafts_are_priced_apart_and_verified_while_the_drafter_is_suspended():
    c = ctl(params=exact_counts(resume_after_tokens=10))
    for _ in range(3):
        c.observe("a", 4, 0)  # the drafter's drafts: none accepted
    assert c.decide(["a"]) == {"a": 0} and c.is_suspended("a")
    c.observe("a", 4, 4, lookup=True)  # the lookup's: all accepted
    assert c.rates("a")[:4] == [0.0, 0.0, 0.0, 0.0]  # the drafter's acceptance is not the lookup's
    assert c.lookup_acceptance.rates("a")[:4] == [1.0, 1.0, 1.0, 1.0]
    # a step of lookup drafts: E[4] = 5 tokens for 62 ms against 1 for 32 ms; the drafter stays suspended
    assert c.decide(["a"], lookup={"a"}) == {"a": 4} and c.is_suspended("a")
    assert c.decide(["a"]) == {"a": 0}  # no recurring suffix this step: plain decoding
    # a lookup step's tokens count as plain-decoded toward the drafter's resume: 5 + 4 = 9, then 10
    c.observe("a", 4, 3, lookup=True)
    assert c.is_suspended("a")
    c.observe("a", 0)
    assert not c.is_suspended("a")


def test_a_lookup_sequence_left_at_plain_decoding_is_not_suspended_and_its_lookup_evidence_ages():
    # one draft at 44 ms against plain at 32 ms: speculate iff (1 + r) / 44 > (1 / 32) / 1.03, i.e. r > 0.335
    c = Controller(2, cost=parse_cost_model("0:32,1:44"), params=ControlParams(decay=0.5, prior_weight=1.0))
    for _ in range(3):
        c.observe("c", 1, 1, lookup=True)
    for _ in range(3):
        c.observe("b", 1, 0, lookup=True)
    for _ in range(3):
        c.observe("c", 1, 1, lookup=True)
    # b's own counts (0 of 1.75 after decay) against the serve-wide rate 1.777 / 1.996 = 0.890 at weight 1
    assert c.lookup_acceptance.rates("b")[0] == pytest.approx(0.890 / 2.75, abs=1e-3)
    assert c.decide(["b"], lookup={"b"}) == {"b": 0} and not c.is_suspended("b")
    # the plain step ages b's counts by the decay: 1.75 -> 0.875, and the serve-wide rate now wins
    assert c.lookup_acceptance.counts("b").obs[0] == pytest.approx(0.875)
    assert c.lookup_acceptance.rates("b")[0] == pytest.approx(0.890 / 1.875, abs=1e-3)
    assert c.decide(["b"], lookup={"b"}) == {"b": 1}
    c.release("b")
    assert c.lookup_acceptance.counts("b").obs[0] == 0.0


def test_a_batch_prices_lookup_rows_and_drafter_rows_together():
    # "a" drafts with the drafter at 0.6 per position, "b" from lookup at 1.0; throughput sums their tokens
    c = ctl(params=exact_counts(objective="throughput"))
    for _ in range(5):
        c.observe("a", 1, 1)
        c.observe("a", 1, 0)
    for _ in range(3):
        c.observe("b", 4, 4, lookup=True)
    assert c.rates("a")[0] == pytest.approx(0.5) and c.lookup_acceptance.rates("b")[0] == 1.0
    assert c.decide(["a", "b"], lookup={"b"}) == {"a": 4, "b": 4}
    c.observe("a", 4, 0)
    assert c.rates("a")[0] == pytest.approx(5 / 11)


def test_lookup_steps_explore_one_deeper_on_their_own_cadence():
    c = ctl(params=exact_counts(explore_every=16, lookup_explore_every=4))
    c.observe("a", 3, 2, lookup=True)  # rates 1, 1, 0: two drafts (3 tokens for 50 ms) is the best depth
    ks = [c.decide(["a"], lookup={"a"})["a"] for _ in range(8)]
    assert ks == [2, 2, 2, 3, 2, 2, 2, 3]  # every 4th lookup decision verifies one more (same choice: gap 4 -> 8)
    assert [c.decide(["a"], lookup={"a"})["a"] for _ in range(8)] == [2] * 7 + [3]
    assert [c.decide(["b"])["b"] for _ in range(4)] == [4] * 4  # the drafter's cadence is its own (no data: top)


def test_a_lookup_row_whose_copies_do_not_pay_does_not_hold_the_batch_back():
    # latency objective (min over participants): "b"'s lookup drafts are never taken, so alone it would decode
    # plainly; it gets 0 and "a", whose lookup drafts are all taken, still verifies 4 (the old min would give 0)
    c = ctl(params=exact_counts())
    c.observe("a", 4, 4, lookup=True)
    c.observe("b", 4, 0, lookup=True)
    c.observe("b", 4, 0, lookup=True)
    assert c.decide(["a", "b"], lookup={"a", "b"}) == {"a": 4, "b": 0}
    assert not c.is_suspended("b")


def test_a_lookup_row_left_at_plain_decoding_probes_at_a_doubling_gap():
    # the serve-wide prior only learns from lookup steps that run: a row whose lookups do not pay probes once after
    # 4 plain lookup decisions, then after 8, ...; once a probe pays, it takes part again and the gap is reset
    c = ctl(params=exact_counts(lookup_explore_every=4))
    c.observe("b", 4, 0, lookup=True)
    ks = [c.decide(["b"], lookup={"b"})["b"] for _ in range(12)]
    assert ks == [0, 0, 0, 4] + [0] * 7 + [4]
    assert not c.is_suspended("b")
    for _ in range(3):
        c.observe("b", 4, 4, lookup=True)  # the copy started: rate at 1 is 3/4
    assert c.decide(["b"], lookup={"b"}) == {"b": 4}
    for _ in range(26):
        c.observe("b", 4, 0, lookup=True)  # 3 of 30 at position 1: E[4] = 1.4 tokens for 62 ms, plain again
    assert [c.decide(["b"], lookup={"b"})["b"] for _ in range(4)] == [0, 0, 0, 4]  # the gap was reset to 4
    with pytest.raises(ValueError, match="lookup_explore_every"):
        ControlParams(lookup_explore_every=-1)


# --- ragged verify -----------------------------------------------------------------------------------------------

RAGGED_TABLE = "0:30,1:45,2:54,3:61,4:67,5:69,6:74,7:74;4=0:40,1:57,2:80,3:85,4:97,5:101,6:122,7:130"
BUCKETS = (1, 2, 4, 8)


def _ragged(on: bool) -> Controller:
    c = ctl(RAGGED_TABLE, gamma=8, params=exact_counts(explore_every=0, objective="throughput"), depths=(0, 1, 3, 7))
    assert c.use_ragged_verify(BUCKETS if on else None) is on
    return c


def test_a_ragged_verify_is_priced_as_the_plain_step_and_a_share_of_the_full_width_extra():
    c = _ragged(True)
    # at the full width (7 drafts, width 8), one drafting row of four (layout (1 | 3)): 40 + (130 - 40) * sqrt(1/4)
    assert c._price(4, 1, 7, lookup=False) == pytest.approx(85.0)
    assert c._price(4, 2, 7, lookup=False) == pytest.approx(40 + 90 * 0.5**0.5)  # (2 | 2)
    assert c._price(4, 3, 7, lookup=False) == 130.0  # (4 | ...) leaves no room: one width
    assert c._price(4, 1, 3, lookup=False) == 85.0  # width 4: never ragged
    assert c._price(4, 1, 7, lookup=False, ragged=False) == 130.0  # a step carrying prompt chunks
    assert _ragged(False)._price(4, 1, 7, lookup=False) == 130.0


def test_under_a_ragged_verify_one_good_row_speculates_beside_suspended_ones():
    # "a" accepts every draft (E = 1 + k); b, c, d accept none and are suspended alone (1/30 beats 1/45).
    # Throughput over 4 rows, the suspended three adding one token each: one width: 4/40 = 0.1 beats 5/57 = 0.088,
    # 7/85 = 0.082 and 11/130 = 0.085 by more than 3% -> plain, "a" suspended too; ragged: 11/85 = 0.129 at 7 drafts
    for on, want in ((False, 0), (True, 7)):
        c = _ragged(on)
        c.observe("a", 7, 7)
        for s in "bcd":
            c.observe(s, 7, 0)
            assert c.decide([s]) == {s: 0} and c.is_suspended(s)
        assert c.decide(["a", "b", "c", "d"]) == {"a": want, "b": 0, "c": 0, "d": 0}, on


def test_a_ragged_step_calibrates_its_layout_share_not_the_table():
    c = _ragged(True)
    for _ in range(30):  # (1 | 3) steps measured at 67 ms: the share falls toward (67 - 40) / 90 = 0.3
        c.observe_step_time(4, 7, 67.0, drafting=1)
    assert c.ragged_share[(1, 3)] == pytest.approx(0.3 + 0.2 * 0.9**30)
    assert c.cost.scale(4) == 1.0 and (2, 2) not in c.ragged_share
    c.observe_step_time(4, 7, 143.0, drafting=4)  # every row drafted: one width, the table's scale
    assert c.cost.scale(4) == pytest.approx(1.01)
    # a controller without a cost table prices nothing
    assert Controller(4, ladder=parse_draft_ladder("1:3")).use_ragged_verify(BUCKETS) is False
