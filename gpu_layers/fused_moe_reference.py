"""The plain-PyTorch side of `gpu_layers.fused_moe` (which re-exports all of it), importable without Triton: the
activation spec its gate_up kernel compiles in, its float32 reference, and the FP8 weight/activation rounding the
reference shares with the kernels."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

FP8_MAX = 448.0  # largest finite float8_e4m3fn
MIN_AMAX = 1e-10  # floor of an absmax, so an all-zero row gets a finite scale
FP8_BLOCK = 128  # the only block shape of FP8 checkpoints: (128, 128)


@dataclass(frozen=True)
class Activation:
    """The GLU between the two GEMMs, a compile-time choice of the gate_up kernel. "silu": silu(gate) * up.
    "swiglu_oai" (gpt-oss): (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g = min(gate, limit)."""

    kind: str = "silu"
    alpha: float = 1.0
    limit: float = 0.0

    def __post_init__(self):
        if self.kind not in ACTIVATIONS:
            raise ValueError(f"activation kind must be one of {', '.join(ACTIVATIONS)}, got {self.kind!r}")
        if self.kind == "swiglu_oai" and not self.limit > 0:
            raise ValueError(f"swiglu_oai's limit must be positive, got {self.limit}")

    def constexprs(self) -> dict:
        # silu ignores alpha and limit: fixed values keep it one compiled variant
        if self.kind == "silu":
            return dict(ACTIVATION=0, ALPHA=1.0, LIMIT=0.0)
        return dict(ACTIVATION=ACTIVATIONS.index(self.kind), ALPHA=float(self.alpha), LIMIT=float(self.limit))

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """The reference: the activation of float32 gate and up [N, I]."""
        if self.kind == "silu":
            return F.silu(gate) * up
        gate = gate.clamp(max=self.limit)
        return (up.clamp(-self.limit, self.limit) + 1) * gate * torch.sigmoid(self.alpha * gate)


ACTIVATIONS = ("silu", "swiglu_oai")  # index = the kernel's ACTIVATION constexpr
SILU = Activation()
SWIGLU_OAI = Activation("swiglu_oai", alpha=1.702, limit=7.0)  # gpt-oss's constants


def fp8_scale(amax: torch.Tensor) -> torch.Tensor:
    """absmax / 448, correctly rounded like the kernels' div_rn. (Dividing by the Python number 448 would let
    CUDA multiply by a rounded 1/448 instead: a scale one ulp off moves exact ties of the float8 rounding.)"""
    return amax.float().clamp_min(MIN_AMAX) / torch.tensor(FP8_MAX, device=amax.device)


def quantize_fp8_weights(w: torch.Tensor, block_shape: tuple[int, int] | None = None):
    """w [E, N, K] -> (float8_e4m3fn [E, N, K], float32 scale): [E, N, 1] per output channel, or
    [E, ceil(N/bn), ceil(K/bk)] per block (w ~= fp8 * scale, the layout fused_moe takes)."""
    num_experts, rows, cols = w.shape
    bn, bk = block_shape or (1, cols)
    padded = F.pad(w.float(), (0, -cols % bk, 0, -rows % bn))
    blocks = padded.view(num_experts, padded.shape[1] // bn, bn, padded.shape[2] // bk, bk)
    scale = fp8_scale(blocks.abs().amax(dim=(2, 4)))  # [E, N/bn, K/bk]
    quantized = (blocks / scale[:, :, None, :, None]).clamp(-FP8_MAX, FP8_MAX)
    quantized = quantized.view_as(padded)[:, :rows, :cols].to(torch.float8_e4m3fn).contiguous()
    return quantized, scale.contiguous()


def dequantize_fp8_weights(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float8 [E, N, K] * scale (per channel [E, N, 1] or per block [E, ceil(N/bn), ceil(K/bk)]) -> float32."""
    if scale.shape[2] == 1 and scale.shape[1] == w.shape[1]:
        return w.float() * scale
    rows, cols = w.shape[1], w.shape[2]
    full = scale.repeat_interleave(FP8_BLOCK, 1)[:, :rows].repeat_interleave(FP8_BLOCK, 2)[:, :, :cols]
    return w.float() * full


def fake_quantize_activations(x: torch.Tensor, group: int | None) -> torch.Tensor:
    """x [M, N] float32 rounded through float8 e4m3 as the kernels do: one scale per row (group None) or per row
    per `group` columns, scale = absmax / 448."""
    cols = x.shape[1]
    group = group or cols
    padded = F.pad(x, (0, -cols % group)).view(x.shape[0], -1, group)
    scale = fp8_scale(padded.abs().amax(dim=-1, keepdim=True))
    quantized = (padded * torch.reciprocal(scale)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return (quantized.float() * scale).view(x.shape[0], -1)[:, :cols]


def fused_moe_reference(
    hidden: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w_gate_up_scale: torch.Tensor | None = None,
    w_down_scale: torch.Tensor | None = None,
    block_shape: tuple[int, int] | None = None,
    activation: Activation = SILU,
    w_gate_up_bias: torch.Tensor | None = None,
    w_down_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain-PyTorch fused_moe in float32 on dequantized weights, rounding where the kernels round: FP8
    activations (per token, or per token per 128 columns with block scales), act and each pair's output in
    hidden's dtype. Raises IndexError on an id >= E."""
    is_fp8 = w_gate_up.dtype == torch.float8_e4m3fn
    if is_fp8:
        w_gate_up = dequantize_fp8_weights(w_gate_up, w_gate_up_scale)
        w_down = dequantize_fp8_weights(w_down, w_down_scale)
    group = block_shape[1] if block_shape else None
    quantize = (lambda x: fake_quantize_activations(x, group)) if is_fp8 else (lambda x: x)
    inter = w_down.shape[2]
    out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    for expert in torch.unique(topk_ids[topk_ids >= 0]).tolist():
        if expert >= w_gate_up.shape[0]:
            raise IndexError(f"expert id {expert} out of range for {w_gate_up.shape[0]} experts")
        token_idx, k_idx = torch.where(topk_ids == expert)
        gate_up = quantize(hidden[token_idx].float()) @ w_gate_up[expert].float().T
        if w_gate_up_bias is not None:
            gate_up += w_gate_up_bias[expert].float()
        act = activation(gate_up[:, :inter], gate_up[:, inter:]).to(hidden.dtype).float()
        y = quantize(act) @ w_down[expert].float().T
        if w_down_bias is not None:
            y += w_down_bias[expert].float()
        y = y * topk_weights[token_idx, k_idx, None]
        out.index_add_(0, token_idx, y.to(hidden.dtype).float())
    return out.to(hidden.dtype)
