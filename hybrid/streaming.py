"""Large prefill steps of CPU-resident experts computed on the GPU, their weights streamed over PCIe.

A prefill step of a few thousand tokens routes to nearly every expert of a layer, and the CPU computes it at a few
TFLOP/s; the GPU computes it a hundred times faster if it has the weights. Copying a layer's int8 experts from
page-locked memory takes a few milliseconds per hundred MB (PCIe), which beats the CPU from a few hundred tokens
on: the same trade llama.cpp makes when it offloads large batches.

`StreamedExperts` wraps a layer's `CpuExperts`: steps of at least `min_tokens` tokens copy the layer's weights to
the GPU a chunk of experts at a time, dequantize them there (int8 with per-row or grouped scales, or bf16) and run
one set of GEMMs per expert over the tokens routed to it (one host sync per layer for their counts; a
prefill step syncs anyway); partitions along I add up as on the CPU. Smaller steps
(decode) go to the CPU module unchanged, overlapped as before. The activations stay in the model's dtype (the CPU
path's int8 activation rounding does not apply). int4 experts stay on the CPU.

Data flow per chunk: host int8 [c, N, K] + float32 scales [c, N, G] -> device (non-blocking when pinned) ->
bf16 [c, N, K] -> per expert e: silu(x_e @ gate_e.T) * (x_e @ up_e.T) @ down_e.T, weighted and added into
out [T, H] (float32) at its tokens' rows.
"""

from __future__ import annotations

import itertools

import numpy as np
import torch
from torch import nn

from cpu_experts.module import CpuExperts

STREAMED_DTYPES = ("int8", "bf16")
# Device memory for one chunk's dequantized weights (float32 while scaling, then bf16).
CHUNK_BYTES = 1 << 30


def pin(array: np.ndarray) -> bool:
    """Page-locks a numpy array in place (cudaHostRegister) so copies from it are asynchronous DMA."""
    if array.nbytes == 0:
        return False
    error = torch.cuda.cudart().cudaHostRegister(array.ctypes.data, array.nbytes, 0)
    return int(error) == 0


class StreamedExperts(nn.Module):
    def __init__(self, cpu: CpuExperts, min_tokens: int, device: torch.device | str):
        super().__init__()
        self.cpu_experts = cpu
        self.min_tokens = min_tokens
        self.device = torch.device(device)
        self._out: torch.Tensor | None = None
        self._pinned: list[np.ndarray] = []

    @property
    def is_async(self) -> bool:
        return self.cpu_experts.is_async

    @property
    def is_streamable(self) -> bool:
        return self.cpu_experts.op is not None and self.cpu_experts.op.layer.spec.dtype in STREAMED_DTYPES

    def checkpoint_targets(self):
        return iter(())  # the CpuExperts inside receives the packed weights

    def pin_weights(self) -> int:
        """Page-locks the layer's packed arrays; returns the bytes pinned (0 where the driver refused)."""
        if not self.is_streamable:
            return 0
        self._pinned = [a for p in self.cpu_experts.op.layer.partitions for a in p.arrays() if pin(a)]
        return sum(a.nbytes for a in self._pinned)

    def unpin_weights(self) -> None:
        """Undoes `pin_weights` (before the arrays are freed, so the driver holds no stale registration)."""
        for array in self._pinned:
            torch.cuda.cudart().cudaHostUnregister(array.ctypes.data)
        self._pinned = []

    def _uses_gpu(self, hidden: torch.Tensor) -> bool:
        return hidden.is_cuda and hidden.shape[0] >= self.min_tokens and self.is_streamable

    def forward(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        if self._uses_gpu(hidden):
            return self.compute_on_gpu(hidden, topk_ids, topk_weights)
        return self.cpu_experts(hidden, topk_ids, topk_weights)

    def submit(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> None:
        if self._uses_gpu(hidden):
            self._out = self.compute_on_gpu(hidden, topk_ids, topk_weights)
        else:
            self.cpu_experts.submit(hidden, topk_ids, topk_weights)

    def sync(self, like: torch.Tensor) -> torch.Tensor:
        out, self._out = self._out, None
        return self.cpu_experts.sync(like) if out is None else out

    def compute_on_gpu(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor):
        """hidden [T, H] (bf16/fp16, CUDA), topk_ids [T, K] (-1: not here) -> [T, H]. One host sync (the
        per-expert token counts), then per expert three cuBLAS GEMMs over its tokens."""
        layer = self.cpu_experts.op.layer
        spec = layer.spec
        top_k = topk_ids.shape[1]
        flat = topk_ids.reshape(-1).long()  # [T*K] pair p = token p // K, slot p % K
        order = flat.argsort()  # pairs grouped by expert, the -1 pairs first
        counts = torch.bincount(flat + 1, minlength=spec.num_experts + 1).tolist()  # [E + 1], -1 first
        starts = list(itertools.accumulate(counts))  # starts[e]: expert e's first pair in `order`
        tokens = order // top_k
        pair_weights = topk_weights.reshape(-1).float()[order]
        out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
        for part in layer.partitions:
            per_expert = 4 * 3 * part.size * spec.hidden_size  # float32 while scaling
            chunk = max(1, min(spec.num_experts, CHUNK_BYTES // per_expert))
            for first in range(0, spec.num_experts, chunk):
                last = min(spec.num_experts, first + chunk)
                if sum(counts[first + 1:last + 1]) == 0:
                    continue  # no token routed to these experts: skip their copy
                gate, up, down = (self._weights(w, s, first, last) for w, s in (
                    (part.gate, part.gate_scales), (part.up, part.up_scales), (part.down, part.down_scales)))
                for e in range(first, last):
                    begin, end = starts[e], starts[e] + counts[e + 1]
                    if begin == end:
                        continue
                    rows = tokens[begin:end]
                    x = hidden[rows]  # [n, H]
                    act = torch.nn.functional.silu(x @ gate[e - first].T) * (x @ up[e - first].T)  # [n, Ip]
                    out.index_add_(0, rows, (act @ down[e - first].T).float() * pair_weights[begin:end, None])
        return out.to(hidden.dtype)

    def _weights(self, array: np.ndarray, scales: np.ndarray | None, first: int, last: int) -> torch.Tensor:
        """Experts [first, last) of one projection on the device in bf16: [c, N, K]."""
        host = torch.from_numpy(array[first:last])
        if host.dtype == torch.uint16:  # bf16 stored as its bits
            return host.view(torch.bfloat16).to(self.device, non_blocking=True)
        w = host.to(self.device, non_blocking=True).float()
        s = torch.from_numpy(scales[first:last]).to(self.device, non_blocking=True)  # [c, N, G]
        c, n, k = w.shape
        w = w.view(c, n, s.shape[2], -1) * s[..., None]  # [c, N, G, group]: one scale per group of K
        return w.view(c, n, k).to(torch.bfloat16)


def wrap_streamed(model: nn.Module, min_tokens: int, device: torch.device | str) -> list[StreamedExperts]:
    """Puts a `StreamedExperts` around every MoE layer's CPU experts (inside `HybridExperts` too)."""
    wrapped = []
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, CpuExperts):
                streamed = StreamedExperts(child, min_tokens, device)
                setattr(module, name, streamed)
                wrapped.append(streamed)
    return wrapped
