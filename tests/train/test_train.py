"""Drafter training: anchors, mask, decay weights, chunked CE, exact resume, a tiny end-to-end run."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.checkpoints.drafter import load_drafter
from dflash_jax.checkpoints.export import export_drafter
from dflash_jax.config import TargetConfig
from dflash_jax.models.layers import RandomBuilder
from dflash_jax.models.target import TargetModel
from dflash_jax.train.losses import (
    chunked_ce,
    decay_weights,
    sample_anchors,
    teacher_forced_tau,
    training_mask,
)
from dflash_jax.train.prompts import build_prompts
from dflash_jax.train.trainer import ShardData, TrainConfig, lr_at, train

TINY = TargetConfig(
    arch="llama",
    vocab_size=48,
    hidden_size=32,
    intermediate_size=64,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
)


def test_anchor_sampler_only_loss_masked_and_inside():
    rng = np.random.default_rng(0)
    L, B = 40, 4
    mask = np.zeros((3, L), np.uint8)
    mask[0, 10:30] = 1
    mask[1, 5:8] = 1  # only 3 masked positions
    mask[2, 35:40] = 1  # masked positions near the end
    lengths = np.array([32, 40, 38])
    for _ in range(50):
        a, keep = sample_anchors(mask, lengths, 6, B, rng)
        for r in range(3):
            sel = a[r][keep[r]]
            assert np.all(mask[r, sel] == 1)
            assert np.all(sel + B <= lengths[r])  # no block past the end
            assert len(set(sel.tolist())) == len(sel)  # without replacement
            assert np.all(np.diff(sel) > 0)  # sorted
        assert keep[0].sum() == 6 and keep[1].sum() == 3
        assert keep[2].sum() == 0  # masked positions exist, but every block from them would pass the end


def test_training_mask_hand_built():
    # two blocks of size 3 anchored at positions 2 and 4, sequence length 5
    m = training_mask(np.array([2, 4]), 5, 3)
    expect_ctx = np.array([[1, 1, 0, 0, 0]] * 3 + [[1, 1, 1, 1, 0]] * 3, bool)
    expect_blk = np.kron(np.eye(2, dtype=bool), np.ones((3, 3), bool))
    np.testing.assert_array_equal(m[:, :5], expect_ctx)
    np.testing.assert_array_equal(m[:, 5:], expect_blk)


def test_decay_weights():
    w = decay_weights(8)
    assert w[0] == 0.0
    np.testing.assert_allclose(w[1:], np.exp(-np.arange(7) / 4.0), rtol=1e-6)
    np.testing.assert_allclose(decay_weights(16)[2], np.exp(-1 / 7.0), rtol=1e-6)
    np.testing.assert_allclose(decay_weights(10)[3], np.exp(-2 / 5.0), rtol=1e-6)


def test_chunked_ce_equals_unchunked_value_and_grad():
    r = np.random.default_rng(1)
    h = jnp.asarray(r.normal(size=(37, 16)), jnp.float32)
    w = jnp.asarray(r.normal(size=(16, 50)), jnp.float32)
    lab = jnp.asarray(r.integers(0, 50, 37))
    wt = jnp.asarray(r.random(37), jnp.float32)

    def ref(h):
        lg = h @ w
        return jnp.sum((jax.nn.logsumexp(lg, -1) - jnp.take_along_axis(lg, lab[:, None], -1)[:, 0]) * wt)

    for chunk in (8, 37, 64):
        loss, correct = chunked_ce(h, w, lab, wt, chunk)
        np.testing.assert_allclose(loss, ref(h), rtol=1e-5)
        np.testing.assert_array_equal(correct, jnp.argmax(h @ w, -1) == lab)
        grad = jax.grad(lambda x, c=chunk: chunked_ce(x, w, lab, wt, c)[0])(h)
        np.testing.assert_allclose(grad, jax.grad(ref)(h), atol=1e-5)


def test_chunked_ce_topk_and_bf16_gemm():
    """The fused top-k ids equal lax.top_k of the full logits; the bf16-input GEMM (f32 accumulation) gives the
    same loss, accuracy and top-k as f32 on bf16-rounded operands (what it computes), and its loss and gradient
    stay close to f32."""
    r = np.random.default_rng(2)
    h = jnp.asarray(r.normal(size=(45, 32)), jnp.float32)
    w = jnp.asarray(r.normal(size=(32, 300)) * 0.3, jnp.float32)
    lab = jnp.asarray(r.integers(0, 300, 45))
    wt = jnp.asarray(r.random(45), jnp.float32)
    loss, correct, ids = chunked_ce(h, w, lab, wt, 16, 5)
    np.testing.assert_array_equal(ids, jax.lax.top_k(h @ w, 5)[1])
    np.testing.assert_allclose(loss, chunked_ce(h, w, lab, wt, 16)[0], rtol=1e-6)

    def rounded(x):
        return x.astype(jnp.bfloat16).astype(jnp.float32)

    lb, cb, ib = chunked_ce(h, w, lab, wt, 16, 5, jnp.bfloat16)
    lr, cr, ir = chunked_ce(rounded(h), rounded(w), lab, wt, 16, 5)
    np.testing.assert_allclose(lb, lr, rtol=1e-5)
    np.testing.assert_array_equal(cb, cr)
    np.testing.assert_array_equal(ib, ir)
    np.testing.assert_allclose(lb, loss, rtol=2e-2)  # bf16 rounding of the inputs only
    gb = jax.grad(lambda x: chunked_ce(x, w, lab, wt, 16, 0, jnp.bfloat16)[0])(h)
    gf = jax.grad(lambda x: chunked_ce(x, w, lab, wt, 16)[0])(h)
    assert float(jnp.abs(gb - gf).max()) <= 0.05 * float(jnp.abs(gf).max())


@pytest.mark.parametrize(
    "total,step,want",
    [
        # warm-up 10 steps, then cosine over steps 10..100 to the floor lr * min_lr_ratio = 1e-4:
        # lr = 1e-4 + 0.9e-3 * (1 + cos(pi * (step - 10) / 90)) / 2
        (None, 0, 0.0),
        (None, 5, 5e-4),
        (None, 10, 1e-3),
        (None, 40, 7.75e-4),  # cos(pi/3) = 1/2
        (None, 55, 5.5e-4),  # cos(pi/2) = 0
        (None, 100, 1e-4),
        (None, 150, 1e-4),
        # time-budgeted (WSD), fitted length 50: warm-up to step 10, constant to step 40 (= 80 %), linear to 1e-4 at 50
        (50, 5, 5e-4),
        (50, 10, 1e-3),
        (50, 39, 1e-3),
        (50, 40, 1e-3),
        (50, 45, 5.5e-4),
        (50, 50, 1e-4),
        (50, 60, 1e-4),
        # a budget so short that the decay starts right after the warm-up (step 10), over 12 - 10 = 2 steps
        (12, 10, 1e-3),
        (12, 11, 5.5e-4),
        (12, 12, 1e-4),
    ],
)
def test_lr_schedule_hand_computed(total, step, want):
    tc = TrainConfig(lr=1e-3, steps=100, warmup_steps=10, min_lr_ratio=0.1, decay_frac=0.2)
    assert lr_at(tc, step, total) == pytest.approx(want, rel=1e-5, abs=1e-9)


def test_lr_warmup_steps_from_fraction():
    tc = TrainConfig(lr=2e-3, steps=200, warmup_frac=0.05)  # 10 warm-up steps
    assert lr_at(tc, 5) == pytest.approx(1e-3, rel=1e-5) and lr_at(tc, 10) == pytest.approx(2e-3, rel=1e-5)


def test_teacher_forced_tau():
    correct = jnp.array([[[1, 1, 0], [0, 1, 1]]], bool)
    valid = jnp.array([[[1, 1, 1], [1, 1, 1]]], bool)
    assert float(teacher_forced_tau(correct, valid)) == pytest.approx((3 + 1) / 2)


def _toy_data(rows=16, L=40, seed=0):
    """A learnable toy corpus: token t+1 = (token t + row-dependent step) mod V."""
    rng = np.random.default_rng(seed)
    d = ShardData.__new__(ShardData)
    step = rng.integers(1, 4, size=rows)
    start = rng.integers(0, TINY.vocab_size, size=rows)
    d.tokens = ((start[:, None] + step[:, None] * np.arange(L)[None, :]) % TINY.vocab_size).astype(np.int32)
    d.loss_mask = np.ones((rows, L), np.uint8)
    d.loss_mask[:, :6] = 0
    d.lengths = np.full(rows, L, np.int32)
    # taps: the target's real hidden states are not needed for a learnability check; give the one-hot of the
    # current token and of the step so the drafter can infer the rule from the context.
    taps = np.zeros((rows, L, 2 * TINY.hidden_size), np.float16)
    taps[np.arange(rows)[:, None], np.arange(L)[None, :], d.tokens % TINY.hidden_size] = 1
    taps[np.arange(rows), :, TINY.hidden_size + step] = 1
    d.taps = taps
    d.files = []
    return d


def _tc(**kw):
    base = dict(
        num_layers=1,
        block_size=4,
        target_layer_ids=(1, 2),
        mask_token_id=TINY.vocab_size - 1,
        num_anchors=6,
        batch_size=4,
        steps=12,
        lr=3e-3,
        log_every=2,
        save_every=4,
        ce_chunk=16,
    )
    base.update(kw)
    return TrainConfig(**base)


def test_resume_equals_uninterrupted(tmp_path):
    target = TargetModel(TINY, RandomBuilder(0, std=0.2))
    data = _toy_data()
    tc = _tc(steps=8)
    full, _ = train(TINY, target.embed[...], target.lm_head[...], data, tc, tmp_path / "a")
    train(TINY, target.embed[...], target.lm_head[...], data, tc, tmp_path / "b", stop_at=4)
    resumed, _ = train(TINY, target.embed[...], target.lm_head[...], data, tc, tmp_path / "b", resume=True)
    for a, b in zip(jax.tree.leaves(full), jax.tree.leaves(resumed), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
    log = [json.loads(x) for x in (tmp_path / "b" / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [2, 4, 6, 8]


@pytest.mark.slow
def test_tiny_end_to_end_learns_and_exports(tmp_path):
    target = TargetModel(TINY, RandomBuilder(0, std=0.2))
    data = _toy_data(rows=32)
    tc = _tc(steps=60, num_anchors=8, batch_size=8, save_every=60)
    model, hist = train(TINY, target.embed[...], target.lm_head[...], data, tc, tmp_path / "run")
    chance = 1.0 / TINY.vocab_size
    assert hist[-1]["acc"] > 5 * chance
    assert hist[-1]["loss"] < hist[0]["loss"]
    out = export_drafter(model, tmp_path / "drafter", TINY.num_layers)
    loaded = load_drafter(out, TINY)
    np.testing.assert_array_equal(np.asarray(loaded.fc[...]), np.asarray(model.fc[...]))
    # the exported drafter drafts through the serving path
    from dflash_jax.spec_decode.runner import SpecRunner
    from dflash_jax.types import SamplingParams

    r = SpecRunner(target, loaded, max_slots=1, max_model_len=32, gamma=4)
    r.add(0, [1, 2, 3], SamplingParams())
    res = r.step([0], {0: 8})[0]
    assert 1 <= len(res.tokens) <= 4 and res.num_drafts == 3


def test_training_prompts_do_not_contain_heldout(tmp_path, monkeypatch):
    from dflash_jax.bench.prompts import HELDOUT_PROMPTS
    from dflash_jax.train import prompts as prompts_mod

    monkeypatch.setattr(prompts_mod, "_shakespeare_passages", lambda *a: [])  # no download in tests

    held = [json.loads(x)["messages"][0]["content"] for x in HELDOUT_PROMPTS.read_text().splitlines() if x]
    train_prompts = {m[0]["content"] for m in build_prompts(400, seed=0, cache_dir=tmp_path / "nocache")}
    assert held and not (set(held) & train_prompts)


def test_decode_chain_steps_through_a_response_by_hand():
    from dflash_jax.train.losses import decode_chain

    # anchor 0 takes 2 drafts (3 tokens), anchor 3 would take 5 but only 3 tokens remain after it
    assert decode_chain(np.array([2, 0, 0, 5, 1, 0, 0])) == [3, 4]
    # nothing accepted: one token per step until the last token is the anchor
    assert decode_chain(np.array([0, 0, 0])) == [1, 1]
    # an anchor the previous step skipped over does not count
    assert decode_chain(np.array([1, 7, 0, 0, 0])) == [2, 1, 1]
    assert decode_chain(np.array([4])) == []
