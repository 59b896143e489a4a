"""Parity of speculative and plain greedy output (`bench.parity`): the rounding bound, the near-tie verdict on
hand-made logits, and the reference forward against the runner's own greedy decoding."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.bench.parity import classify, first_difference, judge, rounding_bound, unit_roundoff

U_BF16 = 2.0**-8


def test_unit_roundoff_of_each_dtype():
    assert unit_roundoff(jnp.bfloat16) == 2.0**-8
    assert unit_roundoff(jnp.float16) == 2.0**-11
    assert unit_roundoff(jnp.float32) == 2.0**-24


def test_the_bound_holds_for_bf16_roundings_of_the_hidden_state():
    """Two bf16 roundings of the same hidden state (of two slightly different f32 values, as two paths compute)
    move the gap between any two tokens by less than the bound, which is not vacuous: about 2u of the gap's
    absolute terms."""
    rng = np.random.default_rng(0)
    hdim, vocab = 256, 64
    w = rng.standard_normal((hdim, vocab)).astype(np.float32)
    for _ in range(50):
        exact = rng.standard_normal(hdim).astype(np.float32) * 3
        h1 = np.asarray(jnp.asarray(exact * (1 + 1e-4 * rng.standard_normal(hdim))).astype(jnp.bfloat16), np.float64)
        h2 = np.asarray(jnp.asarray(exact * (1 + 1e-4 * rng.standard_normal(hdim))).astype(jnp.bfloat16), np.float64)
        a, b = rng.choice(vocab, 2, replace=False)
        g1 = h1 @ (w[:, a] - w[:, b])
        g2 = h2 @ (w[:, a] - w[:, b])
        bound = rounding_bound(h1, w, int(a), int(b), U_BF16)
        assert abs(g1 - g2) <= bound
        assert bound < 3 * U_BF16 * np.abs(h1) @ np.abs(w[:, a] - w[:, b])


def _case(delta: float):
    """h = [4, 4]; token 0 = [0, 0] (logit 0), token 1 = [1, -1 + delta/4] (logit delta), token 2 = [-5, 0]
    (logit -20): the gap between tokens 0 and 1 is delta while the terms it cancels sum to about 8, so their bound
    is about 2u * 8 = 1/16."""
    h = np.array([4.0, 4.0])
    w = np.array([[0.0, 1.0, -5.0], [0.0, -1.0 + delta / 4, 0.0]])
    return h @ w, h, w


def test_a_gap_within_the_bound_is_a_near_tie():
    logits, h, w = _case(0.01)
    kind, gap, bound, top = judge(logits, h, w, spec=0, plain=1, u=U_BF16)
    assert (kind, top) == ("near_tie", 1)
    assert gap == pytest.approx(0.01)
    assert bound == pytest.approx(2 * U_BF16 * (4 * 1 + 4 * (1 - 0.01 / 4)), rel=1e-4)  # + the f32 dot's tiny share


def test_a_clear_gap_is_other():
    logits, h, w = _case(0.5)
    kind, gap, bound, _ = judge(logits, h, w, spec=0, plain=1, u=U_BF16)
    assert kind == "other" and gap == pytest.approx(0.5) and bound < 0.07
    kind, gap, bound, _ = judge(logits, h, w, spec=1, plain=2, u=U_BF16)  # token 2 is 20.5 below the top
    assert kind == "other" and gap == pytest.approx(20.5)


def test_first_difference():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2


def test_classify_against_the_runners_greedy_decoding(tiny_target):
    """The reference forward reproduces the greedy tokens of a tiny f32 model: its own outputs are identical,
    and an output that swaps in a token the target ranks far below is `other`."""
    from dflash_jax.engine.offline import OfflineEngine
    from dflash_jax.types import SamplingParams

    models, runner = tiny_target
    tok = models.target.tokenizer
    prompts = [tok.encode("the cat sat"), tok.encode("hello there, friend")]
    with OfflineEngine(runner, tok, max_num_seqs=1) as llm:
        outs = [list(o.token_ids) for o in llm.generate(prompts, SamplingParams(), max_tokens=6, ignore_eos=True)]
    counts, divs = classify(models.target.model, prompts, outs, outs)
    assert counts == {"identical": 2, "near_tie": 0, "other": 0} and divs == []
    from dflash_jax.bench.parity import reference_last

    logits, _ = reference_last(models.target.model, [*prompts[1], *outs[1][:3]])
    assert int(np.argmax(logits)) == outs[1][3]  # the reference agrees with the runner's greedy token
    worst = int(np.argmin(logits))
    bad = [outs[0], [*outs[1][:3], worst, *outs[1][4:]]]
    counts, divs = classify(models.target.model, prompts, bad, outs)
    assert counts == {"identical": 1, "near_tie": 0, "other": 1}
    (d,) = divs
    assert (d.prompt, d.position, d.spec_token, d.plain_token, d.reference_token) == (
        1,
        3,
        worst,
        outs[1][3],
        outs[1][3],
    )
    assert d.gap > d.bound


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    from dflash_jax.builder import build_runner, load_models
    from tests.tinymodels import write_tiny_llama

    path = write_tiny_llama(tmp_path_factory.mktemp("tiny"))
    models = load_models(str(path), None)
    return models, build_runner(models, max_slots=1, max_model_len=64)
