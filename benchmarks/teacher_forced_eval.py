"""Teacher-forced τ of a drafter on target-generated rows, through the training loss's own forward (`drafter_loss`,
f32 LM head): what inference would accept if every earlier draft were right (for DFlash2, the selector's pick).

Usage:
  python benchmarks/teacher_forced_eval.py DRAFTER_DIR [SHARD.npz ...]   (shards from `dflash-jax train data`)
  python benchmarks/teacher_forced_eval.py DRAFTER_DIR --categories [NAME,...|all]

With shards: 24 random anchors per row, the first 32 rows of each. With no shard it generates the greedy responses
to `bench decode`'s default held-out prompts (128 new tokens), saves them to runs/heldout_greedy.npz and scores those.

--categories: the greedy responses (128 new tokens) to each held-out workload category (built once, cached in
runs/categories_greedy/), every response position taken as an anchor, and the steps greedy decoding takes through
them (`train.losses.decode_chain`): the "decode" τ equals `bench decode --category NAME --max-tokens 128
--dflash-gamma <block>` at T = 0 (its steps do not depend on batching), in about a minute instead of a timed run.
Beside it: τ over every anchor, n-gram drafting (4..1; `bench decode`'s replay) and the hybrid (`bench decode
--draft-method hybrid`: n-gram drafts where the last 4..2 tokens recur, the drafter's elsewhere) on the same responses,
and two ceilings: the copy oracle (at each step the context span whose copy the response accepts longest: no proposer
that copies its context does better) and the drafter-or-copy oracle (per step the better of that and the drafter's
block: a drafter that copied perfectly where copying helps and predicted as this one does elsewhere).
--per-response adds a line per response: its length, decode and hybrid τ, and the start of its text.
"""

import argparse
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.bench.ngram import HYBRID_MIN_N, propose, simulate
from dflash_jax.bench.prompts import category_names, encode_prompts, load_category, load_prompt_file
from dflash_jax.checkpoints.drafter import load_drafter
from dflash_jax.checkpoints.loader import load_target
from dflash_jax.train.data import DataConfig, generate_shard
from dflash_jax.train.losses import decode_chain, sample_anchors, teacher_forced_tau
from dflash_jax.train.trainer import TrainConfig, drafter_loss

ANCHORS, ROWS, BATCH, NEW = 24, 32, 8, 128

ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
ap.add_argument("drafter")
ap.add_argument("shards", nargs="*")
ap.add_argument("--categories", nargs="?", const="all", default=None)
ap.add_argument("--per-response", action="store_true", help="with --categories: one line per response as well")
args = ap.parse_args()

lt = load_target(None)
drafter = load_drafter(args.drafter, lt.cfg)
cfg = drafter.cfg


def train_config(anchors: int) -> TrainConfig:
    return TrainConfig(
        num_layers=cfg.num_layers,
        block_size=cfg.block_size,
        target_layer_ids=cfg.target_layer_ids,
        mask_token_id=cfg.mask_token_id,
        num_anchors=anchors,
        arch=cfg.arch,
        ce_dtype="float32",
    )


tc = train_config(ANCHORS)


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


tc_all = train_config(NEW)


@jax.jit
def accepted_runs(batch):
    """Per anchor of one row: the leading run of correct drafts [1, NEW]."""
    _, (_, valid, correct, _) = drafter_loss(drafter, lt.model.embed[...], lt.model.lm_head[...], batch, tc_all)
    ok = (correct & valid).reshape(1, NEW, tc_all.block_size - 1)
    return jnp.cumprod(ok.astype(jnp.int32), axis=-1).sum(-1)


def greedy_shard(prompts: list[list[int]], path: Path | None) -> dict:
    if path is not None and path.exists():
        return dict(np.load(path))
    taps = tuple(cfg.target_layer_ids)
    dc = DataConfig(taps=taps, max_prompt=max(map(len, prompts)), max_new=NEW, sampled_fraction=0.0)
    d = generate_shard(lt, dc, prompts, 0)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        np.savez(path, **d)
    return d


def copy_oracle_run(ctx: np.ndarray, future: np.ndarray, k: int) -> int:
    """The most drafts a block copied from one span of the context `ctx` (k tokens from any position, cut at the
    context's end) would have accepted against the response's next tokens `future`: the ceiling of any proposer
    that copies its context."""
    best = 0
    for m in range(1, min(k, len(future), len(ctx)) + 1):
        window = np.lib.stride_tricks.sliding_window_view(ctx, m)
        if not (window == future[:m]).all(axis=1).any():
            break
        best = m
    return best


def category_taus(name: str, d) -> None:
    k = cfg.block_size - 1
    chain, every, hybrid, copy, both, prompts, outputs = [], [], [], [], [], [], []
    for i in range(len(d["tokens"])):
        length, start = int(d["lengths"][i]), int(np.argmax(d["loss_mask"][i] > 0))
        anchors = np.arange(start, start + NEW, dtype=np.int32)
        batch = {key: jnp.asarray(d[key][i : i + 1]) for key in ("tokens", "loss_mask", "lengths", "taps")}
        batch["anchors"] = jnp.asarray(np.minimum(anchors, length - 1)[None])
        batch["keep"] = jnp.asarray((anchors < length)[None])
        acc = np.asarray(accepted_runs(batch))[0, : length - start]
        chain += decode_chain(acc)
        every += (acc[: len(acc) - 1] + 1).tolist()
        toks = d["tokens"][i, :length].tolist()
        prompts.append(toks[:start])
        outputs.append(toks[start:])
        runs = np.zeros_like(acc)
        for j in range(len(acc) - 1):
            prop = propose(toks[: start + j + 1], k, min_n=HYBRID_MIN_N)
            m = 0
            while m < len(prop) and start + j + 1 + m < length and prop[m] == toks[start + j + 1 + m]:
                m += 1
            runs[j] = m if prop else acc[j]
        hybrid += decode_chain(runs)
        arr = np.asarray(toks)
        oracle = np.array([copy_oracle_run(arr[: start + j + 1], arr[start + j + 1 :], k) for j in range(len(acc))])
        copy += decode_chain(oracle)
        both += decode_chain(np.maximum(oracle, acc))
        if args.per_response:
            steps, hyb = decode_chain(acc), decode_chain(runs)
            text = lt.tokenizer.decode(toks[start:])[:60].replace("\n", " ")
            print(
                f"  {name}[{i}] {length - start} tokens: tau decode {np.mean(steps):.2f}, hybrid {np.mean(hyb):.2f}"
                f" | {text}",
                flush=True,
            )
    ngram = simulate(prompts, outputs, cfg.block_size)["tau_mean"]
    print(
        f"{name}: {len(d['tokens'])} responses, {len(chain)} steps; tau decode {np.mean(chain):.3f}, every anchor "
        f"{np.mean(every):.3f}, n-gram {ngram:.3f}, hybrid {np.mean(hybrid):.3f}, copy oracle {np.mean(copy):.3f}, "
        f"drafter or copy oracle {np.mean(both):.3f}",
        flush=True,
    )


for f in args.shards:
    evaluate(f, np.load(f))
if args.categories is not None:
    for c in category_names(args.categories):
        d = greedy_shard(encode_prompts(lt.tokenizer, load_category(c)), Path("runs/categories_greedy") / f"{c}.npz")
        category_taus(c, d)
elif not args.shards:
    d = greedy_shard(encode_prompts(lt.tokenizer, load_prompt_file(None)), Path("runs/heldout_greedy.npz"))
    evaluate("held-out greedy responses", d)
