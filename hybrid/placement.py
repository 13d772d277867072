"""Which routed experts live on the GPU: placement data chosen once at start-up, and the module that splits a
layer's experts between the GPU and the CPU by it.

`ExpertPlacement.choose` keeps, per MoE layer, the `num_gpu_experts` experts routed to most often (counts from a
routing-statistics file, `RoutingStats`, JSON {"layers": {"3": [count per expert], ...}}), or the first ones when
there are no statistics (routing is then taken as uniform, where any choice is as good).

`HybridExperts` (one per MoE layer of a converted model): its own stacked parameters hold the GPU-resident
experts, named by their global ids so the loader fills them from the expert files (dequantized); `cpu_experts` is the
CPU operator for all experts, and sees the GPU-resident ones as -1. Per call: ids [T, K] -> local GPU slots (or
-1) and CPU ids (or -1); the CPU part is submitted first (when its executor is bound) and the GPU part computed
while it runs; the two outputs add up to the layer's output.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from cpu_experts.module import CpuExperts
from hybrid.layers.moe import Router, TorchExperts, TritonExperts


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


class RoutingRecorder:
    """Counts the tokens routed to each expert of each MoE layer (attached to the routers by `attach`); `stats()`
    is what `ExpertPlacement.choose` reads back from a file."""

    def __init__(self, num_experts: int):
        self.num_experts = num_experts
        self.counts: dict[int, torch.Tensor] = {}

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
        ids = topk_ids.long().flatten()
        ids = torch.where(ids >= 0, ids, self.num_experts)
        counts.index_add_(0, ids, torch.ones_like(ids))

    def stats(self) -> RoutingStats:
        return RoutingStats({layer: c[:-1].tolist() for layer, c in self.counts.items()})


@dataclass(frozen=True)
class ExpertPlacement:
    gpu_experts: dict[int, tuple[int, ...]]  # MoE layer -> the global ids of its GPU-resident experts, sorted

    @classmethod
    def choose(cls, moe_layers: list[int], num_experts: int, num_gpu_experts: int,
               stats: RoutingStats | None = None) -> ExpertPlacement:
        if not 0 <= num_gpu_experts <= num_experts:
            raise ValueError(f"gpu_experts must be in [0, {num_experts}] (experts per layer), got {num_gpu_experts}")
        chosen = {}
        for layer in moe_layers:
            counts = (stats.counts.get(layer) if stats else None) or [0] * num_experts
            if len(counts) != num_experts:
                raise ValueError(f"routing statistics of layer {layer} have {len(counts)} experts, the model "
                                 f"{num_experts}")
            ranked = sorted(range(num_experts), key=lambda e: (-counts[e], e))  # most routed first, ties by id
            chosen[layer] = tuple(sorted(ranked[:num_gpu_experts]))
        return cls(chosen)


def auto_gpu_experts(config, budget_bytes: int, used_bytes: int, reserve_bytes: int, element_size: int) -> int:
    """`gpu_experts=auto`: how many routed experts per MoE layer fit in `budget_bytes` of device memory once
    `used_bytes` (dense weights, KV cache) and `reserve_bytes` (activations, graphs) are taken; in [0, E]."""
    moe = config.moe
    num_moe_layers = sum(config.moe_layers)
    if num_moe_layers == 0:
        return 0
    expert_bytes = 3 * config.hidden_size * moe.intermediate_size * element_size  # gate, up, down
    free = budget_bytes - used_bytes - reserve_bytes
    return max(0, min(moe.num_experts, free // (expert_bytes * num_moe_layers)))


def activation_bytes(config, max_tokens: int) -> int:
    """A generous bound on a step's transient device memory: a few [T, max(H, I, V-chunk)] buffers in float32
    plus the logits, plus 1 GiB for the CUDA context, graphs and kernels' workspaces."""
    width = max(config.hidden_size, config.moe.intermediate_size * config.moe.top_k, 4 * config.hidden_size)
    return 8 * max_tokens * width * 4 + 64 * config.vocab_size * 4 + (1 << 30)


class HybridExperts(TritonExperts):
    """`is_fused`: the GPU-resident experts run through the fused-MoE kernel (gate and up stacked after loading,
    `TritonExperts`), else through the PyTorch reference."""

    def __init__(self, cpu: CpuExperts, gpu_expert_ids: tuple[int, ...], num_experts: int, hidden_size: int,
                 intermediate_size: int, proj_names: tuple[str, str, str], is_fused: bool = False):
        super().__init__(len(gpu_expert_ids), hidden_size, intermediate_size, proj_names)
        self.is_fused = is_fused
        self.cpu_experts = cpu
        self.gpu_expert_ids = gpu_expert_ids
        self.num_experts = num_experts
        self.register_buffer("local_slot", self._slots(), persistent=False)  # global id -> GPU slot, or -1
        self._gpu_out: torch.Tensor | None = None

    def _slots(self) -> torch.Tensor:
        slots = torch.full((self.num_experts,), -1, dtype=torch.int64, device="cpu")
        slots[list(self.gpu_expert_ids)] = torch.arange(len(self.gpu_expert_ids))
        return slots

    def reset_buffers(self) -> None:
        """Rebuilt after the model was built on the meta device (like the rotary frequencies)."""
        self.local_slot = self._slots().to(self.local_slot.device)

    def checkpoint_targets(self):
        """Slot s holds expert gpu_expert_ids[s]: named by its global id, as the expert files name it."""
        for name in self.proj_names:
            stacked = getattr(self, name)
            for slot, expert in enumerate(self.gpu_expert_ids):
                yield f"{expert}.{name}.weight", stacked.data[slot]

    def fuse_gate_up(self) -> None:
        if self.is_fused:
            super().fuse_gate_up()

    @property
    def is_async(self) -> bool:
        return self.cpu_experts.is_async

    def _split(self, topk_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """topk_ids [T, K] -> (GPU slots or -1, CPU ids or -1), both [T, K] int64."""
        ids = topk_ids.long()
        local = torch.where(ids >= 0, self.local_slot[ids.clamp_min(0)], -1)
        return local, torch.where(local >= 0, -1, ids)

    def forward(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        local, cpu_ids = self._split(topk_ids)
        return self.cpu_experts(hidden, cpu_ids, topk_weights) + super().forward(hidden, local, topk_weights)

    def submit(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> None:
        local, cpu_ids = self._split(topk_ids)
        self.cpu_experts.submit(hidden, cpu_ids, topk_weights)
        self._gpu_out = super().forward(hidden, local, topk_weights)  # while the CPU computes its part

    def sync(self, like: torch.Tensor) -> torch.Tensor:
        gpu_out, self._gpu_out = self._gpu_out, None
        return self.cpu_experts.sync(like) + gpu_out


def hybrid_experts_factory(layer_idx: int, config, placement: ExpertPlacement, int8_activations: bool = True,
                           is_fused: bool = False):
    """Experts factory for converted models with GPU-resident experts: `HybridExperts` where the placement puts
    some on the GPU, else the CPU operator alone."""
    cpu = CpuExperts(layer_idx, int8_activations=int8_activations)
    gpu_ids = placement.gpu_experts.get(layer_idx, ())
    if not gpu_ids:
        return cpu
    moe = config.moe
    if len(gpu_ids) == moe.num_experts:  # the whole layer fits: no CPU part to hand anything to
        cls = TritonExperts if is_fused else TorchExperts
        return cls(moe.num_experts, config.hidden_size, moe.intermediate_size, moe.expert_proj_names)
    return HybridExperts(cpu, gpu_ids, moe.num_experts, config.hidden_size, moe.intermediate_size,
                         moe.expert_proj_names, is_fused)
