"""Rotary position embedding: NeoX halves or DeepSeek interleaved pairs, partial rotary, linear and YaRN scaling.

cos/sin are computed from the step's positions (no table to outgrow) by `ops.rotary`; the multiply-add order
matches the reference implementation so float32 results agree to the last bits.
"""

import math

import torch
from torch import nn

from hybrid.config import RopeConfig, yarn_mscale
from hybrid.layers.ops import TORCH_OPS, DenseOps


def rope_inv_freq(rope: RopeConfig) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [rotary_dim / 2] and the factor that scales cos/sin (YaRN's attention factor)."""
    dim = rope.rotary_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    pos_freqs = rope.theta**exponents
    if rope.scaling_type == "default":
        return 1.0 / pos_freqs, 1.0
    if rope.scaling_type == "linear":
        return 1.0 / pos_freqs / rope.factor, 1.0
    return _yarn_inv_freq(rope, pos_freqs)


def _yarn_inv_freq(rope: RopeConfig, pos_freqs: torch.Tensor) -> tuple[torch.Tensor, float]:
    dim, base, factor = rope.rotary_dim, rope.theta, rope.factor
    attention_factor = rope.attention_factor
    if attention_factor is None:
        if rope.mscale and rope.mscale_all_dim:
            attention_factor = yarn_mscale(factor, rope.mscale) / yarn_mscale(factor, rope.mscale_all_dim)
        else:
            attention_factor = yarn_mscale(factor)

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(rope.original_max_position / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation_weight = 1 - ramp
    inv_freq_extrapolation = 1.0 / pos_freqs
    inv_freq_interpolation = 1.0 / (factor * pos_freqs)
    inv_freq = inv_freq_interpolation * (1 - extrapolation_weight) + inv_freq_extrapolation * extrapolation_weight
    return inv_freq, float(attention_factor)


class RotaryEmbedding(nn.Module):
    def __init__(self, rope: RopeConfig, ops: DenseOps = TORCH_OPS):
        super().__init__()
        self.rope = rope
        self.ops = ops
        self.is_interleaved = rope.is_interleaved
        inv_freq, self.attention_factor = rope_inv_freq(rope)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def reset_buffers(self) -> None:
        """Recomputes the frequencies after the model was built on the meta device."""
        self.inv_freq = rope_inv_freq(self.rope)[0].to(self.inv_freq.device)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, Hq, D], k [T, Hk, D] -> rotated (see `gpu_layers.reference.rotary` for the interleaved convention)."""
        return self.ops.rotary(positions, q, k, self.inv_freq, self.attention_factor, self.is_interleaved)
