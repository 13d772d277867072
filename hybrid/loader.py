"""Weight loading from a HuggingFace checkpoint directory or a `hybrid-convert` output directory.

Tensors are read one at a time (`hybrid.checkpoint`), so the peak extra memory is one tensor; quantized source
weights (DeepSeek FP8 blocks, compressed-tensors FP8 / packed INT4, converted INT8/INT4 experts) are dequantized
on the CPU, except where the GPU kernels take them as stored: with `keep_quantized`, dense Linear layers whose
weight is stored in a form `gpu_layers.linear` multiplies become `QuantizedLinear`s before the names are checked
(`hybrid.layers.quantized_linear`), and receive the stored parts as read (`load_parts`). Before anything is
copied, the set of checkpoint tensors is compared with what the model expects: a missing, unexpected or
mis-shaped tensor is a `CheckpointError` naming it. A model whose routed experts run on the CPU operator takes
them from a converted directory's expert files, or, from a plain checkpoint, as `hybrid.direct_experts` reads them
(copied as stored or quantized at load). A load that takes more than a moment (a large checkpoint) shows
progress bars on a terminal's stderr: the dense tensors, then the CPU experts layer by layer.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from tqdm import tqdm

from hybrid import converted, direct_experts
from hybrid.checkpoint import Checkpoint, dequantize_fp8_block
from hybrid.errors import CheckpointError
from hybrid.layers.quantized_linear import place_quantized_linears
from hybrid.routed_experts import other_rank_expert_names

__all__ = ["load_weights", "open_sources", "check_names", "dequantize_fp8_block"]

PROGRESS_DELAY_SECONDS = 2.0  # a bar appears only once a load has run this long: small checkpoints show none


def open_sources(model, checkpoint_dir: str | Path, keep_quantized: bool = False
                 ) -> tuple[dict[str, object], converted.ConvertedExperts | None, Checkpoint]:
    """Logical tensor name -> the source that reads it (`Checkpoint` or converted experts), names checked; the
    converted experts, if any; and the checkpoint. Expert tensors count only when the model has parameters for
    them (the CPU operator takes the packed files, or `hybrid.direct_experts` reads them, instead).
    `keep_quantized`: place `QuantizedLinear`s first (see above)."""
    checkpoint_dir = Path(checkpoint_dir)
    config = model.config
    manifest = converted.read_manifest(checkpoint_dir)
    experts = converted.ConvertedExperts(checkpoint_dir, manifest, model) if manifest else None
    ckpt = Checkpoint.open(checkpoint_dir, config.fp8_block_size, config.compressed_tensors,
                           exclude=experts.file_names() if experts else (), prefixes=model.checkpoint_prefixes,
                           is_modelopt=config.is_modelopt)
    if keep_quantized:
        place_quantized_linears(model, ckpt)
    sources: dict[str, object] = {name: ckpt for name in ckpt.parts}
    targets = model.checkpoint_targets()
    if experts:
        sources.update({name: experts for name in experts.names() if name in targets})
    else:
        direct = direct_experts.direct_expert_names(model, ckpt) - set(targets)  # GPU-resident ones are targets
        missing = sorted(direct - set(ckpt.parts))
        if missing:
            raise CheckpointError(f"{checkpoint_dir}: missing tensor '{missing[0]}'"
                                  + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
        sources = {name: source for name, source in sources.items() if name not in direct}
    elsewhere = other_rank_expert_names(model)  # tensor parallel: other ranks' GPU experts, which they load
    if elsewhere:
        sources = {name: source for name, source in sources.items() if name not in elsewhere}
    check_names(checkpoint_dir, model, set(sources))
    return sources, experts, ckpt


def load_weights(model, checkpoint_dir: str | Path, num_partitions: int = 1, keep_quantized: bool = False,
                 progress: bool | None = None, expert_dtype: str = "int8", rank: int = 0, num_ranks: int = 1) -> None:
    """Copies every checkpoint tensor into `model` (a `MoECausalLM`), checking names and shapes first; CPU
    experts receive their layers split into `num_partitions`: a converted directory's packed files, or a plain
    checkpoint's experts as `hybrid.direct_experts` reads them (`expert_dtype`: EngineConfig's). `keep_quantized`
    (the Triton ops in bf16/fp16): quantized dense weights the kernels take stay as stored. `progress`: progress
    bars on stderr (None: when stderr is a terminal). `rank` of `num_ranks` (tensor parallel): the CPU experts keep
    the rank's slice of I (`cpu_experts.packed.rank_slice`)."""
    sources, experts, ckpt = open_sources(model, checkpoint_dir, keep_quantized)
    targets = model.checkpoint_targets()
    present = sorted(name for name in sources if not model.is_ignored_tensor(name))
    for name in present:  # shapes from the headers first, so a bad one fails before the long copy
        shape = sources[name].logical_shape(name)
        if shape is not None:
            _check_shape(sources[name], name, shape, targets[name])
    for name in _progress(present, "loading weights", "tensor", progress):
        if hasattr(targets[name], "load_parts"):  # a module keeping the stored (quantized) parts as they are
            _load_parts(sources[name], name, targets[name])
            continue
        tensor = sources[name].read(name)
        _check_shape(sources[name], name, tuple(tensor.shape), targets[name])
        with torch.no_grad():
            targets[name].copy_(tensor)
    bar = lambda layers: _progress(layers, "loading CPU experts", "layer", progress)  # noqa: E731
    if experts is not None:
        converted.load_cpu_experts(model, experts, num_partitions, bar, rank, num_ranks)
    elif direct_experts.cpu_layers(model):
        direct_experts.load_direct_cpu_experts(model, ckpt, expert_dtype, num_partitions, progress=bar, rank=rank,
                                               num_ranks=num_ranks)


def _progress(items, description: str, unit: str, progress: bool | None):
    return tqdm(items, desc=description, unit=unit, file=sys.stderr, delay=PROGRESS_DELAY_SECONDS,
                disable=None if progress is None else not progress)


def _load_parts(source, name: str, module) -> None:
    try:
        module.load_parts(source.read_parts(name))
    except ValueError as exc:
        raise CheckpointError(f"{source.file_of(name)}: '{name}': {exc}") from None


def _check_shape(source, name: str, shape: tuple[int, ...], target: torch.Tensor) -> None:
    if shape != tuple(target.shape):
        raise CheckpointError(
            f"{source.file_of(name)}: tensor '{name}' has shape {shape}, expected {tuple(target.shape)}"
        )


def check_names(checkpoint_dir: Path, model, present: set[str], is_checked_elsewhere=None) -> None:
    """Every expected tensor present (except optional ones), nothing present that the model does not use.
    `is_checked_elsewhere(name)`: names left out on both sides (the converter's fused experts, which their reader
    checks: `hybrid.fused_experts`)."""
    targets = model.checkpoint_targets()
    if is_checked_elsewhere is not None:
        targets = {name: t for name, t in targets.items() if not is_checked_elsewhere(name)}
        present = {name for name in present if not is_checked_elsewhere(name)}
    present = {name for name in present if not model.is_ignored_tensor(name)}
    missing = sorted(set(targets) - present - model.optional_tensor_names())
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"{checkpoint_dir}: missing tensor '{missing[0]}'{more}")
    unexpected = sorted(present - set(targets))
    if unexpected:
        more = f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""
        raise CheckpointError(f"{checkpoint_dir}: unexpected tensor '{unexpected[0]}'{more} not used by the model")
