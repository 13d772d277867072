"""Paged KV-cache bookkeeping: which pages are free. Pure Python, no torch, so it is cheap to test and to
reason about; the engine turns page lists into block tables (see `ForwardBatch`)."""

from __future__ import annotations


class OutOfBlocks(RuntimeError):
    """Not enough free KV pages; the caller should queue the request rather than fail it."""


class BlockAllocator:
    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, count: int) -> list[int]:
        if count > len(self._free):
            raise OutOfBlocks(f"need {count} KV pages, {len(self._free)} free of {self.num_blocks}")
        return [self._free.pop() for _ in range(count)]

    def free(self, blocks: list[int]) -> None:
        self._free.extend(reversed(blocks))


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class PrefixCachingBlockManager:
    """Pages with reference counts and a prefix cache: a full page is known by the chained hash of its tokens
    (its own tokens and every token before it), so a request that starts with the same tokens as an earlier one
    reuses its pages instead of recomputing them. A page whose last user freed it keeps its hash until it is handed
    out again (least recently freed first), so a resent conversation finds it still cached."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks}, {block_size}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._free: dict[int, None] = dict.fromkeys(range(num_blocks))  # insertion order: least recently freed
        self._refs = [0] * num_blocks
        self._hash_of: dict[int, int] = {}  # page -> hash of its full contents
        self._page_of: dict[int, int] = {}  # hash -> page

    @property
    def num_free(self) -> int:
        return len(self._free)

    def block_hashes(self, token_ids: list[int]) -> list[int]:
        """The chained hash of every full page of `token_ids`."""
        hashes, previous = [], 0
        for start in range(0, len(token_ids) - self.block_size + 1, self.block_size):
            previous = hash((previous, tuple(token_ids[start:start + self.block_size])))
            hashes.append(previous)
        return hashes

    def match_prefix(self, token_ids: list[int]) -> list[int]:
        """Cached pages holding a prefix of `token_ids`, referenced for the caller. At most len - 1 tokens: the
        last prompt token is always computed, since its logits pick the first new token."""
        if not self.enable_prefix_caching:
            return []
        pages = []
        for h in self.block_hashes(token_ids[:-1]):
            page = self._page_of.get(h)
            if page is None:
                break
            pages.append(page)
        for page in pages:
            self._refs[page] += 1
            self._free.pop(page, None)
        return pages

    def allocate(self, count: int) -> list[int]:
        if count > len(self._free):
            raise OutOfBlocks(f"need {count} KV pages, {len(self._free)} free of {self.num_blocks}")
        pages = []
        for _ in range(count):
            page = next(iter(self._free))
            del self._free[page]
            old = self._hash_of.pop(page, None)  # its cached contents are about to be overwritten
            if old is not None:
                del self._page_of[old]
            self._refs[page] = 1
            pages.append(page)
        return pages

    def cache_full_blocks(self, pages: list[int], token_ids: list[int]) -> None:
        """Publishes the full pages of a sequence whose KV holds `token_ids` (computed), for later requests."""
        if not self.enable_prefix_caching:
            return
        for page, h in zip(pages, self.block_hashes(token_ids), strict=False):
            if page not in self._hash_of and h not in self._page_of:
                self._hash_of[page], self._page_of[h] = h, page

    def free(self, pages: list[int]) -> None:
        for page in reversed(pages):
            self._refs[page] -= 1
            if self._refs[page] == 0:
                self._free[page] = None
