"""Paged KV-cache storage: per attention layer, one tensor [num_blocks, block_size, heads, dim] for each cache
part the layer declares (GQA: K and V; MLA: the compressed latent), with its cache group's page count
(`hybrid.cache_groups`). Which pages a sequence owns is decided by `hybrid.block_manager`; this module only
allocates the tensors and binds them (and the group) to the layers."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence

import torch

from hybrid.cache_groups import CacheGroup

log = logging.getLogger(__name__)


def page_bytes(group: CacheGroup, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one page of the group takes over all its layers."""
    elem = torch.empty((), dtype=dtype).element_size()
    per_layer = sum(heads * dim for heads, dim in group.page_shapes) * block_size * elem
    return per_layer * len(group.layer_indices)


def kv_cache_bytes(groups: Sequence[CacheGroup], block_size: int, dtype: torch.dtype) -> int:
    return sum(page_bytes(g, block_size, dtype) * g.num_blocks for g in groups)


def allocate_kv_cache(attention_layers, groups: Sequence[CacheGroup], block_size: int, dtype: torch.dtype,
                      device: torch.device | str) -> list[tuple[torch.Tensor, ...]]:
    """Allocates and binds each layer's cache tensors and cache group; returns them (the runner keeps them
    alive)."""
    start = time.perf_counter()
    layers = list(attention_layers)
    caches: list[tuple[torch.Tensor, ...]] = [()] * len(layers)
    for index, group in enumerate(groups):
        for i in group.layer_indices:
            parts = tuple(torch.zeros(group.num_blocks, block_size, heads, dim, dtype=dtype, device=device)
                          for heads, dim in layers[i].kv_cache_shapes())
            layers[i].kv_cache, layers[i].cache_group = parts, index
            caches[i] = parts
        window = f"window {group.sliding_window}" if group.is_windowed else "full"
        log.info("KV cache group %d (%d layers, %s, page %s): %d tokens (%d pages of %d), %.2f GiB", index,
                 len(group.layer_indices), window, group.page_shapes, group.num_blocks * block_size,
                 group.num_blocks, block_size, page_bytes(group, block_size, dtype) * group.num_blocks / 2**30)
    num_bytes = sum(t.numel() * t.element_size() for parts in caches for t in parts)
    # tokens: the context the largest pool holds (a full group's, where there is one)
    log.info("KV cache: %d tokens (%d groups, %d pages of %d), %.2f GiB on %s, allocated in %.2f s",
             max(g.num_blocks for g in groups) * block_size, len(groups), sum(g.num_blocks for g in groups),
             block_size, num_bytes / 2**30, device, time.perf_counter() - start)
    return caches


def state_slot_bytes(state_layers, dtype: torch.dtype) -> int:
    """Bytes one recurrent-state slot takes over all recurrent layers: the float32 state and the conv state."""
    elem = torch.empty((), dtype=dtype).element_size()
    total = 0
    for layer in state_layers:
        state_shape, conv_shape = layer.state_shapes()
        total += math.prod(state_shape) * 4 + math.prod(conv_shape) * elem
    return total


def allocate_state_cache(state_layers, num_slots: int, num_snapshots: int, dtype: torch.dtype,
                         device: torch.device | str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Allocates and binds each recurrent layer's pools (`state_cache`: float32 recurrent states [rows, ...] and
    conv states [rows, conv_dim, K - 1] in `dtype`), whose rows are the running sequences' `num_slots` slots, then
    prefix caching's `num_snapshots` state snapshots (`hybrid.block_manager.StateSnapshotPool`); returns them."""
    layers = list(state_layers)
    caches = []
    num_rows = num_slots + num_snapshots
    for layer in layers:
        state_shape, conv_shape = layer.state_shapes()
        pools = (torch.zeros(num_rows, *state_shape, dtype=torch.float32, device=device),
                 torch.zeros(num_rows, *conv_shape, dtype=dtype, device=device))
        layer.state_cache = pools
        caches.append(pools)
    slot_bytes = state_slot_bytes(layers, dtype)
    log.info("Recurrent state cache: %d slots over %d layers (%.2f GiB) and %d prefix-cache snapshots (%.2f GiB) "
             "on %s", num_slots, len(layers), slot_bytes * num_slots / 2**30, num_snapshots,
             slot_bytes * num_snapshots / 2**30, device)
    return caches
