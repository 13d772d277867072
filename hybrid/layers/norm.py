"""RMSNorm, computed in float32 and cast back, as the reference checkpoints were trained (`ops.rms_norm`)."""

import torch
from torch import nn

from hybrid.layers.ops import TORCH_OPS, DenseOps


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, ops: DenseOps = TORCH_OPS):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., D] (e.g. per-head QK norm on [T, heads, D]) -> same shape."""
        rows = x.reshape(-1, x.shape[-1])  # [N, D]
        return self.ops.rms_norm(rows, self.weight, self.eps).view(x.shape)


class OffsetRMSNorm(RMSNorm):
    """RMSNorm scaling by (1 + w) in float32 before the cast back (Qwen3-Next, Qwen3.5: weights stored centred on
    0). Plain PyTorch whatever the ops: folding 1 + w into a stored weight is exact only in float32."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
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
