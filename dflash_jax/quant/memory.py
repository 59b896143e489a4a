"""Memory estimate for the drafter per quantization tier (weights + KV + scratch), a start-up preflight, and the
KV page pool's sizing arithmetic (`kv_bytes_per_token`, `pool_pages`: plain integers from config fields).

Bytes are computed from shapes and dtypes alone, so `weights` may hold arrays, `jax.ShapeDtypeStruct`s
(e.g. from `nnx.eval_shape`) or already-quantized weights:
* declared: numel * itemsize;  fp8: N*K + 4*N;  nvfp4: N*Kp/2 + N*Kp/16 + 4 (Kp = K rounded up to 16).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

import jax
import ml_dtypes  # noqa: F401  (registers the bfloat16 / fp8 dtype names with numpy)
import numpy as np

from dflash_jax.errors import UserError
from dflash_jax.quant.formats import NVFP4_BLOCK, is_quantized
from dflash_jax.quant.tiers import FLAG, TIERS, parse_tier, tier_format

SCRATCH_BYTES = 300 * 2**20  # activation / workspace allowance


def format_bytes(n: int | float) -> str:
    """Human-readable binary size: `512 B`, `1.50 KiB`, `12.3 MiB`, `1.27 GiB`."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            if unit == "B":
                return f"{int(n)} B"
            return f"{n:.3g} {unit}" if abs(n) >= 100 else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def tensor_nbytes(shape: tuple[int, ...], dtype: Any, fmt: str | None = None) -> int:
    """Bytes of one tensor stored as `fmt` (None = as declared, "fp8", "nvfp4")."""
    if fmt is None:
        return int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    n, k = (int(d) for d in shape)
    if fmt == "fp8":
        return n * k + 4 * n
    if fmt == "nvfp4":
        kp = -(-k // NVFP4_BLOCK) * NVFP4_BLOCK
        return n * kp // 2 + n * kp // NVFP4_BLOCK + 4
    raise ValueError(f"unknown format {fmt!r}")


def weight_nbytes(w: Any) -> int:
    """Bytes a weight (array, ShapeDtypeStruct or quantized pytree) occupies now."""
    if is_quantized(w):
        return w.nbytes
    return tensor_nbytes(tuple(w.shape), w.dtype)


def drafter_weight_bytes(weights: Mapping[str, Any], tier: str) -> int:
    """Bytes of the drafter's weights after `quantize_drafter_weights(weights, tier)`."""
    tier = parse_tier(tier)
    total = 0
    for name, w in weights.items():
        fmt = None if is_quantized(w) else tier_format(name, tier)
        total += weight_nbytes(w) if fmt is None else tensor_nbytes(tuple(w.shape), w.dtype, fmt)
    return total


def weight_bytes_by_tier(weights: Mapping[str, Any]) -> dict[str, int]:
    """`{tier: bytes}` for every tier."""
    return {t: drafter_weight_bytes(weights, t) for t in TIERS}


def kv_cache_bytes(
    *, layers: int, kv_heads: int, head_dim: int, slots: int, max_len: int, dtype: Any = "bfloat16"
) -> int:
    """K and V of `layers` layers for `slots` sequences of `max_len` tokens:
    2 * layers * slots * max_len * kv_heads * head_dim * itemsize."""
    itemsize = np.dtype(dtype).itemsize
    return 2 * layers * slots * max_len * kv_heads * head_dim * itemsize


def kv_bytes_per_token(target_cfg: Any, drafter_cfg: Any | None, dtype: Any) -> int:
    """Bytes one token position takes in the KV pool: the target's K and V of every layer plus, with a drafter,
    the drafter's context K and V of every layer, `2 * layers * kv_heads * head_dim * itemsize` each. The configs
    need `num_layers`, `num_kv_heads` and `head_dim` (`TargetConfig`, `DrafterConfig`)."""
    itemsize = np.dtype(dtype).itemsize
    total = 0
    for cfg in (target_cfg, drafter_cfg):
        if cfg is not None:
            total += 2 * int(cfg.num_layers) * int(cfg.num_kv_heads) * int(cfg.head_dim) * itemsize
    return total


def pool_pages(budget_bytes: int, bytes_per_token: int, page_size: int) -> int:
    """Pages of `page_size` tokens that fit in `budget_bytes`, counting the null page (page 0: allocated with the
    pool, never handed to a sequence), so sequences get one page fewer: `budget // (bytes_per_token * page_size)`."""
    if bytes_per_token < 1 or page_size < 1:
        raise ValueError(f"bytes_per_token and page_size must be >= 1, got {bytes_per_token}, {page_size}")
    return max(0, int(budget_bytes)) // (bytes_per_token * page_size)


def dense_pool_pages(max_num_seqs: int, positions_per_seq: int, page_size: int) -> int:
    """Pages (null page included) holding what dense per-slot caches hold: `max_num_seqs` sequences of
    `positions_per_seq` positions each, every sequence rounded up to whole pages."""
    return max_num_seqs * -(-positions_per_seq // page_size) + 1


def activation_reserve_bytes(target_cfg: Any, *, rows: int, dtype: Any) -> int:
    """Device memory kept out of the KV pool for one device call's working set: `SCRATCH_BYTES` plus, for the most
    token rows one call computes (`rows`: a verify step of every slot or one prefill admission), float32 logits
    and their softmax (`2 * rows * vocab_size * 4`) and the MLP's gate, up and activated products
    (`3 * rows * intermediate_size * itemsize`)."""
    itemsize = np.dtype(dtype).itemsize
    return (
        SCRATCH_BYTES
        + 2 * rows * int(target_cfg.vocab_size) * 4
        + 3 * rows * int(target_cfg.intermediate_size) * itemsize
    )


def memory_in_use_and_total(device: Any = None) -> tuple[int | None, int | None]:
    """`(in_use, total)` bytes of the memory the KV pool is allocated from: an accelerator's allocator stats
    (`bytes_in_use`, `bytes_limit`); on CPU, host RAM from /proc/meminfo (`MemTotal - MemAvailable`,
    `MemTotal`). `(None, None)` where neither is readable."""
    dev = device or jax.local_devices()[0]
    stats = dev.memory_stats() if dev.platform != "cpu" and hasattr(dev, "memory_stats") else None
    if stats and "bytes_limit" in stats:
        return int(stats.get("bytes_in_use", 0)), int(stats["bytes_limit"])
    return host_memory_in_use_and_total()


def memory_agreed_by_all_processes(device: Any = None) -> tuple[int | None, int | None]:
    """`memory_in_use_and_total` agreed by every process of a multi-host run (the most any process has in use, the
    least total any has, in whole MiB), so that each sizes the same KV pool; one process: its own figures."""
    in_use, total = memory_in_use_and_total(device)
    if jax.process_count() == 1:
        return in_use, total
    from jax.experimental import multihost_utils

    mib = 2**20
    mine = np.array([-1 if in_use is None else -(-in_use // mib), -1 if total is None else total // mib], np.int32)
    every = np.asarray(multihost_utils.process_allgather(mine)).reshape(-1, 2)
    if (every < 0).any():
        return None, None
    return int(every[:, 0].max()) * mib, int(every[:, 1].min()) * mib


def host_memory_in_use_and_total(meminfo: str = "/proc/meminfo") -> tuple[int | None, int | None]:
    """`(MemTotal - MemAvailable, MemTotal)` of the host in bytes; the total from `os.sysconf` (in use unknown)
    where /proc/meminfo is not readable."""
    values: dict[str, int] = {}
    try:
        with open(meminfo) as f:
            for line in f:
                key, _, rest = line.partition(":")
                parts = rest.split()
                if parts and parts[0].isdigit():
                    values[key] = int(parts[0]) * (1024 if parts[1:2] == ["kB"] else 1)
    except OSError:
        pass
    if "MemTotal" in values and "MemAvailable" in values:
        return values["MemTotal"] - values["MemAvailable"], values["MemTotal"]
    try:
        return None, os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None, None


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """Drafter bytes for one tier."""

    tier: str
    weights: int
    kv: int
    scratch: int = SCRATCH_BYTES

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.scratch

    def describe(self) -> str:
        return (
            f"drafter ({self.tier}): weights {format_bytes(self.weights)} + KV {format_bytes(self.kv)} "
            f"+ scratch {format_bytes(self.scratch)} = {format_bytes(self.total)}"
        )


def estimate_drafter_memory(
    weights: Mapping[str, Any], tier: str, *, kv_bytes: int, scratch_bytes: int = SCRATCH_BYTES
) -> MemoryEstimate:
    return MemoryEstimate(parse_tier(tier), drafter_weight_bytes(weights, tier), int(kv_bytes), scratch_bytes)


def tier_table(weights: Mapping[str, Any]) -> str:
    """One line per tier: `declared 12.3 MiB | fp8 6.2 MiB | ...` (for the start-up log)."""
    return " | ".join(f"{t} {format_bytes(b)}" for t, b in weight_bytes_by_tier(weights).items())


def device_memory(device: Any = None) -> tuple[int | None, int | None]:
    """`(free, total)` bytes on a device from its allocator stats; `(None, None)` where not reported (CPU)."""
    dev = device or jax.local_devices()[0]
    stats = dev.memory_stats() if hasattr(dev, "memory_stats") else None
    if not stats or "bytes_limit" not in stats:
        return None, None
    limit = int(stats["bytes_limit"])
    return limit - int(stats.get("bytes_in_use", 0)), limit


def check_fits(
    drafter: MemoryEstimate,
    *,
    target_bytes: int,
    free_bytes: int | None,
    by_tier: Mapping[str, int] | None = None,
) -> None:
    """Raise UserError when target + drafter do not fit in `free_bytes` (None = unknown: no check).

    The message lists each term and what to change: a smaller drafter tier (with its weight bytes, when
    `by_tier` is given) or a smaller KV (lower --max-seq-len or fewer slots).
    """
    if free_bytes is None:
        return
    need = drafter.total + int(target_bytes)
    if need <= free_bytes:
        return
    hints = []
    if by_tier:
        smaller = [(t, b) for t, b in by_tier.items() if b < drafter.weights]
        if smaller:
            t, b = min(smaller, key=lambda tb: tb[1])
            hints.append(f"use {FLAG} {t} (drafter weights {format_bytes(b)})")
    hints.append("lower --max-seq-len or the number of sequence slots (drafter and target KV)")
    raise UserError(
        f"not enough device memory: target {format_bytes(target_bytes)} + {drafter.describe()} "
        f"= {format_bytes(need)} > {format_bytes(free_bytes)} free; " + "; or ".join(hints),
        param=FLAG,
    )
