"""Micro-benchmark of the dequant-matmul kernels: agreement with the jnp reference, time per shape and tier.

For each shape `(M, N, K)` and format it reports the Pallas kernel's relative error against the reference
(`max|y - y_ref| / max|y_ref|`, both with f32 output), the XLA fallback's error, the quantization error
against the dense f32 product, and median milliseconds for the dense matmul, the reference, the XLA
fallback and the kernel. `sweep=True` also times a few block-size configurations per shape (GPU tuning).
`*_ms` times are wall clock around `block_until_ready` (10 calls per sample on GPU, so host dispatch is
included); `*_dev_us` times (GPU default) run the op 50 times inside one jitted loop (`device_time_us`), which
shows the on-device time of small ops. On CPU the kernel runs in interpret mode, so its time says nothing
about GPU speed.
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

import dflash_jax.kernels.fp8_matmul as fp8k
import dflash_jax.kernels.nvfp4_matmul as nvk
from dflash_jax.kernels._util import fit_block
from dflash_jax.quant.formats import Fp8RowWeight, Nvfp4Weight, quantize
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


def _bits_dtype(dtype: Any) -> Any:
    """Unsigned dtype of the same width (the dtype itself when it already is one)."""
    dtype = jnp.dtype(dtype)
    return dtype if dtype.kind == "u" else jnp.dtype(f"uint{8 * dtype.itemsize}")


def _touch(a: jax.Array, flag: jax.Array, value: jax.Array | None = None) -> jax.Array:
    """`a` with its first element set to `value` (default: itself) unless the traced `flag` is set (-> 0).

    XLA cannot prove the result equals `a`, so a loop that carries it can neither hoist work on `a` out of
    the loop nor CSE it across iterations; the update touches one element, in place on the loop carry.
    """
    idx = (0,) * a.ndim
    new = a[idx] if value is None else value.astype(a.dtype)
    return a.at[idx].set(jnp.where(flag, jnp.zeros((), a.dtype), new))


def device_time_us(
    fn: Callable[..., Any], x: jax.Array, w: Any, *, iters: int = 50, repeats: int = 5, touch_w: bool = True
) -> float:
    """Median microseconds per call of `fn(x, w)`, run `iters` times back to back inside one jitted loop.

    Host dispatch (tens of microseconds per jitted call) is paid once per loop instead of once per call.
    Each iteration writes one element of its output into x, so the calls form a chain XLA can neither CSE
    nor hoist. With `touch_w` it also rewrites the first element of every weight leaf (carried as raw
    unsigned bits, so the update is an in-place integer store) under a never-true flag computed from the
    output, so work on the weights alone (an XLA dequant) cannot be hoisted out of the loop either. The
    per-iteration bookkeeping (one-element updates) is included; time `fn = lambda x, w: x[:1, :1]` the
    same way to see its size.
    """
    leaves, treedef = jax.tree.flatten(w)
    dtypes = [leaf.dtype for leaf in leaves]

    def unbits(bits: list[jax.Array]) -> Any:
        return treedef.unflatten([jax.lax.bitcast_convert_type(b, d) for b, d in zip(bits, dtypes, strict=True)])

    def body(_, carry):
        x, bits = carry
        y = fn(x, unbits(bits) if touch_w else w)
        y00 = y[(0,) * y.ndim]
        flag = y00 != y00  # NaN test: never true for finite values, unknown to the compiler
        if touch_w:
            bits = [_touch(b, flag) for b in bits]
        return _touch(x, flag, y00), bits

    def loop(x, w):
        bits = [jax.lax.bitcast_convert_type(a, _bits_dtype(a.dtype)) for a in jax.tree.leaves(w)]
        return jax.lax.fori_loop(0, iters, body, (x, bits if touch_w else []))[0]

    return time_ms(jax.jit(loop), x, w, repeats=repeats) * 1e3 / iters


def _rel(a: jax.Array, b: jax.Array) -> float:
    a = np.asarray(jnp.asarray(a, jnp.float32), np.float64)
    b = np.asarray(jnp.asarray(b, jnp.float32), np.float64)
    denom = float(np.max(np.abs(b))) or 1.0
    return float(np.max(np.abs(a - b))) / denom


def _kernel_fn(fmt: str, config: Any, interpret: bool) -> Callable[..., jax.Array]:
    if fmt == "fp8":
        return lambda x, w: fp8k.fp8_matmul(x, w.q, w.scale, config=config, interpret=interpret, out_dtype=jnp.float32)
    return lambda x, w: nvk.nvfp4_matmul(
        x, w.packed, w.block_scale, w.global_scale, config=config, interpret=interpret, out_dtype=jnp.float32
    )


def _reference_fn(fmt: str) -> Callable[..., jax.Array]:
    if fmt == "fp8":
        return jax.jit(lambda x, w: fp8k.fp8_matmul_reference(x, w.q, w.scale, out_dtype=jnp.float32))
    return jax.jit(
        lambda x, w: nvk.nvfp4_matmul_reference(x, w.packed, w.block_scale, w.global_scale, out_dtype=jnp.float32)
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
    device_iters: int | None = None,
) -> dict[str, Any]:
    """Run the benchmark; returns a JSON-ready dict `{platform, device, backend, dtype, records: [...]}`.

    `device_iters` > 0 (default: 50 on GPU, 0 elsewhere) also times the dense matmul, the XLA fallback and
    the kernel (and each sweep config) with `device_time_us` (`*_dev_us` fields), plus the loop's own
    per-iteration cost (`loop_overhead_us`: x only, as for dense/kernel; `loop_overhead_w_us`: with the weight
    leaves rewritten too, as for the XLA fallback).
    """
    platform = jax.default_backend()
    on_gpu = platform == "gpu"
    backend = backend or ("pallas" if on_gpu else "interpret")
    if backend not in ("pallas", "interpret"):
        raise ValueError(f"backend must be 'pallas' or 'interpret', got {backend!r}")
    interpret = backend == "interpret"
    shapes = tuple(shapes or (GPU_SHAPES if on_gpu else CPU_SHAPES))
    dtype = jnp.bfloat16 if on_gpu else jnp.float32
    inner = 10 if on_gpu else 1
    dev_iters = (50 if on_gpu else 0) if device_iters is None else device_iters

    def dev_us(rec: dict[str, Any], field: str, fn: Callable[..., Any], x: Any, w: Any, touch_w: bool) -> None:
        if dev_iters <= 0:
            return
        try:
            rec[field] = device_time_us(fn, x, w, iters=dev_iters, repeats=repeats, touch_w=touch_w)
        except Exception as e:  # a timing failure must not hide the wall-clock numbers
            rec[field.replace("_us", "_error")] = _err(e)

    say = log or (lambda s: None)
    records: list[dict[str, Any]] = []
    key = jax.random.key(seed)
    for m, n, k in shapes:
        key, kx, kw = jax.random.split(key, 3)
        x = jax.random.normal(kx, (m, k), jnp.float32).astype(dtype)
        w = jax.random.normal(kw, (n, k), jnp.float32) * 0.02
        dense = w.astype(dtype)
        dense_fn = jax.jit(linear)
        y_dense = jax.jit(lambda x, w: jnp.einsum("mk,nk->mn", x.astype(jnp.float32), w, precision="highest"))(x, w)
        dense_ms = time_ms(dense_fn, x, dense, repeats=repeats, inner=inner)
        shape_dev: dict[str, Any] = {}
        dev_us(shape_dev, "dense_dev_us", dense_fn, x, dense, False)
        dev_us(shape_dev, "loop_overhead_us", lambda x, w: x[:1, :1], x, dense, False)
        for fmt in formats:
            qw: Fp8RowWeight | Nvfp4Weight = jax.jit(quantize, static_argnums=1)(w, fmt)
            rec: dict[str, Any] = {
                "m": m,
                "n": n,
                "k": k,
                "format": fmt,
                "backend": backend,
                "dtype": jnp.dtype(dtype).name,
                "weight_bytes": qw.nbytes,
                "dense_bytes": int(dense.nbytes),
                "dense_ms": dense_ms,
                **shape_dev,
            }
            dev_us(rec, "loop_overhead_w_us", lambda x, w: x[:1, :1], x, qw, True)
            ref = _reference_fn(fmt)
            y_ref = ref(x, qw)
            rec["quant_rel_err"] = _rel(y_ref, y_dense)
            rec["reference_ms"] = time_ms(ref, x, qw, repeats=repeats, inner=inner)
            xla_fn = jax.jit(linear)  # the weights are on the XLA backend (the quantizers' default)
            rec["xla_rel_err"] = _rel(xla_fn(x, qw), y_ref)
            rec["xla_ms"] = time_ms(xla_fn, x, qw, repeats=repeats, inner=inner)
            dev_us(rec, "xla_dev_us", xla_fn, x, qw, True)
            try:
                kern = _kernel_fn(fmt, None, interpret)
                rec["kernel_rel_err"] = _rel(kern(x, qw), y_ref)
                rec["kernel_ms"] = time_ms(kern, x, qw, repeats=repeats, inner=inner)
                sel = (fp8k if fmt == "fp8" else nvk).select_config(m, n, k, interpret=interpret)
                rec["kernel_config"] = dataclasses.asdict(sel)
                kmin = 32 if fmt == "nvfp4" else 16
                rec["kernel_blocks"] = [
                    fit_block(m, sel.block_m),
                    fit_block(n, sel.block_n),
                    fit_block(k, sel.block_k, kmin),
                ]
                rec["kernel_gbps"] = qw.nbytes / (rec["kernel_ms"] * 1e-3) / 1e9
                dev_us(rec, "kernel_dev_us", kern, x, qw, False)
                if "kernel_dev_us" in rec:
                    rec["kernel_dev_gbps"] = qw.nbytes / (rec["kernel_dev_us"] * 1e-6) / 1e9
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
                        dev_us(entry, "dev_us", kern, x, qw, False)
                    except Exception as e:
                        entry["error"] = _err(e)
                    rec["sweep"].append(entry)
                ok = [e for e in rec["sweep"] if "ms" in e and e["rel_err"] <= 1e-4]
                if ok:
                    rec["sweep_best"] = min(ok, key=lambda e: e["ms"])
                ok_dev = [e for e in ok if "dev_us" in e]
                if ok_dev:
                    rec["sweep_best_dev"] = min(ok_dev, key=lambda e: e["dev_us"])
            records.append(rec)
            say(_line(rec))
    return {
        "platform": platform,
        "device": str(jax.devices()[0].device_kind),
        "jax": jax.__version__,
        "backend": backend,
        "dtype": jnp.dtype(dtype).name,
        "repeats": repeats,
        "device_iters": dev_iters,
        "records": records,
    }


def _line(r: dict[str, Any]) -> str:
    kern = (
        f"kernel {r['kernel_ms']:.3f} ms err {r['kernel_rel_err']:.1e}"
        if "kernel_ms" in r
        else (f"kernel FAILED ({r.get('kernel_error')})")
    )
    best = ""
    if "sweep_best" in r:
        best = f" | best {r['sweep_best']['ms']:.3f} ms {r['sweep_best']['config']}"
    if "sweep_best_dev" in r:
        best += f" | best on device {r['sweep_best_dev']['dev_us']:.1f} us {r['sweep_best_dev']['config']}"
    dev = ""
    if "kernel_dev_us" in r:
        dev = (
            f" | on device (us/call): dense {r.get('dense_dev_us', float('nan')):.1f}, "
            f"xla {r.get('xla_dev_us', float('nan')):.1f}, kernel {r['kernel_dev_us']:.1f} "
            f"({r['kernel_dev_gbps']:.0f} GB/s), loop overhead {r.get('loop_overhead_us', float('nan')):.1f}"
            f"/{r.get('loop_overhead_w_us', float('nan')):.1f}"
        )
    return (
        f"{r['format']:5s} M={r['m']} N={r['n']} K={r['k']}: dense {r['dense_ms']:.3f} ms, "
        f"ref {r['reference_ms']:.3f} ms, xla {r['xla_ms']:.3f} ms err {r['xla_rel_err']:.1e}, {kern}, "
        f"quant err {r['quant_rel_err']:.3f}{dev}{best}"
    )
