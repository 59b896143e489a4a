"""The KV page pool's size: bytes per token, the verify width, pages per sequence and the pool from the serve flags
(`--kv-cache-memory`, `--gpu-memory-utilization`, `--block-size`, `--enable-prefix-caching`).

Every number here is plain arithmetic on config fields, so the builder (which makes the one `PagePool` of a run),
the memory preflight, the runner and the benchmarks size the pool with the same functions:

* `kv_bytes_per_token`: K and V of every layer of the target and, with a drafter, of the drafter's context.
* `verify_width`: the widest block one step verifies (the anchor and its drafts; 1 without a drafter);
  `verify_widths`: the narrower widths steps are compiled for.
* `seq_positions` / `pages_per_seq`: what one sequence of `max_model_len` tokens writes, its last verify included.
* `plan_kv_pool`: the pool for the flags (`KVPoolPlan`). With neither memory flag the pool holds `max_num_seqs`
  sequences of `seq_positions` positions. A pool that cannot hold one sequence of `max_model_len` tokens is
  refused, naming the flag and the bytes and tokens it needs.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import ml_dtypes  # noqa: F401  (registers the bfloat16 dtype name with numpy)
import numpy as np

from dflash_jax.errors import UserError
from dflash_jax.kv.pages import PagePool

SCRATCH_BYTES = 300 * 2**20  # activation / workspace allowance of one device call


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


def layer_kv_bytes_per_token(cfg: Any, dtype: Any) -> int:
    """K and V of every layer of one model for one position: `2 * num_layers * num_kv_heads * head_dim * itemsize`
    (`cfg`: a `TargetConfig` or `DrafterConfig`)."""
    itemsize = np.dtype(dtype).itemsize
    return 2 * int(cfg.num_layers) * int(cfg.num_kv_heads) * int(cfg.head_dim) * itemsize


def kv_bytes_per_token(target_cfg: Any, drafter_cfg: Any | None, dtype: Any) -> int:
    """Bytes one token position takes in the KV pool: the target's K and V of every layer plus, with a drafter,
    the drafter's context K and V of every layer (`layer_kv_bytes_per_token` each)."""
    return sum(layer_kv_bytes_per_token(cfg, dtype) for cfg in (target_cfg, drafter_cfg) if cfg is not None)


def verify_width(gamma: int | None, drafter_block_size: int | None) -> int:
    """The widest block one step verifies (the anchor and its drafts): `gamma`, else the drafter's block size;
    1 without a drafter (`drafter_block_size` None)."""
    if drafter_block_size is None:
        return 1
    return gamma or drafter_block_size


def verify_widths(width: int) -> tuple[int, ...]:
    """The verify widths the steps are compiled for, widest `width`: 1 (plain) and the powers of two below `width`,
    then `width` (8 -> 1, 2, 4, 8; 10 -> 1, 2, 4, 8, 10). A step verifying `k` drafts runs at the narrowest of
    them that holds `k + 1` positions, its rows' own draft counts inside, so a server compiles a few widths at
    start-up instead of one per draft count at run time; the adaptive-k controller prices only the depths `w - 1`
    of these widths."""
    if width < 1:
        raise ValueError(f"a verify width is at least 1, not {width}")
    out = [1]
    while out[-1] * 2 < width:
        out.append(out[-1] * 2)
    return (*out, width) if width > 1 else (1,)


def verify_width_of(drafts: int, width: int) -> int:
    """The verify width a step of `drafts` drafts runs at: the narrowest of `verify_widths(width)` holding
    `drafts + 1` positions (`width` itself past them)."""
    return next((w for w in verify_widths(width) if w >= drafts + 1), width)


def ragged_split(rows: int, drafting: int, batch_buckets: tuple[int, ...]) -> tuple[int, int] | None:
    """A speculative step of `rows` rows of which `drafting` verify drafts, as a ragged verify: the (drafting,
    plain) group sizes, each padded, that fit the batch bucket of `rows` (a drafting group of the smallest bucket
    holding `drafting`, the rest of the bucket plain at width 1); None when every row drafts, none does, or the
    groups do not fit (the step then runs every row at its verify width). `batch_buckets` ascending."""
    if not 0 < drafting < rows:
        return None
    total = next((b for b in batch_buckets if b >= rows), batch_buckets[-1])
    head = next((b for b in batch_buckets if b >= drafting), batch_buckets[-1])
    if head + rows - drafting > total:
        return None
    return head, total - head


def seq_positions(max_model_len: int, width: int) -> int:
    """Positions one sequence of `max_model_len` tokens writes: its last verify block of `width` reaches past it."""
    return max_model_len + width + 1


def pages_per_seq(max_model_len: int, width: int, page_size: int) -> int:
    """Pages of `page_size` tokens covering `seq_positions(max_model_len, width)`."""
    return -(-seq_positions(max_model_len, width) // page_size)


def dense_pool(
    max_num_seqs: int, max_model_len: int, width: int, page_size: int = 16, *, prefix_caching: bool = True
) -> PagePool:
    """A pool holding `max_num_seqs` sequences of `max_model_len` tokens (`dense_pool_pages` of
    `seq_positions`): the pool of a run that gives no memory flag."""
    n = dense_pool_pages(max_num_seqs, seq_positions(max_model_len, width), page_size)
    return PagePool(n, page_size, prefix_caching=prefix_caching)


def pool_pages(budget_bytes: int, bytes_per_token: int, page_size: int) -> int:
    """Pages of `page_size` tokens that fit in `budget_bytes`, counting the null page (page 0: allocated with the
    pool, never handed to a sequence), so sequences get one page fewer: `budget // (bytes_per_token * page_size)`."""
    if bytes_per_token < 1 or page_size < 1:
        raise ValueError(f"bytes_per_token and page_size must be >= 1, got {bytes_per_token}, {page_size}")
    return max(0, int(budget_bytes)) // (bytes_per_token * page_size)


def dense_pool_pages(max_num_seqs: int, positions_per_seq: int, page_size: int) -> int:
    """Pages (null page included) holding `max_num_seqs` sequences of `positions_per_seq` positions each, every
    sequence rounded up to whole pages."""
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
class PoolFlags:
    """The serve flags that size the pool: `--block-size` (`page_size`), `--max-num-seqs`,
    `--enable-prefix-caching`, `--kv-cache-memory` (bytes) and `--gpu-memory-utilization` (a fraction)."""

    page_size: int = 16
    max_num_seqs: int = 8
    prefix_caching: bool = True
    kv_cache_memory: int | None = None
    gpu_memory_utilization: float | None = None


@dataclasses.dataclass(frozen=True)
class KVPoolPlan:
    """The KV pool: `num_pages` pages of `page_size` tokens (page 0, the null page, among them),
    `bytes_per_token` bytes per position (target + drafter K and V), sized by `source` (the flag, or `dense`:
    `max_num_seqs` full-length sequences)."""

    num_pages: int
    page_size: int
    prefix_caching: bool
    bytes_per_token: int
    max_model_len: int
    source: str

    @property
    def pages(self) -> int:
        """Pages sequences can hold (the null page excluded)."""
        return self.num_pages - 1

    @property
    def tokens(self) -> int:
        return self.pages * self.page_size

    @property
    def nbytes(self) -> int:
        """Bytes of the whole pool (null page included)."""
        return self.num_pages * self.page_size * self.bytes_per_token

    @property
    def largest_context(self) -> int:
        return min(self.max_model_len, self.tokens)

    def make_pool(self) -> PagePool:
        """The host page pool of this size (the one the runner's caches and the engine share)."""
        return PagePool(self.num_pages, self.page_size, prefix_caching=self.prefix_caching)

    def describe(self) -> str:
        return describe_pool(
            self.pages, self.page_size, self.bytes_per_token, self.max_model_len, prefix_caching=self.prefix_caching
        )


def describe_pool(pages: int, page_size: int, bytes_per_token: int, max_model_len: int, *, prefix_caching: bool) -> str:
    """`KV pool 123456 tokens (3.77 GiB, 7716 pages of 16); largest context 8192; prefix caching on` for `pages`
    usable pages (the null page's bytes counted in the size)."""
    tokens = pages * page_size
    size = format_bytes((pages + 1) * page_size * bytes_per_token)
    return (
        f"KV pool {tokens} tokens ({size}, {pages} pages of {page_size}); largest context "
        f"{min(max_model_len, tokens)}; prefix caching {'on' if prefix_caching else 'off'}"
    )


def plan_kv_pool(
    flags: PoolFlags,
    *,
    bytes_per_token: int,
    max_model_len: int,
    width: int,
    memory: tuple[int | None, int | None] = (None, None),
    reserve_bytes: int = 0,
) -> KVPoolPlan:
    """The pool for the serve `flags`. `bytes_per_token`: `kv_bytes_per_token` of the models; `width`:
    `verify_width`; `memory`: `(in_use, total)` bytes of the device after the weights are loaded,
    read for `--gpu-memory-utilization` only; `reserve_bytes`: the activation reserve kept out of that budget
    (`activation_reserve_bytes`)."""
    page_size = flags.page_size
    positions = seq_positions(max_model_len, width)
    need_pages = dense_pool_pages(1, positions, page_size)
    need_bytes = need_pages * page_size * bytes_per_token
    plan = dict(
        page_size=page_size,
        prefix_caching=flags.prefix_caching,
        bytes_per_token=bytes_per_token,
        max_model_len=max_model_len,
    )
    if flags.kv_cache_memory is not None:
        flag, budget = "--kv-cache-memory", flags.kv_cache_memory
        given = f"--kv-cache-memory {flags.kv_cache_memory} ({format_bytes(budget)})"
    elif flags.gpu_memory_utilization is not None:
        flag = "--gpu-memory-utilization"
        in_use, total = memory
        if in_use is None or total is None:
            raise UserError(
                "--gpu-memory-utilization: this device reports no memory total and use to size the KV pool from; "
                "give the pool's size with --kv-cache-memory instead",
                param="gpu_memory_utilization",
            )
        f = flags.gpu_memory_utilization
        budget = int(f * total) - in_use - reserve_bytes
        given = (
            f"--gpu-memory-utilization {f} leaves {format_bytes(max(budget, 0))} for the KV pool ({f} x "
            f"{format_bytes(total)} - {format_bytes(in_use)} in use - {format_bytes(reserve_bytes)} activation "
            "reserve), which"
        )
    else:
        return KVPoolPlan(num_pages=dense_pool_pages(flags.max_num_seqs, positions, page_size), source="dense", **plan)
    n = pool_pages(budget, bytes_per_token, page_size)
    if n < need_pages:
        raise UserError(
            f"{given} holds {max(n - 1, 0) * page_size} tokens of KV ({bytes_per_token} bytes per token); one "
            f"sequence of --max-model-len {max_model_len} needs {positions} positions: {need_pages - 1} pages of "
            f"{page_size} + the null page = {need_bytes} bytes ({format_bytes(need_bytes)}). Raise {flag} or lower "
            "--max-model-len",
            param=flag[2:].replace("-", "_"),
        )
    return KVPoolPlan(num_pages=n, source=flag[2:].replace("-", "_"), **plan)
