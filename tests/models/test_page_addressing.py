"""Cache addressing through page tables (`models.layers.Pages`): writes land in the rows' own pages (past the table:
the null page), reads gather them in logical order, and a KV length that ends inside a page reads as the whole
page does."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dflash_jax.models.layers import Pages, RandomBuilder, contiguous_pages, read_rows, write_rows
from dflash_jax.models.target import TargetModel, contiguous_kv_cache, target_forward
from tests.conftest import TINY_LLAMA


def test_write_rows_fills_the_rows_pages_and_drops_past_the_table():
    pool = jnp.zeros((6, 2, 4, 3), jnp.float32)  # 6 pages of 4 positions, 2 heads, head_dim 3
    pages = Pages(jnp.asarray([[3, 1], [5, 2]], jnp.int32))  # row 0: pages 3, 1; row 1: pages 5, 2
    rows = jnp.arange(2 * 3 * 2 * 3, dtype=jnp.float32).reshape(2, 3, 2, 3) + 1
    positions = jnp.asarray([[0, 5, 8], [3, 4, 1 << 30]], jnp.int32)  # 8 and DROP lie past the 8 positions
    out = np.asarray(write_rows(pool, rows, pages, positions))
    want = np.zeros((6, 2, 4, 3), np.float32)
    want[3, :, 0] = rows[0, 0]  # position 0 of row 0: page 3, offset 0
    want[1, :, 1] = rows[0, 1]  # position 5: page 1, offset 1
    want[5, :, 3] = rows[1, 0]
    want[2, :, 0] = rows[1, 1]
    np.testing.assert_array_equal(out[1:], want[1:])  # the dropped writes went to the null page only
    assert np.abs(out[0]).max() > 0
    got = np.asarray(read_rows(jnp.asarray(out), pages, 6))  # 6 positions: the second page in part
    assert got.shape == (2, 2, 6, 3)
    np.testing.assert_array_equal(got[0, :, 0], np.asarray(rows[0, 0]))
    np.testing.assert_array_equal(got[0, :, 5], np.asarray(rows[0, 1]))
    np.testing.assert_array_equal(got[1, :, 3], np.asarray(rows[1, 0]))
    np.testing.assert_array_equal(got[1, :, 4], np.asarray(rows[1, 1]))
    with pytest.raises(ValueError, match="page table has 2"):
        read_rows(jnp.asarray(out), pages, 9)


def test_contiguous_pages_share_nothing_and_keep_the_null_page():
    pages, n = contiguous_pages(3, 20, 8)
    table = np.asarray(pages.table)
    assert n == 3 * 3 + 1 and table.shape == (3, 3) and pages.backend == "xla" and not pages.in_place
    assert 0 not in table and len(set(table.ravel())) == table.size and table.max() == n - 1


def test_a_kv_length_inside_a_page_reads_as_the_whole_page():
    """The same prefill with kv_len 19 (ending inside the third page of 8) and 24 (three whole pages): equal
    logits and caches, bit for bit (positions >= 19 are past every query's causal limit)."""
    model = TargetModel(TINY_LLAMA, RandomBuilder(0, std=0.2))
    graphdef, state = nnx.split(model)
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, TINY_LLAMA.vocab_size, (2, 19)), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(19, dtype=jnp.int32), (2, 19))
    outs = []
    for kv_len in (19, 24):
        cache, pages = contiguous_kv_cache(TINY_LLAMA, 2, 24, page_size=8)
        outs.append(target_forward(graphdef, state, tokens, pos, cache, pages, kv_len=kv_len))
    np.testing.assert_array_equal(np.asarray(outs[0].logits), np.asarray(outs[1].logits))
    for (ka, va), (kb, vb) in zip(outs[0].cache, outs[1].cache, strict=True):
        np.testing.assert_array_equal(np.asarray(ka), np.asarray(kb))
        np.testing.assert_array_equal(np.asarray(va), np.asarray(vb))
    assert np.abs(np.asarray(outs[0].logits)).max() > 0.1
