"""`PagePool`: the host-side manager of the paged KV pools, with prefix caching.

The target K/V pool and the drafter's context K/V pool are pools of `num_pages` fixed-size pages of `page_size`
positions. Both pools share one page table per sequence: page ``i`` of a sequence's table holds its logical
positions ``[i * page_size, (i + 1) * page_size)`` in both pools. Page 0 is the null page: it is never allocated
and never cached, and padded tables point at it.

Every allocatable page is in exactly one state:

- free: referenced by no sequence and holding nothing findable;
- cached and evictable: referenced by no sequence, findable by its prefix hash, queued in release order (LRU);
- referenced: in the table of at least one sequence (possibly also findable by its prefix hash).

Prefix caching: a full page is findable by a chain hash, the digest of (its parent page's digest, the int32 bytes
of its tokens); the first page's parent digest is empty, so a digest names the page's tokens and every token before
them. `commit` registers a sequence's full, written pages; `lookup` / `allocate` walk a prompt's chain and reuse the
registered pages. A prompt never reuses the page holding its last token: that token is always recomputed, so the
prefill has its logits and a sequence never writes a page it shares with another.

Allocation takes free pages first (lowest page id first at start), then evicts cached pages, least recently
released first; one `free_seq` releases a table's pages from the last to the first, so a chain's tail is evicted
before its head.

The engine and the runner share one `PagePool`; it is plain host state with no locking.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict, deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np

_DIGEST_SIZE = 32
_ROOT = b""  # parent digest of a sequence's first page
_INT32_MAX = 2**31 - 1


PAGE_SIZES = (16, 32)  # tokens per page the runner supports (`--block-size`): they divide its KV-length buckets


def contiguous_tables(rows: int, positions: int, page_size: int) -> np.ndarray:
    """Page tables `[rows, n]` int32 (n = ceil(positions / page_size)) of `rows` sequences laid end to end in one
    pool, as batch jobs address it: row r owns pages 1 + r * n .. (r + 1) * n in order, and page 0 stays the null
    page. The pool needs `rows * n + 1` pages (`kv.sizing.dense_pool_pages`)."""
    if rows < 1 or positions < 1 or page_size < 1:
        raise ValueError(f"rows, positions and page_size must be >= 1, got {rows}, {positions}, {page_size}")
    n = -(-positions // page_size)
    return (1 + np.arange(rows * n, dtype=np.int32)).reshape(rows, n)


class OutOfPages(Exception):
    """An allocation the pool cannot satisfy with its unreferenced pages; nothing was allocated."""


@dataclass
class PageStats:
    """Cumulative counters (for /metrics)."""

    prefix_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_hits: int = 0  # of those, tokens found cached
    evictions: int = 0  # cached pages evicted to make room


class _Seq:
    """One sequence's table and the chain digests of its first `len(digests)` (hashed) pages."""

    __slots__ = ("digests", "table")

    def __init__(self, table: list[int], digests: list[bytes]):
        self.table = table
        self.digests = digests


def _token_array(tokens: Sequence[int], what: str) -> np.ndarray:
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise ValueError(f"{what}: tokens must be a flat sequence of token ids, got shape {arr.shape}")
    if arr.size == 0:
        return np.zeros(0, dtype="<i4")
    if arr.dtype.kind not in "iu":
        raise ValueError(f"{what}: tokens must be integer token ids, got dtype {arr.dtype}")
    if int(arr.min()) < 0 or int(arr.max()) > _INT32_MAX:
        raise ValueError(f"{what}: token ids must lie in [0, 2**31), got [{int(arr.min())}, {int(arr.max())}]")
    return arr.astype("<i4", copy=False)


class PagePool:
    """Reference-counted pages shared by every sequence's page table, with an LRU prefix cache of full pages."""

    def __init__(self, num_pages: int, page_size: int, *, prefix_caching: bool = True):
        if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
            raise ValueError(f"page_size must be an integer >= 1, got {page_size!r}")
        if isinstance(num_pages, bool) or not isinstance(num_pages, int) or num_pages < 2:
            raise ValueError(
                f"num_pages must be an integer >= 2 (page 0 is the null page, never allocated), got {num_pages!r}"
            )
        self.num_pages = num_pages
        self.page_size = page_size
        self.prefix_caching = bool(prefix_caching)
        self.stats = PageStats()
        self._ref = [0] * num_pages  # references per page (index 0: the null page, always 0)
        self._free: deque[int] = deque(range(1, num_pages))  # unreferenced, not findable
        self._lru: OrderedDict[int, None] = OrderedDict()  # unreferenced and findable, oldest release first
        self._cached: dict[bytes, int] = {}  # chain digest -> physical page
        self._digest_of: dict[int, bytes] = {}  # physical page -> its registered chain digest
        self._seqs: dict[Hashable, _Seq] = {}
        self._used = 0  # pages with _ref > 0

    # ------------------------------------------------------------------ counts

    @property
    def total(self) -> int:
        """Allocatable pages (every page but the null page)."""
        return self.num_pages - 1

    @property
    def free(self) -> int:
        """Pages an allocation can take: unreferenced ones, evictable cached ones included."""
        return len(self._free) + len(self._lru)

    @property
    def used(self) -> int:
        """Pages referenced by at least one sequence."""
        return self._used

    @property
    def cached(self) -> int:
        """Pages findable by prefix lookups (referenced or evictable)."""
        return len(self._cached)

    def pages_for(self, length: int) -> int:
        """Pages covering `length` positions: ceil(length / page_size)."""
        if length < 0:
            raise ValueError(f"length must be >= 0, got {length}")
        return -(-length // self.page_size)

    def refcount(self, page: int) -> int:
        """How many sequences' tables hold physical page `page`."""
        return self._ref[page]

    def __contains__(self, seq: Hashable) -> bool:
        return seq in self._seqs

    def __len__(self) -> int:
        """Live sequences."""
        return len(self._seqs)

    def table(self, seq: Hashable) -> list[int]:
        """Physical page ids of `seq`, in logical order (a copy)."""
        return list(self._state(seq).table)

    def capacity(self, seq: Hashable) -> int:
        """Positions `seq`'s table covers."""
        return len(self._state(seq).table) * self.page_size

    # ------------------------------------------------------------------ prefix cache

    def _digest(self, parent: bytes, raw: bytes, i: int) -> bytes:
        """Chain digest of page `i` of the tokens whose int32 bytes are `raw`, under digest `parent`."""
        n = 4 * self.page_size
        return hashlib.blake2b(parent + raw[i * n : (i + 1) * n], digest_size=_DIGEST_SIZE).digest()

    def _hits(self, arr: np.ndarray) -> tuple[list[bytes], list[int]]:
        """Digests and physical pages of the cached prefix of a prompt (at most (len - 1) // page_size pages)."""
        digests: list[bytes] = []
        pages: list[int] = []
        if not self.prefix_caching or not self._cached:
            return digests, pages
        raw = arr.tobytes()
        parent = _ROOT
        for i in range((arr.size - 1) // self.page_size):
            d = self._digest(parent, raw, i)
            page = self._cached.get(d)
            if page is None:
                break
            digests.append(d)
            pages.append(page)
            parent = d
        return digests, pages

    def lookup(self, tokens: Sequence[int]) -> int:
        """Tokens of prompt `tokens` found cached, in whole pages, never the last token. Changes nothing."""
        _, pages = self._hits(_token_array(tokens, "lookup"))
        return len(pages) * self.page_size

    # ------------------------------------------------------------------ allocation

    def _available_for(self, hit_pages: list[int]) -> int:
        """Pages fresh allocations could take once `hit_pages` are referenced (they leave the LRU)."""
        return self.free - sum(1 for page in hit_pages if self._ref[page] == 0)

    def _take(self, n: int) -> list[int]:
        """`n` unreferenced pages, free ones first, then evicting the least recently released cached ones."""
        pages = []
        for _ in range(n):
            if self._free:
                page = self._free.popleft()
            else:
                page, _ = self._lru.popitem(last=False)
                del self._cached[self._digest_of.pop(page)]
                self.stats.evictions += 1
            assert self._ref[page] == 0, f"page {page} handed out while referenced"
            self._ref[page] = 1
            pages.append(page)
        self._used += n
        return pages

    def can_allocate(self, tokens: Sequence[int], length: int, *, use_cache: bool = True) -> bool:
        """Whether `allocate(seq, tokens, length, use_cache=use_cache)` would succeed in the pool's present state."""
        arr = _token_array(tokens, "can_allocate")
        self._check_length(arr, length, "can_allocate")
        _, hit_pages = self._hits(arr) if use_cache else ([], [])
        return self.pages_for(length) - len(hit_pages) <= self._available_for(hit_pages)

    def _check_length(self, arr: np.ndarray, length: int, what: str) -> None:
        if length < arr.size:
            raise ValueError(f"{what}: length ({length}) must be >= the prompt's {arr.size} tokens")

    def allocate(self, seq: Hashable, tokens: Sequence[int], length: int, *, use_cache: bool = True) -> int:
        """Add sequence `seq` with prompt `tokens`, its table covering `length` positions.

        Reuses the cached pages of the prompt's prefix (when `use_cache` and prefix caching are on) and takes fresh
        pages for the rest. Returns the number of cached tokens: the prefill starts at that position.
        Raises OutOfPages, allocating nothing, when the pool cannot cover `length`.
        """
        if seq in self._seqs:
            raise ValueError(f"allocate: sequence {seq!r} already holds pages; free_seq it first")
        arr = _token_array(tokens, "allocate")
        self._check_length(arr, length, "allocate")
        consult = use_cache and self.prefix_caching
        digests, hit_pages = self._hits(arr) if consult else ([], [])
        need = self.pages_for(length) - len(hit_pages)
        available = self._available_for(hit_pages)
        if need > available:
            raise OutOfPages(
                f"sequence {seq!r} needs {need} fresh pages for {length} positions "
                f"({len(hit_pages)} cached); {available} are allocatable"
            )
        for page in hit_pages:
            if self._ref[page] == 0:
                del self._lru[page]
                self._used += 1
            self._ref[page] += 1
        table = hit_pages + self._take(need)
        self._seqs[seq] = _Seq(table, digests)
        cached_tokens = len(hit_pages) * self.page_size
        if consult:
            self.stats.prefix_queries += int(arr.size)
            self.stats.prefix_hits += cached_tokens
        return cached_tokens

    def ensure(self, seq: Hashable, length: int) -> bool:
        """Grow `seq`'s table to cover `length` positions; False, allocating nothing, if the pool cannot."""
        state = self._state(seq)
        need = self.pages_for(length) - len(state.table)
        if need <= 0:
            return True
        if need > self.free:
            return False
        state.table.extend(self._take(need))
        return True

    def commit(self, seq: Hashable, tokens: Sequence[int], upto: int) -> None:
        """Record that `seq`'s first `upto` positions hold the final K/V of `tokens[:upto]`.

        Registers its full pages ending at or before `upto` for later lookups. A page whose digest another physical
        page already holds stays private. Idempotent; a no-op with prefix caching off.
        """
        state = self._state(seq)
        if not self.prefix_caching:
            return
        p = self.page_size
        full = upto // p
        if full <= len(state.digests):
            return
        if upto > len(tokens):
            raise ValueError(f"commit: upto ({upto}) exceeds the {len(tokens)} tokens given")
        if full > len(state.table):
            raise ValueError(f"commit: upto ({upto}) exceeds the {len(state.table) * p} positions of {seq!r}'s table")
        start = len(state.digests)  # only the pages not hashed yet are read
        raw = _token_array(tokens[start * p : full * p], "commit").tobytes()
        parent = state.digests[-1] if state.digests else _ROOT
        for i in range(start, full):
            d = self._digest(parent, raw, i - start)
            state.digests.append(d)
            page = state.table[i]
            if d not in self._cached and page not in self._digest_of:
                self._cached[d] = page
                self._digest_of[page] = d
            parent = d

    def free_seq(self, seq: Hashable) -> None:
        """Drop `seq`'s references; unreferenced pages become evictable (cached) or free. Unknown `seq`: no-op."""
        state = self._seqs.pop(seq, None)
        if state is None:
            return
        for page in reversed(state.table):
            self._ref[page] -= 1
            if self._ref[page] == 0:
                self._used -= 1
                if page in self._digest_of:
                    self._lru[page] = None
                else:
                    self._free.append(page)

    def _state(self, seq: Hashable) -> _Seq:
        try:
            return self._seqs[seq]
        except KeyError:
            raise KeyError(f"sequence {seq!r} holds no pages (allocate it first)") from None
