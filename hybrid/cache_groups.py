"""Cache groups: which attention layers share one pool of KV pages, and how many pages each pool gets. Pure
Python, no torch (the layers are read through `kv_cache_shapes()` and their config's `sliding_window`).

Layers with the same per-slot cache shapes and the same window share a group (vLLM's hybrid allocator does the
same): gpt-oss has a windowed group and a full group, MiMo-V2-Flash groups by its per-layer KV heads and head dims
too, every other model has one full group. A sequence holds one block table per group; the tables of all groups
cover the same positions with the same page keys, so one prefix-cache lookup serves them all.

Pool sizes: a full group holds what every layer held before groups, `kv_cache_tokens` (default 4 x max_model_len).
A windowed group only needs, per running sequence, the pages its window can still see plus the step's chunk: at
most ceil((window - 1) / block_size) + 1 pages before the step's first token (the window is rarely page-aligned)
and ceil(chunk / block_size) + 1 pages for the chunk. Over `max_num_seqs` sequences sharing
`max_num_batched_tokens` tokens that is max_num_seqs * (ceil((window - 1) / block_size) + 2) +
ceil(max_num_batched_tokens / block_size) pages, never more than the full size. An engine run with more
sequences or a larger budget than the config's stays correct: the scheduler shrinks a chunk to the window pool's
free pages, or queues and preempts as it does when the full pool runs out."""

from __future__ import annotations

from dataclasses import dataclass


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class CacheGroup:
    """Attention layers (indices into `model.attention_layers()`) whose pages have one shape and one window."""

    layer_indices: tuple[int, ...]
    page_shapes: tuple[tuple[int, int], ...]  # per-slot shapes of one layer's cache parts ([heads, dim] each)
    sliding_window: int | None
    num_blocks: int

    @property
    def is_windowed(self) -> bool:
        return self.sliding_window is not None

    def first_needed_page(self, position: int, block_size: int) -> int:
        """The first page a token at `position` attends to: pages before it are out of this group's window."""
        if self.sliding_window is None:
            return 0
        return max(0, position - self.sliding_window + 1) // block_size

    def min_blocks_per_seq(self, block_size: int) -> int:
        """Pages a windowed sequence needs to advance by one token (its window, not page-aligned, plus one)."""
        return ceil_div(self.sliding_window - 1, block_size) + 2


def windowed_blocks(window: int, block_size: int, max_num_seqs: int, max_num_batched_tokens: int) -> int:
    """A windowed group's pool: every running sequence's window pages plus the step's chunks (module docstring)."""
    return max_num_seqs * (ceil_div(window - 1, block_size) + 2) + ceil_div(max_num_batched_tokens, block_size)


def derive_cache_groups(attention_layers, num_full_blocks: int, block_size: int, max_num_seqs: int,
                        max_num_batched_tokens: int) -> tuple[CacheGroup, ...]:
    """Groups the layers by (cache shapes, window), in order of each group's first layer, and sizes each pool."""
    members: dict[tuple, list[int]] = {}
    for index, layer in enumerate(attention_layers):
        key = (tuple(tuple(shape) for shape in layer.kv_cache_shapes()), layer.cfg.sliding_window)
        members.setdefault(key, []).append(index)
    groups = []
    for (shapes, window), indices in members.items():
        num_blocks = num_full_blocks
        if window is not None:
            num_blocks = min(num_full_blocks, windowed_blocks(window, block_size, max_num_seqs,
                                                              max_num_batched_tokens))
        groups.append(CacheGroup(tuple(indices), shapes, window, num_blocks))
    return tuple(groups)
