"""Training with a bfloat16 compute dtype (`train drafter --dtype bfloat16`): the step's matmuls run in bf16, the
drafter's parameters and Adam state stay f32, and the loss is the f32-compute loss up to bf16 rounding."""

from __future__ import annotations

from functools import partial
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dflash_jax.models.layers import RandomBuilder
from dflash_jax.models.target import TargetModel
from dflash_jax.train.data import DataConfig, generate_shard
from dflash_jax.train.trainer import ShardData, TrainConfig, init_drafter, make_optimizer, set_lr, train_step
from tests.models.test_bf16 import dot_operand_dtypes
from tests.train.test_train_tokens_only import TAPS, TINY


def test_bf16_train_step_computes_in_bf16_and_keeps_f32_state(tmp_path):
    target = TargetModel(TINY, RandomBuilder(0, std=0.3, dtype=jnp.bfloat16))
    lt = SimpleNamespace(model=target, cfg=TINY, tokenizer=SimpleNamespace(eos_token_ids={47}))
    dc = DataConfig(taps=TAPS, num_shards=1, rows_per_shard=3, max_prompt=8, max_new=12, store_taps=True)
    shard = generate_shard(lt, dc, [[1, 2, 3], [4, 5, 6, 7, 8], [9, 10]], 0)  # the bf16 target generates the data
    assert np.isfinite(shard["taps"]).all() and shard["loss_mask"].sum() > 0
    np.savez(tmp_path / "shard_00000.npz", **shard)
    data = ShardData([tmp_path / "shard_00000.npz"])
    losses = {}
    for compute in ("float32", "bfloat16"):
        tc = TrainConfig(
            num_layers=1,
            block_size=4,
            target_layer_ids=TAPS,
            mask_token_id=0,
            num_anchors=2,
            batch_size=3,
            steps=4,
            compute_dtype=compute,
        )
        batch = {k: jnp.asarray(v) for k, v in data.batch(0, tc).items()}
        tx = make_optimizer(tc)
        gd, params = nnx.split(init_drafter(TINY, tc))
        assert {str(x.dtype) for x in jax.tree.leaves(params)} == {"float32"}
        opt_state = set_lr(tx.init(params), 1e-3)
        args = (gd, params, opt_state, target.embed[...], target.lm_head[...], batch)
        if compute == "bfloat16":
            jp = jax.make_jaxpr(partial(train_step, tc=tc, tx=tx))(*args)
            dots = dot_operand_dtypes(jp)
            assert dots and all(d == ("bfloat16", "bfloat16") for d in dots), sorted(set(dots))
        params, opt_state, m = train_step(*args, tc=tc, tx=tx)
        assert {str(x.dtype) for x in jax.tree.leaves(params)} == {"float32"}
        floats = [x for x in jax.tree.leaves(opt_state) if jnp.issubdtype(x.dtype, jnp.floating)]
        assert {str(x.dtype) for x in floats} == {"float32"}
        losses[compute] = float(m["loss"])
    assert np.isfinite(losses["bfloat16"])
    # bf16 rounds the inputs of each of the drafter's few matmul stages by <= 2^-8 relative
    assert losses["bfloat16"] == pytest.approx(losses["float32"], rel=2e-2)
