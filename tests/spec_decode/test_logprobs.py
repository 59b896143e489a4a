"""Log-probabilities from the jitted steps: the target's raw distribution, the same with and without speculation.

Reference: one plain full-sequence forward of the target (no KV cache, no runner) over prompt + generated tokens;
log_softmax of its logits (float64, numpy) at the position before each token. Against it: the chosen token's
log-probability and the top alternatives from prefill and verify (greedy and sampled: raw logprobs do not depend on
temperature), the prompt's log-probabilities (a prompt longer than one `PROMPT_CHUNK`), speculation with a random
drafter giving bit-identical log-probabilities to plain decoding, and a batch where only some rows ask.
"""

from __future__ import annotations

import jax
import jax.extend  # noqa: F401  (jaxprs_in_params, to walk traced programs)
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dflash_jax.models.target import contiguous_kv_cache, target_forward
from dflash_jax.spec_decode.logprobs import PROMPT_CHUNK, emitted_tokens
from dflash_jax.spec_decode.runner import SpecRunner
from dflash_jax.types import MAX_ENDING_TOKENS, MAX_TOP_LOGPROBS, SamplingParams, StepResult

MAX_LEN = 256
N_NEW = 12
TOP = 5


def ref_logprobs(model, seq: list[int]) -> np.ndarray:
    """log_softmax (float64) of the target's logits at every position of `seq`: row t predicts seq[t+1]."""
    graphdef, state = nnx.split(model)
    t = len(seq)
    toks = jnp.asarray([seq], jnp.int32)
    pos = jnp.arange(t, dtype=jnp.int32)[None, :]
    out = target_forward(graphdef, state, toks, pos, *contiguous_kv_cache(model.cfg, 1, t), kv_len=t)
    z = np.asarray(out.logits[0], np.float64)
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def generate(runner: SpecRunner, prompts, sps, n: int = N_NEW) -> tuple[dict[int, list], dict[int, StepResult]]:
    """Drive the runner as the engine does; per slot the (token, TokenLogprob) pairs and the prefill's result."""
    first = runner.add_many([(i, p, sp) for i, (p, sp) in enumerate(zip(prompts, sps, strict=True))])
    out = {i: list(zip(r.tokens, r.logprobs or [None] * len(r.tokens), strict=True)) for i, r in first.items()}
    active = list(out)
    while active:
        res = runner.step(active, {i: n - len(out[i]) for i in active})
        for i, r in res.items():
            assert r.logprobs is None or len(r.logprobs) == len(r.tokens)
            out[i] += list(zip(r.tokens, r.logprobs or [None] * len(r.tokens), strict=True))
        active = [i for i in active if len(out[i]) < n]
    for i in out:
        runner.release(i)
    return {i: o[:n] for i, o in out.items()}, first


@pytest.fixture(scope="module")
def prompts(tiny_llama_cfg) -> list[list[int]]:
    rng = np.random.default_rng(3)
    return [rng.integers(0, tiny_llama_cfg.vocab_size - 1, size=n).tolist() for n in (5, 11, 3)]


def check_against_reference(model, prompt: list[int], pairs, top: int = TOP, greedy: bool = True) -> None:
    seq = prompt + [t for t, _ in pairs]
    ref = ref_logprobs(model, seq)
    for j, (tok, lp) in enumerate(pairs):
        row = ref[len(prompt) - 1 + j]
        if greedy:
            assert tok == int(np.argmax(row))
        np.testing.assert_allclose(lp.logprob, row[tok], atol=2e-5, rtol=0)
        want = np.argsort(-row)[:top]
        assert [i for i, _ in lp.top] == want.tolist()
        np.testing.assert_allclose([v for _, v in lp.top], row[want], atol=2e-5, rtol=0)
        if greedy:  # the chosen token is the most likely one, with the very same number
            assert lp.top[0] == (tok, lp.logprob)


def test_plain_greedy_logprobs_equal_log_softmax_of_a_plain_forward(tiny_target, prompts):
    runner = SpecRunner(tiny_target, None, max_slots=4, max_model_len=MAX_LEN, batch_buckets=(4,))
    out, _ = generate(runner, prompts, [SamplingParams(logprobs=TOP)] * len(prompts))
    for i, p in enumerate(prompts):
        check_against_reference(tiny_target, p, out[i])


@pytest.mark.parametrize("layout", ["in-out", "out-in"])
def test_speculative_greedy_logprobs_are_identical_to_plain(tiny_target, tiny_drafter, prompts, layout):
    """With `[in, out]` weights this tiny target's dots compute a row alike at any token count, so the verify's
    floats are the plain step's bit for bit. `DenseRows` (`out-in`, the CPU default) sums a one-token dot in
    another order than a block's: the same tokens, log-probabilities equal to float rounding."""
    sps = [SamplingParams(logprobs=MAX_TOP_LOGPROBS)] * len(prompts)
    kw = dict(max_slots=4, max_model_len=MAX_LEN, batch_buckets=(4,), dense_layout=layout)
    plain = SpecRunner(tiny_target, None, **kw)
    spec = SpecRunner(tiny_target, tiny_drafter, **kw)
    a, _ = generate(plain, prompts, sps)
    b, _ = generate(spec, prompts, sps)
    if layout == "in-out":
        assert a == b  # tokens and every float, bit for bit
    for i in a:
        assert [t for t, _ in a[i]] == [t for t, _ in b[i]]
        for (_, x), (_, y) in zip(a[i], b[i], strict=True):
            assert [t for t, _ in x.top] == [t for t, _ in y.top]
            np.testing.assert_allclose([v for _, v in x.top], [v for _, v in y.top], rtol=0, atol=1e-4)
    for i, p in enumerate(prompts):
        check_against_reference(tiny_target, p, b[i], top=MAX_TOP_LOGPROBS)


def test_sampled_logprobs_are_the_raw_distribution(tiny_target, tiny_drafter, prompts):
    """At T = 1.5 with top-k 3 the tokens are sampled, but the log-probabilities are the unprocessed target's."""
    sps = [SamplingParams(temperature=1.5, top_k=3, seed=7 + i, logprobs=TOP) for i in range(len(prompts))]
    spec = SpecRunner(tiny_target, tiny_drafter, max_slots=4, max_model_len=MAX_LEN, batch_buckets=(4,))
    out, _ = generate(spec, prompts, sps)
    gaps = []
    for i, p in enumerate(prompts):
        check_against_reference(tiny_target, p, out[i], greedy=False)
        ref = ref_logprobs(tiny_target, p + [t for t, _ in out[i]])
        for j, (tok, _) in enumerate(out[i]):
            row = ref[len(p) - 1 + j] / 1.5  # the processed distribution: T = 1.5, then the top 3 renormalised
            top3 = np.argsort(-row)[:3]
            assert tok in top3  # sampled from the processed distribution
            processed = row[tok] - np.log(np.exp(row[top3]).sum())
            gaps.append(abs(processed - ref[len(p) - 1 + j, tok]))
    assert max(gaps) > 1e-2  # so the raw and processed log-probabilities are told apart


def test_prompt_logprobs_equal_a_plain_forward(tiny_target, tiny_drafter):
    rng = np.random.default_rng(5)
    long = rng.integers(0, 127, size=PROMPT_CHUNK + 23).tolist()  # two chunks of prompt rows
    short = rng.integers(0, 127, size=6).tolist()
    spec = SpecRunner(tiny_target, tiny_drafter, max_slots=2, max_model_len=MAX_LEN, batch_buckets=(2,))
    first = spec.add_many(
        [(0, long, SamplingParams(prompt_logprobs=3)), (1, short, SamplingParams(logprobs=0, prompt_logprobs=0))]
    )
    for slot, p in ((0, long), (1, short)):
        got = first[slot].prompt_logprobs
        ref = ref_logprobs(tiny_target, p)
        assert got is not None and len(got) == len(p) - 1
        np.testing.assert_allclose([g.logprob for g in got], [ref[t - 1, p[t]] for t in range(1, len(p))], atol=2e-5)
        k = 3 if slot == 0 else 0
        for t, g in enumerate(got, start=1):
            assert [i for i, _ in g.top] == np.argsort(-ref[t - 1])[:k].tolist()
    assert first[0].logprobs is None and first[1].logprobs is not None and first[1].logprobs[0].top == ()
    assert first[1].logprobs[0].logprob == pytest.approx(
        ref_logprobs(tiny_target, short + first[1].tokens)[5, first[1].tokens[0]], abs=2e-5
    )


def test_rows_that_do_not_ask_get_none_and_the_same_tokens(tiny_target, tiny_drafter, prompts):
    spec = SpecRunner(tiny_target, tiny_drafter, max_slots=4, max_model_len=MAX_LEN, batch_buckets=(4,))
    base, _ = generate(spec, prompts, [SamplingParams()] * len(prompts))
    mixed, _ = generate(spec, prompts, [SamplingParams(logprobs=2), SamplingParams(), SamplingParams(logprobs=1)])
    for i in base:
        assert [t for t, _ in mixed[i]] == [t for t, _ in base[i]]
        assert all(lp is None for _, lp in base[i])
    assert all(lp is None for _, lp in mixed[1])
    assert all(lp is not None and len(lp.top) == 2 for _, lp in mixed[0])
    assert all(lp is not None and len(lp.top) == 1 for _, lp in mixed[2])


def test_more_alternatives_than_the_cap_are_refused(tiny_target):
    from dflash_jax.errors import UserError

    runner = SpecRunner(tiny_target, None, max_slots=1, max_model_len=MAX_LEN)
    with pytest.raises(UserError, match="logprobs must be between 0 and 20"):
        runner.add(0, [1, 2, 3], SamplingParams(logprobs=MAX_TOP_LOGPROBS + 1))


def test_emitted_tokens_pick_accepted_drafts_then_the_bonus():
    drafts = jnp.asarray([[5, 6, 7], [5, 6, 7], [5, 6, 7]], jnp.int32)
    out = emitted_tokens(drafts, jnp.asarray([0, 2, 3]), jnp.asarray([9, 8, 4]))
    assert np.asarray(out).tolist() == [[9, 9, 9, 9], [5, 6, 8, 8], [5, 6, 7, 4]]


def _top_k_outside_cond(jaxpr) -> bool:
    """Whether a `top_k` runs unconditionally in `jaxpr` (sub-jaxprs walked, a `cond`'s branches skipped)."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "cond":
            continue
        if eqn.primitive.name == "top_k":
            return True
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            if _top_k_outside_cond(sub):
                return True
    return False


def test_steps_compute_no_logprobs_unless_asked(tiny_target, tiny_drafter):
    """The prefill and step run their top-k and log_softmax only under a runtime `want_logprobs` (inside a
    `cond`; prompt log-probabilities are a static variant): requests that do not ask pay nothing, and one compiled
    program serves both. Asked or not, the emitted tokens are the same; unasked, the log-probabilities are zeros."""
    from dflash_jax.spec_decode.sampling import SamplingArrays

    r = SpecRunner(tiny_target, tiny_drafter, max_slots=2, max_model_len=MAX_LEN, batch_buckets=(2,))
    b = 2
    sp = SamplingArrays(jnp.zeros(b), jnp.zeros(b, jnp.int32), jnp.ones(b), jnp.zeros(b, jnp.uint32))
    slots, zeros = jnp.arange(b, dtype=jnp.int32), jnp.zeros(b, jnp.int32)
    banned = jnp.full((b, MAX_ENDING_TOKENS), -1, jnp.int32)
    for flag in (False, True):
        pre = r.programs.prefill.trace(
            r.weights,
            r.state,
            slots,
            jnp.zeros((b, 8), jnp.int32),
            jnp.ones((b, 128), jnp.int32),
            zeros,
            jnp.full((b,), 4, jnp.int32),
            jnp.ones((b,), bool),
            sp,
            zeros,
            banned,
            jnp.asarray(flag),
            kv_len=128,
            sampled=0,
            prompt_logprobs=flag,
        )
        ver = r.programs.step.trace(
            r.weights,
            r.state,
            slots,
            jnp.zeros((b, 8), jnp.int32),
            zeros + 3,
            jnp.asarray(flag),
            kv_len=128,
            width=4,
            sampled=0,
            speculative=True,
        )
        assert _top_k_outside_cond(pre.jaxpr.jaxpr) == flag  # prompt log-probabilities: static
        assert not _top_k_outside_cond(ver.jaxpr.jaxpr)
        assert "top_k" in str(ver.jaxpr)  # inside the cond
    outs = {}
    for want in (None, 0):
        run = SpecRunner(tiny_target, tiny_drafter, max_slots=2, max_model_len=MAX_LEN, batch_buckets=(2,))
        first = run.add_many([(s, [3, 1, 4, 1, 5], SamplingParams(logprobs=want)) for s in range(2)])
        steps = [run.step([0, 1], {0: 4, 1: 4}) for _ in range(3)]
        outs[want] = ([first[s].tokens for s in range(2)], [[st[s].tokens for s in range(2)] for st in steps])
    assert outs[None] == outs[0]
