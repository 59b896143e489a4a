#!/usr/bin/env bash
# The CPU benchmark set behind docs/benchmarks.md; writes benchmarks/results/cpu-2core/ (index:
# benchmarks/results/README.md). Run on an otherwise idle machine:
#   bash benchmarks/run_cpu.sh [all|plain|decode|tiers|adaptive|tp|serve]
# DRAFTER=DIR measures another drafter (default: the committed one); GAMMA pins the verify width (default 8).
# decode/dflash_g8.json and dflash2_g8.json compare two drafters trained with docs/training.md; their commands are
# in docs/benchmarks.md.
set -euo pipefail
cd "$(dirname "$0")/.."
B=.venv/bin/dflash-jax
R=benchmarks/results/cpu-2core
mkdir -p "$R/decode"
what=${1:-all}
G=${GAMMA:-8}
D=${DRAFTER:-default}

if [[ $what == all || $what == plain ]]; then
  $B bench plain --batch-sizes 1,4,8 --max-tokens 64 --json-out $R/plain.json
fi
if [[ $what == all || $what == decode ]]; then
  $B bench decode --draft-model "$D" --dflash-gamma $G --json-out $R/decode/default_g$G.json \
     --plot $R/decode/default_g$G.png
  $B bench decode --draft-model "$D" --dflash-gamma 10 --num-prompts 12 --json-out $R/decode/g10.json
  $B bench decode --draft-model "$D" --dflash-gamma $G --batch-size 4 --num-prompts 12 \
     --json-out $R/decode/g${G}_b4.json
  $B bench decode --draft-model random:2 --dflash-gamma $G --num-prompts 8 --max-tokens 64 \
     --json-out $R/decode/random_g$G.json
fi
if [[ $what == all || $what == tiers ]]; then
  for t in fp8 nvfp4; do
    $B bench decode --draft-model "$D" --dflash-gamma $G --draft-weight-quantization $t \
       --num-prompts 12 --json-out $R/decode/g${G}_$t.json
  done
fi
if [[ $what == all || $what == adaptive ]]; then
  $B bench spec-cost --draft-model "$D" --dflash-gamma $G --json-out $R/spec_cost.json
  T=$(python3 -c "import json;print(json.load(open('$R/spec_cost.json'))['adaptive_k'])")
  $B bench decode --draft-model "$D" --dflash-gamma $G --num-prompts 12 --dflash-adaptive-k "$T" \
     --json-out $R/decode/g${G}_adaptive.json
  $B bench decode --draft-model random:2 --dflash-gamma $G --num-prompts 8 --max-tokens 64 \
     --dflash-adaptive-k "$T" --json-out $R/decode/random_g${G}_adaptive.json
fi
if [[ $what == all || $what == tp ]]; then
  XLA_FLAGS=--xla_force_host_platform_device_count=4 $B bench decode --draft-model "$D" --dflash-gamma $G \
     --tp-size 3 --draft-tp-size auto --num-prompts 4 --max-tokens 48 --json-out $R/decode/tp3.json
fi
if [[ $what == all || $what == serve ]]; then
  $B serve --port 8101 --draft-model "$D" --dflash-gamma $G --max-num-seqs 8 --draft-weight-quantization declared & S=$!
  $B serve --port 8102 --no-spec --max-num-seqs 8 & P=$!
  trap 'kill $S $P 2>/dev/null || true' EXIT
  for port in 8101 8102; do
    until curl -sf localhost:$port/health >/dev/null; do sleep 2; done
  done
  $B bench serve --url http://127.0.0.1:8101 --url http://127.0.0.1:8102 --concurrency 1,2,4,8 \
     --num-prompts 8 --max-tokens 64 --json-out $R/serve.json --plot $R/serve.png
fi
