"""`CpuExperts`: the experts-backend module (see `hybrid.layers.backends`) that runs a layer's routed experts with
`CpuMoE`. Its weights are a `PackedLayer` read from an expert file, not parameters, so the loader hands it the
file's data (`load`) instead of copying tensors into it. Inputs on another device are computed on the CPU and the
result is returned to their device.

`forward` computes inline; the engine reaches the module through its model's one CPU hand-off instead
(`hybrid.cpu_handoff`: the executor thread, or a CUDA graph's flags), which calls `compute` on staging buffers.
"""

from __future__ import annotations

import torch
from torch import nn

from cpu_experts.operator import CpuMoE
from cpu_experts.packed import PackedLayer


class CpuExperts(nn.Module):
    def __init__(self, layer_idx: int, prefill_min_tokens: int | None = None,
                 int8_activations: bool = True):
        super().__init__()
        self.layer_idx = layer_idx
        self.prefill_min_tokens = prefill_min_tokens
        self.int8_activations = int8_activations
        self.op: CpuMoE | None = None

    def load(self, packed: PackedLayer) -> None:
        self.op = CpuMoE(packed, self.prefill_min_tokens, self.int8_activations)

    def checkpoint_targets(self):
        return iter(())  # nothing is copied in: `load` receives the packed weights

    def forward(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        self.check_loaded()
        out = self.op(hidden.detach().cpu(), topk_ids.cpu(), topk_weights.cpu())
        return out.to(hidden.device)

    def compute(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                out: torch.Tensor) -> None:
        """The executor's work for this layer, on its staging buffers (CPU tensors)."""
        out.copy_(self.op(hidden, topk_ids, topk_weights))

    def check_loaded(self) -> None:
        if self.op is None:
            raise RuntimeError(f"layer {self.layer_idx}: CPU experts used before their weights were loaded")
