"""Teacher-forced τ of a drafter on target-generated rows, through the training loss's own forward (`drafter_loss`,
f32 LM head): what inference would accept if every earlier draft were right (for DFlash2, the selector's pick).

Usage: python benchmarks/teacher_forced_eval.py DRAFTER_DIR [SHARD.npz ...]   (shards from `dflash-jax train data`)
With no shard it generates the greedy responses to `bench decode`'s default held-out prompts (128 new tokens),
saves them to runs/heldout_greedy.npz and scores those. 24 random anchors per row, the first 32 rows of a shard."""

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.bench.prompts import encode_prompts, load_prompt_file
from dflash_jax.checkpoints.drafter import load_drafter
from dflash_jax.checkpoints.loader import load_target
from dflash_jax.train.data import DataConfig, generate_shard
from dflash_jax.train.losses import sample_anchors, teacher_forced_tau
from dflash_jax.train.trainer import TrainConfig, drafter_loss

ANCHORS, ROWS, BATCH = 24, 32, 8

lt = load_target(None)
drafter = load_drafter(sys.argv[1], lt.cfg)
cfg = drafter.cfg
tc = TrainConfig(
    num_layers=cfg.num_layers,
    block_size=cfg.block_size,
    target_layer_ids=cfg.target_layer_ids,
    mask_token_id=cfg.mask_token_id,
    num_anchors=ANCHORS,
    arch=cfg.arch,
    ce_dtype="float32",
)


@jax.jit
def block_stats(batch):
    _, (_, valid, correct, _) = drafter_loss(drafter, lt.model.embed[...], lt.model.lm_head[...], batch, tc)
    c3 = correct.reshape(-1, ANCHORS, tc.block_size - 1)
    v3 = valid.reshape(-1, ANCHORS, tc.block_size - 1)
    kept = jnp.sum(v3[..., 0])
    return teacher_forced_tau(c3, v3) * kept, kept, jnp.sum(c3 & v3, axis=(0, 1)), jnp.sum(v3, axis=(0, 1))


def evaluate(name: str, d) -> None:
    rng = np.random.default_rng(0)
    n = min(len(d["tokens"]), ROWS)
    tau_sum = blocks = 0.0
    hits, seen = np.zeros(tc.block_size - 1), np.zeros(tc.block_size - 1)
    for i in range(0, n, BATCH):
        rows = {k: d[k][i : min(i + BATCH, n)] for k in ("tokens", "loss_mask", "lengths", "taps")}
        rows["anchors"], rows["keep"] = sample_anchors(rows["loss_mask"], rows["lengths"], ANCHORS, tc.block_size, rng)
        t, k, h, s = block_stats({k: jnp.asarray(v) for k, v in rows.items()})
        tau_sum, blocks, hits, seen = tau_sum + float(t), blocks + float(k), hits + np.asarray(h), seen + np.asarray(s)
    print(
        f"{name}: {n} rows, {blocks:.0f} blocks, teacher-forced tau {tau_sum / blocks:.3f}, acceptance by "
        f"position {np.round(hits / seen, 3).tolist()}",
        flush=True,
    )


for f in sys.argv[2:]:
    evaluate(f, np.load(f))
if len(sys.argv) == 2:
    prompts = encode_prompts(lt.tokenizer, load_prompt_file(None))
    dc = DataConfig(
        taps=tuple(cfg.target_layer_ids), max_prompt=max(map(len, prompts)), max_new=128, sampled_fraction=0.0
    )
    d = generate_shard(lt, dc, prompts, 0)
    Path("runs").mkdir(exist_ok=True)
    np.savez("runs/heldout_greedy.npz", **d)
    evaluate("held-out greedy responses", d)
