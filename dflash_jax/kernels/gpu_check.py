"""One-shot GPU validation of the Pallas kernels (run where a GPU exists; not part of the CPU test suite).

    python -m dflash_jax.kernels.gpu_check OUT_DIR [--quick]

1. correctness: `linear(x, with_backend(w, "pallas"))` vs the jnp reference for FP8 and NVFP4 (both unpack modes),
   f32 and bf16 activations, shapes that are and are not tile multiples, leading dims;
2. the micro-benchmark on the GPU shape set (agreement; wall-clock ms and on-device `*_dev_us` per call);
3. a block-size sweep on two shapes (decode-sized M=16 and M=128).
Each phase writes `OUT_DIR/gpu_check.json` again, so a run cut short still leaves what it measured. On a
CPU-only host it runs the same code in interpret mode on tiny shapes (a smoke test of this script).
"""

from __future__ import annotations

import functools
import json
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.kernels.bench import run_kernel_bench
from dflash_jax.kernels.fp8_matmul import fp8_matmul, fp8_matmul_reference
from dflash_jax.kernels.nvfp4_matmul import Nvfp4MatmulConfig, nvfp4_matmul, nvfp4_matmul_reference
from dflash_jax.quant.formats import quantize_fp8_row, quantize_nvfp4, with_backend
from dflash_jax.quant.linear import linear


def _rel(a: Any, b: Any) -> float:
    a = np.asarray(jnp.asarray(a, jnp.float32), np.float64)
    b = np.asarray(jnp.asarray(b, jnp.float32), np.float64)
    return float(np.abs(a - b).max() / (np.abs(b).max() or 1.0))


def _nv(x: Any, *, args: tuple, **kw: Any) -> jax.Array:
    return nvfp4_matmul(x, *args, **kw)


def correctness(interpret: bool, shapes: list[tuple[int, int, int]]) -> list[dict[str, Any]]:
    out = []
    backend = "interpret" if interpret else "pallas"
    key = jax.random.key(0)
    for m, n, k in shapes:
        key, kx, kw = jax.random.split(key, 3)
        x32 = jax.random.normal(kx, (m, k), jnp.float32)
        w = jax.random.normal(kw, (n, k), jnp.float32) * 0.05
        f, v = quantize_fp8_row(w), quantize_nvfp4(w)
        for dtype in (jnp.float32, jnp.bfloat16):
            x = x32.astype(dtype)
            split = Nvfp4MatmulConfig(block_m=16, block_n=64, block_k=128, unpack="split")
            nv_args = (v.packed, v.block_scale, v.global_scale)
            kw = {"interpret": interpret, "out_dtype": jnp.float32}
            cases = {
                "fp8": functools.partial(fp8_matmul, q=f.q, scale=f.scale, **kw),
                "nvfp4-interleave": functools.partial(_nv, args=nv_args, config=None, **kw),
                "nvfp4-split": functools.partial(_nv, args=nv_args, config=split, **kw),
            }
            refs = {
                "fp8": fp8_matmul_reference(x, f.q, f.scale, out_dtype=jnp.float32),
                "nvfp4": nvfp4_matmul_reference(x, *nv_args, out_dtype=jnp.float32),
            }
            for name, fn in cases.items():
                rec: dict[str, Any] = {"case": name, "m": m, "n": n, "k": k, "dtype": jnp.dtype(dtype).name}
                try:
                    rec["rel_err"] = _rel(fn(x), refs[name.split("-")[0]])
                    rec["ok"] = rec["rel_err"] <= 1e-5
                except Exception as e:
                    rec["error"] = f"{type(e).__name__}: {e}"[:2000]
                    rec["ok"] = False
                out.append(rec)
                print(json.dumps(rec), flush=True)
        # linear() dispatch with leading dims (x's dtype out)
        for fmt, qw, ref in (("fp8", f, fp8_matmul_reference), ("nvfp4", v, nvfp4_matmul_reference)):
            rec = {"case": f"linear-{fmt}-3d", "m": m, "n": n, "k": k, "dtype": "bfloat16"}
            try:
                x3 = x32.astype(jnp.bfloat16).reshape(1, m, k)
                y = jax.jit(linear)(x3, with_backend(qw, backend))
                args = (qw.q, qw.scale) if fmt == "fp8" else (qw.packed, qw.block_scale, qw.global_scale)
                rec["rel_err"] = _rel(y.reshape(m, n), ref(x3.reshape(m, k), *args, out_dtype=jnp.float32))
                rec["ok"] = rec["rel_err"] <= 1e-2  # bf16 output rounding
            except Exception as e:
                rec["error"] = f"{type(e).__name__}: {e}"[:2000]
                rec["ok"] = False
            out.append(rec)
            print(json.dumps(rec), flush=True)
    return out


def main(argv: list[str]) -> int:
    out_dir = Path(argv[0]) if argv else Path(".")
    quick = "--quick" in argv
    out_dir.mkdir(parents=True, exist_ok=True)
    on_gpu = jax.default_backend() == "gpu"
    interpret = not on_gpu
    result: dict[str, Any] = {
        "platform": jax.default_backend(),
        "jax": jax.__version__,
        "device": jax.devices()[0].device_kind,
    }
    path = out_dir / "gpu_check.json"

    def save() -> None:
        path.write_text(json.dumps(result, indent=1) + "\n")

    t0 = time.time()
    shapes = [(16, 256, 512), (5, 200, 328), (33, 1000, 1000)] if on_gpu else [(5, 40, 72)]
    try:
        result["correctness"] = correctness(interpret, shapes)
    except Exception:
        result["correctness_error"] = traceback.format_exc()[-3000:]
    result["correctness_s"] = time.time() - t0
    save()
    phases = [("bench", None, False)]
    if on_gpu and not quick:
        phases.append(("sweep", [(16, 4096, 4096), (128, 4096, 4096)], True))
    for name, phase_shapes, sweep in phases:
        t0 = time.time()
        try:
            result[name] = run_kernel_bench(
                phase_shapes, repeats=5 if on_gpu else 1, sweep=sweep, log=lambda s: print(s, flush=True)
            )
        except Exception:
            result[f"{name}_error"] = traceback.format_exc()[-3000:]
        result[f"{name}_s"] = time.time() - t0
        save()
    bad = [r for r in result.get("correctness", []) if not r["ok"]]
    print(f"wrote {path}; correctness failures: {len(bad)}", flush=True)
    return 1 if bad or "correctness_error" in result else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
