#!/usr/bin/env bash
# A rehearsal of the lease plan (docs/gpu.md, "One lease") against a stand-in of the GPU host, on any CPU:
#   benchmarks/gpu/rehearse.sh --out DIR
# 1. A venv on Python 3.12 with the host's versions (jax/jaxlib 0.11.2 for CPU, numpy 2.5.2, tokenizers 0.23.2,
#    safetensors 0.8.0, ...) and none of the packages the host lacks (fastapi, uvicorn, pydantic, gguf); built once
#    under ${DFLASH_CACHE:-~/.cache/dflash-jax}/rehearsal-KEY (KEY: the version set), reused after. torch and
#    transformers (on the host) are left out here: a CPU torch for 3.12 is gigabytes; the tests that need them skip.
# 2. benchmarks/gpu/pack.sh .lease (the parts, the wheels, the manifest).
# 3. Each command of the plan in its dry-run form (`run.sh --lease-call N --dry-run`), one after the other, each in
#    a scratch copy of the tree as the host gets it (tracked and untracked-not-ignored files, plus that call's
#    carry), with only that copy on PYTHONPATH and a stash directory shared by the calls, as on a warm host.
# Writes DIR/rehearsal.json: {"python", "jax", "absent", "calls": [{"name", "carry_bytes", "ok", "seconds", ...}]}
# and each call's kit output under DIR/callN/. Exits 1 if a call is not ok.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
out=
while [ $# -gt 0 ]; do
  case $1 in
    --out) out=$2; shift 2 ;;
    *) echo "rehearse.sh: unknown argument $1 (usage: rehearse.sh --out DIR)" >&2; exit 2 ;;
  esac
done
[ -n "$out" ] || { echo "rehearse.sh: --out DIR is required" >&2; exit 2; }
mkdir -p "$out"; out=$(cd "$out" && pwd)
cache=${DFLASH_CACHE:-$HOME/.cache/dflash-jax}
py312=${PY312:-$HOME/.pyenv/versions/3.12.1/bin/python3}
t_all=$(date +%s.%N)

# --- 1. the host's versions (its pip list; flax/optax/orbax at the versions this index resolves)
reqs='jax==0.11.2
jaxlib==0.11.2
numpy==2.5.2
tokenizers==0.23.2
safetensors==0.8.0
huggingface-hub==1.33.0
flax
optax
orbax-checkpoint
ml-dtypes
typer
rich
matplotlib
jinja2
prometheus-client
httpx
pytest
pytest-xdist
hypothesis
psutil
scipy
pyyaml
requests
tqdm'
absent_pkgs='fastapi uvicorn pydantic pydantic_core gguf'
key=$( (echo "$reqs"; echo "$absent_pkgs"; "$py312" -V) | sha1sum | cut -c1-12)
venv=$cache/rehearsal-$key
t0=$(date +%s.%N)
if [ ! -f "$venv/.ok" ]; then
  echo "rehearse: building $venv (Python $("$py312" -V 2>&1), the host's versions)"
  rm -rf "$venv"; mkdir -p "$cache"
  "$py312" -m venv "$venv"
  echo "$reqs" > "$venv/requirements.txt"
  "$venv/bin/pip" install -q -r "$venv/requirements.txt" 2>&1 | grep -v "^WARNING: Location" || true
  "$venv/bin/python" -c "import jax" || { echo "rehearse: venv build failed" >&2; exit 1; }
  # what the host lacks, though a package here may have pulled it in
  for p in $absent_pkgs; do "$venv/bin/pip" uninstall -q -y "$p" >/dev/null 2>&1 || true; done
  touch "$venv/.ok"
  venv_state=built
else
  venv_state=cached
fi
venv_s=$(echo "$(date +%s.%N) - $t0" | bc)
echo "rehearse: venv $venv_state in ${venv_s} s"

# --- 2. pack
t0=$(date +%s.%N)
"$root/benchmarks/gpu/pack.sh" "$root/.lease" 2>&1 | grep -v "^WARNING: Location"
pack_s=$(echo "$(date +%s.%N) - $t0" | bc)

# --- 3. the calls
scratch=$(mktemp -d "${TMPDIR:-/tmp}/dflash-rehearsal.XXXXXX")
trap 'rm -rf "$scratch"' EXIT
stash=$scratch/stash
n_calls=$(cd "$root" && "$venv/bin/python" -c "import importlib.util as u
s = u.spec_from_file_location('kit', 'benchmarks/gpu/kit.py'); k = u.module_from_spec(s); s.loader.exec_module(k)
print(len(k.LEASE_CALLS))")
calls_tsv=$scratch/calls.tsv
: > "$calls_tsv"
for n in $(seq 1 "$n_calls"); do
  tree=$scratch/tree$n
  mkdir -p "$tree/.lease"
  (cd "$root" && git ls-files -co --exclude-standard -z | tar --null -T - -cf -) | tar -x -C "$tree"
  tree_bytes=$(find "$tree" -type f -printf '%s\n' | awk '{s+=$1} END {print s+0}')
  cp -r "$root/.lease/$n" "$tree/.lease/$n"
  carry_bytes=$(find "$tree" -type f -printf '%s\n' | awk '{s+=$1} END {print s+0}')
  rm -rf "$out/call$n"
  echo "rehearse: call $n ($carry_bytes bytes with its carry)"
  t0=$(date +%s.%N)
  rc=0
  (cd "$tree" && env -i PATH=/usr/bin:/bin HOME="$HOME" PYTHON="$venv/bin/python" DFLASH_LEASE_STASH="$stash" \
    JAX_PLATFORMS=cpu timeout 1200 bash benchmarks/gpu/run.sh --lease-call "$n" --dry-run --out "$out/call$n" \
    --work "$stash/work") > "$out/call$n.log" 2>&1 || rc=$?
  secs=$(echo "$(date +%s.%N) - $t0" | bc)
  printf '%s\t%s\t%s\t%s\t%s\n' "$n" "$tree_bytes" "$carry_bytes" "$rc" "$secs" >> "$calls_tsv"
  tail -3 "$out/call$n.log"
  rm -rf "$tree"
done
total_s=$(echo "$(date +%s.%N) - $t_all" | bc)

# --- rehearsal.json
cd "$root"
"$venv/bin/python" - "$out" "$calls_tsv" "$venv_state" "$venv_s" "$pack_s" "$total_s" "$absent_pkgs" <<'PY'
import importlib.util, json, platform, subprocess, sys
from pathlib import Path
out, tsv, venv_state, venv_s, pack_s, total_s, absent_pkgs = sys.argv[1:]
s = importlib.util.spec_from_file_location("kit", "benchmarks/gpu/kit.py")
kit = importlib.util.module_from_spec(s)
s.loader.exec_module(kit)
import jax
def importable(name):
    return subprocess.run([sys.executable, "-c", f"import {name}"], capture_output=True).returncode == 0
names = [*absent_pkgs.split(), "torch", "transformers"]
calls = []
for line in Path(tsv).read_text().splitlines():
    n, tree_bytes, carry_bytes, rc, secs = line.split("\t")
    n = int(n)
    call = kit.LEASE_CALLS[n - 1]
    d = Path(out) / f"call{n}"
    files = sorted(p.name for p in d.iterdir()) if d.is_dir() else []
    summary = kit.read_json(d / "summary.json") or {}
    missing = {f: kit.missing_fields(kit.read_json(d / f) or {}, paths) for f, paths in kit.required_for(call["steps"]).items()}
    missing = {f: m for f, m in missing.items() if m}
    statuses = {k: v.get("status") for k, v in summary.get("steps", {}).items()}
    lease = summary.get("lease") or {}
    ok = (int(rc) == 0 and int(carry_bytes) < kit.CARRY_LIMIT and len(files) <= kit.MAX_OUT_FILES and not missing
          and statuses == {k: "ok" for k in call["steps"]} and not lease.get("error")
          and (n < len(kit.LEASE_CALLS) or bool(lease.get("model"))))
    calls.append({
        "name": call["name"], "carry_bytes": int(carry_bytes), "tree_bytes": int(tree_bytes), "ok": ok,
        "seconds": round(float(secs), 1), "returncode": int(rc), "steps": statuses, "files": files,
        "missing_fields": missing, "lease_error": lease.get("error"), "model_check": lease.get("model_check"),
        "wheels": lease.get("wheels"), "compile": {k: v.get("compile") for k, v in summary.get("steps", {}).items()},
        "tests": summary.get("tests", {}).get("failed_tests"),
    })
rep = {
    "python": platform.python_version(), "jax": jax.__version__, "jaxlib": __import__("jaxlib").__version__,
    "numpy": __import__("numpy").__version__,
    "absent": [n for n in names if not importable(n)],
    "present_but_host_lacks": [n for n in absent_pkgs.split() if importable(n)],
    "left_out": "torch and transformers are on the host but not here (a CPU torch for Python 3.12 is gigabytes): "
                "the tests that need them skip",
    "carry_limit": kit.CARRY_LIMIT, "venv": venv_state, "venv_s": round(float(venv_s), 1),
    "pack_s": round(float(pack_s), 1), "wall_s": round(float(total_s), 1),
    "lease_s_at_most": kit.lease_seconds(), "calls": calls,
}
kit.write_json(Path(out) / "rehearsal.json", rep)
print(json.dumps({k: rep[k] for k in ("python", "jax", "absent", "wall_s")}))
for c in calls:
    print(f"rehearse: {c['name']}: ok {c['ok']}, carry {c['carry_bytes']} bytes, {c['seconds']} s, steps {c['steps']}")
sys.exit(0 if all(c["ok"] for c in calls) else 1)
PY
