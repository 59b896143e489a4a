#!/usr/bin/env bash
# The GPU proof kit: tests, the paged attention kernel, plain vs speculative decode, the 8B-shaped cost table,
# drafter data and training, each time-boxed; at most 8 files in OUT and a summary table. Exits 0 whatever a step did
# (failures are in summary.json).
#   benchmarks/gpu/run.sh --out DIR [--budget-s N] [--steps S,...] [--dry-run] [--dtype auto|bfloat16|...] [...]
#   benchmarks/gpu/run.sh --lease-call N --out DIR      command N of the lease plan (benchmarks/gpu/pack.sh first)
# `--help` lists every option; docs/gpu.md ("GPU proof kit") says what each file holds and gives the lease's calls.
# Python: $PYTHON, else the checkout's .venv, else python3.
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
py=${PYTHON:-}
if [ -z "$py" ]; then
  if [ -x "$root/.venv/bin/python" ]; then py="$root/.venv/bin/python"; else py=python3; fi
fi
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
exec "$py" "$root/benchmarks/gpu/kit.py" "$@"
