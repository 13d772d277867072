"""Plain-PyTorch reference of the routed-experts operator (the oracle for the packed CPU kernels)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cpu_experts.expert_file import SILU, ExpertActivation


def expert_activation(gate: torch.Tensor, up: torch.Tensor, activation: ExpertActivation = SILU) -> torch.Tensor:
    """The activation between an expert's gate/up (biases added) and down projections (`ExpertActivation`)."""
    if activation.is_silu:
        return F.silu(gate) * up
    g = gate.clamp(max=activation.limit)
    u = up.clamp(min=-activation.limit, max=activation.limit)
    return (u + 1) * (g * torch.sigmoid(g * activation.alpha))


def moe_reference(
    hidden: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    int8_activations: bool = False,
    partitions: list[tuple[int, int]] | None = None,
    bf16_activations: bool = False,
    activation: ExpertActivation = SILU,
    biases: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """hidden [T, H]; w_gate, w_up [E, I, H]; w_down [E, H, I]; topk_ids [T, K] (-1 = skip); weights [T, K].

    Experts are visited in id order and accumulated with index_add, the order the reference checkpoints'
    own implementation uses, so float32 results match it closely. `int8_activations`: each matmul's input rows
    are rounded to int8 with a per-row absmax scale first, as the W8A8 prefill path does; with `partitions`
    (slices [start, end) of I), the down projection's input has one scale per row per slice. `bf16_activations`:
    each matmul's input is rounded to bfloat16 instead (the float formats' contract: FP8, MXFP4, NVFP4).
    `activation` and `biases` (gate, up [E, I], down [E, H]): the layer's (`ExpertLayerSpec`); the down bias is part
    of each expert's output, weighted like its matmul.
    """
    def fake_quant(t: torch.Tensor, slices=((0, None),)) -> torch.Tensor:
        if bf16_activations:
            return t.to(torch.bfloat16).to(t.dtype)
        if not int8_activations:
            return t
        return torch.cat([_fake_quant_rows(t[:, lo:hi]) for lo, hi in slices], dim=1)

    out = torch.zeros_like(hidden)
    num_experts = w_gate.shape[0]
    hit = torch.unique(topk_ids[topk_ids >= 0]).tolist()
    for expert in hit:
        if expert >= num_experts:
            raise IndexError(f"expert id {expert} out of range for {num_experts} experts")
        token_idx, k_idx = torch.where(topk_ids == expert)
        x = fake_quant(hidden[token_idx])
        gate_bias, up_bias, down_bias = (b[expert] for b in biases) if biases is not None else (None, None, None)
        h = expert_activation(F.linear(x, w_gate[expert], gate_bias), F.linear(x, w_up[expert], up_bias), activation)
        h = fake_quant(h, partitions or ((0, None),))
        y = F.linear(h, w_down[expert], down_bias) * topk_weights[token_idx, k_idx, None]
        out.index_add_(0, token_idx, y.to(out.dtype))
    return out


def _fake_quant_rows(x: torch.Tensor) -> torch.Tensor:
    scale = x.abs().amax(dim=-1, keepdim=True) / 127
    return torch.round(x / torch.where(scale > 0, scale, torch.ones_like(scale))) * scale
