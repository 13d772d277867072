"""Dynamic hot experts: the GPU-resident experts follow the traffic (`hot_experts_interval` > 0).

Placement is still chosen in one place (`hybrid.llm.LLM._cpu_experts_factory`, `ExpertPlacement.choose`); this
module only moves it afterwards, one expert at a time, through each layer's slot table (`RoutedExperts.local_slot`,
global expert id -> GPU slot or -1 for the CPU). Pieces:
- the routers count the experts they route to on the device (`hybrid.placement.RoutingRecorder`, no host sync, so
  CUDA graphs record too);
- `SwapPolicy`: every `interval` steps, per layer, the counts since the last decision (decayed into a score) ->
  which resident expert to evict for which absent one; hysteresis (`min_ratio`) so that it does not thrash;
- `HotExperts.after_step` (the engine calls it between steps): a swap first copies the admitted expert into a
  spare slot (a slot no step reads: each layer keeps `hot_experts_swaps` of its `gpu_experts` slots free), on a
  side stream on CUDA, its weights dequantized from the CPU operator's copy exactly as the loader dequantizes a
  converted directory's resident experts (`dequantize_expert`); a later between-steps call, once the copy's event
  completed, flips the slot table (one in-place write per id, on the compute stream: tensor addresses never
  change, so captured graphs stay valid) and frees the evicted expert's slot, which the next copy into it waits for
  (an event recorded after the flip, behind every step that could still read it).

The CPU operator keeps every expert of its layer loaded (`CpuExperts` is given the whole layer at load; the slot
table decides per step which ids reach it), so an evicted expert is computed on the CPU the step after its flip and
nothing is ever re-read from disk. The admitted expert's weights come from that copy: a converted directory's
resident experts are the same values (bit-equal); a plain checkpoint's quantized CPU copy differs from its resident
experts loaded as stored by the format's rounding.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from cpu_experts.expert_file import dequantize_matrix
from cpu_experts.packed import PackedLayer
from hybrid.errors import ConfigError


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
    copied: Future | None = None  # CUDA: the background copy, which returns its event (and pinned sources)


class HotExperts:
    """The model's one mover of GPU-resident experts (module docstring). `layers`: the `RoutedExperts` with spare
    slots and a CPU part; `recorder`: the routers' device counts."""

    def __init__(self, layers, recorder, interval: int, policy: SwapPolicy, device: torch.device | str):
        if interval < 1:
            raise ConfigError(f"hot_experts_interval must be >= 1 to move experts, got {interval}")
        self.layers = {m.layer_idx: m for m in layers}
        with torch.no_grad():  # spare slots start as zeros, not whatever the allocator left (no kernel reads NaN)
            for module in layers:
                for slot in module.free_slots():
                    for name in module.proj_names:
                        getattr(module, name).data[slot].zero_()
        self.recorder = recorder
        self.interval = interval
        self.policy = policy
        self.device = torch.device(device)
        self.num_steps = 0
        self._decided_at = 0
        self.num_swaps = 0  # flipped so far
        self.scores: dict[int, list[float]] = {}
        self._seen: dict[int, list[int]] = {}  # counts at the last decision
        self.pending: list[PendingSwap] = []
        self._is_cuda = self.device.type == "cuda"
        self._stream = torch.cuda.Stream(self.device) if self._is_cuda else None
        self._freed: dict[tuple[int, int], torch.cuda.Event] = {}  # (layer, slot) -> recorded after its eviction
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="hot-experts") if self._is_cuda else None

    def after_step(self) -> None:
        """Between steps: flips the swaps whose copies landed; every `interval` steps decides and starts the next."""
        self.num_steps += 1
        self._flip_landed()
        if self.num_steps % self.interval == 0:
            self._start_swaps()

    def at_idle(self) -> None:
        """The engine has nothing to run: flips what landed, and decides now if steps ran since the last decision."""
        self._flip_landed()
        if self.num_steps != self._decided_at:
            self._start_swaps()

    def _start_swaps(self) -> None:
        if self.pending:  # the last decision's copies first
            return
        self._decided_at = self.num_steps
        for layer, pairs in self.decide().items():
            for evict, admit in pairs:
                self._start_copy(layer, evict, admit)

    def decide(self) -> dict[int, list[tuple[int, int]]]:
        """Layer -> (evict, admit) pairs from the counts since the last decision (one host read of the counts)."""
        decisions = {}
        for layer, module in self.layers.items():
            counts = self.recorder.counts.get(layer)
            if counts is None:
                continue
            now = counts[:-1].tolist()
            window = [c - s for c, s in zip(now, self._seen.get(layer, [0] * len(now)), strict=True)]
            self._seen[layer] = now
            self.scores[layer] = self.policy.score(self.scores.get(layer), window)
            pairs = self.policy.swaps(self.scores[layer], module.gpu_expert_ids)
            decisions[layer] = pairs[:len(module.free_slots())]
        return decisions

    def _start_copy(self, layer: int, evict: int, admit: int) -> None:
        module = self.layers[layer]
        taken = {p.slot for p in self.pending if p.layer == layer}
        slot = next(s for s in module.free_slots() if s not in taken)
        swap = PendingSwap(layer, evict, admit, slot)
        if self._is_cuda:  # dequantized and copied off the engine's thread, on the side stream
            swap.copied = self._worker.submit(self._copy_on_stream, module, slot, admit,
                                              self._freed.get((layer, slot)))
        else:  # the engine's device is the CPU: nothing runs beside this thread
            module.write_slot(slot, *dequantize_expert(module.cpu_experts.op.layer, admit))
        self.pending.append(swap)

    def _copy_on_stream(self, module, slot: int, expert: int, freed) -> tuple[torch.cuda.Event, list]:
        """The worker thread's part: (the copy's event, its pinned sources, which must live until it is done)."""
        weights = [w.to(module.slot_dtype).pin_memory() for w in dequantize_expert(module.cpu_experts.op.layer,
                                                                                    expert)]
        with torch.cuda.device(self.device), torch.cuda.stream(self._stream):
            if freed is not None:
                self._stream.wait_event(freed)  # every step that read the slot's evicted expert is over
            module.write_slot(slot, *weights)
            event = torch.cuda.Event()
            event.record(self._stream)
        return event, weights

    def _has_landed(self, swap: PendingSwap) -> bool:
        if swap.copied is None:
            return True
        if not swap.copied.done():
            return False
        return swap.copied.result()[0].query()

    def _flip_landed(self) -> None:
        waiting = []
        for swap in self.pending:
            if not self._has_landed(swap):
                waiting.append(swap)
                continue
            freed_slot = self.layers[swap.layer].flip(swap.evict, swap.admit, swap.slot)
            if self._is_cuda:  # the next copy into the freed slot waits for the steps queued before this point
                event = torch.cuda.Event()
                event.record(torch.cuda.current_stream(self.device))
                self._freed[(swap.layer, freed_slot)] = event
            self.num_swaps += 1
        self.pending = waiting

    def drain(self) -> None:
        """Waits until every started copy is done on the device (before a graph capture: no other thread may
        issue CUDA work during one); their flips still come at the next between-steps call."""
        for swap in self.pending:
            if swap.copied is not None:
                swap.copied.result()[0].synchronize()

    def close(self) -> None:
        self.drain()
        if self._worker is not None:
            self._worker.shutdown(wait=True)


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
