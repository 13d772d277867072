"""Plain-PyTorch reference of the routed-experts operator (the oracle for the packed CPU kernels)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def moe_reference(
    hidden: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
) -> torch.Tensor:
    """hidden [T, H]; w_gate, w_up [E, I, H]; w_down [E, H, I]; topk_ids [T, K] (-1 = skip); weights [T, K].

    Experts are visited in id order and accumulated with index_add, the order the reference checkpoints'
    own implementation uses, so float32 results match it closely.
    """
    out = torch.zeros_like(hidden)
    num_experts = w_gate.shape[0]
    hit = torch.unique(topk_ids[topk_ids >= 0]).tolist()
    for expert in hit:
        if expert >= num_experts:
            raise IndexError(f"expert id {expert} out of range for {num_experts} experts")
        token_idx, k_idx = torch.where(topk_ids == expert)
        x = hidden[token_idx]
        h = F.silu(F.linear(x, w_gate[expert])) * F.linear(x, w_up[expert])
        y = F.linear(h, w_down[expert]) * topk_weights[token_idx, k_idx, None]
        out.index_add_(0, token_idx, y.to(out.dtype))
    return out
