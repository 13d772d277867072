"""`CpuExperts`: the experts-backend module (see `hybrid.layers.backends`) that runs a layer's routed experts with
`CpuMoE`. Its weights are a `PackedLayer` read from an expert file, not parameters, so the loader hands it the
file's data (`load`) instead of copying tensors into it. Inputs on another device are computed on the CPU and the
result is returned to their device.

Bound to an executor (`bind`, once at start-up, one executor for all layers: layers run one after another), the
module is asynchronous: `submit` stages the layer's routed tokens and returns, so the caller overlaps its own work
(the shared expert, GPU-resident experts) with the CPU's, and `sync` returns the output.
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
        self.executor = None  # `cpu_experts.executor.AsyncExperts` once bound

    @property
    def is_async(self) -> bool:
        return self.executor is not None

    def bind(self, executor) -> None:
        self.executor = executor

    def load(self, packed: PackedLayer) -> None:
        self.op = CpuMoE(packed, self.prefill_min_tokens, self.int8_activations)

    def checkpoint_targets(self):
        return iter(())  # nothing is copied in: `load` receives the packed weights

    def forward(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        self._check_loaded()
        out = self.op(hidden.detach().cpu(), topk_ids.cpu(), topk_weights.cpu())
        return out.to(hidden.device)

    def compute(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                out: torch.Tensor) -> None:
        """The executor's work for this layer, on its staging buffers (CPU tensors)."""
        out.copy_(self.op(hidden, topk_ids, topk_weights))

    def submit(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> None:
        self._check_loaded()
        self.executor.submit(self.layer_idx, hidden.detach().to(self.executor.dtype), topk_ids.long(),
                             topk_weights.float())

    def sync(self, like: torch.Tensor) -> torch.Tensor:
        """The submitted layer's output [T, H], on `like`'s device and dtype (a copy: the buffer is reused)."""
        return self.executor.sync().to(device=like.device, dtype=like.dtype, copy=True)

    def _check_loaded(self) -> None:
        if self.op is None:
            raise RuntimeError(f"layer {self.layer_idx}: CPU experts used before their weights were loaded")
