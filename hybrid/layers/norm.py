"""RMSNorm, computed in float32 and cast back, as the reference checkpoints were trained (`ops.rms_norm`).

Given the residual stream, a norm adds it first (the decoder layers' add-then-norm): x + residual rounded to x's
dtype, then normed, in one kernel with the Triton ops (`gpu_layers.norm.rms_norm` with a residual), bit for bit
the separate add and norm."""

import torch
from torch import nn

from hybrid.layers.ops import TORCH_OPS, DenseOps


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, ops: DenseOps = TORCH_OPS):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.ops = ops

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """x [..., D] (e.g. per-head QK norm on [T, heads, D]) -> same shape. With residual [T, D] (x [T, D] too):
        (norm(x + residual), x + residual); the sum is written into `residual` (in place: its owner is the layer
        stack, which passes it on)."""
        rows = x.reshape(-1, x.shape[-1])  # [N, D]
        if residual is None:
            return self.ops.rms_norm(rows, self.weight, self.eps).view(x.shape)
        return self.ops.rms_norm(rows, self.weight, self.eps, residual), residual


class OffsetRMSNorm(RMSNorm):
    """RMSNorm scaling by (1 + w) in float32 before the cast back (Qwen3-Next, Qwen3.5: weights stored centred on
    0). Plain PyTorch whatever the ops: folding 1 + w into a stored weight is exact only in float32."""

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is not None:
            residual = x + residual
            return self.forward(residual), residual
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.float())).to(x.dtype)


class GatedRMSNorm(RMSNorm):
    """The Gated DeltaNet's output norm: w * norm(x) (cast back first), times silu(gate) in float32."""

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """x, gate [N, D] -> [N, D] in x's dtype."""
        xf = x.float()
        normed = self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        return (normed * torch.nn.functional.silu(gate.float())).to(x.dtype)
