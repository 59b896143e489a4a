#!/usr/bin/env bash
# Train SmolLM2 drafters on one GPU (steps 1-3 of the default drafter's recipe, docs/training.md).
#   benchmarks/train_gpu.sh TARGET OUT_DIR [GEN_SECONDS] [TRAIN_SECONDS]     (TARGET: .gguf, HF directory or 'default')
# Tokens-only data: the target answers the training prompts (greedy for first occurrences, T=0.7 for 25% and
#    for repeated prompts), f32 with HIGHEST matmul precision so its choices match the CPU f32 target;
# then a DFlash and a DFlash2 drafter, each for TRAIN_SECONDS with the taps recomputed by the target per
#    batch (TF32 matmuls), steps fitted to the budget (WSD schedule); both exported as float16 z-lab checkpoints.
# Knobs (environment): ROWS, MAX_NEW, LAYERS, BATCH, SKIP_DFLASH2; SEED, SELF_PROMPT (share of prompts the target
# writes itself, `--self-prompt-fraction`), SAMPLED (`--sampled-fraction`); INIT_FROM=DRAFTER_DIR continues that
# drafter at LR (default 3e-4) instead of starting from the target's layers at 3e-3 (SKIP_DFLASH=1 skips the DFlash
# run, for continuing a DFlash2 drafter). Continuing the committed default on fresh self-prompted data:
#   SEED=7 SELF_PROMPT=1 SAMPLED=0 SKIP_DFLASH=1 LAYERS=3 \
#     INIT_FROM=dflash_jax/drafters/smollm2-135m-dflash benchmarks/train_gpu.sh TARGET.gguf OUT 240 240
set -euo pipefail
T=$1; O=$2; GEN=${3:-150}; TR=${4:-170}
export PYTHONUNBUFFERED=1
dj() { python3 -c 'import sys; from dflash_jax.cli.train import app; sys.argv[0] = "dflash-jax train"; app()' "$@"; }
mkdir -p "$O"
JAX_DEFAULT_MATMUL_PRECISION=highest dj data --model "$T" --out "$O/data" --no-store-taps --rows-per-shard "${ROWS:-1024}" \
  --num-shards 96 --max-prompt 128 --max-new "${MAX_NEW:-256}" --max-seconds "$GEN" --seed "${SEED:-0}" \
  --self-prompt-fraction "${SELF_PROMPT:-0}" --sampled-fraction "${SAMPLED:-0.25}"
if [ -n "${INIT_FROM:-}" ]; then init=(--init-from "$INIT_FROM" --lr "${LR:-3e-4}")
else init=(--init-from-target --lr 3e-3); fi
common=(--target "$T" --data "$O/data" --layers "${LAYERS:-2}" --batch-size "${BATCH:-128}" --num-anchors 32
        "${init[@]}" --warmup-steps 50 --time-budget "$TR" --steps 100000 --save-every 100000 --export-dtype float16)
[ "${SKIP_DFLASH:-0}" = 1 ] || dj drafter "${common[@]}" --out "$O/dflash" --export "$O/dflash/drafter"
[ "${SKIP_DFLASH2:-0}" = 1 ] || dj drafter "${common[@]}" --arch dflash2 --selector-rank 32 --out "$O/dflash2" \
  --export "$O/dflash2/drafter"
