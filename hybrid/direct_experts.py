"""The routed experts of a plain HuggingFace checkpoint directory on the CPU operator, without `hybrid-convert`:
what `hybrid.converted.load_cpu_experts` does with a converted directory's expert files, done from the checkpoint.

Per MoE layer, one at a time (so the load's peak memory is the resident experts plus about one layer): the layer's
stacked tensors are allocated (huge-page memory, `cpu_experts.memory`), filled expert by expert by a pool of
threads (torch's ops release the GIL), either copied as the checkpoint stores them (FP8, MXFP4, NVFP4,
compressed-tensors INT4: `hybrid.native_experts`) or quantized from their values to the engine's `expert_dtype`
(bf16 and fp16 experts; int8 by default), then sliced into NUMA partitions and handed to the layer's `CpuExperts`.
A stored expert that holds NaN (NaN codes or scales) is refused, naming the tensor and its file.

A model whose experts are stored fused per layer (gpt-oss) says so with `fused_experts_prefix(layer)`: its layers
are read by `native_experts.read_gpt_oss_layer` (with the biases and activation its spec carries:
`expert_activation`, `has_expert_bias`), and its expert tensors are skipped by the dense load (the model's
`is_ignored_tensor`), so they are not named here. Qwen3.5's fused 3-D experts (`MoEConfig.has_fused_storage`:
`experts.gate_up_proj` [E, 2I, H], `experts.down_proj` [E, H, I]; float, or FP8 with `*_scale_inv` block scales)
are read expert by expert, FP8 copied as stored, float quantized (`native_experts.read_fused_layer`); their two
names per layer are the ones this loader takes (the scales are their parts).
"""

from __future__ import annotations

import logging
from dataclasses import replace

import torch

from cpu_experts import memory, topology
from cpu_experts.expert_file import ROLES, ExpertLayerSpec
from cpu_experts.module import CpuExperts
from cpu_experts.packed import PackedLayer
from hybrid.checkpoint import Checkpoint
from hybrid.native_experts import (
    ExpertFormat,
    for_each_expert,
    fused_fp8_source,
    gpt_oss_source,
    projection_parts,
    read_fused_layer,
    read_gpt_oss_layer,
    resolve,
    routed_names,
    source_format,
)

log = logging.getLogger(__name__)


def cpu_layers(model) -> dict[int, CpuExperts]:
    """The `CpuExperts` modules of `model` by MoE layer (each inside its layer's `RoutedExperts`)."""
    return {module.layer_idx: module for module in model.modules() if isinstance(module, CpuExperts)}


def direct_expert_names(model) -> set[str]:
    """The checkpoint names of the routed experts this loader reads (those of layers computed by the CPU operator)."""
    if is_fused(model):
        return set()
    layers = set(cpu_layers(model))
    if has_fused_3d(model):
        return {f"{_experts_prefix(model, layer)}.{suffix}" for layer in layers
                for suffix in ("gate_up_proj", "down_proj")}
    return {name for layer, _, _, name in routed_names(model) if layer in layers}


def has_fused_3d(model) -> bool:
    """Experts stored as fused 3-D float tensors per layer (Qwen3.5), not one tensor per expert."""
    return model.config.moe.has_fused_storage


def _experts_prefix(model, layer: int) -> str:
    return f"model.layers.{layer}.{model.ff_name}.experts"


def is_fused(model) -> bool:
    return hasattr(model, "fused_experts_prefix")


def expert_format(model, ckpt: Checkpoint, expert_dtype: str) -> ExpertFormat:
    """The CPU experts' format for `expert_dtype` (see `hybrid.native_experts.resolve`) over this checkpoint."""
    if is_fused(model):
        source = gpt_oss_source(ckpt, model.fused_experts_prefix(model.config.moe_layer_indices[0]))
    elif has_fused_3d(model):  # FP8 blocks (kept as stored by default), or float values (quantized, int8 default)
        source = fused_fp8_source(ckpt, _experts_prefix(model, model.config.moe_layer_indices[0]))
    else:
        source = source_format(ckpt, [name for *_, name in routed_names(model)])
    return resolve(source, expert_dtype, flag="--expert-dtype")


def layer_spec(model, fmt: ExpertFormat):
    """The expert files' spec of `model`'s layers in format `fmt`, with the model's activation and biases."""
    spec = fmt.spec(model.config)
    if hasattr(model, "expert_activation"):
        spec = replace(spec, activation=model.expert_activation, has_bias=model.has_expert_bias)
    return spec


def load_direct_cpu_experts(model, ckpt: Checkpoint, expert_dtype: str, num_partitions: int,
                            num_threads: int | None = None, progress=None) -> ExpertFormat:
    """Gives every `CpuExperts` of `model` its layer's experts read from `ckpt` (module docstring); returns the
    format chosen. `progress`: wraps the list of modules (a progress bar)."""
    topology.set_worker_spin()
    fmt = expert_format(model, ckpt, expert_dtype)
    note = fmt.note("expert_dtype='auto' (--expert-dtype auto)")
    if note is not None:
        log.info("%s", note)
    spec = layer_spec(model, fmt)
    modules = sorted(cpu_layers(model).values(), key=lambda m: m.layer_idx)
    num_threads = num_threads or len(topology.allowed_cpus())
    for module in progress(modules) if progress is not None else modules:
        tensors = read_layer(ckpt, model, module.layer_idx, spec, fmt.is_passthrough, num_threads)
        module.load(PackedLayer.from_file_tensors(tensors, spec, num_partitions))
        del tensors  # with several partitions the slices are copies: the stacked layer goes before the next one
    return fmt


def read_layer(ckpt: Checkpoint, model, layer: int, spec: ExpertLayerSpec, is_passthrough: bool,
               num_threads: int = 1) -> dict[str, torch.Tensor]:
    """MoE layer `layer`'s experts as the expert file's stacked tensors, `num_threads` experts at a time."""
    if is_fused(model):
        return read_gpt_oss_layer(ckpt, model.fused_experts_prefix(layer), spec, ckpt.refuse_nonfinite)
    if has_fused_3d(model):
        return read_fused_layer(ckpt, _experts_prefix(model, layer), spec, ckpt.refuse_nonfinite, num_threads)
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
