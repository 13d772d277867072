"""Dynamic hot experts: the GPU-resident experts follow the traffic (`hot_experts_interval` > 0).

Placement is still chosen in one place (`hybrid.llm.LLM._cpu_experts_factory`, `ExpertPlacement.choose`); this
module only moves it afterwards, one expert at a time, through each layer's slot table (`RoutedExperts.local_slot`,
global expert id -> GPU slot or -1 for the CPU). Pieces:
- the routers count the experts they route to on the device (`hybrid.placement.RoutingRecorder`, no host sync, so
  CUDA graphs record too; the MoE block records after handing the CPU its tokens, so the counting kernels run
  while the CPU computes, not before);
- `SwapPolicy`: every `interval` steps, per layer, the counts since the last decision (decayed into a score) ->
  which resident expert to evict for which absent one; hysteresis (`min_ratio`) so that it does not thrash;
- the engine calls `HotExperts.after_step` between steps (flips the swaps whose copies landed, decides every
  `interval` steps) and `HotExperts.during_step` while a step runs on the device (after launching it, before
  waiting for it): that starts the decision's copies, spread over the interval (at least one a step), each into a
  spare slot (a slot no step reads: each layer keeps `hot_experts_swaps` of its `gpu_experts` slots free). A flip
  is one in-place write per id on the compute stream (tensor addresses never change, so captured graphs stay
  valid) and frees the evicted expert's slot, which the next copy into it waits for (an event recorded after the
  flip, behind every step that could still read it).

A copy on CUDA (`SlotCopier`) keeps the host's part to a memcpy of the expert's stored bytes (int8: half its bf16
size) into one of two page-locked staging buffers, done on the engine's thread while the device runs the step,
which that thread would otherwise only wait for; the host-to-device copy and the dequantization
(`gpu_layers.dequant`, the streamed prefill's kernels) run on a side stream. Nothing runs on another host thread:
the decode pool's threads spin on every other CPU, and a thread dequantizing on the host beside them (the first
design: float32 dequantization, a bf16 cast and page-locking per swap, ~10 ms a Qwen3-30B-A3B int8 expert against
~0.25 ms for the memcpy; 16 experts a decision every 32 steps of ~8 ms) takes CPUs from the pool and the engine's
thread for most of each interval: on the H200 host the first design decoded at 0.84x the static placement.
The kernels give each stored weight times its scale rounded once to bf16, what the loader's float32
dequantization (`dequantize_expert`, as `hybrid.converted.ConvertedExperts.read` does) copied into a bf16 slot
gives: bit-equal.
Slots of another dtype (float16, float32) take `dequantize_expert`'s on the engine's thread (slower).

The CPU operator keeps every expert of its layer loaded (`CpuExperts` is given the whole layer at load; the slot
table decides per step which ids reach it), so an evicted expert is computed on the CPU the step after its flip and
nothing is ever re-read from disk. The admitted expert's weights come from that copy: a converted directory's
resident experts are the same values (bit-equal); a plain checkpoint's quantized CPU copy differs from its resident
experts loaded as stored by the format's rounding.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from cpu_experts.expert_file import dequantize_matrix
from cpu_experts.packed import PackedLayer
from hybrid.errors import ConfigError
from hybrid.streaming import dequantize_projection


@dataclass(frozen=True)
class SwapPolicy:
    """Which experts to swap, from per-expert scores (tokens routed, older windows decayed by `decay`)."""

    max_swaps: int = 1  # per layer per decision: the layer's spare slots
    min_ratio: float = 1.5  # an absent expert replaces a resident one only with this many times its score
    min_score: float = 1.0  # and at least this score
    decay: float = 0.5  # weight of the previous score in each decision's new one

    def __post_init__(self):
        if self.max_swaps < 1:
            raise ConfigError(f"hot_experts_swaps must be >= 1, got {self.max_swaps}")
        if self.min_ratio < 1 or not 0 <= self.decay < 1:
            raise ConfigError(f"SwapPolicy: min_ratio must be >= 1 and decay in [0, 1), got {self.min_ratio}, "
                              f"{self.decay}")

    def score(self, previous: Sequence[float] | None, window: Sequence[int]) -> list[float]:
        if previous is None:
            return [float(c) for c in window]
        return [self.decay * p + c for p, c in zip(previous, window, strict=True)]

    def swaps(self, scores: Sequence[float], resident: Iterable[int]) -> list[tuple[int, int]]:
        """(evict, admit) pairs: the most scored absent experts against the least scored resident ones."""
        resident = set(resident)
        absent = sorted((e for e in range(len(scores)) if e not in resident), key=lambda e: (-scores[e], e))
        coldest = sorted(resident, key=lambda e: (scores[e], e))
        pairs = []
        for admit, evict in zip(absent, coldest, strict=False):  # as many pairs as the shorter side
            if len(pairs) == self.max_swaps or scores[admit] < self.min_score \
                    or scores[admit] <= self.min_ratio * scores[evict]:
                break
            pairs.append((evict, admit))
        return pairs


def dequantize_expert(layer: PackedLayer, expert: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One expert of a packed (CPU operator) layer -> float32 gate [I, H], up [I, H], down [H, I], dequantized by
    `dequantize_matrix` over whole matrices, as `hybrid.converted.ConvertedExperts.read` does for the loader."""
    spec = layer.spec
    parts = layer.partitions
    if sum(p.size for p in parts) != spec.intermediate_size:
        raise ConfigError("hot experts need every expert's whole intermediate dimension on this process: set "
                          "hot_experts_interval 0 with tensor parallelism")

    def joined(role: str, dim: int) -> torch.Tensor | None:
        arrays = [getattr(p, role) for p in parts]
        if arrays[0] is None:
            return None
        tensors = [_torch(a[expert]) for a in arrays]
        if role == "down_scales" and not spec.group_size:  # one scale per row over all of I: every partition's
            return tensors[0]
        return torch.cat(tensors, dim=dim)

    weights = []
    for role, dim in (("gate", 0), ("up", 0), ("down", 1)):
        tensor_scale = getattr(parts[0], f"{role}_tensor_scale")  # NVFP4's, whole rows: every partition's
        weights.append(dequantize_matrix(joined(role, dim), joined(f"{role}_scales", dim), role, spec,
                                         None if tensor_scale is None else _torch(tensor_scale[expert:expert + 1])[0]))
    return tuple(weights)


def _torch(array) -> torch.Tensor:
    tensor = torch.from_numpy(array)
    return tensor.view(torch.bfloat16) if tensor.dtype == torch.uint16 else tensor  # bf16 kept as its bits


@dataclass
class PendingSwap:
    layer: int
    evict: int
    admit: int
    slot: int
    landed: torch.cuda.Event | None = None  # CUDA: recorded on the side stream after the copy; None: landed


STAGING_ALIGN = 256  # bytes: every staged array starts on a boundary any dtype's view takes
NUM_STAGING = 2  # page-locked staging buffers: one is filled while the other's copy may still run
# numpy dtype of a stored array -> the dtype its device view takes (bf16 weights and scales are stored as their bits)
DEVICE_DTYPES = {np.dtype(np.int8): torch.int8, np.dtype(np.uint8): torch.uint8,
                 np.dtype(np.float32): torch.float32, np.dtype(np.uint16): torch.bfloat16}


def stored_arrays(layer: PackedLayer, expert: int) -> list[dict[str, np.ndarray]]:
    """Per partition: stored array name -> expert `expert`'s part of it [1, ...] (weights, scales, NVFP4's tensor
    scale), views of the CPU operator's memory."""
    return [{name: array[expert:expert + 1] for name, array in p.named_arrays().items()} for p in layer.partitions]


def _aligned(nbytes: int) -> int:
    return -(-nbytes // STAGING_ALIGN) * STAGING_ALIGN


def staged_bytes(layer: PackedLayer) -> int:
    """Staging bytes of one expert of `layer` (each array aligned)."""
    return sum(_aligned(a.nbytes) for arrays in stored_arrays(layer, 0) for a in arrays.values())


def stage(layer: PackedLayer, expert: int, host: torch.Tensor) -> tuple[list[dict], int]:
    """Copies expert `expert`'s stored arrays into the uint8 buffer `host`, each at an aligned offset -> (per
    partition: name -> (offset, device dtype, shape)), the bytes used)."""
    layout, offset, buffer = [], 0, host.numpy()
    for arrays in stored_arrays(layer, expert):
        placed = {}
        for name, array in arrays.items():
            buffer[offset:offset + array.nbytes] = array.reshape(-1).view(np.uint8)  # a memcpy
            placed[name] = (offset, DEVICE_DTYPES[array.dtype], array.shape)
            offset += _aligned(array.nbytes)
        layout.append(placed)
    return layout, offset


def dequantize_staged(module, slot: int, layout: list[dict], staged: torch.Tensor) -> None:
    """The staged arrays (`stage`'s layout, in `staged` on the slot's device) -> bf16 slot `slot` of `module`: each
    partition's rows of gate and up, its columns of down (`hybrid.streaming.dequantize_projection`)."""
    layer = module.cpu_experts.op.layer
    spec = layer.spec
    gate, up, down = (getattr(module, name).data[slot] for name in module.proj_names)  # [I, H], [I, H], [H, I]
    for part, placed in zip(layer.partitions, layout, strict=True):
        arrays = {name: staged[offset:].view(dtype)[:math.prod(shape)].view(shape)
                  for name, (offset, dtype, shape) in placed.items()}  # each [1, ...]
        rows = slice(part.start, part.end)
        for role, out, num_cols in (("gate", gate[rows], spec.hidden_size), ("up", up[rows], spec.hidden_size),
                                    ("down", down[:, rows], part.size)):
            if spec.dtype == "bf16":
                out.copy_(arrays[role][0])
            else:
                dequantize_projection(arrays, role, spec, num_cols, out.unsqueeze(0))


class SlotCopier:
    """CUDA: one expert's stored arrays -> a free GPU slot of its layer, on a side stream (module docstring): the
    host copies the stored bytes into a page-locked staging buffer, one host-to-device copy moves them, and
    `hybrid.streaming.dequantize_projection` writes each partition's rows of gate and up and columns of down."""

    def __init__(self, layers, device: torch.device):
        self.device = device
        num_bytes = max(staged_bytes(m.cpu_experts.op.layer) for m in layers)
        self.host = [torch.empty(num_bytes, dtype=torch.uint8, pin_memory=True) for _ in range(NUM_STAGING)]
        self.host_free: list[torch.cuda.Event | None] = [None] * NUM_STAGING  # its last host-to-device copy done
        self.staged = torch.empty(num_bytes, dtype=torch.uint8, device=device)  # side stream only: reuse is ordered
        self.stream = torch.cuda.Stream(device)
        self._next = 0

    def is_ready(self) -> bool:
        """Whether the next staging buffer is free now (never waited for: the copy is then left for a later step)."""
        free = self.host_free[self._next]
        return free is None or free.query()

    def copy(self, module, slot: int, expert: int, freed: torch.cuda.Event | None) -> torch.cuda.Event:
        """Starts the copy of `expert` into `slot` (after `freed`, when given) -> the event of its landing."""
        host = self.host[self._next]
        layout, num_bytes = stage(module.cpu_experts.op.layer, expert, host)
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            self.staged[:num_bytes].copy_(host[:num_bytes], non_blocking=True)
            self.host_free[self._next] = torch.cuda.Event()
            self.host_free[self._next].record(self.stream)
            if freed is not None:
                self.stream.wait_event(freed)  # every step that read the slot's evicted expert is over
            dequantize_staged(module, slot, layout, self.staged)
            landed = torch.cuda.Event()
            landed.record(self.stream)
        self._next = (self._next + 1) % NUM_STAGING
        return landed

    def drain(self) -> None:
        self.stream.synchronize()


class HotExperts:
    """The model's one mover of GPU-resident experts (module docstring). `layers`: the `RoutedExperts` with spare
    slots and a CPU part; `recorder`: the routers' device counts."""

    def __init__(self, layers, recorder, interval: int, policy: SwapPolicy, device: torch.device | str):
        if interval < 1:
            raise ConfigError(f"hot_experts_interval must be >= 1 to move experts, got {interval}")
        self.layers = {m.layer_idx: m for m in layers}
        self.recorder = recorder
        self.interval = interval
        self.policy = policy
        self.device = torch.device(device)
        self.num_steps = 0
        self._decided_at = 0
        self.num_swaps = 0  # flipped so far
        self.scores: dict[int, list[float]] = {}
        self._seen: dict[int, list[int]] = {}  # counts at the last decision
        self.queued: list[tuple[int, int, int]] = []  # decided (layer, evict, admit), copy not started
        self.pending: list[PendingSwap] = []  # copies started, not flipped
        self._copies_per_step = 1
        self._freed: dict[tuple[int, int], torch.cuda.Event] = {}  # (layer, slot) -> recorded after its eviction
        is_bf16 = bool(layers) and all(m.slot_dtype == torch.bfloat16 for m in layers)
        self._copier = SlotCopier(layers, self.device) if self.device.type == "cuda" and is_bf16 else None
        with torch.no_grad():
            if self._copier is not None:
                self._compile_kernels(layers)
            for module in layers:  # spare slots start as zeros, not whatever the allocator left (no kernel reads NaN)
                for slot in module.free_slots():
                    for name in module.proj_names:
                        getattr(module, name).data[slot].zero_()

    def _compile_kernels(self, layers) -> None:
        """One copy per layer format into a spare slot now (zeroed after): Triton compiles a kernel at its first
        launch (up to seconds), which must not fall inside a step."""
        seen = set()
        for module in layers:
            layer = module.cpu_experts.op.layer
            key = (repr(layer.spec), tuple(p.size for p in layer.partitions))
            if key not in seen:
                seen.add(key)
                self._copier.copy(module, module.free_slots()[0], 0, None)
        self._copier.drain()

    def during_step(self) -> None:
        """While a step runs on the device (launched, not yet waited for): starts this step's share of the
        decided copies, whose host part then overlaps the device's work."""
        self._start_copies(self._copies_per_step)

    def after_step(self) -> None:
        """Between steps: flips the swaps whose copies landed; every `interval` steps decides the next ones."""
        self.num_steps += 1
        self._flip_landed()
        if self.num_steps % self.interval == 0:
            self._decide_next()

    def at_idle(self) -> None:
        """The engine has nothing to run: flips what landed, decides now if steps ran since the last decision, and
        starts every decided copy."""
        self._flip_landed()
        if self.num_steps != self._decided_at:
            self._decide_next()
        self._start_copies(len(self.queued))

    def _decide_next(self) -> None:
        if self.queued or self.pending:  # the last decision's swaps first
            return
        self._decided_at = self.num_steps
        self.queued = [(layer, evict, admit) for layer, pairs in self.decide().items() for evict, admit in pairs]
        # spread over the interval, each copy's host part small beside a step: the swaps land early in it
        self._copies_per_step = max(1, -(-len(self.queued) // self.interval))

    def decide(self) -> dict[int, list[tuple[int, int]]]:
        """Layer -> (evict, admit) pairs from the counts since the last decision (one host read of the counts)."""
        layers = [layer for layer in self.layers if layer in self.recorder.counts]
        if not layers:
            return {}
        rows = torch.stack([self.recorder.counts[layer][:-1] for layer in layers]).tolist()  # [layers, E]
        decisions = {}
        for layer, now in zip(layers, rows, strict=True):
            module = self.layers[layer]
            window = [c - s for c, s in zip(now, self._seen.get(layer, [0] * len(now)), strict=True)]
            self._seen[layer] = now
            self.scores[layer] = self.policy.score(self.scores.get(layer), window)
            pairs = self.policy.swaps(self.scores[layer], module.gpu_expert_ids)
            decisions[layer] = pairs[:len(module.free_slots())]
        return decisions

    def _start_copies(self, limit: int) -> None:
        started = 0
        while self.queued and started < limit:
            if self._copier is not None and not self._copier.is_ready():
                return
            layer, evict, admit = self.queued.pop(0)
            self._start_copy(layer, evict, admit)
            started += 1

    def _start_copy(self, layer: int, evict: int, admit: int) -> None:
        module = self.layers[layer]
        taken = {p.slot for p in self.pending if p.layer == layer}
        slot = next(s for s in module.free_slots() if s not in taken)
        swap = PendingSwap(layer, evict, admit, slot)
        if self._copier is not None:
            swap.landed = self._copier.copy(module, slot, admit, self._freed.get((layer, slot)))
        else:  # the engine's device is the CPU (or slots of another dtype): on this thread, in stream order
            weights = dequantize_expert(module.cpu_experts.op.layer, admit)
            module.write_slot(slot, *(w.to(module.slot_dtype) for w in weights))
        self.pending.append(swap)

    def _flip_landed(self) -> None:
        waiting = []
        for swap in self.pending:
            if swap.landed is not None and not swap.landed.query():
                waiting.append(swap)
                continue
            freed_slot = self.layers[swap.layer].flip(swap.evict, swap.admit, swap.slot)
            if self.device.type == "cuda":  # the next copy into the freed slot waits for the steps queued so far
                event = torch.cuda.Event()
                event.record(torch.cuda.current_stream(self.device))
                self._freed[(swap.layer, freed_slot)] = event
            self.num_swaps += 1
        self.pending = waiting

    def drain(self) -> None:
        """Waits until every started copy is done on the device (before a graph capture: no work of the side
        stream runs beside one); their flips still come at the next between-steps call."""
        if self._copier is not None:
            self._copier.drain()

    def close(self) -> None:
        self.drain()


def check_hot_experts(interval: int, num_swaps: int, num_gpu_experts: int, num_experts: int) -> None:
    """`hot_experts_interval` > 0 needs resident experts and spare slots: a one-line error saying what to change."""
    if interval and num_gpu_experts <= num_swaps:
        raise ConfigError(f"hot_experts_interval {interval} keeps {num_swaps} of the gpu_experts slots per layer "
                          f"spare (hot_experts_swaps) and needs resident ones too: raise gpu_experts above "
                          f"{num_swaps} (got {num_gpu_experts}), lower hot_experts_swaps, or set "
                          "hot_experts_interval 0")
    if interval and num_gpu_experts - num_swaps >= num_experts:
        raise ConfigError(f"hot_experts_interval {interval}: all {num_experts} experts per layer already fit on the "
                          "GPU; set hot_experts_interval 0")
