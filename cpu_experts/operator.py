"""`CpuMoE`: the routed experts of one MoE layer on the CPU.

forward(hidden [T, H], topk_ids [T, K], topk_weights [T, K]) -> [T, H] = sum_k w[t, k] * expert_{id[t, k]}(h[t]),
expert(x) = down(silu(gate x) * up x); an id of -1 is skipped (the expert runs elsewhere, e.g. on the GPU).

Per call, the (token, slot) pairs are grouped by expert (`route`), then each partition of I computes its partial
output and the partials are summed. Two paths, chosen per call by token count:
- decode (few tokens): the numba kernels stream each routed expert's quantized rows once, dequantizing in
  registers (`cpu_experts.kernels`);
- prefill (many tokens, `prefill_min_tokens` or more, and bf16 experts at any count): per expert, its weights are
  dequantized to the activations' dtype and multiplied with PyTorch's matmul, i.e. oneDNN, which uses AMX-BF16
  or AVX-512 where the CPU has them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from cpu_experts import formats
from cpu_experts.kernels import KERNELS
from cpu_experts.packed import PackedLayer, PartitionWeights

DEFAULT_PREFILL_MIN_TOKENS = 64


@dataclass(frozen=True)
class Routing:
    """The call's (token, slot) pairs grouped by expert; `offsets[u]:offsets[u + 1]` are expert `experts[u]`'s."""
    experts: np.ndarray  # [U] int64
    offsets: np.ndarray  # [U + 1] int64
    pair_token: np.ndarray  # [P] int64
    pair_weight: np.ndarray  # [P] float32


def route(topk_ids: np.ndarray, topk_weights: np.ndarray, num_experts: int) -> Routing:
    flat = topk_ids.reshape(-1)
    if flat.size and (flat.max() >= num_experts or flat.min() < -1):
        bad = flat[(flat >= num_experts) | (flat < -1)][0]
        raise ValueError(f"topk_ids holds expert {bad}, outside [-1, {num_experts})")
    pairs = np.flatnonzero(flat >= 0)
    pairs = pairs[np.argsort(flat[pairs], kind="stable")]
    experts, counts = np.unique(flat[pairs], return_counts=True)
    offsets = np.zeros(len(experts) + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    k = topk_ids.shape[1]
    return Routing(experts.astype(np.int64), offsets, (pairs // k).astype(np.int64),
                   topk_weights.reshape(-1)[pairs].astype(np.float32))


class CpuMoE:
    def __init__(self, layer: PackedLayer, prefill_min_tokens: int = DEFAULT_PREFILL_MIN_TOKENS):
        self.layer = layer
        self.spec = layer.spec
        self.prefill_min_tokens = prefill_min_tokens

    def __call__(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        self._check(hidden, topk_ids, topk_weights)
        routing = route(topk_ids.cpu().numpy(), topk_weights.detach().float().cpu().numpy(), self.spec.num_experts)
        if self.spec.dtype == "bf16" or hidden.shape[0] >= self.prefill_min_tokens:
            return self._prefill(hidden, routing)
        x = hidden.detach().float().contiguous().numpy()
        out = np.zeros_like(x)
        gate_up, down = KERNELS[self.spec.dtype]
        for part in self.layer.partitions:
            act = np.empty((len(routing.pair_token), part.size), dtype=np.float32)
            gate_up(x, routing.experts, routing.offsets, routing.pair_token, part.gate, part.gate_scales, part.up,
                    part.up_scales, self.spec.group(self.spec.hidden_size), act)
            down(act, routing.experts, routing.offsets, routing.pair_token, routing.pair_weight, part.down,
                 part.down_scales, self.spec.group_size or part.size, out)
        return torch.from_numpy(out).to(hidden.dtype)

    def _check(self, hidden, topk_ids, topk_weights) -> None:
        if hidden.dim() != 2 or hidden.shape[1] != self.spec.hidden_size:
            raise ValueError(f"hidden must be [T, {self.spec.hidden_size}], got {tuple(hidden.shape)}")
        if topk_ids.dim() != 2 or topk_ids.shape[0] != hidden.shape[0] or topk_ids.shape != topk_weights.shape:
            raise ValueError(f"topk_ids {tuple(topk_ids.shape)} and topk_weights {tuple(topk_weights.shape)} must "
                             f"both be [T={hidden.shape[0]}, K]")
        if topk_ids.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"topk_ids must be int32 or int64, got {topk_ids.dtype}")

    def _prefill(self, hidden: torch.Tensor, routing: Routing) -> torch.Tensor:
        dtype = hidden.dtype if hidden.dtype in (torch.bfloat16, torch.float32) else torch.float32
        x = hidden.detach().to(dtype)
        out = torch.zeros(hidden.shape, dtype=torch.float32)
        tokens = torch.from_numpy(routing.pair_token)
        weights = torch.from_numpy(routing.pair_weight)
        for u, expert in enumerate(routing.experts.tolist()):
            lo, hi = int(routing.offsets[u]), int(routing.offsets[u + 1])
            xs = x[tokens[lo:hi]]  # [n, H]
            partial = sum(self._expert(part, expert, xs, dtype) for part in self.layer.partitions)
            out.index_add_(0, tokens[lo:hi], partial.float() * weights[lo:hi, None])
        return out.to(hidden.dtype)

    def _expert(self, part: PartitionWeights, expert: int, xs: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        gate = self._dequantize(part.gate[expert], part.gate_scales, expert, dtype, self.spec.hidden_size)
        up = self._dequantize(part.up[expert], part.up_scales, expert, dtype, self.spec.hidden_size)
        down = self._dequantize(part.down[expert], part.down_scales, expert, dtype, part.size)
        return F.silu(xs @ gate.t()) * (xs @ up.t()) @ down.t()

    def _dequantize(self, weight: np.ndarray, scales, expert: int, dtype: torch.dtype, cols: int) -> torch.Tensor:
        """One partition's slice of one expert projection -> [N, cols] in `dtype`."""
        w = torch.from_numpy(weight)
        if self.spec.dtype == "bf16":
            return w.view(torch.bfloat16).to(dtype)
        s = torch.from_numpy(scales[expert])  # [N, G]
        group = self.spec.group_size or cols
        if self.spec.dtype == "int4":
            return formats.dequantize_int4(w, s, group, cols).to(dtype)  # one rounding, of the float32 product
        return formats.dequantize_int8(w, s, group).to(dtype)
