"""Teacher-forced tau of a drafter on target-generated rows (the selector path for DFlash2, as inference drafts).

Usage: python benchmarks/teacher_forced_eval.py DRAFTER_DIR SHARD.npz... (shards from `dflash-jax train data`).
With no shard it regenerates the held-out prompts' greedy responses (runs/s4/heldout_greedy.npz) and scores those."""
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.checkpoints.loader import load_target
from dflash_jax.models.drafter import block_embeddings, candidate_logits, load_drafter
from dflash_jax.models.layers import heads_major
from dflash_jax.train.data import DataConfig, generate_shard
from dflash_jax.train.losses import block_layout, sample_anchors

drafter_path = sys.argv[1]
lt = load_target(None)
dm = load_drafter(drafter_path, lt.cfg)
cfg = dm.cfg
embed, lm_head = lt.model.embed[...], lt.model.lm_head[...]
B = cfg.block_size
NA = 24

@jax.jit
def correct_runs(tokens, taps, anchors, keep, lengths, loss_mask):
    r, L = tokens.shape
    n = anchors.shape[1]
    block_id, slot = (jnp.asarray(a) for a in block_layout(n, B))
    ctx_pos = jnp.arange(L, dtype=jnp.int32)
    kvs = dm.context_kv(taps.astype(jnp.float32), jnp.broadcast_to(ctx_pos, (r, L)))
    anchor_tok = jnp.take_along_axis(tokens, anchors, axis=1)
    blk = jnp.where(slot[None, :] == 0, anchor_tok[:, block_id], cfg.mask_token_id)
    positions = anchors[:, block_id] + slot[None, :]
    h = dm.block_hidden(block_embeddings(cfg, embed, blk), positions, [heads_major(k) for k, _ in kvs],
                        [heads_major(v) for _, v in kvs], ctx_pos, anchors[:, block_id], block_id, slot)
    lab_pos = jnp.minimum(positions, L - 1)
    labels = jnp.take_along_axis(tokens, lab_pos, axis=1)
    valid = keep[:, block_id] & (positions < lengths[:, None]) & (jnp.take_along_axis(loss_mask, lab_pos, axis=1) > 0)
    logits = (h @ lm_head).astype(jnp.float32)
    base = jnp.argmax(logits, -1) == labels
    if cfg.arch == "dflash2":
        u, ids = jax.lax.top_k(logits, cfg.selector_top_k)
        u = candidate_logits(cfg, u)
        z = dm.candidate_selector.project(h)
        pred = jnp.take_along_axis(tokens, jnp.clip(positions - 1, 0, L - 1), axis=1)
        s = dm.candidate_selector.scores(u, ids, z, pred)
        sel = jnp.take_along_axis(ids, jnp.argmax(s, -1)[..., None], -1)[..., 0] == labels
    else:
        sel = base
    def tau(c):
        c3 = c.reshape(r, n, B)[:, :, 1:]
        v3 = valid.reshape(r, n, B)[:, :, 1:]
        run = jnp.cumprod((c3 & v3).astype(jnp.int32), -1).sum(-1)
        kept = v3.all(-1)  # full blocks only
        acc = jnp.sum((c3 & v3), axis=(0, 1)), jnp.sum(v3, axis=(0, 1))
        return jnp.sum((1 + run) * kept), jnp.sum(kept), acc
    return tau(base), tau(sel)

def evaluate(name, tokens, loss_mask, lengths, taps, greedy_only=None):
    rng = np.random.default_rng(0)
    tot = {"base": [0, 0], "sel": [0, 0]}
    accs = np.zeros(B - 1)
    vs = np.zeros(B - 1)
    for i in range(0, len(tokens), 8):
        sl = slice(i, i + 8)
        a, k = sample_anchors(loss_mask[sl], lengths[sl], NA, B, rng)
        (bs, bn, _), (ss, sn, (ac, av)) = correct_runs(jnp.asarray(tokens[sl]), jnp.asarray(taps[sl]), jnp.asarray(a),
                                                   jnp.asarray(k), jnp.asarray(lengths[sl]), jnp.asarray(loss_mask[sl]))
        tot["base"][0] += float(bs)
        tot["base"][1] += float(bn)
        tot["sel"][0] += float(ss)
        tot["sel"][1] += float(sn)
        accs += np.asarray(ac)
        vs += np.asarray(av)
    print(f"{name}: rows {len(tokens)} blocks {tot['sel'][1]:.0f}  tau base {tot['base'][0]/tot['base'][1]:.3f}  "
          f"tau sel {tot['sel'][0]/tot['sel'][1]:.3f}  acc/pos {np.round(accs/vs, 3).tolist()}", flush=True)

for f in sys.argv[2:]:
    d = np.load(f)
    n = min(len(d["tokens"]), 32)
    evaluate(f"{f} (first {n} rows)", d["tokens"][:n], d["loss_mask"][:n], d["lengths"][:n], d["taps"][:n])
if len(sys.argv) == 2:  # no shard: the held-out prompts' greedy responses, 128 new tokens (as `bench decode`)
    msgs = [json.loads(x)["messages"] for x in open("benchmarks/prompts/heldout.jsonl") if x.strip()]
    prompts = [lt.tokenizer.encode_chat(m) for m in msgs]
    dc = DataConfig(taps=tuple(cfg.target_layer_ids), max_prompt=max(len(p) for p in prompts), max_new=128,
                    sampled_fraction=0.0)
    d = generate_shard(lt, dc, prompts, 0)
    Path("runs/s4").mkdir(parents=True, exist_ok=True)
    np.savez("runs/s4/heldout_greedy.npz", **d)
    evaluate("held-out greedy", d["tokens"], d["loss_mask"], d["lengths"], d["taps"])
