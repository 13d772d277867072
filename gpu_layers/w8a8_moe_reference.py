"""The plain-PyTorch side of `gpu_layers.w8a8_moe`, importable without Triton: the per-row int8 rounding of the
CPU experts (`cpu_experts.kernels.quantize_row`) and a reference of the whole W8A8 MoE that forms every float
value the kernels form, in the same order.

Per expert matmul (K the input width, G groups of `group` columns, the last one possibly short):
  codes x_q int8 [n, K], row scales x_s [n]; weight codes w_q int8 [N, K] (int4 unpacked: -8..7), scales [N, G]
  acc [n, N] = sum over g, in order, of float32(x_q[:, g] . w_q[:, g] in int32) * (x_s * w_s[:, g])
"""

from __future__ import annotations

import torch

from gpu_layers.fused_moe_reference import SILU, Activation

INT8_MAX = 127.0


def quantize_rows_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (codes int8 [M, K], scales float32 [M]): the CPU's `quantize_row`, symmetric absmax / 127.
    inv = 127 / absmax (correctly rounded; 0 for an all-zero row), code = x * inv rounded half to even, scale =
    absmax / 127."""
    x = x.float()
    amax = x.abs().amax(dim=1)
    inv = torch.where(amax > 0, torch.tensor(INT8_MAX) / amax.clamp_min(1e-38), torch.zeros_like(amax))
    codes = torch.round(x * inv[:, None]).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return codes, amax / torch.tensor(INT8_MAX)


def unpack_int4(w: torch.Tensor, num_cols: int) -> torch.Tensor:
    """Packed uint8 [..., ceil(K / 2)] (even column in the low nibble, value = nibble - 8) -> int8 [..., K]."""
    codes = torch.stack((w & 0x0F, w >> 4), dim=-1).flatten(-2)[..., :num_cols]
    return codes.to(torch.int8) - 8


def grouped_dot(x_q: torch.Tensor, x_scale: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
                group: int) -> torch.Tensor:
    """x_q int8 [n, K] x w_q int8 [N, K] -> float32 [n, N]: exact int32 sums per group of `group` columns, each
    times (row scale x group scale), added in float32 in group order."""
    acc = torch.zeros(x_q.shape[0], w_q.shape[0])
    for g, k0 in enumerate(range(0, x_q.shape[1], group)):
        exact = x_q[:, k0:k0 + group].long() @ w_q[:, k0:k0 + group].long().T  # [n, N] int64, exact
        acc = acc + exact.to(torch.int32).float() * (x_scale[:, None] * w_scale[None, :, g].float())
    return acc


def w8a8_moe_reference(
    hidden: torch.Tensor,
    gate: tuple[torch.Tensor, torch.Tensor],
    up: tuple[torch.Tensor, torch.Tensor],
    down: tuple[torch.Tensor, torch.Tensor],
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    group_size: int = 0,
    activation: Activation = SILU,
    w_gate_up_bias: torch.Tensor | None = None,
    w_down_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """`w8a8_moe` in PyTorch (same arguments; CPU tensors): float32 [T, H]. gate, up: (codes [E, I, H] int8 or
    packed uint8 [E, I, H / 2], scales [E, I, G]); down: (codes [E, H, I] or packed, scales [E, H, Gi])."""
    hidden_size = hidden.shape[1]
    inter = down[0].shape[2] * (2 if down[0].dtype == torch.uint8 else 1)
    x_q, x_scale = quantize_rows_reference(hidden)

    def codes(w: torch.Tensor, num_cols: int) -> torch.Tensor:
        return unpack_int4(w, num_cols) if w.dtype == torch.uint8 else w

    y = torch.zeros(*topk_ids.shape, hidden_size)  # [T, K, H]: each pair's output, summed in slot order below
    num_experts = gate[0].shape[0]
    for expert in torch.unique(topk_ids[(topk_ids >= 0) & (topk_ids < num_experts)]).tolist():  # others: elsewhere
        tokens, slots = torch.where(topk_ids == expert)
        rows = (x_q[tokens], x_scale[tokens])
        g = grouped_dot(*rows, codes(gate[0][expert], hidden_size), gate[1][expert], group_size or hidden_size)
        u = grouped_dot(*rows, codes(up[0][expert], hidden_size), up[1][expert], group_size or hidden_size)
        if w_gate_up_bias is not None:
            g, u = g + w_gate_up_bias[expert, :inter], u + w_gate_up_bias[expert, inter:]
        a_q, a_scale = quantize_rows_reference(activation(g, u))
        out = grouped_dot(a_q, a_scale, codes(down[0][expert], inter), down[1][expert], group_size or inter)
        if w_down_bias is not None:
            out = out + w_down_bias[expert]
        y[tokens, slots] = out * topk_weights[tokens, slots, None]
    out = torch.zeros(hidden.shape[0], hidden_size)
    for k in range(topk_ids.shape[1]):
        out += y[:, k]
    return out
