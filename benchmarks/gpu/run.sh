#!/usr/bin/env bash
# The GPU proof kit: tests, the paged attention kernel, plain vs speculative decode, the 8B-shaped cost table,
# drafter data and training, each time-boxed; at most 8 files in OUT and a summary table. Exits 0 whatever a step did
# (failures are in summary.json).
#   benchmarks/gpu/run.sh --out DIR [--budget-s N] [--dry-run] [--dtype auto|bfloat16|float16|float32] [...]
# `--help` lists every option; docs/gpu.md ("GPU proof kit") says what to copy to the host and what each file holds.
# Python: $PYTHON, else the checkout's .venv, else python3.
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
py=${PYTHON:-}
if [ -z "$py" ]; then
  if [ -x "$root/.venv/bin/python" ]; then py="$root/.venv/bin/python"; else py=python3; fi
fi
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
exec "$py" "$root/benchmarks/gpu/kit.py" "$@"
