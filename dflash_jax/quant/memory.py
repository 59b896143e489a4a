"""Memory estimate for the drafter per quantization tier (weights + KV + scratch), a start-up preflight, and the
device's memory in use and total (the KV pool's arithmetic is `kv.sizing`).

Bytes are computed from shapes and dtypes alone, so `weights` may hold arrays, `jax.ShapeDtypeStruct`s
(e.g. from `nnx.eval_shape`) or already-quantized weights:
* declared: numel * itemsize;  fp8: N*K + 4*N;  nvfp4: N*Kp/2 + N*Kp/16 + 4 (Kp = K rounded up to 16).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import ml_dtypes  # noqa: F401  (registers the bfloat16 / fp8 dtype names with numpy)
import numpy as np

from dflash_jax.errors import UserError
from dflash_jax.kv.sizing import SCRATCH_BYTES, format_bytes, host_memory_in_use_and_total
from dflash_jax.quant.formats import NVFP4_BLOCK, is_quantized
from dflash_jax.quant.tiers import FLAG, TIERS, parse_tier, tier_format


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
