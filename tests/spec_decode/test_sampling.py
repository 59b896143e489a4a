"""Sampling: the processed distribution (temperature -> top-k -> top-p) against a numpy reference (and HF's
logits warpers when transformers is installed), and the lossless speculative rule: over many seeded trials on a
small vocabulary the tokens emitted by `speculative_accept` with a fixed greedy draft are distributed exactly as
the target's processed distribution (chi-square, p > 1e-3, deterministic seeds), at the first and the second
position, with and without top-k/top-p; plain `sample_tokens` too. Greedy rows reduce to argmax / exact match.
"""

from __future__ import annotations

import jax
import jax.extend  # noqa: F401  (ClosedJaxpr / Jaxpr, to walk traced programs)
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from dflash_jax.spec_decode.sampling import (
    SamplingArrays,
    greedy_accept,
    processed_logprobs,
    sample_tokens,
    speculative_accept,
)


def sp_arrays(params: list[tuple[float, int, float]], seeds=None) -> SamplingArrays:
    n = len(params)
    return SamplingArrays(
        temperature=jnp.asarray([t for t, _, _ in params], jnp.float32),
        top_k=jnp.asarray([k for _, k, _ in params], jnp.int32),
        top_p=jnp.asarray([p for _, _, p in params], jnp.float32),
        seed=jnp.asarray(np.arange(n) if seeds is None else seeds, jnp.uint32),
    )


def ref_probs(logits: np.ndarray, t: float, k: int, p: float) -> np.ndarray:
    """Numpy reference for one row of logits [V] (float64)."""
    z = logits.astype(np.float64)
    if t <= 0:
        return np.eye(len(z))[np.argmax(z)]
    z = z / t
    if k > 0:
        kth = np.sort(z)[::-1][min(k, len(z)) - 1]
        z = np.where(z >= kth, z, -np.inf)
    probs = np.exp(z - z.max())
    probs /= probs.sum()
    order = np.argsort(-probs, kind="stable")
    before = np.cumsum(probs[order]) - probs[order]  # mass of the strictly more likely tokens
    keep = np.zeros(len(z), bool)
    keep[order] = before < p
    keep[order[0]] = True
    probs = np.where(keep, probs, 0.0)
    return probs / probs.sum()


PARAMS = [
    (1.0, 0, 1.0),  # untouched softmax
    (0.7, 5, 1.0),  # temperature + top-k
    (1.3, 0, 0.9),  # temperature + top-p
    (0.5, 10, 0.6),  # all three
    (2.0, 3, 0.3),  # top-p inside top-k
    (1.0, 1, 1.0),  # top-1
    (1.0, 0, 1e-6),  # nucleus of one token
    (0.0, 7, 0.5),  # greedy (top-k/top-p ignored)
]


def test_processed_distribution_matches_numpy_reference():
    rng = np.random.default_rng(0)
    logits = (2.0 * rng.standard_normal((len(PARAMS), 3, 50))).astype(np.float32)
    got = np.exp(np.asarray(processed_logprobs(jnp.asarray(logits), sp_arrays(PARAMS))))
    for b, (t, k, p) in enumerate(PARAMS):
        for r in range(3):
            ref = ref_probs(logits[b, r], t, k, p)
            np.testing.assert_allclose(got[b, r], ref, atol=1e-6, err_msg=f"params {(t, k, p)} row {r}")
            if k > 0 and t > 0:
                assert (ref > 0).sum() <= k
    # the parameters really cut: top-k=5 keeps 5, top-p=0.3 inside top-3 keeps fewer than 3 tokens somewhere
    assert ((got[1] > 0).sum(-1) == 5).all()
    assert ((got[4] > 0).sum(-1) < 3).any()


def test_processed_distribution_matches_hf_warpers():
    torch = pytest.importorskip("torch")
    tr = pytest.importorskip("transformers")
    rng = np.random.default_rng(1)
    logits = (2.0 * rng.standard_normal((len(PARAMS) - 1, 1, 40))).astype(np.float32)
    got = np.exp(np.asarray(processed_logprobs(jnp.asarray(logits), sp_arrays(PARAMS[:-1]))))
    for b, (t, k, p) in enumerate(PARAMS[:-1]):
        scores = torch.from_numpy(logits[b])
        scores = tr.TemperatureLogitsWarper(t)(None, scores)
        if k > 0:
            scores = tr.TopKLogitsWarper(k)(None, scores)
        if p < 1.0:
            scores = tr.TopPLogitsWarper(p)(None, scores)
        ref = torch.softmax(scores, -1).numpy()[0]
        np.testing.assert_allclose(got[b, 0], ref, atol=1e-6, err_msg=f"params {(t, k, p)}")


# ------------------------------------------------------------------------------------------- lossless rule
V = 8
N = 40_000
LOGITS = np.array(
    [
        [1.2, 0.3, -0.5, 2.0, 0.9, -1.5, 0.1, 1.6],
        [0.2, 1.7, 1.1, -0.4, 0.6, 2.1, -0.9, 0.0],
        [-0.3, 0.5, 1.9, 0.8, -1.2, 0.4, 1.3, 0.7],
    ],
    np.float32,
)

_accept = jax.jit(speculative_accept)
_sample = jax.jit(sample_tokens)


def chi2_ok(samples: np.ndarray, probs: np.ndarray, what: str) -> None:
    counts = np.bincount(samples, minlength=V)
    support = probs > 0
    assert counts[~support].sum() == 0, f"{what}: tokens outside the support {np.nonzero(counts * ~support)}"
    res = stats.chisquare(counts[support], probs[support] * counts.sum())
    assert res.pvalue > 1e-3, f"{what}: counts {counts} vs expected {np.round(probs * counts.sum())} (p={res.pvalue})"


@pytest.mark.parametrize(
    "params, drafts, num_drafts",
    [
        ((1.0, 0, 1.0), (7, 5), 2),  # d1 = a likely token, d2 = row 1's mode
        ((1.0, 0, 1.0), (2, 6), 2),  # d1 unlikely, d2 unlikely
        ((0.8, 5, 0.85), (5, 1), 2),  # d1 outside the top-k/top-p support: always rejected
        ((1.5, 0, 0.7), (0, 2), 2),  # top-p only
        ((0.6, 4, 1.0), (3, 5), 1),  # one draft: the second token is the bonus sampled from row 1
    ],
    ids=["plain-likely", "plain-unlikely", "topk-topp-outside", "topp", "one-draft"],
)
def test_speculative_accept_is_lossless(params, drafts, num_drafts):
    """First emitted token ~ p0. Given the first equals d1, the second ~ p1 (the next verify row's
    distribution, conditioned on the prefix [d1]). Seeds differ per trial; everything is deterministic."""
    sp = sp_arrays([params] * N, seeds=np.arange(N) * 7919 + 1)
    logits = jnp.broadcast_to(jnp.asarray(LOGITS), (N, 3, V))
    dr = jnp.broadcast_to(jnp.asarray(drafts, jnp.int32), (N, 2))
    positions = jnp.broadcast_to(jnp.arange(20, 23, dtype=jnp.int32), (N, 3))
    accepted, bonus = _accept(dr, logits, jnp.full((N,), num_drafts, jnp.int32), sp, positions)
    accepted, bonus = np.asarray(accepted), np.asarray(bonus)
    assert accepted.max() <= num_drafts
    p0, p1 = ref_probs(LOGITS[0], *params), ref_probs(LOGITS[1], *params)

    first = np.where(accepted >= 1, drafts[0], bonus)
    chi2_ok(first, p0, "first token")
    # the draft is accepted with probability p0(d1) (std of the estimate is ~0.0025 at N=40k)
    assert abs((accepted >= 1).mean() - p0[drafts[0]]) < 0.015
    # on rejection the emitted token is never the rejected draft
    assert not np.any((accepted == 0) & (bonus == drafts[0]))

    cond = accepted >= 1
    if p0[drafts[0]] > 0.05:
        second = np.where(accepted[cond] >= 2, drafts[1], bonus[cond])
        chi2_ok(second, p1, "second token given the first draft")


def test_plain_sampling_matches_processed_distribution():
    params = (0.9, 6, 0.9)
    sp = sp_arrays([params] * N, seeds=np.arange(N) + 3)
    toks = _sample(jnp.broadcast_to(jnp.asarray(LOGITS[2:3]), (N, 1, V)), sp, jnp.full((N, 1), 5, jnp.int32))
    chi2_ok(np.asarray(toks)[:, 0], ref_probs(LOGITS[2], *params), "plain sample")


def test_chi_square_check_detects_a_wrong_rule():
    """The statistical check has power: sampling the rejection token from p (not the residual) fails it."""
    params = (1.0, 0, 1.0)
    p0 = ref_probs(LOGITS[0], *params)
    rng = np.random.default_rng(0)
    d = 7
    acc = rng.random(N) < p0[d]
    wrong = np.where(acc, d, rng.choice(V, size=N, p=p0))
    with pytest.raises(AssertionError):
        chi2_ok(wrong, p0, "wrong rule")


# ------------------------------------------------------------------------------------------- greedy rows
def test_greedy_rows_reduce_to_argmax_and_exact_match():
    rng = np.random.default_rng(2)
    b, k, v = 64, 4, 16
    logits = rng.standard_normal((b, k + 1, v)).astype(np.float32)
    am = logits.argmax(-1)
    drafts = am[:, :k].copy()
    wrong = rng.random((b, k)) < 0.35
    drafts[wrong] = (drafts[wrong] + 1 + rng.integers(0, v - 1, wrong.sum())) % v
    num_drafts = rng.integers(0, k + 1, b)
    # expected: longest matching prefix within num_drafts, bonus = argmax at that row
    exp_acc = np.array([next((j for j in range(n) if drafts[i, j] != am[i, j]), n) for i, n in enumerate(num_drafts)])
    exp_bonus = am[np.arange(b), exp_acc]
    assert set(exp_acc) == set(range(k + 1))

    greedy_params = [(0.0, int(rng.integers(0, 5)), float(rng.uniform(0.1, 1.0))) for _ in range(b)]
    args = (jnp.asarray(drafts, jnp.int32), jnp.asarray(logits), jnp.asarray(num_drafts, jnp.int32))
    pos = jnp.broadcast_to(jnp.arange(k + 1, dtype=jnp.int32), (b, k + 1))
    acc, bonus = _accept(*args, sp_arrays(greedy_params), pos)
    np.testing.assert_array_equal(np.asarray(acc), exp_acc)
    np.testing.assert_array_equal(np.asarray(bonus), exp_bonus)
    acc_g, bonus_g = greedy_accept(args[0], jnp.asarray(am, jnp.int32), args[2])
    np.testing.assert_array_equal(np.asarray(acc_g), exp_acc)
    np.testing.assert_array_equal(np.asarray(bonus_g), exp_bonus)

    # mixed batch: the greedy rows stay exact whatever the sampled rows do
    mixed = [gp if i % 2 == 0 else (1.0, 0, 1.0) for i, gp in enumerate(greedy_params)]
    acc_m, bonus_m = _accept(*args, sp_arrays(mixed), pos)
    np.testing.assert_array_equal(np.asarray(acc_m)[::2], exp_acc[::2])
    np.testing.assert_array_equal(np.asarray(bonus_m)[::2], exp_bonus[::2])
    toks = _sample(jnp.asarray(logits), sp_arrays(greedy_params), pos)
    np.testing.assert_array_equal(np.asarray(toks), am)


def test_samples_depend_on_seed_and_position_not_on_batch_row():
    rng = np.random.default_rng(3)
    logits = rng.standard_normal((4, 1, 32)).astype(np.float32)
    logits[:] = logits[0]
    pos = jnp.asarray([[9], [9], [9], [10]], jnp.int32)
    sp = sp_arrays([(1.0, 0, 1.0)] * 4, seeds=[5, 6, 5, 5])
    many = [np.asarray(_sample(jnp.asarray(logits), sp._replace(seed=sp.seed + s), pos))[:, 0] for s in range(40)]
    many = np.stack(many)
    np.testing.assert_array_equal(many[:, 0], many[:, 2])  # same seed and position, different row: same draws
    assert (many[:, 0] != many[:, 1]).any()  # another seed
    assert (many[:, 0] != many[:, 3]).any()  # another position


# ------------------------------------------------------------------------------------------- through the runner
def test_runner_sampling_spec_and_plain_match_the_target_distribution(tiny_target, tiny_drafter):
    """End to end at T > 0: the first two generated tokens (the second from a verify step whose first draft is the
    target's mode, so it is accepted often) have the joint distribution p(f) p(s | f) of the processed target
    distribution, with speculation and without. 64 sequences per round, each with its own seed."""
    from flax import nnx

    from dflash_jax.models.target import contiguous_kv_cache, target_forward
    from dflash_jax.spec_decode.oracle import GivenDraftsRunner
    from dflash_jax.spec_decode.runner import SpecRunner
    from dflash_jax.types import SamplingParams

    t, k, p = 1.0, 4, 0.95
    prompt = [5, 17, 99, 3, 42]
    graphdef, state = nnx.split(tiny_target)

    def next_logits(seq):  # full forward over the sequence padded to 16 (one compilation), logits at its end
        toks = np.zeros((1, 16), np.int32)
        toks[0, : len(seq)] = seq
        out = target_forward(
            graphdef,
            state,
            jnp.asarray(toks),
            jnp.arange(16, dtype=jnp.int32)[None],
            *contiguous_kv_cache(tiny_target.cfg, 1, 16),
            jnp.asarray([len(seq) - 1], jnp.int32),
            kv_len=16,
            last_only=True,
        )
        return np.asarray(out.logits)[0, 0]

    p1 = ref_probs(next_logits(prompt), t, k, p)
    firsts = np.nonzero(p1)[0]
    p2 = {int(f): ref_probs(next_logits(prompt + [int(f)]), t, k, p) for f in firsts}
    greedy_after = {}
    for f in firsts:
        seq = prompt + [int(f)]
        for _ in range(tiny_drafter.cfg.block_size - 1):
            seq.append(int(next_logits(seq).argmax()))
        greedy_after[int(f)] = seq[len(prompt) + 1 :]
    cells = [(int(f), s) for f in firsts for s in np.nonzero(p2[int(f)])[0]]
    expected = np.array([p1[f] * p2[f][s] for f, s in cells])
    index = {c: i for i, c in enumerate(cells)}

    class ModeOracle(GivenDraftsRunner):
        def given_drafts(self, slot_list, width):
            return np.asarray([greedy_after[self.slots[s].anchor][: width - 1] for s in slot_list], np.int32)

    B, rounds = 64, 40
    results = {}
    for name, runner in (
        ("plain", SpecRunner(tiny_target, None, max_slots=B, max_model_len=16, batch_buckets=(B,))),
        ("spec", ModeOracle(tiny_target, tiny_drafter, max_slots=B, max_model_len=16, batch_buckets=(B,))),
    ):
        counts = np.zeros(len(cells), np.int64)
        accepted_first = 0
        for r in range(rounds):
            first = runner.add_many([(s, prompt, SamplingParams(t, p, k, seed=1000 * r + s)) for s in range(B)])
            res = runner.step(list(range(B)), {s: 8 for s in range(B)})
            for s in range(B):
                f, second = first[s].tokens[0], res[s].tokens[0]
                counts[index[(f, second)]] += 1
                accepted_first += res[s].num_accepted >= 1
                runner.release(s)
        res = stats.chisquare(counts, expected * counts.sum())
        results[name] = (res.pvalue, accepted_first / (B * rounds))
        assert res.pvalue > 1e-3, f"{name}: counts {counts} vs expected {np.round(expected * counts.sum())}"
    # speculation really happened: the first draft (the mode of p(. | f)) was accepted at about its probability
    mode_prob = sum(p1[f] * p2[f].max() for f in p2)
    assert abs(results["spec"][1] - mode_prob) < 0.05, results
    assert results["plain"][1] == 0


# ------------------------------------------------------------------------------------------- cost of the path
# The reference the cheaper path must reproduce bit for bit: every batch sorted, every row drawing random bits (with
# top_p = 1 as off, see `test_top_p_one_keeps_the_whole_vocabulary_in_any_batch`).
def full_sort_logprobs(logits, sp):
    from dflash_jax.spec_decode.sampling import NEG_INF

    logits = logits.astype(jnp.float32)
    t = sp.temperature[:, None, None]
    greedy = t <= 0.0
    scaled = logits / jnp.where(greedy, 1.0, t)
    v = logits.shape[-1]
    srt = jnp.sort(scaled, axis=-1)[..., ::-1]
    k = jnp.where(sp.top_k > 0, jnp.minimum(sp.top_k, v), v)[:, None, None]
    kth = jnp.take_along_axis(srt, k - 1, axis=-1)
    masked = jnp.where(scaled >= kth, scaled, NEG_INF)
    srt_k = jnp.where(jnp.arange(v)[None, None, :] < k, srt, NEG_INF)
    probs_sorted = jax.nn.softmax(srt_k, axis=-1)
    cum = jnp.cumsum(probs_sorted, axis=-1)
    p = sp.top_p[:, None, None]
    n_keep = jnp.clip(jnp.sum((cum - probs_sorted) < p, axis=-1, keepdims=True), 1, v)
    pth = jnp.take_along_axis(srt_k, n_keep - 1, axis=-1)
    masked = jnp.where((masked >= pth) | (p >= 1.0), masked, NEG_INF)
    logp = jax.nn.log_softmax(masked, axis=-1)
    onehot = jax.nn.one_hot(jnp.argmax(logits, axis=-1), v, dtype=jnp.float32)
    return jnp.where(greedy, jnp.where(onehot > 0, 0.0, NEG_INF), logp)


@jax.jit
def full_sort_sample(logits, sp, positions):
    from dflash_jax.rng import TOKEN_SAMPLE, row_keys
    from dflash_jax.spec_decode.sampling import sample_from_logprobs

    return sample_from_logprobs(full_sort_logprobs(logits, sp), row_keys(sp.seed, positions, purpose=TOKEN_SAMPLE))


@jax.jit
def full_sort_accept(drafts, logits, num_drafts, sp, positions):
    from dflash_jax.rng import ACCEPT_UNIFORM, BONUS_SAMPLE, row_keys
    from dflash_jax.spec_decode.sampling import NEG_INF

    b, k = drafts.shape
    logp = full_sort_logprobs(logits, sp)
    p_d = jnp.exp(jnp.take_along_axis(logp[:, :k, :], drafts[:, :, None], axis=-1)[..., 0])
    ukeys = row_keys(sp.seed, positions[:, :k], purpose=ACCEPT_UNIFORM)
    u = jax.vmap(jax.vmap(lambda kk: jax.random.uniform(kk)))(ukeys)
    ok = (u < p_d) & (jnp.arange(k)[None, :] < num_drafts[:, None])
    accepted = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1)
    row_logp = jnp.take_along_axis(logp, accepted[:, None, None], axis=1)[:, 0]
    d_at = jnp.take_along_axis(drafts, jnp.minimum(accepted, k - 1)[:, None], axis=1)[:, 0]
    remove = jax.nn.one_hot(d_at, logp.shape[-1], dtype=bool) & (accepted < num_drafts)[:, None]
    resid = jnp.where(remove, NEG_INF, row_logp)
    pos_at = jnp.take_along_axis(positions, accepted[:, None], axis=1)[:, 0]
    bkeys = row_keys(sp.seed, pos_at[:, None], purpose=BONUS_SAMPLE)[:, 0]
    return accepted, jax.vmap(lambda kk, lp: jax.random.categorical(kk, lp))(bkeys, resid).astype(jnp.int32)


def reachable_primitives(jaxpr, branch: int) -> set[str]:
    """Primitive names of a jaxpr and its nested jaxprs, following only branch `branch` of every `lax.cond`
    (0: its predicate false)."""
    names: set[str] = set()
    for eqn in jaxpr.eqns:
        names.add(eqn.primitive.name)
        for key, p in eqn.params.items():
            subs = p if isinstance(p, tuple | list) else (p,)
            if eqn.primitive.name == "cond" and key == "branches":
                subs = (subs[branch],)
            for sub in subs:
                if isinstance(sub, jax.extend.core.ClosedJaxpr):
                    names |= reachable_primitives(sub.jaxpr, branch)
                elif isinstance(sub, jax.extend.core.Jaxpr):
                    names |= reachable_primitives(sub, branch)
    return names


def eqns_named(jaxpr, name: str):
    """Every equation of primitive `name` in a jaxpr and its nested jaxprs (all branches)."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == name:
            yield eqn
        for p in eqn.params.values():
            for sub in p if isinstance(p, tuple | list) else (p,):
                if isinstance(sub, jax.extend.core.ClosedJaxpr):
                    yield from eqns_named(sub.jaxpr, name)
                elif isinstance(sub, jax.extend.core.Jaxpr):
                    yield from eqns_named(sub, name)


def has_random(names: set[str]) -> bool:
    return any(n.startswith("random_") or n.startswith("threefry") for n in names)


def _batch(v: int, b: int, k: int, params, seed: int):
    rng = np.random.default_rng(seed)
    logits = jnp.asarray((2.0 * rng.standard_normal((b, k + 1, v))).astype(np.float32))
    drafts = jnp.asarray(np.asarray(logits).argmax(-1)[:, :k] * (rng.random((b, k)) < 0.6), jnp.int32)
    pos = jnp.asarray(rng.integers(0, 100, b)[:, None] + np.arange(k + 1)[None], jnp.int32)
    sp = sp_arrays([params[i % len(params)] for i in range(b)], seeds=rng.integers(0, 2**31, b))
    return logits, drafts, jnp.asarray(rng.integers(0, k + 1, b), jnp.int32), sp, pos


def test_greedy_and_unfiltered_paths_sort_nothing_and_draw_nothing():
    from dflash_jax.spec_decode.sampling import any_sampled, filters_active, speculative_accept_q

    logits, drafts, nd, _, pos = _batch(64, 4, 3, [(1.0, 0, 1.0)], seed=0)
    greedy = sp_arrays([(0.0, 5, 0.5)] * 4)  # greedy rows ignore their top-k/top-p
    plain = sp_arrays([(0.8, 0, 1.0), (0.0, 3, 0.2), (1.0, 64, 1.0), (1.2, 0, 1.0)])  # top-k = V cuts nothing
    cut = sp_arrays([(0.8, 0, 1.0), (0.7, 5, 1.0), (0.0, 0, 1.0), (1.0, 0, 1.0)])
    assert not filters_active(greedy, 64) and not filters_active(plain, 64) and filters_active(cut, 64)
    assert not any_sampled(greedy) and any_sampled(plain)
    for sp in (greedy, plain, cut):  # the branch each batch takes
        logp = jax.make_jaxpr(processed_logprobs)(logits, sp).jaxpr
        assert "sort" not in reachable_primitives(logp, 0) and "sort" in reachable_primitives(logp, 1)
    q = (jnp.zeros((4, 3, 2), jnp.int32), jnp.full((4, 3, 2), 0.5, jnp.float32))
    programs = {
        "sample_tokens": jax.make_jaxpr(sample_tokens)(logits, greedy, pos),
        "speculative_accept": jax.make_jaxpr(speculative_accept)(drafts, logits, nd, greedy, pos),
        "speculative_accept_q": jax.make_jaxpr(speculative_accept_q)(drafts, logits, nd, greedy, pos, *q),
    }
    for name, closed in programs.items():
        off, on = reachable_primitives(closed.jaxpr, 0), reachable_primitives(closed.jaxpr, 1)
        assert "sort" not in off and not has_random(off), f"{name}: {sorted(off)}"
        assert "sort" in on and has_random(on), name  # the check sees them where they are


@pytest.mark.parametrize(
    "params",
    [
        PARAMS,  # mixed: some rows cut, one greedy
        [(1.0, 0, 1.0), (0.0, 7, 0.5), (0.6, 0, 1.0)],  # sampled rows without top-k/top-p, and a greedy row
        [(0.0, 0, 1.0), (0.0, 4, 0.3)],  # all greedy
    ],
    ids=["cut", "uncut", "greedy"],
)
def test_cheaper_path_gives_bit_identical_results(params):
    logits, drafts, nd, sp, pos = _batch(50, 24, 3, params, seed=len(params))
    np.testing.assert_array_equal(
        np.asarray(jax.jit(processed_logprobs)(logits, sp)), np.asarray(jax.jit(full_sort_logprobs)(logits, sp))
    )
    np.testing.assert_array_equal(np.asarray(_sample(logits, sp, pos)), np.asarray(full_sort_sample(logits, sp, pos)))
    for new, old in zip(
        _accept(drafts, logits, nd, sp, pos), full_sort_accept(drafts, logits, nd, sp, pos), strict=True
    ):
        np.testing.assert_array_equal(np.asarray(new), np.asarray(old))


def test_top_p_one_keeps_the_whole_vocabulary_in_any_batch():
    """top_p = 1 is off: a row whose float cumulative mass reaches 1 before its tail ends (two tokens of probability
    0.5 in float32, the rest ~1e-15) keeps every token, with the same log-probabilities whether or not another row of
    the batch sets top-k (which makes the batch take the sorting path)."""
    row = np.array([3.0, 3.0, -30.0, -30.0, -31.0, -32.0, -29.0, -30.5], np.float32)
    logits = jnp.asarray(np.broadcast_to(row, (2, 1, row.size)))
    alone = np.asarray(processed_logprobs(logits, sp_arrays([(1.0, 0, 1.0)] * 2)))
    mixed = np.asarray(processed_logprobs(logits, sp_arrays([(1.0, 0, 1.0), (1.0, 1, 1.0)])))
    assert (alone[0] > -1e29).all()
    np.testing.assert_allclose(alone[0, 0], ref_probs_log(row), rtol=1e-5)
    np.testing.assert_array_equal(mixed[0], alone[0])
    assert (mixed[1] > -1e29).sum() == 2  # top-1 keeps the tie


def ref_probs_log(row: np.ndarray) -> np.ndarray:
    z = row.astype(np.float64)
    return z - z.max() - np.log(np.exp(z - z.max()).sum())


def test_training_data_pick_draws_noise_only_for_sampled_rows():
    from dflash_jax.rng import TOKEN_SAMPLE, row_keys
    from dflash_jax.train.data import _pick

    rng = np.random.default_rng(4)
    n, v = 6, 40
    logits = jnp.asarray((2.0 * rng.standard_normal((n, 1, v))).astype(np.float32))
    temps = np.array([0.0, 0.7, 0.0, 0.7, 0.7, 0.0], np.float32)
    sp = SamplingArrays(
        jnp.asarray(temps), jnp.zeros(n, jnp.int32), jnp.ones(n, jnp.float32), jnp.asarray(rng.integers(0, 2**31, n))
    )
    pos = jnp.asarray(rng.integers(0, 50, (n, 1)), jnp.int32)
    rows = jnp.asarray(np.flatnonzero(temps > 0), jnp.int32)
    # the previous formulation: every row sampled, greedy rows then replaced by the argmax
    keys = row_keys(sp.seed, pos, purpose=TOKEN_SAMPLE)
    drawn = jax.vmap(jax.vmap(jax.random.categorical))(keys, logits / jnp.maximum(sp.temperature, 1e-6)[:, None, None])
    before = np.where(temps[:, None] > 0, np.asarray(drawn), np.asarray(logits).argmax(-1))
    np.testing.assert_array_equal(np.asarray(_pick(logits, sp, pos, rows)), before)
    shapes = [
        e.outvars[0].aval.shape for e in eqns_named(jax.make_jaxpr(_pick)(logits, sp, pos, rows).jaxpr, "random_bits")
    ]
    assert shapes and all(s[0] == rows.shape[0] for s in shapes)  # noise for the 3 sampled rows only
    none = jax.make_jaxpr(_pick)(logits, sp, pos, jnp.zeros((0,), jnp.int32))
    assert not has_random(reachable_primitives(none.jaxpr, 1))


def test_mixed_batches_draw_random_bits_only_for_the_sampling_rows(tiny_target, tiny_drafter):
    """In a batch of greedy and sampled sequences the runner puts the sampling rows first and the step draws random
    bits (and would sort) only for those rows' bucket; each row's tokens equal its tokens in a batch of its own
    kind (greedy rows: an all-greedy batch; sampled rows: an all-sampled batch with the same seeds)."""
    from dflash_jax.spec_decode.runner import SpecRunner
    from dflash_jax.types import SamplingParams

    prompt = [5, 17, 99, 3, 42]
    mixed = [SamplingParams(0.0), SamplingParams(1.0, seed=7), SamplingParams(0.0), SamplingParams(0.9, seed=8)]

    def run(sps, slots):
        r = SpecRunner(tiny_target, tiny_drafter, max_slots=4, max_model_len=32, batch_buckets=(1, 2, 4))
        first = r.add_many([(s, prompt, sp) for s, sp in zip(slots, sps, strict=True)])
        out = {s: list(first[s].tokens) for s in slots}
        for _ in range(4):
            for s, res in r.step(slots, {s: 8 for s in slots}).items():
                out[s] += res.tokens
        return r, out

    r, got = run(mixed, [0, 1, 2, 3])
    _, greedy = run([mixed[0], mixed[2]], [0, 2])
    _, sampled = run([mixed[1], mixed[3]], [1, 3])
    assert {s: got[s][:9] for s in (0, 2)} == {s: t[:9] for s, t in greedy.items()}
    assert {s: got[s][:9] for s in (1, 3)} == {s: t[:9] for s, t in sampled.items()}
    assert r._sampled_rows(mixed, 4) == 2
    traced = r.programs.step.trace(
        r.weights,
        r.state,
        np.asarray([1, 3, 0, 2], np.int32),
        np.zeros((4, r.kv_buckets[0] // r.page_size), np.int32),
        np.full((4,), 3, np.int32),
        np.asarray(False),
        width=4,
        kv_len=r.kv_buckets[0],
        sampled=2,
        speculative=True,
    )
    draws = [e for name in ("random_bits", "threefry2x32") for e in eqns_named(traced.jaxpr.jaxpr, name)]
    assert draws and all(v.aval.shape[0] <= 2 for e in draws for v in e.outvars if v.aval.shape)
