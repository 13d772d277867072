"""The dense operations of the layers, as one table of functions chosen once at start-up: plain PyTorch (the CPU
path and the reference; `gpu_layers.reference` and the functions in these layer files) or the Triton kernels of
`gpu_layers` (the GPU path). Layers hold the table they were built with and never ask where they run.

Each entry takes plain tensors:
- rms_norm(x [N, D], weight [D], eps) -> [N, D]
- rotary(positions [T], q [T, Hq, D], k [T, Hk, D], inv_freq [R / 2], attention_factor, is_interleaved) -> (q, k)
  (the Triton kernel rotates in place and returns the same tensors)
- silu_and_mul(gate_up [T, 2I]) -> [T, I]
- softmax_topk / grouped_topk: as `gpu_layers.reference` (weights float32 [T, K], ids [T, K])
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from gpu_layers import reference


@dataclass(frozen=True)
class DenseOps:
    name: str
    rms_norm: Callable
    rotary: Callable
    silu_and_mul: Callable
    softmax_topk: Callable
    grouped_topk: Callable

    @property
    def is_fused_gate_up(self) -> bool:
        """MLPs multiply gate and up as one [2I, H] weight (the kernels' layout) instead of two."""
        return self.name != "torch"


def torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """In float32 and cast back, then times the weight, as the reference checkpoints were trained."""
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def torch_rotary(positions, q, k, inv_freq, attention_factor, is_interleaved):
    freqs = positions[:, None].float() * inv_freq  # [T, rotary_dim / 2]
    cos, sin = freqs.cos() * attention_factor, freqs.sin() * attention_factor
    return apply_rotary(q, cos, sin, is_interleaved), apply_rotary(k, cos, sin, is_interleaved)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, is_interleaved: bool) -> torch.Tensor:
    """Rotates the leading cos.shape[-1] * 2 dims of x [T, heads, D]; cos/sin are [T, rotary_dim / 2].

    Interleaved input pairs come out as halves (evens then odds); q and k get the same permutation, so their
    dot products, and the attention, are unchanged.
    """
    rotary_dim = cos.shape[-1] * 2
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    cos, sin = cos.unsqueeze(-2).to(x.dtype), sin.unsqueeze(-2).to(x.dtype)  # [T, 1, rotary_dim / 2]
    if is_interleaved:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
    else:
        x1, x2 = rot[..., : rotary_dim // 2], rot[..., rotary_dim // 2 :]
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return torch.cat((out, rest), dim=-1) if rest.shape[-1] else out


def torch_silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


TORCH_OPS = DenseOps("torch", torch_rms_norm, torch_rotary, torch_silu_and_mul, reference.softmax_topk,
                     reference.grouped_topk)


def triton_ops() -> DenseOps:
    from gpu_layers import activation, norm, rotary, routing

    return DenseOps("triton", norm.rms_norm, rotary.rotary_embedding, activation.silu_and_mul,
                    routing.softmax_topk, routing.grouped_topk)


def dense_ops_for(device: torch.device | str, kernels: str = "auto") -> DenseOps:
    """`kernels`: "auto" (Triton on CUDA, PyTorch elsewhere), "triton" or "torch"."""
    if kernels == "torch" or (kernels == "auto" and torch.device(device).type != "cuda"):
        return TORCH_OPS
    return triton_ops()
