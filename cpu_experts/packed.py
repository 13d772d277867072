"""One MoE layer's routed experts in memory for the CPU kernels, split into partitions along the intermediate
dimension I (one per NUMA node, or forced): partition p owns rows [start, end) of every expert's gate and up
projections and the same columns of its down projection, so it computes a partial output that the partitions sum.

With tensor parallelism, rank r of n first takes its slice of I (`rank_slice`), then cuts that slice into its
partitions; the ranks' partial outputs add up (the block's all-reduce), so the down bias, added once, stays with
rank 0. Partition and rank boundaries are multiples of the scale group along I (down's input), so each partition
owns whole groups; with one scale per output row (per channel) every partition shares the row's scale. Arrays
are numpy, C contiguous, in huge-page memory (`cpu_experts.memory`), in the file's dtypes (int8; packed int4,
MXFP4 and NVFP4 as uint8 with two columns per byte; FP8 e4m3 and 8-bit scales as their uint8 bits; bf16 as uint16
bits).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from cpu_experts import memory
from cpu_experts.expert_file import (
    ALLOWED_SCALES,
    PACKED_FP4,
    SILU,
    ExpertActivation,
    ExpertLayerSpec,
    quantize_matrix,
)
from cpu_experts.topology import check_rank, split_dim

PARTITION_ALIGN = 32  # partition boundaries along I: whole SIMD vectors, and whole int4 bytes


@dataclass
class PartitionWeights:
    start: int  # rows [start, end) of I
    end: int
    gate: np.ndarray  # [E, Ip, H] (int4: [E, Ip, H/2])
    up: np.ndarray
    down: np.ndarray  # [E, H, Ip] (int4: [E, H, Ip/2])
    gate_scales: np.ndarray | None  # [E, Ip, G_H] in the spec's scale dtype (bf16, e8m0, e4m3: their bits)
    up_scales: np.ndarray | None
    down_scales: np.ndarray | None  # [E, H, G_Ip]
    gate_tensor_scale: np.ndarray | None = None  # [E] float32, NVFP4 only (whole rows: every partition has it)
    up_tensor_scale: np.ndarray | None = None
    down_tensor_scale: np.ndarray | None = None
    gate_bias: np.ndarray | None = None  # [E, Ip] float32, layers with biases only (rows [start, end))
    up_bias: np.ndarray | None = None

    @property
    def size(self) -> int:
        return self.end - self.start

    def named_arrays(self) -> dict[str, np.ndarray]:
        """The weight, scale and bias arrays this partition holds, by field name (scales are absent for bf16)."""
        roles = ("gate", "up", "down", "gate_scales", "up_scales", "down_scales", "gate_tensor_scale",
                 "up_tensor_scale", "down_tensor_scale", "gate_bias", "up_bias")
        return {role: getattr(self, role) for role in roles if getattr(self, role) is not None}

    def arrays(self) -> list[np.ndarray]:
        return list(self.named_arrays().values())


@dataclass
class PackedLayer:
    spec: ExpertLayerSpec
    partitions: list[PartitionWeights]
    down_bias: np.ndarray | None = None  # [E, H] float32 (whole rows: added once, after the partitions' sum; rank 0)

    @property
    def nbytes(self) -> int:
        bias = 0 if self.down_bias is None else self.down_bias.nbytes
        return sum(a.nbytes for p in self.partitions for a in p.arrays()) + bias

    def expert_bytes(self) -> int:
        """Bytes of weights and scales one expert reads (all partitions)."""
        return self.nbytes // self.spec.num_experts

    @classmethod
    def from_file_tensors(cls, tensors: dict[str, torch.Tensor], spec: ExpertLayerSpec, num_partitions: int = 1,
                          rank: int = 0, num_ranks: int = 1) -> PackedLayer:
        """Slices the stacked tensors of an expert file (`gate.weight`, `gate.scales`, ...) into partitions: rank
        `rank` of `num_ranks` keeps only its slice of I (`rank_slice`, copied: the caller's whole layer can go),
        cut into `num_partitions`, and the down bias only on rank 0. A rank whose slice is empty (I shorter than
        one aligned block per rank) gets no partitions and computes nothing but rank 0's bias."""
        first, last = rank_slice(spec, rank, num_ranks)
        arrays = {name: _numpy(t) for name, t in tensors.items()}
        parts = []
        for start, end in split_dim(last - first, num_partitions, partition_align(spec)):
            if start == end:
                continue
            parts.append(_slice(arrays, spec, first + start, first + end))
        return cls(spec, parts, arrays.get("down.bias") if rank == 0 else None)

    @classmethod
    def from_float(cls, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, dtype: str, group_size: int = 0,
                   num_partitions: int = 1, activation: ExpertActivation = SILU,
                   biases: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None, rank: int = 0,
                   num_ranks: int = 1) -> PackedLayer:
        """Quantizes stacked float weights (`quantize_layer`) and packs them (tests and benchmarks); `rank`,
        `num_ranks` as in `from_file_tensors`."""
        tensors, spec = quantize_layer(gate, up, down, dtype, group_size, activation, biases)
        return cls.from_file_tensors(tensors, spec, num_partitions, rank, num_ranks)


def quantize_layer(gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, dtype: str, group_size: int = 0,
                   activation: ExpertActivation = SILU,
                   biases: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
                   ) -> tuple[dict[str, torch.Tensor], ExpertLayerSpec]:
    """Stacked float weights gate/up [E, I, H], down [E, H, I] as an expert file's tensors and spec, quantized to
    `dtype`; `biases`: gate, up [E, I] and down [E, H], kept float32."""
    num_experts, inter, hidden = gate.shape
    spec = ExpertLayerSpec(num_experts, hidden, inter, dtype, group_size, ALLOWED_SCALES[dtype][0], activation,
                           biases is not None)
    tensors: dict[str, list[torch.Tensor]] = {}
    for role, stacked in (("gate", gate), ("up", up), ("down", down)):
        for e in range(num_experts):
            for part, t in quantize_matrix(stacked[e], spec).items():
                tensors.setdefault(f"{role}.{part}", []).append(t)
    stacked = {n: torch.stack(ts) for n, ts in tensors.items()}
    for role, bias in zip(("gate", "up", "down"), biases or (), strict=False):
        stacked[f"{role}.bias"] = bias.float().contiguous()
    return stacked, spec


def partition_align(spec: ExpertLayerSpec) -> int:
    """Where a rank's slice or a partition of I may start: whole SIMD vectors, int4 bytes and scale groups."""
    return max(PARTITION_ALIGN, spec.group_size)


def rank_slice(spec: ExpertLayerSpec, rank: int = 0, num_ranks: int = 1) -> tuple[int, int]:
    """Rows [first, last) of I that tensor-parallel rank `rank` of `num_ranks` computes for every routed expert:
    as equal as the alignment allows, in rank order, together all of I (empty at I's end for ranks beyond its
    aligned blocks)."""
    check_rank(rank, num_ranks)
    return split_dim(spec.intermediate_size, num_ranks, partition_align(spec))[rank]


def _numpy(t: torch.Tensor) -> np.ndarray:
    if t.dtype == torch.bfloat16:
        return t.contiguous().view(torch.uint16).numpy()
    return t.contiguous().numpy()


def _slice(arrays: dict[str, np.ndarray], spec: ExpertLayerSpec, start: int, end: int) -> PartitionWeights:
    packed = 2 if spec.dtype in PACKED_FP4 else 1  # columns per stored element along K

    def part(name, index):
        if name not in arrays:
            return None
        sliced = arrays[name][index]
        # one partition keeps the caller's arrays (the loader reads them into huge-page memory)
        return sliced if sliced.flags.c_contiguous and sliced.size == arrays[name].size else memory.copy(sliced)

    rows = (slice(None), slice(start, end))
    group_i = spec.group(spec.intermediate_size)
    down_groups = slice(start // group_i, -(-end // group_i)) if spec.group_size else slice(0, 1)
    return PartitionWeights(
        start, end,
        gate=part("gate.weight", rows),
        up=part("up.weight", rows),
        down=part("down.weight", (slice(None), slice(None), slice(start // packed, -(-end // packed)))),
        gate_scales=part("gate.scales", rows),
        up_scales=part("up.scales", rows),
        down_scales=part("down.scales", (slice(None), slice(None), down_groups)),
        gate_tensor_scale=part("gate.tensor_scale", slice(None)),
        up_tensor_scale=part("up.tensor_scale", slice(None)),
        down_tensor_scale=part("down.tensor_scale", slice(None)),
        gate_bias=part("gate.bias", rows),
        up_bias=part("up.bias", rows),
    )
