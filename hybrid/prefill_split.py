"""Which of a streamed prefill step's CPU-resident experts the CPU computes instead (`hybrid.streaming`).

A streamed step copies an expert's weights over PCIe whatever its token count, while the CPU operator's time grows
with the tokens: an expert routed few tokens costs the CPU less than its copy. So per MoE layer, after routing, the
experts the step routes to (less the GPU-resident ones) split into a CPU set, computed by the CPU operator on the
executor's thread while the GPU works, and a streamed set, copied and computed on the GPU; the outputs add up.

`plan_cpu_experts` orders the routed experts by tokens (fewest first; ties by id) and gives the CPU the prefix that
makes both sides finish together: the k minimizing max(CPU seconds of the first k, streaming seconds of the rest),
costed from `PrefillRates` (the one place the rates live: the link's and the CPU operator's measured after loading,
`measure_link` and `measure_cpu`, the GPU's from settings). A fixed share (`EngineConfig.prefill_cpu_share`, tests
and benchmarks) gives the CPU that fraction of the routed experts, fewest tokens first: 0 streams them all (the ring
of `hybrid.streaming`, no host sync), 1 computes them all on the CPU.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace

import numpy as np
import torch

from cpu_experts.module import CpuExperts
from cpu_experts.packed import PackedLayer

# The H200 host: a Qwen3-30B-A3B layer (604 MB of int8 experts, 9.4 MFLOP a routed token) took the CPU operator
# 9, 15 and 18 ms for 128, 256 and 512 tokens (hybrid.streaming): about 6 ms to read the weights (~100 GB/s) plus
# the FLOPs at ~3.2 TFLOP/s (AMX, int8 activations); PCIe 5 from page-locked memory ~54 GB/s; the GPU's bf16 fused
# MoE a fraction of its peak at these sizes.
CPU_FLOPS = 3.2e12
CPU_READ_BYTES_PER_S = 100e9
LINK_BYTES_PER_S = 54e9
GPU_FLOPS = 200e12


@dataclass(frozen=True)
class PrefillRates:
    """Rates the split is costed from: FLOP/s and bytes/s (module docstring)."""

    cpu_flops: float = CPU_FLOPS
    cpu_read_bytes_per_s: float = CPU_READ_BYTES_PER_S
    link_bytes_per_s: float = LINK_BYTES_PER_S
    gpu_flops: float = GPU_FLOPS

    def __post_init__(self):
        for name in ("cpu_flops", "cpu_read_bytes_per_s", "link_bytes_per_s", "gpu_flops"):
            if not getattr(self, name) > 0:
                raise ValueError(f"PrefillRates.{name} must be > 0, got {getattr(self, name)}")

    def cpu_seconds(self, tokens: np.ndarray, flops_per_token: int, expert_bytes: int) -> np.ndarray:
        """Per expert: its tokens' FLOPs at the CPU's rate plus one read of its weights."""
        return tokens * flops_per_token / self.cpu_flops + expert_bytes / self.cpu_read_bytes_per_s

    def stream_seconds(self, tokens: np.ndarray, flops_per_token: int, expert_bytes: int) -> np.ndarray:
        """Per expert: its stored bytes over the link plus its tokens' FLOPs on the GPU."""
        return expert_bytes / self.link_bytes_per_s + tokens * flops_per_token / self.gpu_flops


def plan_cpu_experts(tokens: np.ndarray, flops_per_token: int, expert_bytes: int, rates: PrefillRates,
                     share: float | None = None) -> np.ndarray:
    """tokens [E] (the step's tokens per expert, 0: not routed or not this module's) -> the ids the CPU computes,
    sorted; the other routed ones are streamed. `share` None: balanced on `rates`; else that fraction of the routed
    experts (rounded half to even), fewest tokens first."""
    tokens = np.asarray(tokens, dtype=np.int64)
    routed = np.flatnonzero(tokens > 0)
    order = routed[np.lexsort((routed, tokens[routed]))]  # fewest tokens first, ties by id
    if share is not None:
        return np.sort(order[:round(share * len(order))])
    counts = tokens[order]
    cpu = np.concatenate([[0.0], np.cumsum(rates.cpu_seconds(counts, flops_per_token, expert_bytes))])
    streamed = rates.stream_seconds(counts, flops_per_token, expert_bytes)
    rest = np.concatenate([np.cumsum(streamed[::-1])[::-1], [0.0]])  # rest[k]: the experts after the first k
    num_cpu = int(np.argmin(np.maximum(cpu, rest)))  # the first minimum: fewer on the CPU when tied
    return np.sort(order[:num_cpu])


def flops_per_pair(layer: PackedLayer) -> int:
    """FLOPs of one token through one expert of `layer` (gate, up and down over every partition of I)."""
    return 2 * 3 * layer.spec.hidden_size * sum(p.size for p in layer.partitions)


def measure_link(device: torch.device | str, nbytes: int = 64 << 20) -> float:
    """Host-to-device bytes/s from page-locked memory (the faster of 3 copies, after a first): a few ms at start-up."""
    host = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    target = torch.empty(nbytes, dtype=torch.uint8, device=device)
    best = float("inf")
    for _ in range(4):
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        target.copy_(host, non_blocking=True)
        torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return nbytes / best


def measure_cpu(cpu: CpuExperts, top_k: int, rates: PrefillRates) -> PrefillRates:
    """`rates` with the CPU's FLOP/s and weight-read rate fitted from two calls of a loaded layer's operator (after
    one that compiles its kernels): every expert routed 4, then 32 tokens a token-expert pair each (T x K pairs,
    K consecutive experts a token), t = pairs x FLOPs / cpu_flops + layer bytes / cpu_read_bytes_per_s. Tens of
    milliseconds for a Qwen3-30B-A3B layer; a fit that is not positive (noise on a tiny layer) keeps `rates`."""
    layer = cpu.op.layer
    num_experts, hidden_size = layer.spec.num_experts, layer.spec.hidden_size
    flops = flops_per_pair(layer)

    def seconds(tokens_per_expert: int) -> tuple[int, float]:
        num_tokens = max(1, tokens_per_expert * num_experts // top_k)
        ids = (torch.arange(num_tokens * top_k) % num_experts).view(num_tokens, top_k)  # [T, K], distinct a row
        hidden = torch.randn(num_tokens, hidden_size, generator=torch.Generator().manual_seed(0))
        weights = torch.full((num_tokens, top_k), 1 / top_k)
        start = time.perf_counter()
        cpu(hidden, ids, weights)
        return num_tokens * top_k, time.perf_counter() - start

    seconds(4)  # compiles
    (few, few_s), (many, many_s) = seconds(4), seconds(32)
    if not many_s > few_s:
        return rates
    fitted = (many - few) * flops / (many_s - few_s)
    read_s = few_s - few * flops / fitted
    if not (math.isfinite(fitted) and read_s > 0):
        return rates
    return replace(rates, cpu_flops=fitted, cpu_read_bytes_per_s=layer.nbytes / read_s)
