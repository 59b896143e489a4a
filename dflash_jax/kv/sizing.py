"""The KV page pool's size from the serve flags: `--kv-cache-memory`, `--gpu-memory-utilization`, `--block-size`,
`--enable-prefix-caching`.

`plan_kv_pool` turns the flags and the models' shapes into a `KVPoolPlan` (pages of `--block-size` tokens, the
null page included, target and drafter caches together). With neither memory flag the pool holds what dense
per-slot caches hold: `--max-num-seqs` sequences of `max_model_len + gamma + 1` positions. A pool that cannot hold
one sequence of `max_model_len` tokens is refused, naming the flag and the bytes and tokens it needs.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from dflash_jax.errors import UserError
from dflash_jax.quant.memory import dense_pool_pages, format_bytes, pool_pages
from dflash_jax.server.config import ServeConfig, flag_name


@dataclasses.dataclass(frozen=True)
class KVPoolPlan:
    """The KV pool: `num_pages` pages of `page_size` tokens (page 0, the null page, among them),
    `bytes_per_token` bytes per position (target + drafter K and V), sized by `source` (a flag, or `dense` for
    the dense-equivalent default; then `num_pages_arg` is None and the runner sizes it the same way)."""

    num_pages: int
    page_size: int
    prefix_caching: bool
    bytes_per_token: int
    max_model_len: int
    source: str
    num_pages_arg: int | None

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

    def runner_kwargs(self) -> dict[str, Any]:
        """The `SpecRunner` keywords for this pool."""
        return {"num_pages": self.num_pages_arg, "page_size": self.page_size, "prefix_caching": self.prefix_caching}

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
    config: ServeConfig,
    *,
    bytes_per_token: int,
    max_model_len: int,
    gamma: int,
    memory: tuple[int | None, int | None] = (None, None),
    reserve_bytes: int = 0,
) -> KVPoolPlan:
    """The pool for `config`'s flags. `bytes_per_token`: `quant.memory.kv_bytes_per_token` of the models;
    `gamma`: the verify width (1 without speculation); `memory`: `(in_use, total)` bytes of the device after the
    weights are loaded (`quant.memory.memory_in_use_and_total`), read for `--gpu-memory-utilization` only;
    `reserve_bytes`: the activation reserve kept out of that budget (`quant.memory.activation_reserve_bytes`)."""
    page = config.block_size
    positions = max_model_len + gamma + 1  # what one sequence of max_model_len tokens writes
    need_pages = dense_pool_pages(1, positions, page)
    need_bytes = need_pages * page * bytes_per_token
    plan = dict(
        page_size=page,
        prefix_caching=config.enable_prefix_caching,
        bytes_per_token=bytes_per_token,
        max_model_len=max_model_len,
    )
    if config.kv_cache_memory is not None:
        source, budget = "kv_cache_memory", config.kv_cache_memory
        given = f"--kv-cache-memory {config.kv_cache_memory} ({format_bytes(budget)})"
    elif config.gpu_memory_utilization is not None:
        source = "gpu_memory_utilization"
        in_use, total = memory
        if in_use is None or total is None:
            raise UserError(
                "--gpu-memory-utilization: this device reports no memory total and use to size the KV pool from; "
                "give the pool's size with --kv-cache-memory instead",
                param=source,
            )
        f = config.gpu_memory_utilization
        budget = int(f * total) - in_use - reserve_bytes
        given = (
            f"--gpu-memory-utilization {f} leaves {format_bytes(max(budget, 0))} for the KV pool ({f} x "
            f"{format_bytes(total)} - {format_bytes(in_use)} in use - {format_bytes(reserve_bytes)} activation "
            "reserve), which"
        )
    else:
        n = dense_pool_pages(config.max_num_seqs, positions, page)
        return KVPoolPlan(num_pages=n, source="dense", num_pages_arg=None, **plan)
    n = pool_pages(budget, bytes_per_token, page)
    if n < need_pages:
        raise UserError(
            f"{given} holds {max(n - 1, 0) * page} tokens of KV ({bytes_per_token} bytes per token); one sequence of "
            f"--max-model-len {max_model_len} needs {positions} positions: {need_pages - 1} pages of {page} + the "
            f"null page = {need_bytes} bytes ({format_bytes(need_bytes)}). Raise {flag_name(source)} or lower "
            "--max-model-len",
            param=source,
        )
    return KVPoolPlan(num_pages=n, source=source, num_pages_arg=n, **plan)
