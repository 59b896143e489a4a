"""PagePool: hand-worked examples, and a seeded random op sequence checked against a simple reference model."""

from __future__ import annotations

import random
from dataclasses import astuple

import numpy as np
import pytest

from dflash_jax.kv.pages import OutOfPages, PagePool, PageStats

# ---------------------------------------------------------------------------------------------- worked examples


def test_constructor_validation_names_the_argument():
    with pytest.raises(ValueError, match="page_size"):
        PagePool(8, 0)
    with pytest.raises(ValueError, match="num_pages"):
        PagePool(1, 4)
    pool = PagePool(2, 1)
    assert (pool.total, pool.free, pool.used) == (1, 1, 0)


def test_pages_for_is_ceil():
    pool = PagePool(8, 4)
    assert [pool.pages_for(n) for n in (0, 1, 3, 4, 5, 8, 9)] == [0, 1, 1, 1, 2, 2, 3]


def test_allocate_and_free_counts():
    pool = PagePool(9, 4)  # 8 allocatable pages
    assert pool.allocate("a", [1, 2, 3, 4, 5], 10) == 0  # 3 pages, nothing cached
    assert "a" in pool and "b" not in pool
    assert pool.table("a") == [1, 2, 3]  # page 0 (null) is never handed out
    assert (pool.free, pool.used) == (5, 3)
    assert pool.allocate("b", [7], 1) == 0
    assert pool.table("b") == [4]
    assert (pool.free, pool.used) == (4, 4)
    pool.free_seq("a")  # never committed: the pages go back free
    assert "a" not in pool
    assert (pool.free, pool.used, pool.cached) == (7, 1, 0)
    pool.free_seq("a")  # unknown: no-op
    assert (pool.free, pool.used) == (7, 1)
    with pytest.raises(ValueError, match="already"):
        pool.allocate("b", [1], 1)
    with pytest.raises(ValueError, match="length"):
        pool.allocate("c", [1, 2, 3], 2)


def test_lookup_caps_at_the_page_before_the_last_token():
    pool = PagePool(16, 4)
    prompt = list(range(100, 112))  # exactly 3 full pages
    pool.allocate("a", prompt, 12)
    pool.commit("a", prompt, 12)
    assert pool.cached == 3
    assert pool.lookup(prompt) == 8  # 3 full pages cached, 2 usable: the last token is recomputed
    assert pool.lookup(prompt[:9]) == 8  # 9 tokens: page 2 ends at 8 <= 8
    assert pool.lookup(prompt[:8]) == 4  # 8 tokens: page 2 would hold the last token
    assert pool.lookup(prompt + [5]) == 12  # one more token: all 3 pages usable
    assert pool.lookup([999] + prompt[1:]) == 0  # first page differs: the chain breaks at once
    changed = prompt[:4] + [0] + prompt[5:]
    assert pool.lookup(changed) == 4  # page 1 differs: later pages do not match either (position in the chain)
    assert pool.lookup(prompt[4:] + [1]) == 0  # the same tokens at another position are not a hit
    assert pool.lookup([]) == 0 and pool.lookup([1]) == 0


def test_lookup_is_a_pure_query():
    pool = PagePool(8, 2)
    pool.allocate("a", [1, 2, 3, 4, 5], 5)
    pool.commit("a", [1, 2, 3, 4, 5], 5)
    before = (pool.free, pool.used, pool.cached, pool.table("a"), astuple(pool.stats))
    assert pool.lookup([1, 2, 3, 4, 5]) == 4
    assert pool.can_allocate([1, 2, 3, 4, 5], 5)
    assert not pool.can_allocate([1, 2, 3, 4, 5], 100)
    assert (pool.free, pool.used, pool.cached, pool.table("a"), astuple(pool.stats)) == before
    assert pool.stats == PageStats(prefix_queries=5, prefix_hits=0)  # a's own allocation only


def test_two_sequences_share_cached_pages():
    pool = PagePool(16, 4)
    prompt = list(range(10, 23))  # 13 tokens: 3 full pages + 1
    pool.allocate("a", prompt, 16)
    ta = pool.table("a")
    pool.commit("a", prompt, 13)  # pages 0..2 are full and written
    assert pool.cached == 3
    hit = pool.allocate("b", prompt[:10] + [7, 7, 7], 14)  # shares pages 0, 1 (tokens 0..7), page 2 differs
    assert hit == 8
    tb = pool.table("b")
    assert tb[:2] == ta[:2]  # the same physical pages
    assert set(tb[2:]).isdisjoint(ta)
    assert [pool.refcount(p) for p in ta] == [2, 2, 1, 1]
    assert pool.used == 4 + 2  # shared pages count once
    pool.free_seq("a")
    assert [pool.refcount(p) for p in ta[:2]] == [1, 1]
    assert pool.used == 4
    assert pool.free == 15 - 4  # a's cached page 2 is evictable, page 3 free
    pool.free_seq("b")
    assert (pool.used, pool.free) == (0, 15)
    assert pool.cached == 3  # b never committed; a's 3 pages stay findable
    assert pool.allocate("c", prompt, 13) == 12


def test_lru_eviction_order_and_hash_removal():
    pool = PagePool(5, 2)  # 4 allocatable pages
    pool.allocate("a", [1, 2, 3], 3)  # pages [1, 2]
    pool.commit("a", [1, 2, 3], 2)  # page 1 cached (holds [1, 2])
    pool.allocate("b", [5, 6, 7], 3)  # pages [3, 4]
    pool.commit("b", [5, 6, 7], 2)  # page 3 cached (holds [5, 6])
    pool.free_seq("b")  # released first: page 4 free, page 3 evictable
    pool.free_seq("a")  # page 2 free, page 1 evictable (released after page 3)
    assert (pool.free, pool.cached) == (4, 2)
    assert pool.allocate("c", [9], 2) == 0
    assert pool.table("c") == [4]  # truly free pages go first
    assert pool.allocate("d", [9], 2) == 0
    assert pool.table("d") == [2]
    assert pool.stats.evictions == 0
    assert pool.allocate("e", [9], 2) == 0
    assert pool.table("e") == [3]  # least recently released cached page
    assert pool.stats.evictions == 1
    assert pool.lookup([5, 6, 7]) == 0  # its hash went with it
    assert pool.lookup([1, 2, 3]) == 2
    pool.free_seq("c")
    assert pool.allocate("f", [1, 2, 3], 3) == 2  # page 1 hit: referenced, out of the LRU
    assert pool.table("f") == [1, 4]
    assert pool.free == 0
    assert not pool.can_allocate([9], 1)


def test_one_release_evicts_the_tail_of_a_chain_first():
    pool = PagePool(5, 1)
    pool.allocate("a", [1, 2, 3, 4], 4)
    pool.commit("a", [1, 2, 3, 4], 4)
    pool.free_seq("a")
    assert pool.free == 4 and pool.lookup([1, 2, 3, 4, 0]) == 4
    pool.allocate("b", [8], 1)
    assert pool.table("b") == [4]  # the page holding token 4 (the chain's tail) goes first
    assert pool.lookup([1, 2, 3, 4, 0]) == 3


def test_hit_pages_are_not_evictable_for_the_allocation_reusing_them():
    pool = PagePool(4, 2)  # 3 allocatable pages
    pool.allocate("a", [1, 2, 3, 4], 4)
    pool.commit("a", [1, 2, 3, 4], 4)
    pool.free_seq("a")
    assert (pool.free, pool.cached) == (3, 2)
    # [1, 2, 3, 4, 5] reuses 2 cached pages: 6 positions need 1 fresh page, 1 is free.
    assert pool.can_allocate([1, 2, 3, 4, 5], 6)
    # 8 positions need 2 fresh pages; only 1 is allocatable once the 2 hits are taken.
    assert not pool.can_allocate([1, 2, 3, 4, 5], 8)
    with pytest.raises(OutOfPages):
        pool.allocate("b", [1, 2, 3, 4, 5], 8)
    assert pool.stats == PageStats(prefix_queries=4, prefix_hits=0)  # the failed allocation left no trace
    # Without the cache, 6 positions take 3 fresh pages: the free one, then both cached pages evicted.
    assert pool.can_allocate([1, 2, 3, 4, 5], 6, use_cache=False)
    assert not pool.can_allocate([1, 2, 3, 4, 5], 7, use_cache=False)
    assert pool.allocate("b", [1, 2, 3, 4, 5], 6) == 4  # with it: 2 shared pages + 1 fresh
    assert pool.free == 0 and pool.stats.evictions == 0
    pool.free_seq("b")
    assert pool.allocate("c", [1, 2, 3, 4, 5], 6, use_cache=False) == 0
    assert pool.stats.evictions == 2 and pool.cached == 0


def test_out_of_pages_is_all_or_nothing():
    pool = PagePool(6, 4)  # 5 allocatable pages
    prompt = list(range(1, 10))
    pool.allocate("a", prompt, 9)
    pool.commit("a", prompt, 9)
    pool.free_seq("a")  # 2 cached evictable, 3 free
    pool.allocate("x", [0], 4)  # takes one free page: 2 free remain
    snapshot = (pool.free, pool.used, pool.cached, pool.stats.evictions, pool.stats.prefix_queries)
    assert not pool.can_allocate(prompt, 9 + 4 * 3)
    with pytest.raises(OutOfPages):
        pool.allocate("b", prompt, 9 + 4 * 3)  # 6 pages: 2 hits + 4 fresh, 2 allocatable
    assert (pool.free, pool.used, pool.cached, pool.stats.evictions, pool.stats.prefix_queries) == snapshot
    assert "b" not in pool
    assert pool.lookup(prompt) == 8  # the cached pages were neither taken nor evicted
    assert not pool.can_allocate(prompt, 17)  # 2 hits + 3 fresh
    assert pool.allocate("b", prompt, 16) == 8  # 2 hits + 2 fresh: fits exactly
    assert pool.free == 0 and pool.stats.evictions == 0


def test_ensure_grows_and_refuses_without_side_effects():
    pool = PagePool(6, 4)  # 5 allocatable pages
    pool.allocate("a", [1, 2], 2)
    assert pool.table("a") == [1]
    assert pool.ensure("a", 4)  # still one page
    assert pool.table("a") == [1]
    assert pool.ensure("a", 5)
    assert pool.table("a") == [1, 2]
    assert pool.ensure("a", 3)  # never shrinks
    assert pool.table("a") == [1, 2]
    assert pool.capacity("a") == 8
    assert not pool.ensure("a", 4 * 6)  # 6 pages > 5
    assert pool.table("a") == [1, 2] and pool.free == 3
    assert pool.ensure("a", 4 * 5)
    assert pool.table("a") == [1, 2, 3, 4, 5] and pool.free == 0
    with pytest.raises(KeyError, match="allocate it first"):
        pool.ensure("zz", 1)


def test_ensure_evicts_cached_pages_when_nothing_is_free():
    pool = PagePool(4, 2)
    pool.allocate("a", [1, 2, 3], 4)
    pool.commit("a", [1, 2, 3, 4], 4)
    pool.free_seq("a")
    pool.allocate("b", [5], 2)  # the last free page
    assert pool.table("b") == [3]
    assert pool.ensure("b", 4)
    assert pool.table("b") == [3, 2]  # page 2 (tail of a's chain) released before page 1
    assert pool.stats.evictions == 1
    assert pool.lookup([1, 2, 3, 4, 0]) == 2


def test_commit_is_idempotent_and_does_not_register_duplicates():
    pool = PagePool(16, 2)
    toks = [3, 1, 4, 1, 5, 9, 2]
    pool.allocate("a", toks, 7)
    pool.commit("a", toks, 3)  # one full page (positions 0-1)
    assert pool.cached == 1
    pool.commit("a", toks, 3)
    pool.commit("a", toks, 2)
    pool.commit("a", toks, 0)
    assert pool.cached == 1
    pool.commit("a", toks, 7)  # pages 0..2 full
    assert pool.cached == 3
    pool.commit("a", toks, 7)
    assert pool.cached == 3
    # b writes the same prefix privately (use_cache=False): its pages stay private, a's stay the cached ones.
    assert pool.allocate("b", toks, 7, use_cache=False) == 0
    pool.commit("b", toks, 7)
    assert pool.cached == 3
    pool.free_seq("b")
    assert pool.free == 15 - 4  # b's 4 pages went back free, not cached
    assert pool.allocate("c", toks, 7) == 6
    assert pool.table("c")[:3] == pool.table("a")[:3]
    with pytest.raises(ValueError, match="upto"):
        pool.commit("c", toks, 9)
    with pytest.raises(KeyError):
        pool.commit("zz", toks, 2)


def test_commit_after_a_private_duplicate_registers_the_following_pages():
    pool = PagePool(16, 2)
    toks = [1, 2, 3, 4, 5]
    pool.allocate("a", toks, 5)
    pool.commit("a", toks, 2)  # page [1, 2] cached by a
    pool.allocate("b", toks, 5, use_cache=False)
    pool.commit("b", toks, 4)  # b's page 0 duplicates a's (private); b's page 1 ([3, 4]) is registered
    assert pool.cached == 2
    pool.free_seq("b")
    c_hit = pool.allocate("c", toks, 5)
    assert c_hit == 4
    assert pool.table("c")[0] == pool.table("a")[0]


def test_prefix_caching_off_never_shares():
    pool = PagePool(16, 2, prefix_caching=False)
    toks = [1, 2, 3, 4, 5]
    pool.allocate("a", toks, 5)
    pool.commit("a", toks, 5)
    assert pool.cached == 0
    assert pool.lookup(toks) == 0
    assert pool.allocate("b", toks, 5) == 0
    assert set(pool.table("a")).isdisjoint(pool.table("b"))
    pool.free_seq("a")
    pool.free_seq("b")
    assert pool.free == 15 and pool.cached == 0
    assert pool.stats == PageStats()  # the cache is never consulted


def test_stats_count_queries_hits_and_evictions():
    pool = PagePool(11, 2)  # 10 allocatable pages
    a = [1, 2, 3, 4, 5, 6, 7]
    pool.allocate("a", a, 7)  # 7 queried, 0 hit
    pool.commit("a", a, 7)
    pool.allocate("b", a[:5], 5)  # 5 queried, 4 hit
    pool.allocate("c", a, 7, use_cache=False)  # not consulted
    assert pool.stats == PageStats(prefix_queries=12, prefix_hits=4, evictions=0)
    pool.free_seq("a")
    pool.free_seq("b")
    pool.free_seq("c")
    assert (pool.free, pool.cached) == (10, 3)
    pool.allocate("d", [9] * 20, 20)  # 10 pages: 7 free, then the 3 cached pages evicted
    assert pool.stats == PageStats(prefix_queries=32, prefix_hits=4, evictions=3)
    assert pool.cached == 0


def test_numpy_tokens_and_bad_tokens():
    pool = PagePool(8, 2)
    arr = np.array([1, 2, 3, 4, 5], dtype=np.int64)
    pool.allocate("a", arr, 5)
    pool.commit("a", arr, 5)
    assert pool.lookup(arr.astype(np.int32)) == 4
    assert pool.lookup([1, 2, 3, 4, 5]) == 4
    with pytest.raises(ValueError, match="token ids"):
        pool.lookup([1, -2, 3])
    with pytest.raises(ValueError, match="integer"):
        pool.lookup([1.0, 2.0])


# ---------------------------------------------------------------------------------------------- model-based test


class _Reference:
    """A plain model of the pool: prefixes as token tuples (no hashing), lists for the LRU, linear scans.

    It predicts every determined outcome (hits, which cached pages are reused, how many and which cached pages are
    evicted, success or OutOfPages) and takes the pool's choice among free pages from the pool, checking it.
    """

    def __init__(self, total: int, page_size: int, prefix_caching: bool):
        self.p = page_size
        self.caching = prefix_caching
        self.free = set(range(1, total + 1))
        self.lru: list[int] = []  # oldest release first
        self.cached: dict[tuple[int, ...], int] = {}  # the full token prefix a page ends -> page
        self.refs = {}  # page -> refcount
        self.tables: dict[object, list[int]] = {}
        self.hashed: dict[object, int] = {}  # seq -> pages of its table with a known prefix
        self.content: dict[int, tuple[int, ...]] = {}  # page -> the token prefix its K/V were written for
        self.evictions = 0
        self.queries = 0
        self.hits = 0

    def hit_pages(self, tokens: list[int]) -> list[int]:
        if not self.caching:
            return []
        pages = []
        for i in range((len(tokens) - 1) // self.p):
            page = self.cached.get(tuple(tokens[: (i + 1) * self.p]))
            if page is None:
                break
            pages.append(page)
        return pages

    def n_free(self) -> int:
        return len(self.free) + len(self.lru)

    def can(self, tokens, length, use_cache=True) -> bool:
        hits = self.hit_pages(tokens) if use_cache else []
        need = -(-length // self.p) - len(hits)
        return need <= self.n_free() - sum(1 for pg in hits if pg in self.lru)

    def take_fresh(self, fresh: list[int]) -> None:
        """Apply the pool's choice of fresh pages, checking it follows the policy."""
        n_from_free = min(len(fresh), len(self.free))
        for page in fresh[:n_from_free]:
            assert page in self.free, f"page {page} taken from the free list but not free"
            self.free.remove(page)
        evicted = fresh[n_from_free:]
        assert evicted == self.lru[: len(evicted)], "eviction must follow release order"
        del self.lru[: len(evicted)]
        for page in evicted:
            (key,) = [k for k, v in self.cached.items() if v == page]
            del self.cached[key]
        self.evictions += len(evicted)
        for page in fresh:
            assert page not in self.refs
            self.refs[page] = 1
            self.content.pop(page, None)

    def allocate(self, seq, tokens, length, use_cache, table):
        consult = use_cache and self.caching
        hits = self.hit_pages(tokens) if consult else []
        assert table[: len(hits)] == hits
        for page in hits:
            if page in self.lru:
                self.lru.remove(page)
            self.refs[page] = self.refs.get(page, 0) + 1
        self.take_fresh(table[len(hits) :])
        self.tables[seq] = list(table)
        self.hashed[seq] = len(hits)
        if consult:
            self.queries += len(tokens)
            self.hits += len(hits) * self.p
        return len(hits) * self.p

    def commit(self, seq, tokens, upto):
        if not self.caching:
            return
        table = self.tables[seq]
        for i in range(self.hashed[seq], upto // self.p):
            prefix = tuple(tokens[: (i + 1) * self.p])
            page = table[i]
            self.content[page] = prefix
            if prefix not in self.cached and page not in self.cached.values():
                self.cached[prefix] = page
        self.hashed[seq] = max(self.hashed[seq], upto // self.p)

    def free_seq(self, seq):
        table = self.tables.pop(seq)
        del self.hashed[seq]
        for page in reversed(table):
            self.refs[page] -= 1
            if self.refs[page] == 0:
                del self.refs[page]
                if page in self.cached.values():
                    self.lru.append(page)
                else:
                    self.free.add(page)
                    self.content.pop(page, None)


def _check_invariants(pool: PagePool, ref: _Reference, live: dict) -> None:
    pages = range(1, pool.num_pages)
    free, lru, referenced = set(pool._free), set(pool._lru), {p for p in pages if pool._ref[p] > 0}
    assert len(free) == len(pool._free) and len(lru) == len(pool._lru)
    assert free.isdisjoint(lru) and free.isdisjoint(referenced) and lru.isdisjoint(referenced)
    assert free | lru | referenced == set(pages), "every page is in exactly one state"
    assert pool._ref[0] == 0 and 0 not in free | lru and 0 not in pool._digest_of
    assert pool.free + pool.used == pool.total
    assert pool.used == len(referenced)
    assert lru <= set(pool._digest_of), "evictable pages are cached"
    assert free.isdisjoint(pool._digest_of), "free pages are not findable"
    assert {v: k for k, v in pool._cached.items()} == pool._digest_of
    counts: dict[int, int] = {}
    for seq in live:
        table = pool.table(seq)
        assert len(set(table)) == len(table)
        assert 0 not in table
        for page in table:
            counts[page] = counts.get(page, 0) + 1
    assert counts == {p: pool._ref[p] for p in referenced}, "refcounts equal the live tables' references"
    # Agreement with the reference model.
    assert set(live) == set(ref.tables)
    assert {seq: pool.table(seq) for seq in live} == ref.tables
    assert free == ref.free and list(pool._lru) == ref.lru
    assert set(pool._digest_of) == set(ref.cached.values())
    assert pool.stats == PageStats(ref.queries, ref.hits, ref.evictions)


@pytest.mark.parametrize("seed", range(40))
def test_random_ops_match_the_reference_model(seed):
    rng = random.Random(seed)
    page_size = rng.choice([1, 2, 3, 4])
    num_pages = rng.randint(2, 24)
    caching = seed % 4 != 3
    pool = PagePool(num_pages, page_size, prefix_caching=caching)
    ref = _Reference(num_pages - 1, page_size, caching)
    stems = [[rng.randint(0, 2) for _ in range(12)] for _ in range(3)]  # shared prefixes: many hits
    live: dict[int, list[int]] = {}  # seq -> its tokens so far (written positions)
    next_seq = 0

    def prompt() -> list[int]:
        stem = rng.choice(stems)[: rng.randint(0, 12)]
        return stem + [rng.randint(0, 2) for _ in range(rng.randint(0 if stem else 1, 4))]

    for _ in range(300):
        op = rng.random()
        if op < 0.3 or not live:
            toks = prompt()
            length = len(toks) + rng.randint(0, 5)
            use_cache = rng.random() < 0.85
            predicted = ref.can(toks, length, use_cache)
            assert pool.can_allocate(toks, length, use_cache=use_cache) == predicted
            seq, next_seq = next_seq, next_seq + 1
            if not predicted:
                with pytest.raises(OutOfPages):
                    pool.allocate(seq, toks, length, use_cache=use_cache)
            else:
                got = pool.allocate(seq, toks, length, use_cache=use_cache)
                table = pool.table(seq)
                assert got == ref.allocate(seq, toks, length, use_cache, table)
                assert got <= len(toks) - 1 or got == 0
                for i in range(got // page_size):  # every hit page holds K/V of exactly the query's prefix
                    assert ref.content[table[i]] == tuple(toks[: (i + 1) * page_size])
                live[seq] = list(toks)
        elif op < 0.5:
            seq = rng.choice(list(live))
            toks = live[seq]
            grow = rng.randint(1, 6)
            before = pool.table(seq)
            need = pool.pages_for(len(toks) + grow) - len(before)
            ok = pool.ensure(seq, len(toks) + grow)
            assert ok == (need <= ref.n_free())
            if ok:
                ref.take_fresh(pool.table(seq)[len(before) :])
                ref.tables[seq] = pool.table(seq)
                toks.extend(rng.randint(0, 2) for _ in range(grow))  # the decode writes `grow` positions
            else:
                assert pool.table(seq) == before
        elif op < 0.75:
            seq = rng.choice(list(live))
            toks = live[seq]
            upto = rng.randint(0, len(toks))
            pool.commit(seq, toks, upto)
            ref.commit(seq, toks, upto)
        elif op < 0.95:
            seq = rng.choice(list(live))
            pool.free_seq(seq)
            ref.free_seq(seq)
            del live[seq]
        else:
            toks = prompt()
            assert pool.lookup(toks) == len(ref.hit_pages(toks)) * page_size
        _check_invariants(pool, ref, live)
    for seq in list(live):
        pool.free_seq(seq)
        ref.free_seq(seq)
        del live[seq]
    _check_invariants(pool, ref, live)
    assert pool.used == 0 and pool.free == pool.total


def test_contiguous_tables_give_each_row_its_own_run_of_pages():
    from dflash_jax.kv.pages import contiguous_tables
    from dflash_jax.kv.sizing import dense_pool_pages

    t = contiguous_tables(3, 40, 16)  # 40 positions: 3 pages a row, the last in part
    assert t.dtype == np.int32 and t.shape == (3, 3)
    np.testing.assert_array_equal(t, [[1, 2, 3], [4, 5, 6], [7, 8, 9]])
    assert dense_pool_pages(3, 40, 16) == 10  # pages 1..9 and the null page 0
    assert contiguous_tables(1, 16, 16).tolist() == [[1]]
    with pytest.raises(ValueError, match="positions"):
        contiguous_tables(2, 0, 16)
