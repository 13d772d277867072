"""One routed-experts module per MoE layer, one protocol: `submit(hidden [T, H], topk_ids [T, K], topk_weights
[T, K])`, then `collect(like) -> [T, H]` (`forward` is the two in a row). The MoE block overlaps its own work (the
shared expert) between them.

Where each expert runs is placement, decided once at start-up and held as data: `gpu_expert_ids` (the layer's
GPU-resident experts, `hybrid.placement.ExpertPlacement`; every expert for a model whose experts all live on the
engine's device) and the CPU operator (`cpu_experts`, all the others, split into NUMA partitions at load). The
module's own stacked parameters hold the GPU-resident experts, named by their global ids so the loader fills them
from the checkpoint or the expert files. Per step: ids -> local GPU slots (or -1) and CPU ids (or -1); the CPU part
is submitted first, through the model's one `CpuHandoff` in the step mode the runner set, or, for an eager step of
at least `gpu_prefill_tokens` tokens, computed on the GPU from streamed weights (`hybrid.streaming`); then the GPU
part is computed while the CPU works; the two outputs add up.

Tensor parallel (expert parallel on the GPUs): a rank's module holds its own share of the GPU-resident experts
(`gpu_expert_ids`) and knows the other ranks' (`other_rank_expert_ids`), which it computes nowhere; its CPU part
is its slice of I of every expert resident on no GPU (`cpu_experts.packed.rank_slice`). Its output is then a
partial sum, which the block's one all-reduce completes.
"""

from __future__ import annotations

import torch

from cpu_experts.expert_file import ROLES
from cpu_experts.module import CpuExperts
from hybrid.cpu_handoff import CpuHandoff, StepMode
from hybrid.layers.moe import TritonExperts, fused_expert_targets
from hybrid.placement import ExpertPlacement
from hybrid.streaming import StreamedPrefill

OTHER_RANK = -2  # `local_slot` of an expert on another tensor-parallel rank's GPU


class RoutedExperts(TritonExperts):
    """`is_fused`: the GPU-resident experts run through the fused-MoE kernel (gate and up stacked after loading,
    `TritonExperts`), else through the PyTorch reference. `cpu_experts` None: every expert is GPU-resident, here or
    (`other_rank_expert_ids`) on another tensor-parallel rank's GPU."""

    def __init__(self, layer_idx: int, config, gpu_expert_ids: tuple[int, ...], cpu: CpuExperts | None = None,
                 handoff: CpuHandoff | None = None, is_fused: bool = False, streamed: StreamedPrefill | None = None,
                 other_rank_expert_ids: tuple[int, ...] = (), num_spare_slots: int = 0):
        moe = config.moe
        # experts resident on a GPU are whole there (expert parallel), except where every rank holds every expert
        is_split = cpu is None and not other_rank_expert_ids
        super().__init__(len(gpu_expert_ids) + num_spare_slots, config.hidden_size, moe.intermediate_size,
                         moe.expert_proj_names, is_split=is_split)
        if set(gpu_expert_ids) & set(other_rank_expert_ids):
            raise ValueError(f"layer {layer_idx}: experts {sorted(set(gpu_expert_ids) & set(other_rank_expert_ids))} "
                             "are both on this rank's GPU and on another's")
        num_resident = len(gpu_expert_ids) + len(other_rank_expert_ids)
        if cpu is None and (num_resident != moe.num_experts or not gpu_expert_ids):
            raise ValueError(f"layer {layer_idx}: {len(gpu_expert_ids)} of {moe.num_experts} experts on this GPU, "
                             f"{len(other_rank_expert_ids)} on other ranks' and no CPU operator for the rest")
        if cpu is not None and handoff is None:
            raise ValueError(f"layer {layer_idx}: CPU experts need the model's CpuHandoff")
        self.layer_idx = layer_idx
        self.num_experts = moe.num_experts
        if num_spare_slots and (cpu is None or other_rank_expert_ids):
            raise ValueError(f"layer {layer_idx}: spare GPU slots (hot experts) need a CPU part and one GPU")
        self.gpu_expert_ids = gpu_expert_ids  # sorted; slot s holds slot_experts[s] (-1: a spare slot)
        self.slot_experts = list(gpu_expert_ids) + [-1] * num_spare_slots
        self.other_rank_expert_ids = other_rank_expert_ids
        self.is_fused = is_fused
        self.cpu_experts = cpu
        self.handoff = handoff
        self.streamed = streamed
        self.register_buffer("local_slot", self._slots(), persistent=False)  # global id -> GPU slot, or -1
        self._pending: tuple[bool, torch.Tensor | None] | None = None  # (CPU part handed off, device part)

    @property
    def has_cpu_part(self) -> bool:
        return self.cpu_experts is not None

    @property
    def num_cpu_experts(self) -> int:
        """The layer's experts resident on no GPU (of which a tensor-parallel rank computes its slice of I)."""
        return self.num_experts - len(self.gpu_expert_ids) - len(self.other_rank_expert_ids)

    @property
    def is_graph_safe(self) -> bool:
        """The CPU part goes through the graph hand-off; a GPU part must run on the fused kernel."""
        return not self.gpu_expert_ids or self.w_gate_up is not None

    def _slots(self) -> torch.Tensor:
        slots = torch.full((self.num_experts,), -1, dtype=torch.int64, device="cpu")
        for slot, expert in enumerate(self.slot_experts):
            if expert >= 0:
                slots[expert] = slot
        slots[list(self.other_rank_expert_ids)] = OTHER_RANK
        return slots

    def reset_buffers(self) -> None:
        """Rebuilt after the model was built on the meta device (like the rotary frequencies)."""
        self.local_slot = self._slots().to(self.local_slot.device)

    def checkpoint_targets(self):
        """Slot s holds expert gpu_expert_ids[s]: named by its global id, as checkpoints and expert files name it."""
        if self.has_fused_storage:
            self._check_unsplit_storage()
            yield from fused_expert_targets(self, self.gpu_expert_ids, self.num_experts)
            return
        for name in self.proj_names:
            stacked = getattr(self, name)
            for slot, expert in enumerate(self.slot_experts[:len(self.gpu_expert_ids)]):  # before any swap
                yield f"{expert}.{name}.weight", self.expert_target(name, stacked.data[slot])

    def free_slots(self) -> list[int]:
        """GPU slots no expert occupies (hot experts: where the next admitted expert is copied)."""
        return [slot for slot, expert in enumerate(self.slot_experts) if expert < 0]

    @property
    def slot_dtype(self) -> torch.dtype:
        return getattr(self, self.proj_names[0]).dtype

    def write_slot(self, slot: int, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> None:
        """One expert's weights (gate, up [I, H], down [H, I]) into free slot `slot`, on the current stream (the
        fused layout's gate and up parameters are views of `w_gate_up`, so it sees them)."""
        if self.slot_experts[slot] >= 0:
            raise RuntimeError(f"layer {self.layer_idx}: slot {slot} holds expert {self.slot_experts[slot]}")
        for name, weight in zip(self.proj_names, (gate, up, down), strict=True):
            getattr(self, name).data[slot].copy_(weight, non_blocking=True)

    def flip(self, evict: int, admit: int, slot: int) -> int:
        """Between steps, after `admit`'s weights landed in free slot `slot`: `admit` is computed there from the
        next step on and `evict` on the CPU; returns the slot `evict` leaves free. In-place writes on the current
        stream: the slot table keeps its address (captured graphs read it at replay)."""
        if self.slot_experts[slot] >= 0 or evict not in self.gpu_expert_ids or admit in self.gpu_expert_ids:
            raise RuntimeError(f"layer {self.layer_idx}: cannot swap expert {evict} for {admit} into slot {slot}")
        freed = self.slot_experts.index(evict)
        self.local_slot[admit] = slot
        self.local_slot[evict] = -1
        self.slot_experts[slot], self.slot_experts[freed] = admit, -1
        self.gpu_expert_ids = tuple(sorted(e for e in self.slot_experts if e >= 0))
        return freed

    def fuse_gate_up(self) -> None:
        if self.is_fused and self.gpu_expert_ids:
            super().fuse_gate_up()

    def _split(self, topk_ids: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """topk_ids [T, K] -> (GPU slots or -1, CPU ids or -1), each None where that side has no experts; another
        rank's GPU experts are -1 on both sides."""
        if not self.other_rank_expert_ids:  # one GPU, or this layer's experts on no other rank's
            if not self.has_cpu_part:
                return topk_ids, None
            if not self.gpu_expert_ids:
                return None, topk_ids
        ids = topk_ids.long()
        slot = torch.where(ids >= 0, self.local_slot[ids.clamp_min(0)], -1)  # >= 0, -1 (CPU) or OTHER_RANK
        local = slot.clamp_min(-1) if self.gpu_expert_ids else None
        return local, torch.where(slot == -1, ids, -1) if self.has_cpu_part else None

    def submit(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> None:
        if self._pending is not None:
            raise RuntimeError(f"layer {self.layer_idx}: submit() while a submit is pending: collect() first")
        local, cpu_ids = self._split(topk_ids)
        streamed_out = None
        if cpu_ids is not None:
            streamed = self.streamed
            streamed_ids = experts = None
            if streamed is not None and self.handoff.mode is StepMode.EAGER and streamed.takes(hidden):
                # a streamed step: some experts may stay on the CPU (`hybrid.prefill_split`), computed meanwhile
                cpu_ids, streamed_ids, experts = streamed.split(cpu_ids)
            if cpu_ids is not None:
                self.handoff.submit(self.cpu_experts, hidden, cpu_ids, topk_weights)
            if streamed_ids is not None:
                streamed_out = streamed.compute_on_gpu(hidden, streamed_ids, topk_weights, experts)
        gpu_out = super().forward(hidden, local, topk_weights) if local is not None else None  # while the CPU works
        if streamed_out is not None:
            gpu_out = streamed_out if gpu_out is None else gpu_out + streamed_out
        self._pending = (cpu_ids is not None, gpu_out)

    def collect(self, like: torch.Tensor) -> torch.Tensor:
        """The submitted step's output [T, H] in `like`'s dtype, on its device."""
        if self._pending is None:
            raise RuntimeError(f"layer {self.layer_idx}: collect() without a pending submit()")
        (has_cpu, gpu_out), self._pending = self._pending, None
        cpu_out = self.handoff.collect(like) if has_cpu else None
        if cpu_out is None:  # neither side when a split step's tokens route to none of this rank's experts
            return gpu_out if gpu_out is not None else torch.zeros_like(like)
        return cpu_out if gpu_out is None else cpu_out + gpu_out

    def forward(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        self.submit(hidden, topk_ids, topk_weights)
        return self.collect(hidden)


def device_experts_factory(layer_idx: int, config, is_fused: bool = False) -> RoutedExperts:
    """Every routed expert on the engine's device (the model's own weights)."""
    return RoutedExperts(layer_idx, config, tuple(range(config.moe.num_experts)), is_fused=is_fused)


def cpu_experts_factory(layer_idx: int, config, handoff: CpuHandoff, placement: ExpertPlacement | None = None,
                        int8_activations: bool = True, is_fused: bool = False, min_streamed_tokens: int = 0,
                        device: torch.device | str = "cpu", rank: int = 0, num_spare_slots: int = 0,
                        prefill_cpu_share: float | None = 0.0) -> RoutedExperts:
    """The CPU operator for the layer's experts, less those `placement` keeps on the GPUs (rank `rank`'s on its
    own); `min_streamed_tokens` > 0: eager steps of that many tokens stream the CPU experts' weights to `device`
    instead (`hybrid.streaming`), but for `prefill_cpu_share` of them (None: chosen on the rates `LLM` measures,
    `hybrid.prefill_split`); `num_spare_slots`: free GPU slots that hot experts copy into (`hybrid.hot_experts`).
    The CPU operator is loaded later, with the rank's slice of I (every expert of it, resident or not)."""
    gpu_ids = placement.on_rank(layer_idx, rank) if placement is not None else ()
    resident = placement.gpu_experts.get(layer_idx, ()) if placement is not None else ()
    others = tuple(sorted(set(resident) - set(gpu_ids)))  # other ranks' GPUs: computed nowhere here
    if len(resident) == config.moe.num_experts:  # the whole layer fits: no CPU part to hand anything to
        if not others:
            return device_experts_factory(layer_idx, config, is_fused)
        return RoutedExperts(layer_idx, config, gpu_ids, is_fused=is_fused, other_rank_expert_ids=others)
    cpu = CpuExperts(layer_idx, int8_activations=int8_activations)
    streamed = StreamedPrefill(cpu, min_streamed_tokens, device, prefill_cpu_share) if min_streamed_tokens else None
    return RoutedExperts(layer_idx, config, gpu_ids, cpu, handoff, is_fused, streamed, others, num_spare_slots)


def other_rank_expert_names(model) -> set[str]:
    """The checkpoint names of the routed experts that other tensor-parallel ranks' GPUs hold (per-expert names:
    fused storage names a layer's experts together, and every rank reads its own out of it), which this rank's
    load leaves alone."""
    return {model.routed_expert_name(m.layer_idx, e, role) for m in model.modules() if isinstance(m, RoutedExperts)
            for e in m.other_rank_expert_ids for role in ROLES}
