"""The KV pool's size from the serve flags (`kv.sizing.plan_kv_pool`), against hand-computed examples."""

from __future__ import annotations

import pytest

from dflash_jax.errors import UserError
from dflash_jax.kv.sizing import PoolFlags, describe_pool, plan_kv_pool
from dflash_jax.server.config import ServeConfig


def pool_for(cfg: ServeConfig, **kw):
    """The pool for a `ServeConfig`'s flags."""
    return plan_kv_pool(cfg.pool_flags(), **kw)


BPT = 100  # bytes per token in these examples
# max_model_len 100 + width 4 + 1 = 105 positions a sequence: 7 pages of 16 (112 positions)
SEQ = dict(bytes_per_token=BPT, max_model_len=100, width=4)


def test_the_pool_flags_of_a_serve_config():
    cfg = ServeConfig(max_num_seqs=3, block_size=32, enable_prefix_caching=False, kv_cache_memory=1000)
    assert cfg.pool_flags() == PoolFlags(32, 3, False, 1000, None)
    assert ServeConfig(gpu_memory_utilization=0.5).pool_flags() == PoolFlags(gpu_memory_utilization=0.5)


def test_neither_flag_holds_what_dense_caches_hold():
    plan = pool_for(ServeConfig(max_num_seqs=4), **SEQ)
    assert (plan.num_pages, plan.pages, plan.tokens) == (4 * 7 + 1, 28, 448)
    assert plan.nbytes == 29 * 16 * 100
    pool = plan.make_pool()
    assert (pool.num_pages, pool.page_size, pool.prefix_caching) == (29, 16, True)
    assert plan.describe() == "KV pool 448 tokens (45.31 KiB, 28 pages of 16); largest context 100; prefix caching on"
    plan = pool_for(ServeConfig(max_num_seqs=4, block_size=32, enable_prefix_caching=False), **SEQ)
    assert (plan.num_pages, plan.tokens) == (4 * 4 + 1, 512)  # 105 positions: 4 pages of 32
    pool = plan.make_pool()
    assert (pool.num_pages, pool.page_size, pool.prefix_caching) == (17, 32, False)


def test_kv_cache_memory_is_the_whole_pool():
    plan = pool_for(ServeConfig(kv_cache_memory=46400), **SEQ)  # 46400 // (16 * 100) = 29 pages
    assert (plan.num_pages, plan.pages, plan.tokens, plan.source) == (29, 28, 448, "kv_cache_memory")
    assert plan.make_pool().total == 28
    assert plan.largest_context == 100


def test_gpu_memory_utilization_takes_the_fraction_less_use_and_reserve():
    cfg = ServeConfig(gpu_memory_utilization=0.5)
    # 0.5 * 100000 - 1000 in use - 500 reserve = 48500 bytes: 48500 // 1600 = 30 pages
    plan = pool_for(cfg, **SEQ, memory=(1000, 100000), reserve_bytes=500)
    assert (plan.num_pages, plan.tokens, plan.source) == (30, 29 * 16, "gpu_memory_utilization")
    with pytest.raises(UserError, match="--kv-cache-memory instead") as e:
        pool_for(cfg, **SEQ, memory=(None, None))
    assert e.value.param == "gpu_memory_utilization"


def test_smallest_pool_holds_one_full_length_sequence():
    # one sequence: 7 pages + the null page = 8 pages = 12800 bytes
    plan = pool_for(ServeConfig(kv_cache_memory=12800), **SEQ)
    assert (plan.num_pages, plan.tokens, plan.largest_context) == (8, 112, 100)
    with pytest.raises(UserError) as e:
        pool_for(ServeConfig(kv_cache_memory=12799), **SEQ)
    msg = str(e.value)
    assert e.value.param == "kv_cache_memory"
    assert msg.startswith("--kv-cache-memory 12799 (12.50 KiB) holds 96 tokens of KV (100 bytes per token)")
    assert "--max-model-len 100 needs 105 positions: 7 pages of 16 + the null page = 12800 bytes" in msg
    with pytest.raises(UserError, match=r"--gpu-memory-utilization 0.1 leaves 1000 B for the KV pool \(0.1 x ") as e:
        pool_for(ServeConfig(gpu_memory_utilization=0.1), **SEQ, memory=(9000, 100000))  # 10000 - 9000
    assert "= 12800 bytes" in str(e.value) and "Raise --gpu-memory-utilization" in str(e.value)


def test_start_up_line():
    assert describe_pool(7716, 16, 1000, 8192, prefix_caching=True) == (
        "KV pool 123456 tokens (118 MiB, 7716 pages of 16); largest context 8192; prefix caching on"
    )  # 7717 * 16 * 1000 bytes = 123472000 B = 117.75 MiB: format_bytes rounds to 3 digits
    assert describe_pool(100, 16, 10, 8192, prefix_caching=False).endswith("largest context 1600; prefix caching off")
