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
