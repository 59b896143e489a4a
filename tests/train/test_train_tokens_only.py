"""Tokens-only training data (`train data --no-store-taps`): the taps recomputed inside the training step equal the
taps captured while the target generated, so both paths train the same drafter; plus the host-side LR schedules."""

from __future__ import annotations

from types import SimpleNamespace

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dflash_jax.config import TargetConfig
from dflash_jax.models.layers import RandomBuilder
from dflash_jax.models.target import TargetModel
from dflash_jax.train.data import DataConfig, generate_shard
from dflash_jax.train.trainer import (
    ShardData,
    TrainConfig,
    init_drafter,
    lr_at,
    make_optimizer,
    set_lr,
    target_taps,
    train_step,
)

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
TAPS = (1, 3)


def _shard(store_taps: bool):
    lt = SimpleNamespace(
        model=TargetModel(TINY, RandomBuilder(0, std=0.3)), cfg=TINY, tokenizer=SimpleNamespace(eos_token_ids={47})
    )
    cfg = DataConfig(
        taps=TAPS, num_shards=1, rows_per_shard=3, max_prompt=8, max_new=12, sampled_fraction=0.5, store_taps=store_taps
    )
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9, 10]]
    return lt, generate_shard(lt, cfg, prompts, 0, force_sampled=np.array([False, False, True]))


def test_tokens_only_shard_matches_and_recomputed_taps_equal_captured(tmp_path):
    lt, with_taps = _shard(True)
    _, tokens_only = _shard(False)
    assert "taps" not in tokens_only and "taps" in with_taps
    for k in ("tokens", "loss_mask", "lengths"):
        np.testing.assert_array_equal(tokens_only[k], with_taps[k])
    assert with_taps["loss_mask"].sum() > 0
    graphdef, state = nnx.split(lt.model)
    recomputed = np.asarray(target_taps(TINY, graphdef, state, jnp.asarray(with_taps["tokens"]), TAPS))
    for i, n in enumerate(with_taps["lengths"]):  # positions inside each row (beyond: padding, zeros when cached)
        np.testing.assert_allclose(recomputed[i, :n], with_taps["taps"][i, :n].astype(np.float32), atol=2e-3, rtol=2e-3)

    # one training step: tokens-only batch (taps recomputed in the step) == batch carrying those taps
    np.savez(tmp_path / "shard_00000.npz", **tokens_only)
    data = ShardData([tmp_path / "shard_00000.npz"])
    assert data.taps is None
    tc = TrainConfig(
        num_layers=1, block_size=4, target_layer_ids=TAPS, mask_token_id=0, num_anchors=2, batch_size=3, steps=4
    )
    batch = {k: jnp.asarray(v) for k, v in data.batch(0, tc).items()}
    tx = make_optimizer(tc)
    outs = []
    batch_taps = target_taps(TINY, graphdef, state, batch["tokens"], TAPS)  # the batch's rows, in its order
    for b in (batch, {**batch, "taps": batch_taps}):
        model = init_drafter(TINY, tc)
        gd, params = nnx.split(model)
        opt_state = set_lr(tx.init(params), 1e-3)
        _, _, m = train_step(
            gd,
            params,
            opt_state,
            lt.model.embed[...],
            lt.model.lm_head[...],
            b,
            state,
            tc=tc,
            tx=tx,
            tgt_graphdef=graphdef,
            tcfg=TINY,
        )
        outs.append(float(m["loss"]))
    # the same taps from two programs (in the step, and on their own) round differently in f32: losses 5.44461 and
    # 5.44457 with XLA's back end at -O0; the batch's taps in reversed row order give 5.44361, other layers' 5.45175
    assert outs[0] == pytest.approx(outs[1], rel=5e-5)


def test_shard_data_concatenates_and_pads_shards_of_other_lengths(tmp_path):
    rng = np.random.default_rng(0)
    parts = []
    for i, (rows, length) in enumerate([(2, 5), (3, 7)]):
        part = {
            "tokens": rng.integers(1, 40, (rows, length)).astype(np.int32),
            "loss_mask": rng.integers(0, 2, (rows, length)).astype(np.uint8),
            "lengths": np.full(rows, length - 1, np.int32),
            "taps": rng.standard_normal((rows, length, 6)).astype(np.float16),
        }
        np.savez(tmp_path / f"shard_{i:05d}.npz", **part)
        parts.append(part)
    data = ShardData(sorted(tmp_path.glob("shard_*.npz")))
    assert len(data) == 5 and data.tokens.shape == (5, 7) and data.taps.shape == (5, 7, 6)
    row = 0
    for part in parts:
        r, length = part["tokens"].shape
        for k in ("tokens", "loss_mask", "taps"):
            np.testing.assert_array_equal(getattr(data, k)[row : row + r, :length], part[k])
            assert not getattr(data, k)[row : row + r, length:].any()  # zero padding
        np.testing.assert_array_equal(data.lengths[row : row + r], part["lengths"])
        row += r


def test_train_cli_refuses_data_dirs_with_other_taps(tmp_path):
    import json

    from typer.testing import CliRunner

    from dflash_jax.cli.main import app

    for name, taps in (("a", [1, 3]), ("b", [1, 2])):
        (tmp_path / name).mkdir()
        (tmp_path / name / "data.json").write_text(json.dumps({"config": {"taps": taps}}))
    res = CliRunner().invoke(
        app,
        [
            "train",
            "drafter",
            "--out",
            str(tmp_path / "run"),
            "--data",
            str(tmp_path / "a"),
            "--data",
            str(tmp_path / "b"),
        ],
    )
    assert res.exit_code != 0 and "Traceback" not in res.output
    assert "--data" in res.stderr and "different taps" in res.stderr


def test_train_drafter_names_its_block_size_apart_from_the_kv_page_size(tmp_path):
    """`--block-size` is the KV page size of `serve`; `train drafter` takes the drafter's as `--drafter-block-size`."""
    from typer.testing import CliRunner

    from dflash_jax.cli.main import app

    base = ["train", "drafter", "--out", str(tmp_path / "run"), "--data", str(tmp_path / "absent")]
    old = CliRunner().invoke(app, [*base, "--block-size", "8"])
    assert old.exit_code == 2 and "No such option" in old.output and "--block-size" in old.output
    new = CliRunner().invoke(app, [*base, "--drafter-block-size", "1"])  # parsed: refused by its bound, min 2
    assert new.exit_code == 2 and "--drafter-block-size" in new.output


def test_mixed_shards_refused(tmp_path):
    _, a = _shard(True)
    _, b = _shard(False)
    np.savez(tmp_path / "shard_00000.npz", **a)
    np.savez(tmp_path / "shard_00001.npz", **b)
    with pytest.raises(Exception, match="mix cached taps"):
        ShardData(sorted(tmp_path.glob("shard_*.npz")))


def test_lr_schedules_worked_example():
    tc = TrainConfig(lr=1.0, steps=100, warmup_steps=10, min_lr_ratio=0.1, decay_frac=0.2)
    # cosine: 0 at step 0, peak at the end of warm-up, floor at the last step
    assert lr_at(tc, 0) == pytest.approx(0.0)
    assert lr_at(tc, 10) == pytest.approx(1.0)
    assert lr_at(tc, 100) == pytest.approx(0.1)
    assert lr_at(tc, 55) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + np.cos(np.pi * 45 / 90)))
    # WSD fitted to 200 steps: linear warm-up, constant to step 160, then linear to the floor at 200
    assert lr_at(tc, 5, total=200) == pytest.approx(0.5)
    assert lr_at(tc, 159, total=200) == pytest.approx(1.0)
    assert lr_at(tc, 180, total=200) == pytest.approx(0.55)
    assert lr_at(tc, 200, total=200) == pytest.approx(0.1)


def test_init_from_saved_drafter_continues_and_refuses_mismatch(tmp_path):
    from dflash_jax.checkpoints.export import export_drafter
    from dflash_jax.errors import UserError

    tc = TrainConfig(num_layers=1, block_size=4, target_layer_ids=TAPS, mask_token_id=0)
    src = init_drafter(TINY, tc)
    export_drafter(src, tmp_path / "d", TINY.num_layers)
    again = init_drafter(TINY, TrainConfig(**{**tc.__dict__, "init_from": str(tmp_path / "d")}))
    np.testing.assert_array_equal(np.asarray(again.fc[...]), np.asarray(src.fc[...]))
    np.testing.assert_array_equal(np.asarray(again.layers[0].qkv_proj[...]), np.asarray(src.layers[0].qkv_proj[...]))
    with pytest.raises(UserError, match="num_layers is 1 but this run trains 2"):
        init_drafter(TINY, TrainConfig(**{**tc.__dict__, "num_layers": 2, "init_from": str(tmp_path / "d")}))
