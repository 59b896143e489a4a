"""Attention over a paged KV pool: a jnp reference, an XLA path and a Pallas GPU (Triton) kernel.

The pool of one layer is `k_pages`, `v_pages`: `[num_pages, kv_heads, page_size, head_dim]` (head-major within a
page). Page 0 is the null page: it never holds live data, and unused page-table entries point at it. Logical
position `s` of batch row `b` lives at page `page_table[b, s // page_size]`, offset `s % page_size`. Query `(b, t)`
sees the keys at positions `lo[b, t] <= s < hi[b, t]` (causal attention: `hi = pos + 1`, `lo = pos - window + 1`
or 0; drafter context: `hi` = the block start). Every path computes the scores, the softmax and the accumulation
in f32 and returns `softmax(q k^T / sqrt(d)) v` in q's dtype, plus on request the log-sum-exp of the visible
scaled scores; a query with no visible key gets 0 and log-sum-exp -inf.

* `backend="reference"`: gathers every row's first `kv_len` positions to `[B, Hkv, kv_len, d]`, one masked
  softmax in f32 at HIGHEST precision (the test oracle).
* `backend="xla"`: operands stay in their dtype, dots accumulate in f32 and the probabilities go back to v's dtype
  for the second dot (as `layers.gqa_attention`). Small problems (`T * kv_len <= config.xla_dense_max` and
  `kv_len <= config.xla_dense_max_kv`) gather the pages once and run two einsums; larger ones loop over key
  blocks of `config.kv_block` tokens with an online softmax, reading each block's pages from the table, from the
  batch's first needed block to its last, so memory grows with `T * kv_block`, not `T * kv_len`.
* `backend="pallas"`: grid over (batch row, kv head, query block); a program holds its query rows (`block_q`
  rows of (position, head-in-group) pairs) and loops over its own row's pages, from the block of its smallest
  `lo` to the block of its largest `hi` (bounds computed outside the kernel and read from a small input), with
  an online softmax in f32. Triton lowering on GPU; `backend="interpret"` (or `interpret=True`) runs it in the
  Pallas interpreter (CPU).

`merge_attention` combines two partial attentions over disjoint key sets by their log-sum-exps.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from dflash_jax.kernels._util import MIN_TILE, dot_precision, next_pow2, round_up, triton_params
from dflash_jax.kernels.backends import BACKENDS as KERNEL_BACKENDS
from dflash_jax.kernels.backends import on_gpu

BACKENDS = (*KERNEL_BACKENDS, "reference")  # `reference`: the test oracle
# Finite stand-in for -inf in the online softmax: masked probabilities are zeroed explicitly, so a row whose keys
# are all masked so far keeps m = MASK, l = 0 and acc = 0 without inf - inf.
MASK = -0.7 * float(np.finfo(np.float32).max)


@dataclasses.dataclass(frozen=True)
class PagedAttentionConfig:
    """Tiling of the paged attention paths.

    `kv_block`: keys per step of the key loop (a multiple of the page size; the Pallas kernel loads
    `kv_block // page_size` pages per step, so that count must be a power of two there). `block_q`: query rows
    per Pallas program (rows are (position, head-in-group) pairs; a power of two >= 16). `kv_splits`: Pallas
    programs per (batch row, kv head, query block), each over an equal share of the row's key blocks, combined
    afterwards by their log-sum-exps (0: enough to fill `TARGET_PROGRAMS`, for small batches with long
    contexts). `num_warps`, `num_stages`: Triton launch parameters. The XLA path gathers all pages and runs one
    softmax when `T * kv_len <= xla_dense_max` and `kv_len <= xla_dense_max_kv`, and loops over key blocks
    otherwise: with `xla_skip_blocks` from the batch's first needed block to its last (bounds read from the data,
    which a loop run by the host, as on CPU, gets for free), else over every block of `kv_len` (a fixed trip count:
    on a GPU a while loop with data-dependent bounds reads its predicate on the host at every iteration).
    """

    kv_block: int = 64
    block_q: int = 16
    kv_splits: int = 0
    num_warps: int = 4
    num_stages: int = 2
    xla_dense_max: int = 1 << 16
    xla_dense_max_kv: int = 1 << 30
    xla_skip_blocks: bool = True

    def __post_init__(self):
        for name in ("kv_block", "block_q", "num_warps", "num_stages", "xla_dense_max", "xla_dense_max_kv"):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"PagedAttentionConfig.{name} must be a positive int, got {v!r}")
        if not isinstance(self.kv_splits, int) or self.kv_splits < 0:
            raise ValueError(f"PagedAttentionConfig.kv_splits must be an int >= 0 (0 = auto), got {self.kv_splits!r}")
        if self.block_q < MIN_TILE or self.block_q & (self.block_q - 1):
            raise ValueError(f"PagedAttentionConfig.block_q must be a power of two >= {MIN_TILE}, got {self.block_q}")


# GPU table: (max query rows T * g, config); the first row whose bound >= the rows wins. Starting points taken
# from the Pallas GPU attention kernels' defaults (block_k 64-128, 4-8 warps); not swept on hardware.
TUNED_GPU: tuple[tuple[int, PagedAttentionConfig], ...] = (
    (16, PagedAttentionConfig(kv_block=128, block_q=16, num_warps=4, num_stages=2)),
    (64, PagedAttentionConfig(kv_block=64, block_q=64, num_warps=4, num_stages=2)),
    (1 << 30, PagedAttentionConfig(kv_block=64, block_q=128, num_warps=8, num_stages=2)),
)
# XLA on CPU, from paged_attention_bench on a 2-core Xeon (Hq 16, Hkv 8, d 128, page 16, B 1-8, T 1-16). The
# gather of the pages is a copy that attention over a dense cache does not make. With bf16 operands one gather of
# every page cost 0.9-1.3x the dense attention; with f32 operands it cost about as much as the attention itself,
# and a loop over 128-token key blocks (each block's gather small enough to stay in cache) cost 1.0-1.6x dense
# from 512 keys on, so f32 loops from 256 keys on. Prefill-sized problems (T * kv_len > 64K) loop in any dtype.
XLA_CONFIGS = {
    "float32": PagedAttentionConfig(kv_block=128, xla_dense_max_kv=256),
    "other": PagedAttentionConfig(kv_block=512),
}
# Interpret mode costs per grid step and per loop step: big tiles, one split.
INTERPRET_CONFIG = PagedAttentionConfig(kv_block=128, block_q=64, kv_splits=1)
# The grid size `kv_splits=0` aims for: two programs per SM of an H100/H200 (132 SMs), rounded.
TARGET_PROGRAMS = 256


def select_config(
    backend: str, rows: int, page_size: int, dtype=jnp.float32, *, interpret: bool = False
) -> PagedAttentionConfig:
    """The table's config for `rows = T * g` query rows per (batch row, kv head) and K/V `dtype`, with
    `kv_block` rounded up to a whole number of pages (a power-of-two page count for Pallas)."""
    if backend != "pallas":
        cfg = XLA_CONFIGS["float32" if jnp.dtype(dtype) == jnp.float32 else "other"]
        cfg = dataclasses.replace(cfg, xla_skip_blocks=not on_gpu())
    elif interpret:
        cfg = INTERPRET_CONFIG
    else:
        cfg = next(c for bound, c in TUNED_GPU if rows <= bound)
    pages = max(1, -(-cfg.kv_block // page_size))
    if backend == "pallas":
        pages = next_pow2(pages)
    return dataclasses.replace(cfg, kv_block=pages * page_size)


# ----------------------------------------------------------------------------------------------- validation
def _check(q, k_pages, v_pages, page_table, lo, hi, kv_len, backend, config) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"paged_attention: backend must be one of {BACKENDS}, got {backend!r}")
    if q.ndim != 4:
        raise ValueError(f"paged_attention: q must be [B, T, Hq, d], got shape {tuple(q.shape)}")
    if k_pages.ndim != 4 or k_pages.shape != v_pages.shape:
        raise ValueError(
            "paged_attention: k_pages and v_pages must both be [num_pages, kv_heads, page_size, head_dim], got "
            f"{tuple(k_pages.shape)} and {tuple(v_pages.shape)}"
        )
    b, t, hq, d = q.shape
    _, hkv, p, dk = k_pages.shape
    if dk != d:
        raise ValueError(f"paged_attention: q has head_dim {d} but k_pages/v_pages have {dk}")
    if hq % hkv:
        raise ValueError(f"paged_attention: q has {hq} heads, not a multiple of the pool's {hkv} kv heads")
    if page_table.ndim != 2 or page_table.shape[0] != b or not jnp.issubdtype(page_table.dtype, jnp.integer):
        raise ValueError(
            f"paged_attention: page_table must be an int [B={b}, pages] array, got {page_table.dtype} "
            f"{tuple(page_table.shape)}"
        )
    for name, a in (("lo", lo), ("hi", hi)):
        if tuple(a.shape) != (b, t) or not jnp.issubdtype(a.dtype, jnp.integer):
            raise ValueError(f"paged_attention: {name} must be an int [B={b}, T={t}] array, got {a.dtype} {a.shape}")
    n = page_table.shape[1]
    if not isinstance(kv_len, (int, np.integer)) or kv_len <= 0 or kv_len % p or kv_len > n * p:
        raise ValueError(
            f"paged_attention: kv_len must be a static positive multiple of page_size {p} and at most "
            f"page_table's {n} pages x {p} = {n * p}; got {kv_len!r}"
        )
    if config is not None and config.kv_block % p:
        raise ValueError(f"paged_attention: config.kv_block {config.kv_block} is not a multiple of page_size {p}")
    if backend == "pallas":
        if q.dtype != k_pages.dtype or v_pages.dtype != k_pages.dtype:
            raise ValueError(
                f"paged_attention: the pallas backend needs q, k_pages and v_pages in one dtype; got {q.dtype}, "
                f"{k_pages.dtype}, {v_pages.dtype}"
            )
        if d < MIN_TILE or d & (d - 1) or p & (p - 1):
            raise ValueError(
                f"paged_attention: the pallas backend needs head_dim and page_size powers of two (head_dim >= "
                f"{MIN_TILE}); got head_dim {d}, page_size {p}; use backend='xla'"
            )
        if config is not None and (config.kv_block < MIN_TILE or (config.kv_block // p) & (config.kv_block // p - 1)):
            raise ValueError(
                f"paged_attention: the pallas backend needs config.kv_block >= {MIN_TILE} and kv_block / page_size "
                f"a power of two; got {config.kv_block} / {p}"
            )


# ----------------------------------------------------------------------------------------------- shared pieces
def gather_pages(pages: jax.Array, table: jax.Array) -> jax.Array:
    """pages [N, H, P, d], table [B, n] -> [B, H, n * P, d] (head-major, logical order): the rows' K or V, position
    s of row b at index s."""
    b, n = table.shape
    _, h, p, d = pages.shape
    heads = jnp.arange(h, dtype=table.dtype)
    return pages[table[:, None, :], heads[None, :, None]].reshape(b, h, n * p, d)


def _finish(acc: jax.Array, m: jax.Array, l: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """Normalized output and log-sum-exp from an online-softmax state (rows with l = 0 -> 0 and -inf)."""
    seen = l > 0
    out = jnp.where(seen[..., None], acc / jnp.where(seen, l, 1.0)[..., None], 0.0)
    lse = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), -jnp.inf)
    return out.astype(dtype), lse


def _to_rows(x: jax.Array) -> jax.Array:
    """[b, k, g, t, ...] -> [b, t, k * g * ...] (q's head order: head = kv_head * g + j)."""
    b, k, g, t = x.shape[:4]
    x = jnp.moveaxis(x, 3, 1)
    return x.reshape(b, t, -1)


# ----------------------------------------------------------------------------------------------- reference
def _reference(q, k_pages, v_pages, page_table, lo, hi, kv_len):
    b, t, hq, d = q.shape
    hkv, p = k_pages.shape[1], k_pages.shape[2]
    table = page_table[:, : kv_len // p]
    k = gather_pages(k_pages, table).astype(jnp.float32)
    v = gather_pages(v_pages, table).astype(jnp.float32)
    qg = q.astype(jnp.float32).reshape(b, t, hkv, hq // hkv, d)
    s = jnp.einsum("btkgd,bksd->bkgts", qg, k, precision=lax.Precision.HIGHEST) / math.sqrt(d)
    pos = jnp.arange(kv_len)
    vis = (pos >= lo[:, :, None]) & (pos < hi[:, :, None])  # [b, t, s]
    vis = vis[:, None, None]
    m = jnp.max(jnp.where(vis, s, -jnp.inf), axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    e = jnp.where(vis, jnp.exp(s - m), 0.0)
    l = jnp.sum(e, axis=-1)
    acc = jnp.einsum("bkgts,bksd->bkgtd", e, v, precision=lax.Precision.HIGHEST)
    out, lse = _finish(acc, m[..., 0], l, q.dtype)
    return _to_rows(out), _to_rows(lse)


# ----------------------------------------------------------------------------------------------- XLA
def masked_attention(q: jax.Array, k: jax.Array, v: jax.Array, visible: jax.Array) -> tuple[jax.Array, jax.Array]:
    """q [B, T, Hq, d] over head-major k, v [B, Hkv, S, d] where `visible` [B, T, S] (bool): (out [B, T, Hq * d] in
    q's dtype, f32 lse [B, T, Hq]; 0 and -inf for a query that sees nothing). Operands stay in their dtype, the
    dots accumulate in f32, the probabilities go back to v's dtype for the second dot (as `layers.gqa_attention`).
    The XLA path's one-gather case, and the drafter's in-block attention it merges with its paged context."""
    b, t, hq, d = q.shape
    hkv = k.shape[1]
    qg = q.reshape(b, t, hkv, hq // hkv, d)
    s = jnp.einsum("btkgd,bksd->bkgts", qg, k, preferred_element_type=jnp.float32) * (1.0 / math.sqrt(d))
    vis = visible[:, None, None]
    s = jnp.where(vis, s, MASK)
    m = jnp.max(s, axis=-1, keepdims=True)
    e = jnp.where(vis, jnp.exp(s - m), 0.0)
    l = jnp.sum(e, axis=-1, keepdims=True)
    prob = (e / jnp.where(l > 0, l, 1.0)).astype(v.dtype)
    out = jnp.einsum("bkgts,bksd->bkgtd", prob, v, preferred_element_type=jnp.float32)
    out = _to_rows(out.astype(q.dtype))
    lse = jnp.where(l[..., 0] > 0, m[..., 0] + jnp.log(jnp.where(l[..., 0] > 0, l[..., 0], 1.0)), -jnp.inf)
    return out, _to_rows(lse)


def _xla_dense(q, k_pages, v_pages, page_table, lo, hi, kv_len):
    p = k_pages.shape[2]
    table = page_table[:, : kv_len // p]
    k, v = gather_pages(k_pages, table), gather_pages(v_pages, table)
    pos = jnp.arange(kv_len, dtype=lo.dtype)
    return masked_attention(q, k, v, (pos >= lo[:, :, None]) & (pos < hi[:, :, None]))


def _xla_blocked(q, k_pages, v_pages, page_table, lo, hi, kv_len, kv_block, skip_blocks=True):
    b, t, hq, d = q.shape
    hkv, p = k_pages.shape[1], k_pages.shape[2]
    g = hq // hkv
    ppb = kv_block // p
    nblk = -(-kv_len // kv_block)
    table = page_table[:, : kv_len // p]
    table = jnp.pad(table, ((0, 0), (0, nblk * ppb - table.shape[1])))  # tail of the last block: the null page
    qg = q.reshape(b, t, hkv, g, d)
    scale = 1.0 / math.sqrt(d)
    valid = hi > lo
    first = jnp.min(jnp.where(valid, lo, kv_len)) // kv_block
    last = -(-jnp.max(jnp.where(valid, hi, 0)) // kv_block)

    def body(j, carry):
        acc, m, l = carry
        pages = lax.dynamic_slice_in_dim(table, j * ppb, ppb, axis=1)
        k, v = gather_pages(k_pages, pages), gather_pages(v_pages, pages)
        s = jnp.einsum("btkgd,bksd->bkgts", qg, k, preferred_element_type=jnp.float32) * scale
        pos = j * kv_block + jnp.arange(kv_block, dtype=lo.dtype)
        vis = ((pos >= lo[:, :, None]) & (pos < hi[:, :, None]))[:, None, None]
        s = jnp.where(vis, s, MASK)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        e = jnp.where(vis, jnp.exp(s - m_new[..., None]), 0.0)
        corr = jnp.exp(m - m_new)
        l = l * corr + jnp.sum(e, axis=-1)
        pv = jnp.einsum("bkgts,bksd->bkgtd", e.astype(v.dtype), v, preferred_element_type=jnp.float32)
        return acc * corr[..., None] + pv, m_new, l

    init = (
        jnp.zeros((b, hkv, g, t, d), jnp.float32),
        jnp.full((b, hkv, g, t), MASK, jnp.float32),
        jnp.zeros((b, hkv, g, t), jnp.float32),
    )
    if skip_blocks:
        acc, m, l = lax.fori_loop(first, jnp.maximum(first, last), body, init)
    else:  # blocks outside every row's range are fully masked: they leave acc, m and l as they are
        acc, m, l = lax.fori_loop(0, nblk, body, init)
    out, lse = _finish(acc, m, l, q.dtype)
    return _to_rows(out), _to_rows(lse)


# ----------------------------------------------------------------------------------------------- Pallas
def _kernel(bounds_ref, lo_ref, hi_ref, table_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, *, ppb: int, scale: float):
    block_q, d = q_ref.shape
    page = k_ref.shape[1]
    kv_block = ppb * page
    q = q_ref[...]
    lo = lo_ref[...]
    hi = hi_ref[...]
    prec = dot_precision(q.dtype)

    def body(j, carry):
        acc, m, l = carry
        pages = table_ref[pl.ds(j * ppb, ppb)]
        k = k_ref[pages].reshape(kv_block, d)
        v = v_ref[pages].reshape(kv_block, d)
        s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=prec, preferred_element_type=jnp.float32)
        s = s * scale
        pos = j * kv_block + lax.broadcasted_iota(jnp.int32, (block_q, kv_block), 1)
        vis = (pos >= lo[:, None]) & (pos < hi[:, None])
        s = jnp.where(vis, s, MASK)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        e = jnp.where(vis, jnp.exp(s - m_new[:, None]), 0.0)
        corr = jnp.exp(m - m_new)
        l = l * corr + jnp.sum(e, axis=1)
        pv = lax.dot_general(
            e.astype(v.dtype), v, (((1,), (0,)), ((), ())), precision=prec, preferred_element_type=jnp.float32
        )
        return acc * corr[:, None] + pv, m_new, l

    init = (
        jnp.zeros((block_q, d), jnp.float32),
        jnp.full((block_q,), MASK, jnp.float32),
        jnp.zeros((block_q,), jnp.float32),
    )
    acc, m, l = lax.fori_loop(bounds_ref[0], bounds_ref[1], body, init)
    seen = l > 0
    l_safe = jnp.where(seen, l, 1.0)
    o_ref[...] = jnp.where(seen[:, None], acc / l_safe[:, None], 0.0).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(seen, m + jnp.log(l_safe), -jnp.inf)


def kv_splits_for(cfg: PagedAttentionConfig, programs: int, key_blocks: int) -> int:
    """Key-range splits per (batch row, kv head, query block): `cfg.kv_splits`, or with 0 as many as bring the
    grid to `TARGET_PROGRAMS` programs, at most one per key block."""
    want = cfg.kv_splits or -(-TARGET_PROGRAMS // programs)
    return max(1, min(want, key_blocks))


def _pallas(q, k_pages, v_pages, page_table, lo, hi, kv_len, cfg, interpret):
    b, t, hq, d = q.shape
    npages, hkv, p, _ = k_pages.shape
    g = hq // hkv
    rows = t * g
    block_q = max(MIN_TILE, min(cfg.block_q, next_pow2(rows)))
    rows_pad = round_up(rows, block_q)
    nqb = rows_pad // block_q
    ppb = cfg.kv_block // p
    nblk = -(-kv_len // cfg.kv_block)
    splits = kv_splits_for(cfg, b * hkv * nqb, nblk)
    table = page_table[:, : kv_len // p].astype(jnp.int32)
    table = jnp.pad(table, ((0, 0), (0, nblk * ppb - table.shape[1])))
    # rows r = t * g + j of kv head h: query position t, query head h * g + j
    qr = q.reshape(b, t, hkv, g, d).transpose(0, 2, 1, 3, 4).reshape(b, hkv, rows, d)
    qr = jnp.pad(qr, ((0, 0), (0, 0), (0, rows_pad - rows), (0, 0)))
    lo_r = jnp.pad(jnp.repeat(lo.astype(jnp.int32), g, axis=1), ((0, 0), (0, rows_pad - rows)))
    hi_r = jnp.pad(jnp.repeat(hi.astype(jnp.int32), g, axis=1), ((0, 0), (0, rows_pad - rows)))
    valid = (hi_r > lo_r).reshape(b, nqb, block_q)
    first = jnp.min(jnp.where(valid, lo_r.reshape(b, nqb, block_q), kv_len), axis=2) // cfg.kv_block
    last = jnp.maximum(first, -(-jnp.max(jnp.where(valid, hi_r.reshape(b, nqb, block_q), 0), axis=2) // cfg.kv_block))
    # split s of a query block covers key blocks [first + s * chunk, min(last, first + (s + 1) * chunk))
    chunk = -(-(last - first) // splits)
    s_first = first[..., None] + jnp.arange(splits) * chunk[..., None]
    s_last = jnp.minimum(last[..., None], s_first + chunk[..., None])
    bounds = jnp.stack([s_first, jnp.maximum(s_first, s_last)], axis=3).astype(jnp.int32)  # [b, nqb, splits, 2]
    kernel = functools.partial(_kernel, ppb=ppb, scale=1.0 / math.sqrt(d))
    out_dtype = q.dtype if splits == 1 else jnp.float32
    out, lse = pl.pallas_call(
        kernel,
        out_shape=(
            jax.ShapeDtypeStruct((b, hkv, splits, rows_pad, d), out_dtype),
            jax.ShapeDtypeStruct((b, hkv, splits, rows_pad), jnp.float32),
        ),
        grid=(b, hkv, nqb, splits),
        in_specs=[
            pl.BlockSpec((None, None, None, 2), lambda i, h, r, s: (i, r, s, 0)),
            pl.BlockSpec((None, block_q), lambda i, h, r, s: (i, r)),
            pl.BlockSpec((None, block_q), lambda i, h, r, s: (i, r)),
            pl.BlockSpec((None, nblk * ppb), lambda i, h, r, s: (i, 0)),
            pl.BlockSpec((None, None, block_q, d), lambda i, h, r, s: (i, h, r, 0)),
            pl.BlockSpec((npages, None, p, d), lambda i, h, r, s: (0, h, 0, 0)),
            pl.BlockSpec((npages, None, p, d), lambda i, h, r, s: (0, h, 0, 0)),
        ],
        out_specs=(
            pl.BlockSpec((None, None, None, block_q, d), lambda i, h, r, s: (i, h, s, r, 0)),
            pl.BlockSpec((None, None, None, block_q), lambda i, h, r, s: (i, h, s, r)),
        ),
        interpret=interpret,
        compiler_params=None if interpret else triton_params(cfg.num_warps, cfg.num_stages),
        name="paged_attention",
    )(bounds, lo_r, hi_r, table, qr, k_pages, v_pages)
    out, lse = out[:, :, :, :rows], lse[:, :, :, :rows]
    if splits == 1:
        out, lse = out[:, :, 0], lse[:, :, 0]
    else:  # combine the splits' normalized partials by their log-sum-exps
        m = jnp.max(lse, axis=2)
        m = jnp.where(jnp.isfinite(m), m, 0.0)
        w = jnp.exp(lse - m[:, :, None])
        tot = jnp.sum(w, axis=2)
        out = jnp.sum(out * w[..., None], axis=2)
        out, lse = _finish(out, m, tot, q.dtype)
    out = out.reshape(b, hkv, t, g, d).transpose(0, 2, 1, 3, 4).reshape(b, t, hq * d)
    lse = lse.reshape(b, hkv, t, g).transpose(0, 2, 1, 3).reshape(b, t, hq)
    return out, lse


# ----------------------------------------------------------------------------------------------- entry points
@functools.partial(jax.jit, static_argnames=("kv_len", "backend", "interpret", "config", "return_lse"))
def paged_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    page_table: jax.Array,
    lo: jax.Array,
    hi: jax.Array,
    *,
    kv_len: int,
    backend: str = "xla",
    interpret: bool = False,
    config: PagedAttentionConfig | None = None,
    return_lse: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Attention of q `[B, T, Hq, d]` (query head h uses kv head `h // (Hq // Hkv)`) over the pages of
    `k_pages`/`v_pages` `[N, Hkv, P, d]` listed by `page_table` `[B, n]`; query (b, t) sees logical positions
    `lo[b, t] <= s < hi[b, t]` (`hi` is clamped to `kv_len`). Only positions below the static `kv_len` (a
    multiple of P, at most n * P) are read. Masked keys meet a zero probability, so pages hold finite values
    (the null page included).

    Returns `[B, T, Hq * d]` in q's dtype, and with `return_lse` also the f32 log-sum-exp `[B, T, Hq]` of the
    scaled visible scores (-inf where none is visible, with output 0). `config=None` takes `select_config`'s.
    """
    if backend == "interpret":
        backend, interpret = "pallas", True
    _check(q, k_pages, v_pages, page_table, lo, hi, kv_len, backend, config)
    p = k_pages.shape[2]
    hi = jnp.minimum(hi, kv_len)
    if backend == "reference":
        out, lse = _reference(q, k_pages, v_pages, page_table, lo, hi, kv_len)
    else:
        rows = q.shape[1] * (q.shape[2] // k_pages.shape[1])
        cfg = config or select_config(backend, rows, p, k_pages.dtype, interpret=interpret)
        if backend == "pallas":
            out, lse = _pallas(q, k_pages, v_pages, page_table, lo, hi, kv_len, cfg, interpret)
        elif q.shape[1] * kv_len <= cfg.xla_dense_max and kv_len <= cfg.xla_dense_max_kv:
            out, lse = _xla_dense(q, k_pages, v_pages, page_table, lo, hi, kv_len)
        else:
            out, lse = _xla_blocked(q, k_pages, v_pages, page_table, lo, hi, kv_len, cfg.kv_block, cfg.xla_skip_blocks)
    return (out, lse) if return_lse else out


def causal_bounds(positions: jax.Array, window: int = 0) -> tuple[jax.Array, jax.Array]:
    """(lo, hi) for queries at absolute `positions` [B, T] of causal attention, optionally with a sliding window
    of `window` keys (0 = none): the query at p sees keys p - window < s <= p, as `layers.attention_masks`."""
    hi = positions.astype(jnp.int32) + 1
    lo = jnp.maximum(hi - window, 0) if window else jnp.zeros_like(hi)
    return lo, hi


def merge_attention(
    out_a: jax.Array, lse_a: jax.Array, out_b: jax.Array, lse_b: jax.Array, heads: int
) -> tuple[jax.Array, jax.Array]:
    """Two attentions of the same queries over disjoint key sets (out `[B, T, heads * d]`, lse `[B, T, heads]`)
    -> the attention over their union and its log-sum-exp (f32 arithmetic, output in out_a's dtype). A side
    with lse -inf (no key) contributes nothing; both -inf gives 0 and -inf."""
    b, t, hd = out_a.shape
    if out_b.shape != out_a.shape or lse_a.shape != (b, t, heads) or lse_b.shape != (b, t, heads) or hd % heads:
        raise ValueError(
            f"merge_attention: out_a/out_b must be [B, T, {heads} * d] and lse_a/lse_b [B, T, {heads}]; got "
            f"{tuple(out_a.shape)}, {tuple(out_b.shape)}, {tuple(lse_a.shape)}, {tuple(lse_b.shape)}"
        )
    m = jnp.maximum(lse_a, lse_b)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    wa, wb = jnp.exp(lse_a - m), jnp.exp(lse_b - m)
    tot = wa + wb
    seen = tot > 0
    tot_safe = jnp.where(seen, tot, 1.0)
    oa = out_a.astype(jnp.float32).reshape(b, t, heads, hd // heads)
    ob = out_b.astype(jnp.float32).reshape(b, t, heads, hd // heads)
    out = (oa * (wa / tot_safe)[..., None] + ob * (wb / tot_safe)[..., None]).reshape(b, t, hd)
    lse = jnp.where(seen, m + jnp.log(tot_safe), -jnp.inf)
    return out.astype(out_a.dtype), lse
