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
