"""Micro-benchmark of the dequant-matmul kernels: agreement with the jnp reference, time per shape and tier.

For each shape `(M, N, K)` and format it reports the Pallas kernel's relative error against the reference
(`max|y - y_ref| / max|y_ref|`, both with f32 output), the XLA fallback's error, the quantization error
against the dense f32 product, and median milliseconds for the dense matmul, the reference, the XLA
fallback and the kernel. `sweep=True` also times a few block-size configurations per shape (GPU tuning).
Times are wall clock around `block_until_ready`; on CPU the kernel runs in interpret mode, so its time says
nothing about GPU speed.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import dflash_jax.quant.kernels.fp8_matmul as fp8k
import dflash_jax.quant.kernels.nvfp4_matmul as nvk
from dflash_jax.quant.formats import Fp8RowWeight, Nvfp4Weight, quantize
from dflash_jax.quant.kernels._util import fit_block
from dflash_jax.quant.linear import linear

FORMATS = ("fp8", "nvfp4")
CPU_SHAPES = ((16, 256, 256), (40, 200, 328))
GPU_SHAPES = ((16, 4096, 4096), (128, 4096, 4096), (16, 12288, 4096), (16, 4096, 12288), (256, 4096, 4096))

_SWEEP = (  # (block_m, block_n, block_k, num_warps, num_stages)
    (16, 32, 256, 4, 4),
    (16, 64, 256, 4, 4),
    (16, 128, 128, 4, 4),
    (16, 64, 512, 4, 3),
    (32, 64, 256, 4, 4),
    (64, 64, 128, 4, 4),
    (64, 128, 64, 4, 3),
    (64, 128, 128, 4, 3),
    (128, 128, 64, 8, 3),
    (128, 256, 64, 8, 3),
)


def parse_shapes(text: str) -> tuple[tuple[int, int, int], ...]:
    """`"16x4096x4096,128x4096x4096"` -> ((16, 4096, 4096), (128, 4096, 4096)) as (M, N, K)."""
    shapes = []
    for part in text.split(","):
        part = part.strip().lower()
        if not part:
            continue
        dims = part.split("x")
        if len(dims) != 3 or not all(d.isdigit() and int(d) > 0 for d in dims):
            raise ValueError(f"bad shape {part!r}; expected MxNxK with positive integers")
        shapes.append((int(dims[0]), int(dims[1]), int(dims[2])))
    if not shapes:
        raise ValueError("no shapes given")
    return tuple(shapes)


def time_ms(fn: Callable[..., Any], *args: Any, repeats: int = 5, inner: int = 1) -> float:
    """Median wall-clock ms of `fn(*args)` over `repeats` samples of `inner` calls (after one warm-up)."""
    jax.block_until_ready(fn(*args))
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(inner):
            out = fn(*args)
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - t0) * 1e3 / inner)
    return statistics.median(samples)


def _rel(a: jax.Array, b: jax.Array) -> float:
    a = np.asarray(jnp.asarray(a, jnp.float32), np.float64)
    b = np.asarray(jnp.asarray(b, jnp.float32), np.float64)
    denom = float(np.max(np.abs(b))) or 1.0
    return float(np.max(np.abs(a - b))) / denom


def _kernel_fn(fmt: str, config: Any, interpret: bool) -> Callable[..., jax.Array]:
    if fmt == "fp8":
        return lambda x, w: fp8k.fp8_matmul(
            x, w.q, w.scale, config=config, interpret=interpret, out_dtype=jnp.float32
        )
    return lambda x, w: nvk.nvfp4_matmul(
        x, w.packed, w.block_scale, w.global_scale, config=config, interpret=interpret, out_dtype=jnp.float32
    )


def _reference_fn(fmt: str) -> Callable[..., jax.Array]:
    if fmt == "fp8":
        return jax.jit(lambda x, w: fp8k.fp8_matmul_reference(x, w.q, w.scale, out_dtype=jnp.float32))
    return jax.jit(
        lambda x, w: nvk.nvfp4_matmul_reference(
            x, w.packed, w.block_scale, w.global_scale, out_dtype=jnp.float32
        )
    )


def sweep_configs(fmt: str) -> list[Any]:
    """Candidate block-size configs for the GPU sweep (NVFP4 tries both unpack modes)."""
    out: list[Any] = []
    for bm, bn, bk, nw, ns in _SWEEP:
        if fmt == "fp8":
            out.append(fp8k.Fp8MatmulConfig(bm, bn, bk, nw, ns))
        else:
            for unpack in nvk.UNPACK_MODES:
                out.append(nvk.Nvfp4MatmulConfig(bm, bn, max(bk, 32), nw, ns, unpack))
    return out


def _err(e: Exception) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"


def run_kernel_bench(
    shapes: Sequence[tuple[int, int, int]] | None = None,
    *,
    formats: Sequence[str] = FORMATS,
    backend: str | None = None,
    repeats: int = 5,
    sweep: bool = False,
    seed: int = 0,
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Run the benchmark; returns a JSON-ready dict `{platform, device, backend, dtype, records: [...]}`."""
    platform = jax.default_backend()
    on_gpu = platform == "gpu"
    backend = backend or ("pallas" if on_gpu else "pallas_interpret")
    if backend not in ("pallas", "pallas_interpret"):
        raise ValueError(f"backend must be 'pallas' or 'pallas_interpret', got {backend!r}")
    interpret = backend == "pallas_interpret"
    shapes = tuple(shapes or (GPU_SHAPES if on_gpu else CPU_SHAPES))
    dtype = jnp.bfloat16 if on_gpu else jnp.float32
    inner = 10 if on_gpu else 1
    say = log or (lambda s: None)
    records: list[dict[str, Any]] = []
    key = jax.random.key(seed)
    for m, n, k in shapes:
        key, kx, kw = jax.random.split(key, 3)
        x = jax.random.normal(kx, (m, k), jnp.float32).astype(dtype)
        w = jax.random.normal(kw, (n, k), jnp.float32) * 0.02
        dense = w.astype(dtype)
        dense_fn = jax.jit(lambda x, w: linear(x, w))
        y_dense = jax.jit(
            lambda x, w: jnp.einsum("mk,nk->mn", x.astype(jnp.float32), w, precision="highest")
        )(x, w)
        dense_ms = time_ms(dense_fn, x, dense, repeats=repeats, inner=inner)
        for fmt in formats:
            qw: Fp8RowWeight | Nvfp4Weight = jax.jit(quantize, static_argnums=1)(w, fmt)
            rec: dict[str, Any] = {
                "m": m, "n": n, "k": k, "format": fmt, "backend": backend, "dtype": jnp.dtype(dtype).name,
                "weight_bytes": qw.nbytes, "dense_bytes": int(dense.nbytes), "dense_ms": dense_ms,
            }
            ref = _reference_fn(fmt)
            y_ref = ref(x, qw)
            rec["quant_rel_err"] = _rel(y_ref, y_dense)
            rec["reference_ms"] = time_ms(ref, x, qw, repeats=repeats, inner=inner)
            xla_fn = jax.jit(lambda x, w: linear(x, w, backend="xla"))
            rec["xla_rel_err"] = _rel(xla_fn(x, qw), y_ref)
            rec["xla_ms"] = time_ms(xla_fn, x, qw, repeats=repeats, inner=inner)
            try:
                kern = _kernel_fn(fmt, None, interpret)
                rec["kernel_rel_err"] = _rel(kern(x, qw), y_ref)
                rec["kernel_ms"] = time_ms(kern, x, qw, repeats=repeats, inner=inner)
                sel = (fp8k if fmt == "fp8" else nvk).select_config(m, n, k, interpret=interpret)
                rec["kernel_config"] = dataclasses.asdict(sel)
                kmin = 32 if fmt == "nvfp4" else 16
                rec["kernel_blocks"] = [
                    fit_block(m, sel.block_m), fit_block(n, sel.block_n), fit_block(k, sel.block_k, kmin)
                ]
                rec["kernel_gbps"] = qw.nbytes / (rec["kernel_ms"] * 1e-3) / 1e9
            except Exception as e:  # record and continue: one lowering failure must not hide the rest
                rec["kernel_error"] = _err(e)
            if sweep:
                rec["sweep"] = []
                for cfg in sweep_configs(fmt):
                    entry: dict[str, Any] = {"config": dataclasses.asdict(cfg)}
                    try:
                        kern = _kernel_fn(fmt, cfg, interpret)
                        entry["rel_err"] = _rel(kern(x, qw), y_ref)
                        entry["ms"] = time_ms(kern, x, qw, repeats=repeats, inner=inner)
                    except Exception as e:
                        entry["error"] = _err(e)
                    rec["sweep"].append(entry)
                ok = [e for e in rec["sweep"] if "ms" in e and e["rel_err"] <= 1e-4]
                if ok:
                    rec["sweep_best"] = min(ok, key=lambda e: e["ms"])
            records.append(rec)
            say(_line(rec))
    return {
        "platform": platform,
        "device": str(jax.devices()[0].device_kind),
        "jax": jax.__version__,
        "backend": backend,
        "dtype": jnp.dtype(dtype).name,
        "repeats": repeats,
        "records": records,
    }


def _line(r: dict[str, Any]) -> str:
    kern = f"kernel {r['kernel_ms']:.3f} ms err {r['kernel_rel_err']:.1e}" if "kernel_ms" in r else (
        f"kernel FAILED ({r.get('kernel_error')})"
    )
    best = ""
    if "sweep_best" in r:
        best = f" | best {r['sweep_best']['ms']:.3f} ms {r['sweep_best']['config']}"
    return (
        f"{r['format']:5s} M={r['m']} N={r['n']} K={r['k']}: dense {r['dense_ms']:.3f} ms, "
        f"ref {r['reference_ms']:.3f} ms, xla {r['xla_ms']:.3f} ms err {r['xla_rel_err']:.1e}, {kern}, "
        f"quant err {r['quant_rel_err']:.3f}{best}"
    )
