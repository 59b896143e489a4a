"""The device mesh for tensor parallelism: one axis, `"tp"`, over `--tp-size` devices.

The mesh is built with explicit `AxisType.Auto` axes: `jax.make_mesh` defaults to `Explicit`, under which an
eager row-parallel matmul refuses to pick an output sharding and `shard_map` refuses inputs whose sharding
differs from its `in_specs`. With `Auto`, jitted steps over sharded inputs are
plain GSPMD programs and the compiler inserts the collectives.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
from jax.sharding import AxisType, Mesh

from dflash_jax.errors import UserError

TP = "tp"  # the tensor-parallel mesh axis
TP_FLAG = "--tp-size"


def check_tp_heads(
    tp_size: int, num_heads: int, num_kv_heads: int, *, flag: str = TP_FLAG, what: str = "the target"
) -> None:
    """UserError naming `flag` unless `tp_size` divides both the query heads and the KV heads."""
    for n, name in ((num_heads, "attention heads"), (num_kv_heads, "KV heads")):
        if n % tp_size:
            raise UserError(
                f"{flag} {tp_size}: {what} has {n} {name}, which do not divide among {tp_size} ranks; "
                f"use a {flag} that divides {num_heads} attention heads and {num_kv_heads} KV heads",
                param=flag,
            )


def make_mesh(
    tp_size: int,
    devices: Sequence[jax.Device] | None = None,
    *,
    num_heads: int | None = None,
    num_kv_heads: int | None = None,
) -> Mesh:
    """A 1-D mesh `("tp",)` over the first `tp_size` of `devices` (default: `jax.devices()`, i.e. every process's
    devices under multi-host). When head counts are given they must divide by `tp_size` (else UserError)."""
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise UserError(f"{TP_FLAG} must be an integer >= 1, got {tp_size!r}", param=TP_FLAG)
    devs = list(jax.devices() if devices is None else devices)
    if tp_size > len(devs):
        raise UserError(
            f"{TP_FLAG} {tp_size} is larger than the {len(devs)} available device(s) "
            f"({devs[0].platform if devs else 'none'}); use {TP_FLAG} {len(devs)} or less",
            param=TP_FLAG,
        )
    if num_heads is not None:
        check_tp_heads(tp_size, num_heads, num_kv_heads if num_kv_heads is not None else num_heads)
    return jax.make_mesh((tp_size,), (TP,), axis_types=(AxisType.Auto,), devices=devs[:tp_size])


def tp_size_of(mesh: Mesh | None) -> int:
    """Ranks on the mesh's `"tp"` axis (1 without a mesh)."""
    return 1 if mesh is None else int(mesh.shape[TP])
