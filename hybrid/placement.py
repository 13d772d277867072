"""Which routed experts live on the GPU: placement data chosen once at start-up (the layers' `RoutedExperts`,
`hybrid.routed_experts`, split each step's experts by it).

`ExpertPlacement.choose` keeps, per MoE layer, the `num_gpu_experts` experts routed to most often (counts from a
routing-statistics file, `RoutingStats`, JSON {"layers": {"3": [count per expert], ...}}), or the first ones when
there are no statistics (routing is then taken as uniform, where any choice is as good). With tensor parallelism
(expert parallel for the GPU-resident experts) the chosen experts are dealt out over the ranks' GPUs, whole
experts, most routed first, round-robin (so the ranks' shares of the traffic are close and their counts differ by
at most one); every rank holds the same placement, computes its own GPU experts (`on_rank`) and leaves all the
GPU-resident ones, on any rank, out of its CPU part.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from hybrid.layers.moe import Router


@dataclass(frozen=True)
class RoutingStats:
    counts: dict[int, list[int]]  # MoE layer -> tokens routed to each expert

    @classmethod
    def read(cls, path: str | Path) -> RoutingStats:
        try:
            raw = json.loads(Path(path).read_text())
            return cls({int(layer): [int(c) for c in counts] for layer, counts in raw["layers"].items()})
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"{path}: not a routing-statistics file ({type(exc).__name__}: {exc})") from None

    def write(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps({"layers": {str(k): v for k, v in sorted(self.counts.items())}}))


NO_ROW_LIMIT = 1 << 62  # `RoutingRecorder.row_limit` outside graph steps: every row counts


class RoutingRecorder:
    """Counts the tokens routed to each expert of each MoE layer (attached to the routers by `attach`); `stats()`
    is what `ExpertPlacement.choose` reads back from a file."""

    def __init__(self, num_experts: int):
        self.num_experts = num_experts
        self.counts: dict[int, torch.Tensor] = {}
        # device [1]: rows at or past it are not counted (a CUDA graph step's padding rows, `hybrid.cuda_graphs`,
        # which route like any row); NO_ROW_LIMIT outside graph steps
        self.row_limit: torch.Tensor | None = None

    def limit_rows(self, device: torch.device | str) -> torch.Tensor:
        """The row limit on `device` (created once): a graph runner fills it before each replay and resets it."""
        if self.row_limit is None:
            self.row_limit = torch.full((1,), NO_ROW_LIMIT, dtype=torch.int64, device=device)
        return self.row_limit

    def attach(self, model) -> None:
        for layer_idx, layer in enumerate(model.model.layers):
            for module in layer.modules():
                if isinstance(module, Router):
                    module.recorder = (self, layer_idx)

    def add(self, layer_idx: int, topk_ids: torch.Tensor) -> None:
        """Counts stay on the ids' device with no host sync, so recording works inside a CUDA graph; ids of -1
        (padding, experts another module computes) land in an extra last slot that `stats` drops."""
        counts = self.counts.get(layer_idx)
        if counts is None:
            counts = self.counts[layer_idx] = torch.zeros(self.num_experts + 1, dtype=torch.int64,
                                                          device=topk_ids.device)
        ids = topk_ids.long()
        if self.row_limit is not None:
            rows = torch.arange(ids.shape[0], device=ids.device)[:, None]  # [T, 1]
            ids = torch.where(rows < self.row_limit, ids, -1)
        ids = ids.flatten()
        ids = torch.where(ids >= 0, ids, self.num_experts)
        counts.index_add_(0, ids, torch.ones_like(ids))

    def stats(self) -> RoutingStats:
        return RoutingStats({layer: c[:-1].tolist() for layer, c in self.counts.items()})


@dataclass(frozen=True)
class ExpertPlacement:
    gpu_experts: dict[int, tuple[int, ...]]  # MoE layer -> the global ids of its GPU-resident experts, sorted
    # MoE layer -> the rank whose GPU holds each of gpu_experts[layer], in its order; a layer absent: all on rank 0
    expert_ranks: dict[int, tuple[int, ...]] = field(default_factory=dict)

    def __post_init__(self):
        for layer, ranks in self.expert_ranks.items():
            if len(ranks) != len(self.gpu_experts.get(layer, ())):
                raise ValueError(f"ExpertPlacement.expert_ranks[{layer}] has {len(ranks)} ranks for "
                                 f"{len(self.gpu_experts.get(layer, ()))} GPU-resident experts")

    @classmethod
    def choose(cls, moe_layers: list[int], num_experts: int, num_gpu_experts: int,
               stats: RoutingStats | None = None, num_ranks: int = 1) -> ExpertPlacement:
        """`num_gpu_experts` per layer over all `num_ranks` GPUs together (module docstring)."""
        if not 0 <= num_gpu_experts <= num_experts:
            raise ValueError(f"gpu_experts must be in [0, {num_experts}] (experts per layer), got {num_gpu_experts}")
        if num_ranks < 1:
            raise ValueError(f"num_ranks must be at least 1, got {num_ranks}")
        chosen, ranks = {}, {}
        for layer in moe_layers:
            counts = (stats.counts.get(layer) if stats else None) or [0] * num_experts
            if len(counts) != num_experts:
                raise ValueError(f"routing statistics of layer {layer} have {len(counts)} experts, the model "
                                 f"{num_experts}")
            ranked = sorted(range(num_experts), key=lambda e: (-counts[e], e))  # most routed first, ties by id
            owner = {e: i % num_ranks for i, e in enumerate(ranked[:num_gpu_experts])}
            chosen[layer] = tuple(sorted(owner))
            if num_ranks > 1:
                ranks[layer] = tuple(owner[e] for e in chosen[layer])
        return cls(chosen, ranks)

    def on_rank(self, layer: int, rank: int = 0) -> tuple[int, ...]:
        """The global ids, sorted, of layer `layer`'s experts on rank `rank`'s GPU."""
        experts = self.gpu_experts.get(layer, ())
        ranks = self.expert_ranks.get(layer, (0,) * len(experts))
        return tuple(e for e, r in zip(experts, ranks, strict=True) if r == rank)


def auto_gpu_experts(config, budget_bytes: int | Sequence[int], used_bytes: int, reserve_bytes: int,
                     element_size: int) -> int:
    """`gpu_experts=auto`: how many routed experts per MoE layer fit in `budget_bytes` of device memory once
    `used_bytes` (dense weights, KV cache) and `reserve_bytes` (activations, graphs) are taken; in [0, E].
    Tensor parallel: `budget_bytes` lists every rank's GPU budget (used and reserve are each rank's own); the
    count, over all GPUs, is what `ExpertPlacement.choose` deals out, so every rank holds at most its fill of the
    GPU with the least room. Every rank must pass the same list (they must agree on the placement)."""
    budgets = list(budget_bytes) if isinstance(budget_bytes, Sequence) else [budget_bytes]
    per_expert = resident_expert_bytes(config, 1, element_size)  # one expert in every MoE layer
    if per_expert == 0 or not budgets:
        return 0
    per_rank = min(budget - used_bytes - reserve_bytes for budget in budgets) // per_expert
    return max(0, min(config.moe.num_experts, len(budgets) * per_rank))


def resident_expert_bytes(config, num_experts: int, element_size: int) -> int:
    """Device bytes of `num_experts` GPU-resident routed experts in every MoE layer (gate, up and down)."""
    return num_experts * sum(config.moe_layers) * 3 * config.hidden_size * config.moe.intermediate_size \
        * element_size


@dataclass(frozen=True)
class MemoryPlan:
    """A GPU's memory before any routed expert is placed on it (`LLM._memory_plan`): every rank's budget, this
    rank's dense weights, its KV cache and state pools for a step budget (`kv_bytes(step_tokens)`: windowed cache
    groups grow with the step), and the streamed prefill's ring."""

    budgets: list[int]
    dense_bytes: int
    kv_bytes: Callable[[int], int]
    streaming_bytes: int


def layerwise_step_tokens(budget_bytes: int | Sequence[int], step_bytes, min_tokens: int, max_tokens: int) -> int:
    """`layerwise_prefill_tokens=auto`: the largest step in [min_tokens, max_tokens] tokens whose device memory,
    `step_bytes(tokens)` (weights, KV cache and the step's activations: nondecreasing in tokens), fits every
    budget (tensor parallel: each rank's GPU); `min_tokens` (max_num_batched_tokens) where none does. A larger step
    reuses each streamed expert for more tokens: as large as the memory holds."""
    budget = min(budget_bytes) if isinstance(budget_bytes, Sequence) else budget_bytes
    if step_bytes(min_tokens) > budget:
        return min_tokens
    low, high = min_tokens, max_tokens  # step_bytes(low) fits; find the last that does
    while low < high:
        middle = (low + high + 1) // 2
        if step_bytes(middle) <= budget:
            low = middle
        else:
            high = middle - 1
    return low


def activation_bytes(config, max_tokens: int) -> int:
    """A generous bound on a step's transient device memory: a few [T, max(H, I, V-chunk)] buffers in float32
    plus the logits, plus 1 GiB for the CUDA context, graphs and kernels' workspaces."""
    width = max(config.hidden_size, config.moe.intermediate_size * config.moe.top_k, 4 * config.hidden_size)
    return 8 * max_tokens * width * 4 + 64 * config.vocab_size * 4 + (1 << 30)
