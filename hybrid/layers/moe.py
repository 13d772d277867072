"""Sparse MoE block: router -> routed experts (one module per layer, `hybrid.routed_experts`, through its
submit/collect protocol) + optional shared expert."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from cpu_experts.reference import moe_reference
from hybrid import parallel
from hybrid.config import MoEConfig
from hybrid.errors import ConfigError
from hybrid.layers.mlp import GatedMLP
from hybrid.layers.ops import TORCH_OPS, DenseOps


class _HoldsCorrectionBias(nn.Module):
    """A module that may own the routing correction bias (`e_score_correction_bias`, float32 [E] or None); the
    bias stays float32 whatever the model dtype: it decides selection between close sigmoid scores."""

    def _register_correction_bias(self, moe: MoEConfig, owner: str) -> None:
        if moe.has_correction_bias and moe.correction_bias_at == owner:
            self.register_buffer("e_score_correction_bias", torch.zeros(moe.num_experts, dtype=torch.float32))
        else:
            self.e_score_correction_bias = None

    def _apply(self, fn, recurse=True):
        # Keep the correction bias in float32 when the module is cast (e.g. model.to(torch.bfloat16)).
        bias = self.e_score_correction_bias
        super()._apply(fn, recurse)
        if bias is not None:
            self.e_score_correction_bias = self.e_score_correction_bias.float()
        return self


class Router(_HoldsCorrectionBias):
    """Top-k expert choice per token. Parameter names follow the checkpoints (`gate.weight`, and
    `gate.e_score_correction_bias` unless the MoE block holds the bias: `MoEConfig.correction_bias_at`)."""

    def __init__(self, hidden_size: int, moe: MoEConfig, ops: DenseOps = TORCH_OPS):
        super().__init__()
        self.moe = moe
        self.ops = ops
        self.recorder = None  # `hybrid.placement.RoutingRecorder` and this layer's index, when recording
        self.weight = nn.Parameter(torch.empty(moe.num_experts, hidden_size))
        self._register_correction_bias(moe, "gate")
        # the fused router's completion counter (`gpu_layers.routing.router_topk`), 0 between launches
        self.register_buffer("route_counter", torch.zeros(1, dtype=torch.int32), persistent=False)

    def reset_buffers(self) -> None:
        """Zeroed after the model was built on the meta device (like the rotary frequencies)."""
        self.route_counter = torch.zeros(1, dtype=torch.int32, device=self.route_counter.device)

    def forward(self, x: torch.Tensor, correction_bias: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """`correction_bias`: the block's, where the block holds it (else the router's own is used)."""
        weights, ids = self.route(x, correction_bias)
        self.record(ids)
        return weights, ids

    def route(self, x: torch.Tensor, correction_bias: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward` without the recording: a block that records later (`SparseMoE`) calls `record` itself."""
        return self._route(x, self.e_score_correction_bias if correction_bias is None else correction_bias)

    def record(self, ids: torch.Tensor) -> None:
        """The routing counts, when recording (`hybrid.placement.RoutingRecorder`)."""
        if self.recorder is not None:
            recorder, layer_idx = self.recorder
            recorder.add(layer_idx, ids)

    def _is_fused(self, x: torch.Tensor) -> bool:
        """Decode-sized steps on the kernels' ops: the GEMV and the top-k in one launch (larger steps: two)."""
        from gpu_layers.routing import MAX_FUSED_TOKENS

        return (self.ops.router_topk is not None and 1 <= x.shape[0] <= MAX_FUSED_TOKENS
                and x.dtype == self.weight.dtype and x.stride(-1) == 1)

    def _route(self, x: torch.Tensor, correction_bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        moe = self.moe
        if self._is_fused(x):
            # The kernel multiplies in float32 (16-bit products are exact there: a router "in float32" needs no
            # converted copies) and rounds the logits to x's dtype unless the router runs in float32, as the
            # unfused GEMV's output is rounded.
            return self.ops.router_topk(
                x, self.weight, correction_bias, self.route_counter, moe.top_k, moe.num_groups, moe.topk_group,
                moe.scoring, moe.group_score, moe.norm_topk_prob, moe.routed_scaling_factor, moe.router_in_fp32)
        if moe.router_in_fp32:
            logits = F.linear(x.float(), self.weight.float())
        else:
            logits = F.linear(x, self.weight)  # [T, E]
        if moe.scoring == "softmax" and moe.group_score == "none" and correction_bias is None:
            weights, ids = self.ops.softmax_topk(logits, moe.top_k, moe.norm_topk_prob)
            return weights * moe.routed_scaling_factor if moe.routed_scaling_factor != 1.0 else weights, ids
        return self.ops.grouped_topk(
            logits.float(), correction_bias, moe.top_k, moe.num_groups, moe.topk_group,
            moe.scoring, moe.group_score, moe.norm_topk_prob, moe.routed_scaling_factor,
        )


class FusedExpertsTarget:
    """The loader's destination for a fused 3-D expert tensor (`experts.gate_up_proj` [E, 2I, H], gate rows first;
    `experts.down_proj` [E, H, I]): it has the stored shape, and `copy_` spreads each resident expert's rows into
    that expert's per-expert parameters (`pieces`: (expert id, row slice, destination view))."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, pieces: list[tuple[int, slice, torch.Tensor]]):
        self.shape, self.dtype, self.pieces = torch.Size(shape), dtype, pieces

    def dim(self) -> int:
        return len(self.shape)

    def copy_(self, tensor: torch.Tensor) -> None:
        for expert, rows, dest in self.pieces:
            dest.copy_(tensor[expert, rows])


def fused_expert_targets(module: nn.Module, expert_ids, num_experts: int):
    """(suffix, FusedExpertsTarget) for a stacked-experts module whose slot s holds expert `expert_ids[s]`."""
    gate, up, down = (getattr(module, n) for n in module.proj_names)
    inter, hidden = gate.shape[1], gate.shape[2]
    yield "gate_up_proj", FusedExpertsTarget(
        (num_experts, 2 * inter, hidden), gate.dtype,
        [piece for s, e in enumerate(expert_ids)
         for piece in ((e, slice(0, inter), gate.data[s]), (e, slice(inter, 2 * inter), up.data[s]))])
    yield "down_proj", FusedExpertsTarget((num_experts, hidden, inter), down.dtype,
                                          [(e, slice(None), down.data[s]) for s, e in enumerate(expert_ids)])


class TorchExperts(nn.Module):
    """All of a layer's routed experts as stacked tensors, computed by the plain-PyTorch reference. With
    `has_fused_storage` (set by the model: `MoEConfig.has_fused_storage`) the checkpoint names them as two fused
    3-D tensors (`FusedExpertsTarget`), else one name per expert and projection. Tensor parallel: each rank holds
    every expert's slice of the intermediate dimension (gate and up rows, down columns), so its output is a partial
    sum that the MoE block's one all-reduce completes."""

    has_fused_storage = False

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int,
                 proj_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"), is_split: bool = True):
        """`is_split` False: whole experts on every rank (the CPU operator's GPU-resident experts, dealt over the
        ranks' GPUs instead: `hybrid.routed_experts`)."""
        super().__init__()
        self.tp = parallel.current() if is_split else parallel.SINGLE
        if self.tp.size > 1:
            parallel.check_divisible("moe_intermediate_size", intermediate_size, self.tp)
            intermediate_size //= self.tp.size
        self.proj_names = proj_names
        gate, up, down = proj_names
        self.register_parameter(gate, nn.Parameter(torch.empty(num_experts, intermediate_size, hidden_size)))
        self.register_parameter(up, nn.Parameter(torch.empty(num_experts, intermediate_size, hidden_size)))
        self.register_parameter(down, nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size)))

    def checkpoint_targets(self):
        """(checkpoint suffix, destination view) pairs: expert e's `{e}.gate_proj.weight` is row e of the stack."""
        if self.has_fused_storage:
            self._check_unsplit_storage()
            yield from fused_expert_targets(self, range(getattr(self, self.proj_names[0]).shape[0]),
                                            getattr(self, self.proj_names[0]).shape[0])
            return
        for name in self.proj_names:
            stacked = getattr(self, name)
            for e in range(stacked.shape[0]):
                yield f"{e}.{name}.weight", self.expert_target(name, stacked.data[e])

    def expert_target(self, name: str, view: torch.Tensor):
        """One expert's projection as the loader fills it: the view, or at tensor parallel its `ShardTarget`
        (gate and up split by rows, down by columns)."""
        if self.tp.size == 1:
            return view
        shard = parallel.ROW if name == self.proj_names[2] else parallel.COLUMN
        return parallel.ShardTarget(view, shard, self.tp)

    def _check_unsplit_storage(self) -> None:
        if self.tp.size > 1:
            raise ConfigError("routed experts stored fused (experts.gate_up_proj) are not split over tensor-parallel "
                              "ranks yet: run with tensor_parallel_size 1")

    def forward(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        gate, up, down = (getattr(self, n) for n in self.proj_names)
        return moe_reference(hidden, gate, up, down, topk_ids, topk_weights)


class TritonExperts(TorchExperts):
    """The routed experts on the GPU through `gpu_layers.fused_moe` (bf16/fp16). After loading, `fuse_gate_up`
    stacks gate and up into one [E, 2I, H] weight, the kernel's layout; the two parameters become its views, so
    the checkpoint names still address them and no memory is added."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.w_gate_up: torch.Tensor | None = None

    @property
    def is_graph_safe(self) -> bool:
        """Whether a CUDA graph can capture this module: the fused-MoE kernel runs from shapes alone, while the
        PyTorch reference picks the routed experts on the host."""
        return self.w_gate_up is not None

    def fuse_gate_up(self) -> None:
        if self.w_gate_up is not None:
            return
        gate, up, _ = (getattr(self, n) for n in self.proj_names)
        inter = gate.shape[1]
        fused = torch.cat((gate.data, up.data), dim=1)  # [E, 2I, H]
        gate.data, up.data = fused[:, :inter], fused[:, inter:]
        self.w_gate_up = fused

    def forward(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        from gpu_layers.fused_moe import fused_moe

        if self.w_gate_up is None:  # not loaded through `LLM` (which fuses after loading)
            return super().forward(hidden, topk_ids, topk_weights)
        down = getattr(self, self.proj_names[2])
        return fused_moe(hidden, self.w_gate_up, down, topk_ids, topk_weights.float().contiguous())


class ExpertDeferral:
    """`defer_experts=N` (opt-in; 0 keeps the model exact): each token's N lowest-weight routed experts of a MoE
    layer run on the CPU while the GPU computes the next layer's attention, and their output is added to the next
    MoE layer's output instead of this one's, so that attention sees a hidden state missing them. One instance per
    model carries the pending layer from one SparseMoE to the next; the last MoE layer defers nothing."""

    def __init__(self, num_deferred: int):
        self.num_deferred = num_deferred
        self._pending: tuple[nn.Module, torch.Tensor] | None = None  # (experts submitted, their input)

    @staticmethod
    def split(topk_ids: torch.Tensor, topk_weights: torch.Tensor, num_deferred: int):
        """topk_ids [T, K] -> (ids now, ids deferred), each -1 where the other one has the expert."""
        lowest = topk_weights.argsort(dim=1)[:, :num_deferred]  # [T, N] columns of the lowest weights
        is_deferred = torch.zeros_like(topk_ids, dtype=torch.bool).scatter_(1, lowest, True)
        return topk_ids.masked_fill(is_deferred, -1), topk_ids.masked_fill(~is_deferred, -1)

    def hold(self, experts: nn.Module, x: torch.Tensor) -> None:
        self._pending = (experts, x)

    def collect(self) -> torch.Tensor | None:
        """The previous MoE layer's deferred output [T, H] (waits for the CPU), or None."""
        if self._pending is None:
            return None
        experts, x = self._pending
        self._pending = None
        return experts.collect(like=x)


class SparseMoE(_HoldsCorrectionBias):
    """`shared_name` follows the checkpoint: `shared_experts` (DeepSeek, GLM) or `shared_expert` (Qwen2-MoE,
    which also has a sigmoid `shared_expert_gate`). `experts`: the layer's routed experts, anything with
    `submit(hidden, topk_ids, topk_weights)` and `collect(like)` (`hybrid.routed_experts.RoutedExperts`).
    `deferral`: expert deferral across MoE layers (CPU experts only), `is_deferring`: whether this layer hands some
    of its experts to the next one."""

    def __init__(self, hidden_size: int, moe: MoEConfig, experts: nn.Module, shared_name: str = "shared_experts",
                 ops: DenseOps = TORCH_OPS, deferral: ExpertDeferral | None = None, is_deferring: bool = False):
        super().__init__()
        self.gate = Router(hidden_size, moe, ops)
        self._register_correction_bias(moe, "block")
        self.experts = experts
        self.tp = parallel.current()  # tensor parallel without deferral: `parallel.check_tensor_parallel`
        self.shared_name = shared_name if moe.shared_intermediate_size else None
        if self.shared_name:  # its partial sum joins the routed experts' before the block's one all-reduce
            setattr(self, shared_name, GatedMLP(hidden_size, moe.shared_intermediate_size, ops, is_reduced=False))
        self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False) if moe.has_shared_gate else None
        self.deferral, self.is_deferring = deferral, is_deferring

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        topk_weights, topk_ids = self.gate.route(x, self.e_score_correction_bias)
        routed_ids = topk_ids
        carried = self.deferral.collect() if self.deferral is not None else None
        deferred_ids = None
        if self.is_deferring:
            topk_ids, deferred_ids = ExpertDeferral.split(topk_ids, topk_weights, self.deferral.num_deferred)
        # the routed experts' submit/collect protocol (`hybrid.routed_experts`): the shared expert runs between
        self.experts.submit(x, topk_ids, topk_weights)
        # counted once the CPU has its tokens: in a graph step the counting kernels then run while the CPU computes,
        # not on the way to the hand-off (hot experts record every step)
        self.gate.record(routed_ids)
        shared = self._shared(x)
        out = self.experts.collect(like=x)
        if deferred_ids is not None:  # runs on the CPU while the next layer's attention runs on the GPU
            self.experts.submit(x, deferred_ids, topk_weights)
            self.deferral.hold(self.experts, x)
        for part in (shared, carried):
            if part is not None:
                out = out + part
        return parallel.all_reduce(out, self.tp)  # routed + shared partial sums: the block's one all-reduce

    def _shared(self, x: torch.Tensor) -> torch.Tensor | None:
        if not self.shared_name:
            return None
        shared = getattr(self, self.shared_name)(x)
        if self.shared_expert_gate is not None:
            shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
        return shared
