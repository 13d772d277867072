"""Paged KV-cache bookkeeping: which pages are free, and which hold a cached prefix. Pure Python, no torch, so it
is cheap to test and to reason about; the model runner turns page lists into block tables (see `ForwardBatch`).

The KV cache is split into cache groups (`CacheGroup`: attention layers with one page shape and one window kind,
as vLLM's hybrid allocator groups them); each group has its own pool of pages and its own
`PrefixCachingBlockManager`. `CacheGroupBlocks` (one per model, `LLM.blocks`) holds them all and works on a
sequence's block tables, one per group: the engine's scheduler and `LLM.prefill_logits` both take pages from it,
so a page is never handed to two users at once.

A sliding-window group keeps a sequence's table aligned with its positions, but pages that fall entirely before
the window are given back while the sequence runs (`release_out_of_window`); their entries become `NULL_PAGE`,
which the runner writes as page 0: the attention kernels and the reference never read a key before the window."""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Callable, Sequence

from hybrid.cache_groups import CacheGroup

# The chain's root: the key of "no page before this one". A page's key covers its parent's key, so equal keys mean
# equal tokens from position 0 on.
ROOT_KEY = b""
# A windowed group's table entry whose page went back to the pool: never read, never written.
NULL_PAGE = -1


class OutOfBlocks(RuntimeError):
    """Not enough free KV pages; the caller should queue the request rather than fail it."""


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def page_key(parent: bytes, page_token_ids: Sequence[int]) -> bytes:
    """The prefix-cache key of one full page: BLAKE2b-256 over the parent page's key and the page's token ids as
    fixed-width integers (injective for pages of one size). Collision-resistant, so a hit never reuses another
    sequence's KV; Python's builtin `hash` is not (and is salted per process for some types)."""
    digest = hashlib.blake2b(parent, digest_size=32)
    digest.update(array("q", page_token_ids).tobytes())
    return digest.digest()


class PrefixCachingBlockManager:
    """Pages with reference counts and a prefix cache: a full page is known by its chained key (`page_key`: its
    own tokens and, through its parent's key, every token before it), so a request that starts with the same
    tokens as an earlier one reuses its pages instead of recomputing them. A page whose last user freed it keeps its
    key until it is handed out again (least recently freed first), so a resent conversation finds it still cached.

    Keys are computed by the caller once per full page (`extend_keys`), kept with the sequence, and passed in."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks}, {block_size}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._free: dict[int, None] = dict.fromkeys(range(num_blocks))  # insertion order: least recently freed
        self._refs = [0] * num_blocks
        self._key_of: dict[int, bytes] = {}  # page -> key of its full contents
        self._page_of: dict[bytes, int] = {}  # key -> page
        self.on_evict: Callable[[bytes], None] | None = None  # told each key whose page is handed out again

    @property
    def num_free(self) -> int:
        return len(self._free)

    def extend_keys(self, keys: list[bytes], token_ids: Sequence[int], num_tokens: int) -> None:
        """Appends to `keys` (a sequence's page keys so far) the keys of the full pages among its first
        `num_tokens` tokens that it lacks: each page is hashed once over the sequence's life."""
        size = self.block_size
        for page in range(len(keys), num_tokens // size):
            keys.append(page_key(keys[-1] if keys else ROOT_KEY, token_ids[page * size:(page + 1) * size]))

    def cached_page(self, key: bytes) -> int | None:
        """The page holding the full page of this key, if cached (not referenced: see `acquire`)."""
        return self._page_of.get(key) if self.enable_prefix_caching else None

    def acquire(self, pages: Sequence[int]) -> None:
        """References cached pages for a new user (taking them off the free list if nobody held them)."""
        for page in pages:
            self._refs[page] += 1
            self._free.pop(page, None)

    def match_prefix(self, keys: Sequence[bytes]) -> list[int]:
        """Cached pages holding the leading pages whose keys are `keys`, referenced for the caller (the longest run
        of hits from the first page on)."""
        if not self.enable_prefix_caching:
            return []
        pages = []
        for key in keys:
            page = self._page_of.get(key)
            if page is None:
                break
            pages.append(page)
        self.acquire(pages)
        return pages

    def allocate(self, count: int) -> list[int]:
        if count > len(self._free):
            raise OutOfBlocks(f"need {count} KV pages, {len(self._free)} free of {self.num_blocks}")
        pages = []
        for _ in range(count):
            page = next(iter(self._free))
            del self._free[page]
            old = self._key_of.pop(page, None)  # its cached contents are about to be overwritten
            if old is not None:
                del self._page_of[old]
                if self.on_evict is not None:
                    self.on_evict(old)
            self._refs[page] = 1
            pages.append(page)
        return pages

    def cache_pages(self, pages: Sequence[int], keys: Sequence[bytes]) -> None:
        """Publishes pages whose KV now holds the full pages with these keys, for later requests (a key already
        cached keeps its page)."""
        if not self.enable_prefix_caching:
            return
        for page, key in zip(pages, keys, strict=True):
            if page != NULL_PAGE and page not in self._key_of and key not in self._page_of:
                self._key_of[page], self._page_of[key] = key, page

    def free(self, pages: list[int]) -> None:
        for page in reversed(pages):
            if page == NULL_PAGE:
                continue
            self._refs[page] -= 1
            if self._refs[page] == 0:
                self._free[page] = None


class StateSlotPool:
    """Recurrent-state slots (Gated DeltaNet layers' recurrent and conv states): a sequence holds one slot while it
    runs, whatever its length; the pool is sized at start-up. Like pages, a slot is never handed to two users."""

    def __init__(self, num_slots: int):
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self.num_slots = num_slots
        self._free: dict[int, None] = dict.fromkeys(range(num_slots))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int | None:
        """A free slot, or None when every slot is held (the caller queues the request)."""
        if not self._free:
            return None
        slot = next(iter(self._free))
        del self._free[slot]
        return slot

    def free(self, slot: int) -> None:
        if slot < 0 or slot in self._free:
            return
        self._free[slot] = None


class StateSnapshotPool:
    """Recurrent-state snapshots for prefix caching of models with recurrent layers: snapshot `i` is row
    `first_row + i` of the layers' state pools (after the running sequences' slots), holding the recurrent and conv
    states exactly as they were after the full pages up to the one whose prefix-cache key it is stored under; a hit
    on that key is exactly that position. Least recently used snapshots make room for new ones (`take`); a snapshot
    whose page leaves the prefix cache goes with it (`drop`). Pure bookkeeping: the model runner copies the rows."""

    def __init__(self, num_snapshots: int, first_row: int):
        if num_snapshots < 0:
            raise ValueError(f"num_snapshots must be >= 0, got {num_snapshots}")
        self.num_snapshots, self.first_row = num_snapshots, first_row
        self._free = list(range(first_row + num_snapshots - 1, first_row - 1, -1))
        self._row_of: dict[bytes, int] = {}  # key -> row, least recently used first

    @property
    def num_cached(self) -> int:
        return len(self._row_of)

    def latest(self, keys: Sequence[bytes], num_pages: int) -> int:
        """The most pages among the first `num_pages` of `keys` after which a snapshot is kept (0: none)."""
        while num_pages > 0 and keys[num_pages - 1] not in self._row_of:
            num_pages -= 1
        return num_pages

    def use(self, key: bytes) -> int:
        """The row of a kept snapshot, marked most recently used (a restore reads it before anything is taken)."""
        row = self._row_of.pop(key)
        self._row_of[key] = row
        return row

    def take(self, key: bytes, replacing: bytes | None = None) -> int | None:
        """A row to copy the state at `key` into, now keyed by it; None where `key` is kept already or there are no
        snapshots. `replacing`: the key of the caller's previous snapshot, whose row is reused if it is still kept
        (a running sequence keeps one rolling snapshot); else a free row, else the least recently used one's."""
        if self.num_snapshots == 0 or key in self._row_of:
            return None
        if replacing is not None and replacing in self._row_of:
            row = self._row_of.pop(replacing)
        elif self._free:
            row = self._free.pop()
        else:
            row = self._row_of.pop(next(iter(self._row_of)))
        self._row_of[key] = row
        return row

    def drop(self, key: bytes) -> None:
        """The page of `key` left the prefix cache: its snapshot goes too (a hit needs the page as well)."""
        row = self._row_of.pop(key, None)
        if row is not None:
            self._free.append(row)


class CacheGroupBlocks:
    """One `PrefixCachingBlockManager` per cache group (`hybrid.cache_groups`), worked on together: a sequence
    holds one block table per group (`new_tables`), and reserving, prefix matching, publishing and freeing cover
    every group. Windowed groups give back the pages before a running sequence's window
    (`release_out_of_window`) and may lose published pages later, so a prefix hit of P tokens needs every full
    group's pages for all P and each windowed group's pages only for the window before P (vLLM's sliding-window
    manager semantics). With one full group this costs what one manager does."""

    def __init__(self, groups: Sequence[CacheGroup], block_size: int, enable_prefix_caching: bool = True,
                 num_state_slots: int = 0, num_state_snapshots: int = 0):
        """`num_state_slots` > 0: the model has recurrent layers, and each running sequence also holds one of
        these slots (`state_slots`); its prefix hits also need a state snapshot (`snapshots`, rows after the slots),
        so with `num_state_snapshots` 0 its prefix caching is off."""
        if not groups:
            raise ValueError("a KV cache needs at least one cache group")
        self.state_slots = StateSlotPool(num_state_slots) if num_state_slots else None
        if num_state_slots and not num_state_snapshots:
            enable_prefix_caching = False
        self.snapshots = StateSnapshotPool(num_state_snapshots, num_state_slots) \
            if num_state_slots and enable_prefix_caching else None
        self.groups = tuple(groups)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.allocators = tuple(PrefixCachingBlockManager(g.num_blocks, block_size, enable_prefix_caching)
                                for g in self.groups)
        if self.snapshots is not None:
            for group, allocator in zip(self.groups, self.allocators, strict=True):
                if not group.is_windowed:  # a hit needs every full group's pages up to the snapshot's
                    allocator.on_evict = self.snapshots.drop
        self.has_windows = any(g.is_windowed for g in self.groups)

    @property
    def num_blocks(self) -> int:
        return sum(a.num_blocks for a in self.allocators)

    @property
    def num_free(self) -> int:
        return sum(a.num_free for a in self.allocators)

    def num_used(self, group: int) -> int:
        allocator = self.allocators[group]
        return allocator.num_blocks - allocator.num_free

    def new_tables(self) -> list[list[int]]:
        return [[] for _ in self.groups]

    def extend_keys(self, keys: list[bytes], token_ids: Sequence[int], num_tokens: int) -> None:
        self.allocators[0].extend_keys(keys, token_ids, num_tokens)  # one page size, one chain: the same keys

    def too_large(self, num_tokens: int) -> str | None:
        """Why a sequence of `num_tokens` tokens can never run (a group's pool is too small for it), or None."""
        needed = blocks_needed(num_tokens, self.block_size)
        for index, (group, allocator) in enumerate(zip(self.groups, self.allocators, strict=True)):
            least = min(needed, group.min_blocks_per_seq(self.block_size)) if group.is_windowed else needed
            if least > allocator.num_blocks:
                return f"needs {least} KV pages in cache group {index}, which has {allocator.num_blocks}"
        return None

    def match_prefix(self, keys: Sequence[bytes]) -> tuple[int, list[list[int]]]:
        """(P, tables): the longest run of the leading pages `keys` that every group holds (its window's share in a
        windowed group) and, for a model with recurrent layers, after which a state snapshot is kept (the latest
        one at or before the pages' hit); the pages are referenced for the caller; tables hold them, `NULL_PAGE`
        before a window."""
        tables = self.new_tables()
        if not self.enable_prefix_caching or not keys:
            return 0, tables
        num_pages = len(keys)
        for group, allocator in zip(self.groups, self.allocators, strict=True):
            if not group.is_windowed:
                run = 0
                while run < num_pages and allocator.cached_page(keys[run]) is not None:
                    run += 1
                num_pages = run
        while True:
            while num_pages > 0 and not all(self._holds_window(g, keys, num_pages)
                                            for g in range(len(self.groups)) if self.groups[g].is_windowed):
                num_pages -= 1
            # recurrent layers resume only from a kept state: the latest snapshot at or before the pages' hit
            usable = num_pages if self.snapshots is None else self.snapshots.latest(keys, num_pages)
            if usable == num_pages:
                break
            num_pages = usable
        for group, allocator, table in zip(self.groups, self.allocators, tables, strict=True):
            first = group.first_needed_page(num_pages * self.block_size, self.block_size)
            pages = [allocator.cached_page(key) for key in keys[first:num_pages]]
            allocator.acquire(pages)
            table += [NULL_PAGE] * first + pages
        return num_pages, tables

    def _holds_window(self, group: int, keys: Sequence[bytes], num_pages: int) -> bool:
        first = self.groups[group].first_needed_page(num_pages * self.block_size, self.block_size)
        allocator = self.allocators[group]
        return all(allocator.cached_page(key) is not None for key in keys[first:num_pages])

    def fit(self, tables: Sequence[list[int]], num_computed: int, num_new: int) -> int:
        """How many of the next `num_new` tokens can get pages now: 0 unless every full group has room for all of
        them; a windowed group may shrink the chunk to its free pages (the chunk still starts at num_computed)."""
        granted = num_new
        for group, allocator, table in zip(self.groups, self.allocators, tables, strict=True):
            room = (len(table) + allocator.num_free) * self.block_size - num_computed
            if group.is_windowed:
                granted = min(granted, room)
            elif room < num_new:
                return 0
        return max(granted, 0)

    def allocate(self, tables: Sequence[list[int]], num_tokens: int) -> None:
        """Extends every table to cover the first `num_tokens` positions (call `fit` first: raises OutOfBlocks)."""
        needed = blocks_needed(num_tokens, self.block_size)
        for allocator, table in zip(self.allocators, tables, strict=True):
            if needed > len(table):
                table += allocator.allocate(needed - len(table))

    def release_out_of_window(self, tables: Sequence[list[int]], num_computed: int) -> None:
        """Gives back each windowed table's pages that the next token (at `num_computed`) can no longer see; the
        chunk's first token is the earliest one, so every later one of the step sees at most as far back."""
        if not self.has_windows:
            return
        for group, allocator, table in zip(self.groups, self.allocators, tables, strict=True):
            end = min(group.first_needed_page(num_computed, self.block_size), len(table))
            released = []
            page = end - 1
            while page >= 0 and table[page] != NULL_PAGE:  # released entries are a prefix: stop at the first one
                released.append(table[page])
                table[page] = NULL_PAGE
                page -= 1
            allocator.free(released)

    def cache_pages(self, tables: Sequence[list[int]], start: int, end: int, keys: Sequence[bytes]) -> None:
        """Publishes pages start..end-1 of every table (their KV is now complete) under `keys[start:end]`."""
        for allocator, table in zip(self.allocators, tables, strict=True):
            allocator.cache_pages(table[start:end], keys[start:end])

    def free(self, tables: Sequence[list[int]]) -> None:
        """Gives back every page of the tables (none: a request that never got pages)."""
        for allocator, table in zip(self.allocators, tables or self.new_tables(), strict=True):
            allocator.free(table)
