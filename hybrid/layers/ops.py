"""The dense operations of the layers, as one table of functions chosen once at start-up: plain PyTorch (the CPU
path: the kernels' references in `gpu_layers.reference`) or the Triton kernels of `gpu_layers` (the GPU path).
Layers hold the table they were built with and never ask where they run.

Each entry takes plain tensors:
- rms_norm(x [N, D], weight [D], eps) -> [N, D]
- rotary(positions [T], q [T, Hq, D], k [T, Hk, D], inv_freq [R / 2], attention_factor, is_interleaved) -> (q, k)
  (both rotate in place and return the same tensors)
- silu_and_mul(gate_up [T, 2I]) -> [T, I]
- softmax_topk / grouped_topk: as `gpu_layers.reference` (weights float32 [T, K], ids [T, K])
- router_topk: the router's GEMV and its top-k in one launch for decode-sized steps (`gpu_layers.routing`), or None
  (the PyTorch ops: the GEMV, then the top-k)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from gpu_layers import reference


@dataclass(frozen=True)
class DenseOps:
    name: str
    rms_norm: Callable
    rotary: Callable
    silu_and_mul: Callable
    softmax_topk: Callable
    grouped_topk: Callable
    router_topk: Callable | None = None

    @property
    def is_fused_gate_up(self) -> bool:
        """MLPs multiply gate and up as one [2I, H] weight (the kernels' layout) instead of two."""
        return self.name != "torch"


TORCH_OPS = DenseOps("torch", reference.rms_norm, reference.rotary, reference.silu_and_mul, reference.softmax_topk,
                     reference.grouped_topk)


def triton_ops() -> DenseOps:
    from gpu_layers import activation, norm, rotary, routing

    return DenseOps("triton", norm.rms_norm, rotary.rotary_embedding, activation.silu_and_mul,
                    routing.softmax_topk, routing.grouped_topk, routing.router_topk)


def dense_ops_for(device: torch.device | str, kernels: str = "auto") -> DenseOps:
    """`kernels`: "auto" (Triton on CUDA, PyTorch elsewhere), "triton" or "torch"."""
    if kernels == "torch" or (kernels == "auto" and torch.device(device).type != "cuda"):
        return TORCH_OPS
    return triton_ops()
