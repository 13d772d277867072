"""Large prefill steps of CPU-resident experts computed on the GPU, their weights streamed over PCIe.

A prefill step of a few thousand tokens routes to nearly every expert of a layer, and the CPU computes it at a few
TFLOP/s; the GPU computes it a hundred times faster if it has the weights. Copying a layer's int8 experts from
page-locked memory runs at the link's speed (~55 GB/s on PCIe 5: 11 ms for a Qwen3-30B-A3B layer), which beats
the CPU from a few hundred tokens on: the trade llama.cpp makes when it offloads large batches. Every format crosses
the link as stored (int4, MXFP4 and NVFP4 packed: half int8's bytes; FP8 as its codes) and expands on the device.

Pieces:
- `ExpertStream` (one per model) cuts every streamed layer into units (experts [first, last) of one partition,
  at most CHUNK_BYTES of stored weights and 2 x CHUNK_BYTES of bf16 tables each) in layer order, and copies them
  on its own CUDA stream into a ring of NUM_SLOTS device buffers. Acquiring unit u also starts the copies of the
  units after it that have a free slot, so the next layer's weights cross the link while this layer computes and
  the link never idles. Events order the two streams: a unit's compute waits for its copy; a slot's next copy
  waits for the compute that read it. No host sync anywhere: a slot still holding its unit (a model whose units
  all fit) is reused, not re-copied.
- `StreamedPrefill`, a part of a layer's `hybrid.routed_experts.RoutedExperts`: the eager steps of at least
  `min_tokens` tokens run here, per unit, with the ids shifted by `first` (ids outside the unit count as
  elsewhere) and the layer's activation and biases (gpt-oss: the gate/up biases in every unit, the down bias with
  partition 0's); the units' outputs add up in float32. Smaller steps (decode) and graph steps go to the CPU.
  W8A8 layers (int8/int4 experts whose CPU operator rounds activations to int8, the default): the hidden rows are
  rounded to int8 once per step exactly as the CPU does, and each unit's stored codes go straight into
  `gpu_layers.w8a8_moe` (exact int32 sums per scale group, act rounded per row of the partition), so a prompt's
  output does not depend on which of its steps were streamed (README, numerics contracts). Layers computing in
  float (`expert_activations="float"`), bf16 experts and the float formats: weights -> bf16 (`gpu_layers.dequant`,
  gate and up side by side in one [c, 2Ip, H] table) -> `gpu_layers.fused_moe` on bf16 activations. Layers whose
  weights could not be page-locked stay on the CPU.
- The split (`hybrid.prefill_split`, `StreamedPrefill.split`): unless `cpu_share` is 0, the step's experts with
  the fewest tokens go to the CPU operator instead and only the others' weights cross, packed in a slot
  (`ExpertStream.acquire_rows`, copied once the layer's routing is known, nothing ahead).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import numpy as np
import torch

from cpu_experts.expert_file import ExpertLayerSpec
from cpu_experts.module import CpuExperts
from cpu_experts.packed import PackedLayer
from gpu_layers.dequant import dequantize_fp4, dequantize_fp8, dequantize_int4, dequantize_int8
from gpu_layers.fused_moe import Activation, fused_moe
from gpu_layers.w8a8_moe import BLOCK_KS, quantize_rows, w8a8_moe
from hybrid.engine_config import EngineConfig
from hybrid.prefill_split import PrefillRates, flops_per_pair, may_split, plan_cpu_experts

STREAMED_DTYPES = ("int8", "int4", "bf16", "fp8", "mxfp4", "nvfp4")
# gpu_prefill_tokens="auto": stream a step's experts once each gets this many of its tokens on average. On the H200
# host the CPU took 9, 15 and 18 ms per Qwen3-30B-A3B layer for 128, 256 and 512 tokens (8, 16 and 32 per
# expert), the copy over PCIe 11 ms at any size.
AUTO_TOKENS_PER_EXPERT = 16
# Stored bytes of one unit, which bound the ring (NUM_SLOTS of them), and half the unit's bf16 tables: int8 expands
# 2x, so its units fill both bounds; int4 expands 4x, so its units are half as large (`layer_units`).
CHUNK_BYTES = 1 << 30
NUM_SLOTS = 2


def pin(array: np.ndarray) -> bool:
    """Page-locks a numpy array in place (cudaHostRegister) so copies from it are asynchronous DMA."""
    if array.nbytes == 0:
        return False
    error = torch.cuda.cudart().cudaHostRegister(array.ctypes.data, array.nbytes, 0)
    return int(error) == 0


@dataclass(frozen=True)
class Unit:
    """Experts [first, last) of partition `partition` of one streamed layer."""

    layer: PackedLayer = field(repr=False)
    partition: int
    first: int
    last: int

    def arrays(self) -> dict[str, np.ndarray]:
        named = self.layer.partitions[self.partition].named_arrays()
        return {role: a[self.first:self.last] for role, a in named.items()}


def layer_units(layer: PackedLayer, chunk_bytes: int, has_tables: bool = True) -> list[Unit]:
    """Each partition's experts in runs of at most `chunk_bytes` stored and (`has_tables`: computed from bf16
    tables, not from the codes) 2 x `chunk_bytes` of bf16 tables."""
    units = []
    for index, part in enumerate(layer.partitions):
        per_expert = sum(a.nbytes for a in part.arrays()) // layer.spec.num_experts
        table_per_expert = 2 * 3 * part.size * layer.spec.hidden_size if has_tables else 1  # gate, up, down in bf16
        chunk = min(chunk_bytes // max(per_expert, 1), 2 * chunk_bytes // table_per_expert)
        chunk = max(1, min(layer.spec.num_experts, chunk))
        units += [Unit(layer, index, first, min(first + chunk, layer.spec.num_experts))
                  for first in range(0, layer.spec.num_experts, chunk)]
    return units


class ExpertStream:
    """Copies units of streamed layers to the device ahead of their use (module docstring)."""

    def __init__(self, device: torch.device | str, num_slots: int = NUM_SLOTS):
        self.device = torch.device(device)
        self.units: list[Unit] = []
        self.num_slots = num_slots
        self._is_cuda = self.device.type == "cuda"
        self._copy_stream = torch.cuda.Stream(self.device) if self._is_cuda else None
        self._slot_unit = [-1] * num_slots  # unit index each slot holds (or is copying)
        self._buffers: list[dict[str, torch.Tensor]] = [{} for _ in range(num_slots)]  # role -> flat uint8
        self._copied = [self._event() for _ in range(num_slots)]
        self._freed = [self._event() for _ in range(num_slots)]
        self._pinned: list[np.ndarray] = []

    def _event(self):
        return torch.cuda.Event() if self._is_cuda else None

    def add_layer(self, layer: PackedLayer, chunk_bytes: int | None = None, has_tables: bool = True) -> range:
        """Appends the layer's units (call in layer order); returns their indices."""
        first = len(self.units)
        self.units += layer_units(layer, CHUNK_BYTES if chunk_bytes is None else chunk_bytes, has_tables)
        return range(first, len(self.units))

    def pin(self, layer: PackedLayer) -> int:
        """Page-locks a layer's arrays; the bytes pinned, 0 if the driver refused any (then the layer is not
        streamed: copies from pageable memory run at a fraction of the link's speed)."""
        arrays = [a for p in layer.partitions for a in p.arrays()]
        pinned = [a for a in arrays if pin(a)]
        self._pinned += pinned
        return sum(a.nbytes for a in pinned) if len(pinned) == len(arrays) else 0

    def unpin(self) -> None:
        """Undoes `pin` (before the arrays are freed, so the driver holds no stale registration)."""
        for array in self._pinned:
            torch.cuda.cudart().cudaHostUnregister(array.ctypes.data)
        self._pinned = []

    def acquire(self, index: int) -> dict[str, torch.Tensor]:
        """Unit `index`'s stored arrays on the device, ordered before the current stream's next work; starts the
        copies of the units after it. Pair with `release(index)` after the last kernel that reads them."""
        for ahead in range(index, min(index + self.num_slots, len(self.units))):
            if self._slot_unit[ahead % self.num_slots] != ahead:
                self._copy(ahead)
        slot = index % self.num_slots
        if self._is_cuda:
            torch.cuda.current_stream(self.device).wait_event(self._copied[slot])
        return self._views(slot, self.units[index].arrays())

    def acquire_rows(self, index: int, rows: np.ndarray) -> dict[str, torch.Tensor]:
        """Like `acquire`, for experts `rows` (sorted, relative to the unit's first) of unit `index` only, packed
        in that order ([len(rows), ...] each); copied now, nothing ahead (a split step knows its streamed experts
        only after the layer's routing, `hybrid.prefill_split`). Pair with `release(index)`."""
        slot = index % self.num_slots
        arrays = self.units[index].arrays()
        views = self._views(slot, {role: a[:len(rows)] for role, a in arrays.items()})
        breaks = np.flatnonzero(np.diff(rows) != 1) + 1
        runs = [(int(run[0]), len(run)) for run in np.split(rows, breaks)]  # consecutive experts copy as one
        self._copy_runs(slot, arrays, views, runs)
        if self._is_cuda:  # the compute's stream, outside the copy stream's context
            torch.cuda.current_stream(self.device).wait_event(self._copied[slot])
        self._slot_unit[slot] = -1  # holds part of a unit: a later `acquire` copies the whole one again
        return views

    def release(self, index: int) -> None:
        if self._is_cuda:
            self._freed[index % self.num_slots].record(torch.cuda.current_stream(self.device))

    def _copy(self, index: int) -> None:
        slot = index % self.num_slots
        arrays = self.units[index].arrays()
        num_rows = len(next(iter(arrays.values())))  # every role is [experts of the unit, ...]
        self._copy_runs(slot, arrays, self._views(slot, arrays), [(0, num_rows)])
        self._slot_unit[slot] = index

    def _copy_runs(self, slot: int, arrays: dict[str, np.ndarray], views: dict[str, torch.Tensor],
                   runs: list[tuple[int, int]]) -> None:
        """Each run (first expert, count) of every role's array into the next rows of its slot view, on the copy
        stream once the compute that read the slot's last unit is done; `_copied[slot]` marks the end."""
        stream = torch.cuda.stream(self._copy_stream) if self._is_cuda else contextlib.nullcontext()
        with stream:
            if self._is_cuda:
                self._copy_stream.wait_event(self._freed[slot])
            at = 0
            for first, count in runs:
                for role, view in views.items():
                    rows = np.ascontiguousarray(arrays[role][first:first + count])
                    view[at:at + count].copy_(torch.from_numpy(rows), non_blocking=True)
                at += count
            if self._is_cuda:
                self._copied[slot].record(self._copy_stream)

    def _views(self, slot: int, arrays: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
        """Device tensors shaped like `arrays` over the slot's buffers (grown to the largest unit on first use)."""
        buffers, views = self._buffers[slot], {}
        for role, array in arrays.items():
            if role not in buffers or buffers[role].numel() < array.nbytes:
                size = max(u.arrays()[role].nbytes for u in self.units)  # every unit has the same roles
                buffers[role] = torch.empty(size, dtype=torch.uint8, device=self.device)
            dtype = torch.from_numpy(array[:0]).dtype
            views[role] = buffers[role][:array.nbytes].view(dtype).view(array.shape)
        return views


class StreamedPrefill:
    """Streamed prefill of one layer's CPU experts (module docstring); `RoutedExperts` asks `takes` per step."""

    def __init__(self, cpu: CpuExperts, min_tokens: int, device: torch.device | str, cpu_share: float | None = 0.0,
                 rates: PrefillRates | None = None):
        """`cpu_share`: the fraction of a step's routed experts the CPU computes beside the streamed ones (None:
        chosen on `rates`, `hybrid.prefill_split`; 0: all streamed)."""
        self.cpu_experts = cpu
        self.min_tokens = min_tokens
        self.cpu_share = cpu_share
        self.rates = rates if rates is not None else PrefillRates()
        self.num_split_experts = [0, 0]  # over the split steps so far: routed experts on the CPU, streamed (metrics)
        self.device = torch.device(device)
        self.stream: ExpertStream | None = None
        self.units = range(0)
        self._device_down_bias: torch.Tensor | None = None

    @property
    def is_streamable(self) -> bool:
        """Experts of a streamed format (every expert format) whose partitions fused_moe can take (I and H
        multiples of 16)."""
        if self.cpu_experts.op is None:
            return False
        layer = self.cpu_experts.op.layer
        return layer.spec.dtype in STREAMED_DTYPES and layer.spec.hidden_size % 16 == 0 and bool(layer.partitions) \
            and all(p.size % 16 == 0 for p in layer.partitions)

    @property
    def is_w8a8(self) -> bool:
        """Whether the CPU operator rounds this layer's activations to int8 (int8/int4 experts, by default), which
        the streamed steps then do too (`w8a8_moe`; its scale groups: one a row, or a multiple of 32 columns)."""
        op = self.cpu_experts.op
        return op is not None and op.is_w8a8 and op.spec.dtype in ("int8", "int4") \
            and op.spec.group_size % BLOCK_KS[0] == 0

    def attach(self, stream: ExpertStream, chunk_bytes: int | None = None, pin: bool = True) -> int:
        """Registers the layer's units with the model's stream (after loading, in layer order); the bytes
        page-locked. A layer that cannot be streamed, or whose weights the driver would not pin, stays on the CPU."""
        if not self.is_streamable:
            return 0
        layer = self.cpu_experts.op.layer
        pinned = stream.pin(layer) if pin else layer.nbytes
        if pinned:
            self.stream, self.units = stream, stream.add_layer(layer, chunk_bytes, has_tables=not self.is_w8a8)
        return pinned

    def takes(self, hidden: torch.Tensor) -> bool:
        """Whether an eager step of `hidden` [T, H] runs here: attached, at least min_tokens, on the device."""
        return (self.stream is not None and hidden.shape[0] >= self.min_tokens
                and hidden.device.type == self.device.type)  # "cuda" and "cuda:0" alike

    def split(self, topk_ids: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, np.ndarray | None]:
        """A streamed step's CPU-resident ids [T, K] (-1: elsewhere) -> (the CPU operator's ids or None, the streamed
        ids or None, the streamed experts or None: all of them through the ring). A share strictly between 0 and 1
        or "auto" reads the step's per-expert token counts (one host sync a layer), but "auto" streams as share 0
        does, with no host sync, a step whose even routing would not split (`hybrid.prefill_split.may_split`)."""
        if self.cpu_share == 0:
            return None, topk_ids, None
        if self.cpu_share == 1:
            return topk_ids, None, None
        ids = topk_ids.long()
        layer = self.cpu_experts.op.layer
        num_experts, num_tokens = layer.spec.num_experts, topk_ids.shape[0]
        flops, expert_bytes = flops_per_pair(layer), layer.expert_bytes()
        if self.cpu_share is None and not may_split(num_tokens, num_experts, topk_ids.shape[1], flops, expert_bytes,
                                                    self.rates):
            return None, topk_ids, None
        counts = torch.bincount(ids[ids >= 0], minlength=num_experts).cpu().numpy()
        on_cpu = plan_cpu_experts(counts, flops, expert_bytes, self.rates, self.cpu_share, num_tokens)
        streamed = np.setdiff1d(np.flatnonzero(counts), on_cpu)
        self.num_split_experts[0] += on_cpu.size
        self.num_split_experts[1] += streamed.size
        is_cpu = torch.zeros(num_experts + 1, dtype=torch.bool)  # index E: the -1 ids
        is_cpu[torch.from_numpy(on_cpu)] = True
        mask = is_cpu.to(ids.device)[torch.where(ids >= 0, ids, num_experts)]
        cpu_ids = torch.where(mask, topk_ids, -1) if on_cpu.size else None
        return cpu_ids, torch.where(mask, -1, topk_ids) if streamed.size else None, streamed

    def compute_on_gpu(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                       experts: np.ndarray | None = None):
        """hidden [T, H] (bf16/fp16; float32 too for W8A8 layers), topk_ids [T, K] (-1: not here) -> [T, H] in
        hidden's dtype. `experts` None: every unit through the ring, no host sync; else only those experts'
        weights (sorted ids, those `topk_ids` routes to) cross."""
        dtype = hidden.dtype
        ids = topk_ids.to(torch.int32)
        weights = topk_weights.float().contiguous()
        if self.is_w8a8:
            x = quantize_rows(hidden.contiguous())  # the CPU's int8 rows (codes, scales), once for every unit
        else:
            x = hidden.to(torch.bfloat16).contiguous()  # the tables are bf16; no copy when it already is
        out = None
        for index in self.units:
            unit = self.stream.units[index]
            if experts is None:
                arrays, unit_ids, rows = self.stream.acquire(index), ids - unit.first, slice(unit.first, unit.last)
            else:
                rows = experts[(experts >= unit.first) & (experts < unit.last)]
                if not rows.size:
                    continue
                arrays, unit_ids = self.stream.acquire_rows(index, rows - unit.first), _packed_ids(ids, rows)
                rows = torch.from_numpy(rows)
            part = self._unit_output(x, arrays, unit, unit_ids, weights, rows, hidden.device)
            self.stream.release(index)
            out = part if out is None else out.add_(part)
        return (out if out is not None else torch.zeros_like(hidden, dtype=torch.float32)).to(dtype)

    def _unit_output(self, x, arrays: dict[str, torch.Tensor], unit: Unit, unit_ids: torch.Tensor,
                     weights: torch.Tensor, rows, device: torch.device) -> torch.Tensor:
        """One unit's float32 [T, H]: x the int8 rows (codes, scales) of a W8A8 layer, else bf16 hidden; `rows` the
        layer's experts in the unit's order (the down bias's rows)."""
        spec = self.cpu_experts.op.layer.spec
        activation = Activation(spec.activation.kind, spec.activation.alpha, spec.activation.limit)
        gate_up_bias = down_bias = None
        if spec.has_bias:  # gate/up rows of this partition; the down bias once per expert, with partition 0
            gate_up_bias = torch.cat([arrays["gate_bias"], arrays["up_bias"]], dim=1)  # [c, 2Ip]
            down_bias = self._down_bias(device)[rows] \
                if unit.partition == 0 and self.cpu_experts.op.layer.down_bias is not None else None  # rank 0
        if self.is_w8a8:
            gate, up, down = ((arrays[role], _scales(arrays[f"{role}_scales"])) for role in ("gate", "up", "down"))
            return w8a8_moe(*x, gate, up, down, unit_ids, weights, group_size=spec.group_size, activation=activation,
                            w_gate_up_bias=gate_up_bias, w_down_bias=down_bias)
        gate_up, down = self._bf16_tables(arrays, spec)
        return fused_moe(x, gate_up, down, unit_ids, weights, activation=activation, w_gate_up_bias=gate_up_bias,
                         w_down_bias=down_bias).float()

    def _down_bias(self, device: torch.device) -> torch.Tensor:
        """The layer's down bias [E, H] float32 on the device (a few MB, copied once)."""
        if self._device_down_bias is None:
            self._device_down_bias = torch.from_numpy(self.cpu_experts.op.layer.down_bias).to(device)
        return self._device_down_bias

    @staticmethod
    def _bf16_tables(arrays: dict[str, torch.Tensor], spec: ExpertLayerSpec) -> tuple[torch.Tensor, torch.Tensor]:
        """A unit's stored arrays -> gate_up bf16 [c, 2Ip, H] (gate rows first) and down bf16 [c, H, Ip]."""
        gate, up, down = arrays["gate"], arrays["up"], arrays["down"]
        if gate.dtype == torch.uint16:  # bf16 stored as its bits
            return torch.cat([gate.view(torch.bfloat16), up.view(torch.bfloat16)], dim=1), down.view(torch.bfloat16)
        num_experts, inter, hidden_size = gate.shape[0], gate.shape[1], down.shape[1]
        gate_up = torch.empty(num_experts, 2 * inter, hidden_size, dtype=torch.bfloat16, device=gate.device)
        dequantize_projection(arrays, "gate", spec, hidden_size, gate_up[:, :inter])
        dequantize_projection(arrays, "up", spec, hidden_size, gate_up[:, inter:])
        return gate_up, dequantize_projection(arrays, "down", spec, inter)


def dequantize_projection(arrays: dict[str, torch.Tensor], role: str, spec: ExpertLayerSpec, num_cols: int,
                          out: torch.Tensor | None = None) -> torch.Tensor:
    """One projection of a unit (or of one partition of an expert: `hybrid.hot_experts`), K = `num_cols` (gate and
    up: H, down: the partition's Ip), -> bf16 [c, N, K]: each stored weight dequantized as the format's reference
    does, rounded once to bf16 (a quantized format: bf16 experts are their own tables)."""
    w, scales = arrays[role], arrays[f"{role}_scales"]
    if spec.dtype == "int8":
        return dequantize_int8(w, scales, out)
    if spec.dtype == "int4":  # packed: gate and up's K is H (the tables' width), down's is Ip (its rows' count)
        return dequantize_int4(w, _scales(scales), spec.group(num_cols), num_cols, out)
    if spec.dtype == "fp8":
        return dequantize_fp8(w, scales, spec.group(num_cols), out)
    return dequantize_fp4(w, scales, num_cols, arrays.get(f"{role}_tensor_scale"), out)  # MXFP4 or NVFP4


def _packed_ids(ids: torch.Tensor, rows: np.ndarray) -> torch.Tensor:
    """ids [T, K] int32 (global, -1: not here) -> positions in `rows` (the packed experts, sorted), -1 elsewhere."""
    ids_long = ids.long()
    position = torch.full((int(rows[-1]) + 2,), -1, dtype=torch.int32)  # last index: ids past rows[-1] and -1
    position[torch.from_numpy(rows)] = torch.arange(len(rows), dtype=torch.int32)
    position = position.to(ids.device)
    return position[torch.where((ids_long >= 0) & (ids_long <= int(rows[-1])), ids_long, len(position) - 1)]


def _scales(scales: torch.Tensor) -> torch.Tensor:
    """Stored scales as the kernels take them: bfloat16 ones arrive as their uint16 bits (numpy has no bfloat16)."""
    return scales.view(torch.bfloat16) if scales.dtype == torch.uint16 else scales


def min_streamed_tokens(config: EngineConfig, num_experts: int, top_k: int) -> int:
    """`gpu_prefill_tokens` as a count: 0 (no streaming) off CUDA; "auto" 16 x E / K, above the graphs' batches."""
    if not config.is_cuda:
        return 0
    if config.gpu_prefill_tokens != "auto":
        return config.gpu_prefill_tokens
    floor = config.max_graph_batch + 1 if config.cuda_graph else 1
    return max(AUTO_TOKENS_PER_EXPERT * num_experts // top_k, floor)


def reserve_bytes(num_experts: int, hidden_size: int, intermediate_size: int) -> int:
    """Device memory streaming needs at most: the ring's slots and one unit's bf16 tables (at most twice CHUNK_BYTES
    and twice an int8 layer's bytes, whatever the experts' dtype: `layer_units`)."""
    return (NUM_SLOTS + 2) * min(CHUNK_BYTES, 3 * num_experts * hidden_size * intermediate_size)


def attach_streamed(modules: list[StreamedPrefill], device: torch.device | str) -> tuple[ExpertStream, int]:
    """One stream for the model's streamed layers; (the stream, bytes page-locked)."""
    stream = ExpertStream(device)
    return stream, sum(m.attach(stream) for m in modules)
