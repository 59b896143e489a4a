"""KV pool arithmetic (`kv.sizing`), against hand-computed examples."""

from __future__ import annotations

import os
import types

import pytest

from dflash_jax.kv.sizing import (
    SCRATCH_BYTES,
    activation_reserve_bytes,
    dense_pool,
    dense_pool_pages,
    host_memory_in_use_and_total,
    kv_bytes_per_token,
    layer_kv_bytes_per_token,
    pages_per_seq,
    pool_pages,
    seq_positions,
    verify_width,
)
from dflash_jax.quant.memory import memory_in_use_and_total
from dflash_jax.testing.waits import communicate

QWEN3_8B = types.SimpleNamespace(num_layers=36, num_kv_heads=8, head_dim=128)
DFLASH_B16 = types.SimpleNamespace(num_layers=5, num_kv_heads=8, head_dim=128)


def test_kv_bytes_per_token_by_hand():
    # 2 (K and V) * 36 layers * 8 heads * 128 dims * 2 bytes = 147456; the drafter: 2 * 5 * 8 * 128 * 2 = 20480
    assert kv_bytes_per_token(QWEN3_8B, None, "bfloat16") == 147456
    assert kv_bytes_per_token(QWEN3_8B, DFLASH_B16, "bfloat16") == 147456 + 20480
    assert kv_bytes_per_token(QWEN3_8B, DFLASH_B16, "float32") == 2 * (147456 + 20480)
    tiny = types.SimpleNamespace(num_layers=3, num_kv_heads=2, head_dim=16)
    assert kv_bytes_per_token(tiny, None, "float16") == 2 * 3 * 2 * 16 * 2 == 384


def test_one_model_is_the_per_layer_term():
    assert layer_kv_bytes_per_token(QWEN3_8B, "bfloat16") == 147456
    assert layer_kv_bytes_per_token(DFLASH_B16, "float32") == 2 * 5 * 8 * 128 * 4


def test_verify_width_and_a_sequence_s_pages():
    assert verify_width(None, None) == 1 and verify_width(7, None) == 1  # no drafter: plain decoding
    assert verify_width(None, 16) == 16 and verify_width(5, 16) == 5  # the drafter's block, else gamma
    assert seq_positions(100, 4) == 105
    assert pages_per_seq(100, 4, 16) == 7 and pages_per_seq(100, 4, 32) == 4 and pages_per_seq(10, 5, 16) == 1
    pool = dense_pool(3, 100, 4, 32, prefix_caching=False)
    assert (pool.num_pages, pool.page_size, pool.prefix_caching) == (3 * 4 + 1, 32, False)


def test_pool_pages_counts_whole_pages_null_page_included():
    page = 16 * 768  # bytes of one page of 16 tokens at 768 bytes per token
    assert pool_pages(10 * page, 768, 16) == 10
    assert pool_pages(10 * page + page - 1, 768, 16) == 10  # a partial page does not count
    assert pool_pages(page - 1, 768, 16) == 0
    assert pool_pages(-5, 768, 16) == 0
    # 16 * 167936 = 2686976 bytes a page; 26051 * 2686976 = 69998411776 <= 70e9 < 26052 * 2686976
    assert pool_pages(70 * 10**9, 167936, 16) == 26051
    with pytest.raises(ValueError, match="page_size"):
        pool_pages(100, 10, 0)


def test_dense_pool_pages_rounds_each_sequence_up():
    # 4 sequences of 105 positions: 7 pages of 16 each (112 positions), + the null page
    assert dense_pool_pages(4, 105, 16) == 4 * 7 + 1
    assert dense_pool_pages(4, 105, 32) == 4 * 4 + 1
    assert dense_pool_pages(1, 32, 16) == 3


def test_activation_reserve_by_hand():
    cfg = types.SimpleNamespace(vocab_size=128, intermediate_size=96)
    assert activation_reserve_bytes(cfg, rows=10, dtype="float32") == SCRATCH_BYTES + 2 * 10 * 128 * 4 + 3 * 10 * 96 * 4
    assert activation_reserve_bytes(cfg, rows=10, dtype="bfloat16") == SCRATCH_BYTES + 10240 + 3 * 10 * 96 * 2


def test_host_memory_from_meminfo(tmp_path):
    f = tmp_path / "meminfo"
    f.write_text("MemTotal:        1000 kB\nMemFree:          100 kB\nMemAvailable:     250 kB\n")
    assert host_memory_in_use_and_total(str(f)) == (750 * 1024, 1000 * 1024)
    in_use, total = host_memory_in_use_and_total(str(tmp_path / "absent"))  # sysconf: a total, no use
    assert in_use is None and total is not None and total > 0


def test_memory_in_use_and_total_on_this_host():
    in_use, total = memory_in_use_and_total()
    assert total is not None and in_use is not None and 0 < in_use < total


def test_capacity_table_by_hand():
    from benchmarks.kv_capacity import capacity_rows

    rows = capacity_rows(70 * 10**9, max_model_len=32768, gamma=16, page_size=16, lengths=[2048, 8192, 32768])
    f32, bf16, paged = rows
    # dense slot: (32768 + 16 + 1) positions; f32: 335872 * 32785 = 11011563520 B -> 6 slots - 1 scratch = 5
    assert f32["unit_bytes"] == 11011563520 and f32["sequences"] == {2048: 5, 8192: 5, 32768: 5}
    # bf16: 5505781760 B a slot -> 12 - 1 = 11
    assert bf16["sequences"] == {2048: 11, 8192: 11, 32768: 11}
    # 26051 pages - the null page = 26050; 2048 + 17 = 2065 positions = 130 pages; 8209 = 514; 32785 = 2050
    assert paged["pages"] == 26050
    assert (
        paged["sequences"]
        == {2048: 26050 // 130, 8192: 26050 // 514, 32768: 26050 // 2050}
        == {
            2048: 200,
            8192: 50,
            32768: 12,
        }
    )


_AGREE = """
import sys
rank, port = int(sys.argv[1]), sys.argv[2]
import jax
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=rank)
import dflash_jax.quant.memory as M
M.memory_in_use_and_total = lambda device=None: ((3 + rank) * 2**30 + 5, (64 - rank) * 2**30 + 7)
print("AGREED", *M.memory_agreed_by_all_processes(), flush=True)
jax.distributed.shutdown()
"""


def test_memory_agreed_by_all_processes():
    """Two processes with different figures both get the most in use and the least total, in whole MiB."""
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    procs = [
        subprocess.Popen([sys.executable, "-c", _AGREE, str(r), port], stdout=subprocess.PIPE, text=True, env=env)
        for r in (0, 1)
    ]
    outs = [communicate(p)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    # in use: max(3 GiB + 5, 4 GiB + 5) rounded up to MiB = 4097 MiB
    # total: min(64 GiB + 7, 63 GiB + 7) rounded down = 64512 MiB
    for out in outs:
        line = next(x for x in out.splitlines() if x.startswith("AGREED"))
        assert line.split()[1:] == [str(4097 * 2**20), str(64512 * 2**20)]
