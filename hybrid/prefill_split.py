"""Which of a streamed prefill step's CPU-resident experts the CPU computes instead (`hybrid.streaming`).

A streamed step copies an expert's weights over PCIe whatever its token count, while the CPU operator's time grows
with the tokens: an expert routed few tokens may cost the CPU less than its copy. So per MoE layer, after routing,
the experts the step routes to (less the GPU-resident ones) split into a CPU set, computed by the CPU operator on
the executor's thread while the GPU works, and a streamed set, copied and computed on the GPU; the outputs add up.

The step model (`PrefillRates.step_seconds`), per layer, for the k experts with the fewest tokens on the CPU:
- the CPU: `cpu_token_seconds` for every token of the step (the operator converts and quantizes all T rows and
  writes all T outputs, whatever its share of the pairs) plus, per expert, the seconds measured for its token count
  (`cpu_expert_seconds`: the operator's time per expert at a few tokens per expert, interpolated; AMX pads an
  expert's tokens to tiles of 16 and reads its weights once, so the time is far from proportional to the tokens);
- the streamed side: each expert's stored bytes over the link plus its tokens' FLOPs on the GPU;
- a split layer takes the longer side plus `overlap_loss` of the shorter (on the H200 host the two sides hid only
  about a third of the shorter one, docs/benchmarks.md) plus `split_seconds` (the routing's host sync; the copy
  starts only once the routing is known, so the ring's prefetch under the layer's GPU work is lost).
A step with nothing on the CPU runs as `prefill_cpu_share` 0: the ring, no host sync, the link's time alone.

"auto" takes the k of the least predicted time, and only if that beats the all-streamed step by `min_gain` (else
0): a split must win on the model by a margin, and the model credits a split with less overlap than the device's
split steps got, so a split is chosen only where it wins with room to spare. `StreamedPrefill` first asks the
model about the step's expected counts (T x K / E tokens each, `may_split`) and takes share 0's ring, without any
host sync, when no split wins.
A fixed share (`EngineConfig.prefill_cpu_share`, tests and benchmarks) gives the CPU that fraction of the routed
experts, fewest tokens first: 0 streams them all (the ring of `hybrid.streaming`, no host sync), 1 computes them
all on the CPU. The rates: the link's and the CPU operator's measured after loading (`measure_link`,
`measure_cpu`), the rest from settings.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, replace

import numpy as np
import torch

from cpu_experts.module import CpuExperts
from cpu_experts.packed import PackedLayer

# Until measured: the H200 host's CPU operator on a Qwen3-30B-A3B layer (604 MB of int8 experts, 128 of 4.7 MB),
# every expert routed 8, 16, 32, 64 and 128 tokens (128 to 2048 tokens a step: 9, 14.6, 17.6, 28.4 and 48.2 ms a
# layer, docs/benchmarks.md), per expert; PCIe 5 from page-locked memory ~54 GB/s; the GPU's bf16 fused MoE a
# fraction of its peak at these sizes.
CPU_EXPERT_SECONDS = ((8, 70e-6), (16, 114e-6), (32, 137e-6), (64, 222e-6), (128, 376e-6))
LINK_BYTES_PER_S = 54e9
GPU_FLOPS = 200e12
# Fitted to the H200 host's split steps (512 tokens, 27% and 50% of the experts on the CPU: 11.35 and 10.48 ms a
# layer, the CPU side 3.68 and 6.12 ms, the streamed one ~8.2 and ~5.6 ms): the longer side plus 0.63 of the
# shorter plus 0.8 ms; 2048 tokens with 37% on the CPU (25.9 ms a layer: 18.5 + 7.1 streamed) fits as well.
# Rounded up: a split is credited with less overlap than it got.
OVERLAP_LOSS = 0.7
SPLIT_SECONDS = 1e-3
MIN_GAIN = 0.05
# `measure_cpu`: tokens per expert of its calls. A streamed step gives each expert 16 or more on average (the
# `gpu_prefill_tokens` "auto" threshold); above the last point the time grows in proportion (more than the fit's
# slope: on the safe side). 64 a DeepSeek-V3 layer takes ~0.6 s: the start-up cost bounds the grid.
MEASURED_TOKENS_PER_EXPERT = (4, 16, 64)


@dataclass(frozen=True)
class PrefillRates:
    """What the split is costed from (module docstring): seconds per expert at tokens per expert, seconds per token,
    bytes/s, FLOP/s, and the split's own costs."""

    cpu_expert_seconds: tuple[tuple[int, float], ...] = CPU_EXPERT_SECONDS  # (tokens, seconds), tokens increasing
    cpu_token_seconds: float = 0.0
    link_bytes_per_s: float = LINK_BYTES_PER_S
    gpu_flops: float = GPU_FLOPS
    overlap_loss: float = OVERLAP_LOSS
    split_seconds: float = SPLIT_SECONDS
    min_gain: float = MIN_GAIN

    def __post_init__(self):
        points = self.cpu_expert_seconds
        if not points or any(len(p) != 2 or not p[0] >= 1 or not p[1] > 0 for p in points) \
                or any(b[0] <= a[0] for a, b in zip(points, points[1:], strict=False)):
            raise ValueError("PrefillRates.cpu_expert_seconds must be (tokens >= 1, seconds > 0) pairs, tokens "
                             f"increasing, got {points}")
        for name in ("link_bytes_per_s", "gpu_flops"):
            if not getattr(self, name) > 0:
                raise ValueError(f"PrefillRates.{name} must be > 0, got {getattr(self, name)}")
        for name, low, high in (("cpu_token_seconds", 0, float("inf")), ("split_seconds", 0, float("inf")),
                                ("overlap_loss", 0, 1), ("min_gain", 0, 1)):
            if not low <= getattr(self, name) <= high:
                raise ValueError(f"PrefillRates.{name} must be in [{low}, {high}], got {getattr(self, name)}")

    def cpu_seconds(self, tokens: np.ndarray) -> np.ndarray:
        """Per expert, the CPU operator's seconds for its tokens: interpolated between the measured points, the
        first point's below it (a tile of 16 tokens costs the same from 1 to 16), in proportion above the last."""
        tokens = np.asarray(tokens, dtype=np.float64)
        at, seconds = (np.array(column, dtype=np.float64) for column in zip(*self.cpu_expert_seconds, strict=True))
        inside = np.interp(tokens, at, seconds)
        return np.where(tokens > at[-1], seconds[-1] * tokens / at[-1], inside)

    def stream_seconds(self, tokens: np.ndarray, flops_per_token: int, expert_bytes: int) -> np.ndarray:
        """Per expert: its stored bytes over the link plus its tokens' FLOPs on the GPU."""
        return expert_bytes / self.link_bytes_per_s + np.asarray(tokens) * flops_per_token / self.gpu_flops

    def step_seconds(self, counts: np.ndarray, num_tokens: int, flops_per_token: int,
                     expert_bytes: int) -> np.ndarray:
        """counts [U] (routed experts' tokens, fewest first) -> [U + 1]: the layer's predicted seconds with the first
        k on the CPU, k = 0 (all streamed through the ring, no split) to U."""
        cpu_side = num_tokens * self.cpu_token_seconds + np.cumsum(self.cpu_seconds(counts))
        streamed = self.stream_seconds(counts, flops_per_token, expert_bytes)
        rest = np.cumsum(streamed[::-1])[::-1]  # rest[k]: the experts after the first k
        rest_after = np.concatenate([rest[1:], [0.0]])
        split = np.maximum(cpu_side, rest_after) + self.overlap_loss * np.minimum(cpu_side, rest_after)
        return np.concatenate([rest[:1] if len(rest) else [0.0], split + self.split_seconds])


def plan_cpu_experts(tokens: np.ndarray, flops_per_token: int, expert_bytes: int, rates: PrefillRates,
                     share: float | None = None, num_tokens: int = 0) -> np.ndarray:
    """tokens [E] (the step's tokens per expert, 0: not routed or not this module's) -> the ids the CPU computes,
    sorted; the other routed ones are streamed. `share` None: the k of the least predicted time for a step of
    `num_tokens` tokens, if it beats the all-streamed step by `rates.min_gain` (else none); a number: that fraction
    of the routed experts (rounded half to even), fewest tokens first."""
    tokens = np.asarray(tokens, dtype=np.int64)
    routed = np.flatnonzero(tokens > 0)
    order = routed[np.lexsort((routed, tokens[routed]))]  # fewest tokens first, ties by id
    if share is not None:
        return np.sort(order[:round(share * len(order))])
    if len(order) == 0:
        return order
    seconds = rates.step_seconds(tokens[order], num_tokens, flops_per_token, expert_bytes)
    num_cpu = 1 + int(np.argmin(seconds[1:]))  # the first minimum: fewer on the CPU when tied
    if not seconds[num_cpu] < (1 - rates.min_gain) * seconds[0]:  # a tie streams: a split must gain
        return order[:0]
    return np.sort(order[:num_cpu])


@functools.lru_cache(maxsize=256)
def may_split(num_tokens: int, num_experts: int, top_k: int, flops_per_token: int, expert_bytes: int,
              rates: PrefillRates) -> bool:
    """Whether a step of `num_tokens` routed evenly (T x K / E tokens an expert, at least 1) would split on
    `rates`: if not, "auto" streams the step as share 0 does, with no host sync to read its routing. Cached: every
    streamed layer of a step asks with the same arguments."""
    pairs = num_tokens * top_k
    even = np.full(min(num_experts, pairs), max(1, pairs // num_experts), dtype=np.int64)
    return plan_cpu_experts(even, flops_per_token, expert_bytes, rates, num_tokens=num_tokens).size > 0


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


def measure_cpu(cpu: CpuExperts, top_k: int, rates: PrefillRates,
                tokens_per_expert: tuple[int, ...] = MEASURED_TOKENS_PER_EXPERT) -> PrefillRates:
    """`rates` with the CPU operator's seconds measured on a loaded layer (after a call that compiles its kernels;
    the faster of two calls each): per token, from a step of the largest call's tokens routed one pair; per expert
    at each of `tokens_per_expert`, from a call routing every expert that many tokens (T x K pairs, K consecutive
    experts a token), less the per-token part. About 0.1 s for a Qwen3-30B-A3B layer, 2 s for a DeepSeek-V3
    one."""
    layer = cpu.op.layer
    num_experts, hidden_size = layer.spec.num_experts, layer.spec.hidden_size

    def seconds(num_tokens: int, num_pairs: int) -> float:
        ids = (torch.arange(num_tokens * top_k) % num_experts).view(num_tokens, top_k)  # [T, K], distinct a row
        ids.view(-1)[num_pairs:] = -1
        hidden = torch.randn(num_tokens, hidden_size, generator=torch.Generator().manual_seed(0))
        weights = torch.full((num_tokens, top_k), 1 / top_k)
        best = float("inf")
        for _ in range(2):
            start = time.perf_counter()
            cpu(hidden, ids, weights)
            best = min(best, time.perf_counter() - start)
        return best

    def num_tokens(per_expert: int) -> int:
        return max(1, per_expert * num_experts // top_k)

    seconds(num_tokens(tokens_per_expert[0]), num_tokens(tokens_per_expert[0]) * top_k)  # compiles
    largest = num_tokens(tokens_per_expert[-1])
    token_seconds = seconds(largest, 1) / largest  # one pair: the per-token work and one expert's (an overestimate)
    points = []
    for per_expert in tokens_per_expert:
        whole = seconds(num_tokens(per_expert), num_tokens(per_expert) * top_k)
        experts = max(whole - token_seconds * num_tokens(per_expert), whole / 2)  # noise: never below half the call
        points.append((per_expert, experts / num_experts))
    return replace(rates, cpu_expert_seconds=tuple(points), cpu_token_seconds=token_seconds)
