"""The routed experts of a plain HuggingFace checkpoint directory on the CPU operator, without `hybrid-convert`:
what `hybrid.converted.load_cpu_experts` does with a converted directory's expert files, done from the checkpoint.

Per MoE layer, one at a time (so the load's peak memory is the resident experts plus about one layer): the layer's
stacked tensors are allocated (huge-page memory, `cpu_experts.memory`), filled expert by expert by a pool of
threads (torch's ops release the GIL), either copied as the checkpoint stores them (FP8, MXFP4, NVFP4,
compressed-tensors INT4: `hybrid.native_experts`) or quantized from their values to the engine's `expert_dtype`
(bf16 and fp16 experts; int8 by default), then sliced into NUMA partitions and handed to the layer's `CpuExperts`.
A stored expert that holds NaN (NaN codes or scales) is refused, naming the tensor and its file.

A model whose experts are stored fused per layer (gpt-oss: `fused_experts_prefix(layer)`, with the activation and
biases its spec carries, `expert_activation`, `has_expert_bias`; Qwen3.5's 3-D experts, float or block FP8:
`MoEConfig.has_fused_storage`) has its layers read expert by expert by `hybrid.fused_experts`, the converter's
readers (published MXFP4 and block FP8 kept as stored by default); their names (`FusedExperts.names`) are the ones
this loader takes (gpt-oss's are also skipped by the dense load: the model's `is_ignored_tensor`).
"""

from __future__ import annotations

import logging

import torch

from cpu_experts import memory, topology
from cpu_experts.expert_file import ROLES, ExpertLayerSpec
from cpu_experts.module import CpuExperts
from cpu_experts.packed import PackedLayer
from hybrid.checkpoint import Checkpoint
from hybrid.fused_experts import fused_experts, fused_source, read_fused_layer
from hybrid.native_experts import ExpertFormat, for_each_expert, projection_parts, resolve, routed_names, source_format

log = logging.getLogger(__name__)


def cpu_layers(model) -> dict[int, CpuExperts]:
    """The `CpuExperts` modules of `model` by MoE layer (each inside its layer's `RoutedExperts`)."""
    return {module.layer_idx: module for module in model.modules() if isinstance(module, CpuExperts)}


def direct_expert_names(model, ckpt: Checkpoint) -> set[str]:
    """The checkpoint names of the routed experts this loader reads (those of layers computed by the CPU operator)."""
    layers = set(cpu_layers(model))
    fused = [fused_experts(model, ckpt, layer) for layer in sorted(layers)]
    if any(f is not None for f in fused):
        return {name for f in fused if f is not None for name in f.names()}
    return {name for layer, _, _, name in routed_names(model) if layer in layers}


def expert_format(model, ckpt: Checkpoint, expert_dtype: str) -> ExpertFormat:
    """The CPU experts' format for `expert_dtype` (see `hybrid.native_experts.resolve`) over this checkpoint."""
    fused = [fused_experts(model, ckpt, layer) for layer in model.config.moe_layer_indices]
    if fused and fused[0] is not None:
        source = fused_source(fused)
    else:
        source = source_format(ckpt, [name for *_, name in routed_names(model)])
    return resolve(source, expert_dtype, flag="--expert-dtype")


def load_direct_cpu_experts(model, ckpt: Checkpoint, expert_dtype: str, num_partitions: int,
                            num_threads: int | None = None, progress=None, rank: int = 0,
                            num_ranks: int = 1) -> ExpertFormat:
    """Gives every `CpuExperts` of `model` its layer's experts read from `ckpt` (module docstring); returns the
    format chosen. A tensor-parallel rank keeps only its slice of I (`cpu_experts.packed.rank_slice`): the layer
    is read and quantized whole (a per-channel scale spans all of I), then sliced. `progress`: wraps the list of
    modules (a progress bar)."""
    topology.set_worker_spin()
    fmt = expert_format(model, ckpt, expert_dtype)
    note = fmt.note("expert_dtype='auto' (--expert-dtype auto)")
    if note is not None:
        log.info("%s", note)
    spec = fmt.model_spec(model)  # with the model's own activation and biases (gpt-oss)
    modules = sorted(cpu_layers(model).values(), key=lambda m: m.layer_idx)
    num_threads = num_threads or len(topology.allowed_cpus())
    for module in progress(modules) if progress is not None else modules:
        tensors = read_layer(ckpt, model, module.layer_idx, spec, fmt.is_passthrough, num_threads)
        module.load(PackedLayer.from_file_tensors(tensors, spec, num_partitions, rank, num_ranks))
        del tensors  # the slices are copies (several partitions, a rank's slice): the stacked layer goes now
    return fmt


def read_layer(ckpt: Checkpoint, model, layer: int, spec: ExpertLayerSpec, is_passthrough: bool,
               num_threads: int = 1) -> dict[str, torch.Tensor]:
    """MoE layer `layer`'s experts as the expert file's stacked tensors, `num_threads` experts at a time."""
    fused = fused_experts(model, ckpt, layer)
    if fused is not None:
        fused.check(ckpt, spec.num_experts, spec.hidden_size, spec.intermediate_size)
        return read_fused_layer(ckpt, fused, spec, is_passthrough, ckpt.refuse_nonfinite, num_threads)
    tensors = {name: memory.empty_tensor(shape, dtype) for name, (shape, dtype) in spec.tensor_shapes().items()}

    def one_expert(expert: int) -> None:
        for role in ROLES:
            name = model.routed_expert_name(layer, expert, role)
            for part, tensor, first in projection_parts(ckpt, name, role, spec, is_passthrough,
                                                        ckpt.refuse_nonfinite):
                target = tensors[f"{role}.{part}"][expert]
                (target if target.dim() == 0 else target[first:first + tensor.shape[0]]).copy_(tensor)

    for_each_expert(one_expert, spec.num_experts, num_threads)
    return tensors
