"""Micro-benchmark of `paged_attention` against `layers.gqa_attention` on a dense cache holding the same keys.

For each case (batch B, query width T, kv_len, dtype) it builds a shuffled page pool and the dense
`[B, Hkv, kv_len, d]` cache with the same contents, queries at the last T positions of each row (causal), and
reports the relative error of the paged result against the dense one and the milliseconds of: the dense
`gqa_attention` (mask built outside the timed call), the rows' pages gathered in logical order (`layers.read_rows`)
plus `gqa_attention`, and `paged_attention` (its mask comes from lo/hi inside).
Wall clock around `block_until_ready`, the calls interleaved round by round after a warm-up; `*_ms` is the
minimum over the rounds (the least disturbed by other load), `*_median_ms` the median. On a GPU the Pallas
kernel is timed too, and every path also on device (`*_dev_us`); interpret mode says nothing about speed.

    python -m dflash_jax.kernels.paged_attention_bench [OUT.json] [--cases BxTxKVLEN,...] [--check] [--sweep]

`--check` first compares the XLA path and the Pallas kernel (compiled on a GPU, interpreted elsewhere) with the
reference and exits non-zero on a disagreement; `--sweep` times the kernel under each `SWEEP` tiling.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.kernels.paged_attention import PagedAttentionConfig, paged_attention
from dflash_jax.models.layers import Pages, gqa_attention, read_rows

# (B, T, kv_len) on CPU: decode and verify widths over short and long contexts
CPU_CASES = tuple((b, t, s) for b in (1, 8) for t in (1, 16) for s in (128, 2048))
GPU_CASES = tuple((b, t, s) for b in (1, 8) for t in (1, 16) for s in (2048, 8192))


def time_all(fns: Sequence[tuple[Callable[..., Any], tuple]], repeats: int) -> list[tuple[float, float]]:
    """(min, median) wall-clock ms of each `fn(*args)` over `repeats` rounds (after one warm-up); each round calls
    every fn once in turn, so a burst of load from other processes hits them alike."""
    for fn, args in fns:
        jax.block_until_ready(fn(*args))
    samples: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for i, (fn, args) in enumerate(fns):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*args))
            samples[i].append((time.perf_counter() - t0) * 1e3)
    return [(min(s), statistics.median(s)) for s in samples]


def make_case(b: int, t: int, kv_len: int, *, heads: int, kv_heads: int, head_dim: int, page_size: int, dtype, seed=0):
    """A shuffled page pool and the equal dense cache: (q, k_pages, v_pages, table, lo, hi, k, v, mask)."""
    rng = np.random.default_rng(seed)
    n = kv_len // page_size
    perm = rng.permutation(b * n) + 1  # physical pages 1..b*n, page 0 the null page
    table = perm.reshape(b, n).astype(np.int32)
    k = rng.standard_normal((b, kv_heads, kv_len, head_dim)).astype(np.float32)
    v = rng.standard_normal((b, kv_heads, kv_len, head_dim)).astype(np.float32)
    k_pages = np.zeros((b * n + 1, kv_heads, page_size, head_dim), np.float32)
    v_pages = np.zeros_like(k_pages)
    k_pages[table] = k.reshape(b, kv_heads, n, page_size, head_dim).transpose(0, 2, 1, 3, 4)
    v_pages[table] = v.reshape(b, kv_heads, n, page_size, head_dim).transpose(0, 2, 1, 3, 4)
    q = rng.standard_normal((b, t, heads, head_dim)).astype(np.float32)
    pos = np.broadcast_to(kv_len - t + np.arange(t), (b, t))
    hi = (pos + 1).astype(np.int32)
    lo = np.zeros_like(hi)
    mask = np.arange(kv_len)[None, None, :] < hi[:, :, None]
    c = lambda a: jnp.asarray(a, dtype)  # noqa: E731
    i = jnp.asarray
    return c(q), c(k_pages), c(v_pages), i(table), i(lo), i(hi), c(k), c(v), i(mask)


def _rel(a, b) -> float:
    a = np.asarray(jnp.asarray(a, jnp.float32), np.float64)
    b = np.asarray(jnp.asarray(b, jnp.float32), np.float64)
    return float(np.abs(a - b).max() / (np.abs(b).max() or 1.0))


# Pallas tilings timed by `run_paged_bench(sweep=True)` (GPU)
SWEEP = tuple(
    PagedAttentionConfig(kv_block=kb, block_q=bq, kv_splits=ks, num_warps=nw, num_stages=2)
    for kb, bq, ks, nw in (
        (32, 16, 0, 4),
        (64, 16, 0, 4),
        (128, 16, 0, 4),
        (128, 16, 1, 4),
        (256, 16, 0, 8),
        (64, 64, 0, 4),
        (128, 64, 0, 8),
        (64, 128, 0, 8),
    )
)


def run_paged_bench(
    cases: Sequence[tuple[int, int, int]] | None = None,
    *,
    dtypes: Sequence[Any] = (jnp.float32, jnp.bfloat16),
    heads: int = 16,
    kv_heads: int = 8,
    head_dim: int = 128,
    page_size: int = 16,
    repeats: int = 20,
    sweep: Sequence[PagedAttentionConfig] = (),
    device_iters: int | None = None,
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Run the benchmark; returns `{platform, device, shape, records: [...]}` (JSON-ready).

    `device_iters` > 0 (default: 50 on a GPU, 0 elsewhere) also times every path on device (`*_dev_us`: that
    many calls chained in one jitted loop, so host dispatch is paid once; `kernels.bench.device_time_us`).
    `sweep` times the Pallas kernel under each given tiling (`sweep` records, fastest first; interpret mode
    off a GPU, where the times say nothing about speed)."""
    on_gpu = jax.default_backend() == "gpu"
    dev_iters = (50 if on_gpu else 0) if device_iters is None else device_iters
    cases = tuple(cases or (GPU_CASES if on_gpu else CPU_CASES))
    say = log or (lambda s: None)
    dense_fn = jax.jit(gqa_attention)
    gathered_fn = jax.jit(
        lambda q, k_pages, v_pages, table, mask: gqa_attention(
            q,
            read_rows(k_pages, Pages(table), mask.shape[-1]),
            read_rows(v_pages, Pages(table), mask.shape[-1]),
            mask,
        )
    )
    backends = ("xla", "pallas") if on_gpu else ("xla",)
    records = []
    for b, t, kv_len in cases:
        for dtype in dtypes:
            q, kp, vp, table, lo, hi, k, v, mask = make_case(
                b, t, kv_len, heads=heads, kv_heads=kv_heads, head_dim=head_dim, page_size=page_size, dtype=dtype
            )
            ref = dense_fn(q, k, v, mask)
            rec: dict[str, Any] = {"b": b, "t": t, "kv_len": kv_len, "dtype": jnp.dtype(dtype).name}
            fns = [(dense_fn, (q, k, v, mask)), (gathered_fn, (q, kp, vp, table, mask))]
            for backend in backends:
                fn = functools.partial(paged_attention, kv_len=kv_len, backend=backend)
                rec[f"{backend}_rel_err"] = _rel(fn(q, kp, vp, table, lo, hi), ref)
                fns.append((fn, (q, kp, vp, table, lo, hi)))
            times = time_all(fns, repeats)
            for name, (t_min, t_med) in zip(("dense", "gathered", *backends), times, strict=True):
                rec[f"{name}_ms"], rec[f"{name}_median_ms"] = t_min, t_med
            for backend in backends:
                rec[f"{backend}_vs_dense"] = rec[f"{backend}_ms"] / rec["dense_ms"]
                rec[f"{backend}_vs_gathered"] = rec[f"{backend}_ms"] / rec["gathered_ms"]
            paged = (kp, vp, table, lo, hi)
            if dev_iters > 0:
                # the bool mask rides in the closure (device_time_us carries its operands as unsigned bits)
                dev = [
                    ("dense", lambda q, rest, mask=mask: dense_fn(q, *rest, mask), (k, v)),
                    ("gathered", lambda q, rest, mask=mask: gathered_fn(q, *rest, mask), (kp, vp, table)),
                ]
                dev += [(be, _bound(kv_len, be, None, False), paged) for be in backends]
                for name, fn, rest in dev:
                    rec[f"{name}_dev_us"] = _dev_us(fn, q, rest, dev_iters, repeats)
            if sweep:
                rec["sweep"] = []
                for cfg in sweep:
                    entry: dict[str, Any] = {"config": dataclasses.asdict(cfg)}
                    fn = _bound(kv_len, "pallas", cfg, not on_gpu)
                    try:
                        entry["rel_err"] = _rel(fn(q, paged), ref)
                        ((entry["ms"], _),) = time_all([(fn, (q, paged))], repeats)
                        if dev_iters > 0:
                            entry["dev_us"] = _dev_us(fn, q, paged, dev_iters, repeats)
                    except Exception as e:  # record and continue: one failing tiling must not hide the rest
                        entry["error"] = f"{type(e).__name__}: {e}"[:500]
                    rec["sweep"].append(entry)
                rec["sweep"].sort(key=lambda e: e.get("dev_us", e.get("ms", float("inf"))))
            records.append(rec)
            say(_line(rec, backends))
    return {
        "platform": jax.default_backend(),
        "device": str(jax.devices()[0].device_kind),
        "jax": jax.__version__,
        "shape": {"heads": heads, "kv_heads": kv_heads, "head_dim": head_dim, "page_size": page_size},
        "repeats": repeats,
        "records": records,
    }


def _bound(kv_len: int, backend: str, cfg: PagedAttentionConfig | None, interpret: bool) -> Callable[..., jax.Array]:
    """`fn(q, (k_pages, v_pages, table, lo, hi))`, the argument order of `device_time_us`."""
    return lambda q, rest: paged_attention(q, *rest, kv_len=kv_len, backend=backend, interpret=interpret, config=cfg)


def _dev_us(fn: Callable[..., jax.Array], q: jax.Array, rest: tuple, iters: int, repeats: int) -> float:
    """On-device microseconds per call of `fn(q, rest)` (`iters` chained calls in one jitted loop)."""
    from dflash_jax.kernels.bench import device_time_us

    return device_time_us(fn, q, rest, iters=iters, repeats=min(repeats, 5), touch_w=False)


def _line(r: dict[str, Any], backends: Sequence[str]) -> str:
    parts = [
        f"B={r['b']} T={r['t']} kv_len={r['kv_len']} {r['dtype']}: dense {r['dense_ms']:.3f} ms, "
        f"gathered pages + dense {r['gathered_ms']:.3f} ms"
    ]
    if "dense_dev_us" in r:
        devs = ", ".join(f"{n} {r[f'{n}_dev_us']:.1f}" for n in ("dense", "gathered", *backends))
        parts.append(f"on device (us/call): {devs}")
    if r.get("sweep") and "error" not in r["sweep"][0]:
        best = r["sweep"][0]
        parts.append(f"best tiling {best['config']} {best.get('dev_us', best.get('ms'))}")
    for be in backends:
        parts.append(
            f"{be} {r[f'{be}_ms']:.3f} ms ({r[f'{be}_vs_dense']:.2f}x dense, {r[f'{be}_vs_gathered']:.2f}x "
            f"gathered, err {r[f'{be}_rel_err']:.1e})"
        )
    return ", ".join(parts)


CHECK_GPU = ((4, 1, 2048, 0), (4, 16, 2048, 0), (2, 16, 4096, 1024), (1, 256, 1024, 0))  # (B, T, kv_len, window)
CHECK_CPU = ((2, 1, 64, 0), (2, 5, 64, 24))
CHECK_TILES = (
    None,  # the table's
    PagedAttentionConfig(kv_block=32, block_q=16, kv_splits=1),
    PagedAttentionConfig(kv_block=64, kv_splits=3),
)


def _check_one(args, ref, ref_lse, tol, kv_len, backend, cfg, interpret) -> dict[str, Any]:
    rec: dict[str, Any] = {"backend": backend, "config": None if cfg is None else dataclasses.asdict(cfg)}
    try:
        o, lse = paged_attention(
            *args, kv_len=kv_len, backend=backend, interpret=interpret, config=cfg, return_lse=True
        )
        rec["max_abs_err"] = float(jnp.max(jnp.abs(o.astype(jnp.float32) - ref.astype(jnp.float32))))
        fin = jnp.isfinite(ref_lse)
        rec["lse_max_abs_err"] = float(jnp.max(jnp.where(fin, jnp.abs(lse - ref_lse), 0.0)))
        lse_tol = 1e-4 * max(1.0, float(jnp.max(jnp.where(fin, jnp.abs(ref_lse), 0.0))))
        rec["ok"] = rec["max_abs_err"] <= tol and rec["lse_max_abs_err"] <= lse_tol
    except Exception as e:  # record and continue: one lowering failure must not hide the rest
        rec["error"] = f"{type(e).__name__}: {e}"[:2000]
        rec["ok"] = False
    return rec


def check_paths(
    *,
    interpret: bool,
    log: Callable[[str], None] | None = None,
    cases: Sequence[tuple[int, int, int, int]] | None = None,
    dtypes: Sequence[Any] = (jnp.bfloat16, jnp.float32),
    tiles: Sequence[PagedAttentionConfig | None] = CHECK_TILES,
) -> list[dict[str, Any]]:
    """The XLA path and the Pallas kernel (the table's tiling and two others) vs the reference: serving-like
    shapes on a GPU (head_dim 128, page 16, 8 kv heads, GQA 4), tiny ones in interpret mode; rows of different
    lengths, a sliding window on one case. Tolerance: 1e-5 of max|v| in f32, 2^-7 of max|v| in bf16 (the
    probabilities and the output rounded to bf16), lse 1e-4 relative. `cases` (B, T, kv_len, window), `dtypes`
    and `tiles` (None: the table's) narrow the set (default: the platform's cases, both dtypes, `CHECK_TILES`)."""
    say = log or (lambda s: None)
    kv_heads, g, d = (2, 2, 16) if interpret else (8, 4, 128)
    out = []
    for b, t, kv_len, window in cases or (CHECK_CPU if interpret else CHECK_GPU):
        for dtype in dtypes:
            q, kp, vp, table, lo, hi, _, v, _ = make_case(
                b, t, kv_len, heads=kv_heads * g, kv_heads=kv_heads, head_dim=d, page_size=16, dtype=dtype, seed=b + t
            )
            hi = hi - (jnp.arange(b, dtype=hi.dtype) * (kv_len // (2 * b)))[:, None]  # ragged rows
            lo = jnp.maximum(hi - window, 0) if window else lo
            args = (q, kp, vp, table, lo, hi)
            ref, ref_lse = paged_attention(*args, kv_len=kv_len, backend="reference", return_lse=True)
            tol = (1e-5 if dtype == jnp.float32 else 2.0**-7) * float(jnp.max(jnp.abs(v.astype(jnp.float32))))
            case = {"b": b, "t": t, "kv_len": kv_len, "window": window, "dtype": jnp.dtype(dtype).name}
            runs = [("xla", None, False)] + [("pallas", c, interpret) for c in tiles]
            for backend, cfg, interp in runs:
                rec = case | _check_one(args, ref, ref_lse, tol, kv_len, backend, cfg, interp)
                out.append(rec)
                say(json.dumps(rec))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m dflash_jax.kernels.paged_attention_bench [OUT.json] [--cases BxTxS,...] [--check] [--sweep]`.

    `--check` first compares every path with the reference (on a GPU: the compiled Pallas kernel) and exits
    non-zero on a disagreement; the JSON is rewritten after each phase."""

    import argparse
    from pathlib import Path

    ap = argparse.ArgumentParser(prog="python -m dflash_jax.kernels.paged_attention_bench")
    ap.add_argument("out", nargs="?", help="write the JSON result here")
    ap.add_argument("--cases", help="comma-separated BxTxKVLEN cases (default: the platform's set)")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--check", action="store_true", help="compare every path with the reference first")
    ap.add_argument("--sweep", action="store_true", help="also time the Pallas kernel under each SWEEP tiling (GPU)")
    args = ap.parse_args(argv)
    cases = None
    if args.cases:
        try:
            cases = [tuple(int(x) for x in c.lower().split("x")) for c in args.cases.split(",") if c.strip()]
        except ValueError:
            ap.error(f"--cases: expected BxTxKVLEN items, got {args.cases!r}")
        if any(len(c) != 3 or min(c) <= 0 for c in cases):
            ap.error(f"--cases: expected BxTxKVLEN items of positive integers, got {args.cases!r}")
    dtypes = [jnp.dtype(d) for d in args.dtypes.split(",")]
    say = lambda s: print(s, flush=True)  # noqa: E731
    result: dict[str, Any] = {}

    def save() -> None:
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=1) + "\n")

    bad = 0
    if args.check:
        result["check"] = check_paths(interpret=jax.default_backend() != "gpu", log=say)
        bad = sum(not r["ok"] for r in result["check"])
        say(f"check: {bad} disagreements")
        save()
    sweep = SWEEP if args.sweep else ()
    result["bench"] = run_paged_bench(cases, dtypes=dtypes, repeats=args.repeats, sweep=sweep, log=say)
    save()
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
