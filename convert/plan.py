"""What a conversion writes, decided before anything is written: the source is opened and checked whole
(config, every shard's header, every tensor's name and shape against the model), then split into units of
one output file each: the non-layer GPU weights, each layer's GPU weights, each MoE layer's routed experts.
A unit is the granule of streaming (its tensors pass through memory one at a time) and of resuming. A layer whose
experts are stored fused (gpt-oss, Qwen3.5: `hybrid.fused_experts`) has its fused tensors checked by their reader's
expectations instead of the model's names, and read one expert's rows at a time.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from hybrid.checkpoint import Checkpoint
from hybrid.config import ModelConfig
from hybrid.converted import MANIFEST_FILE
from hybrid.errors import CheckpointError, ConfigError
from hybrid.fused_experts import FusedExperts, fused_experts
from hybrid.loader import check_names
from hybrid.models import load_model_config
from hybrid.models.base import MoECausalLM
from hybrid.stored_matrix import is_finite

EMBED_FILE = "gpu-embed.safetensors"
ROLES = ("gate", "up", "down")
# Any one of them makes a tokenizer transformers can load (with tokenizer_config.json where there is one).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tiktoken.model", "vocab.json", "vocab.txt")


def gpu_layer_file(layer: int) -> str:
    return f"gpu-layer-{layer:03d}.safetensors"


def expert_layer_file(layer: int) -> str:
    return f"experts/layer-{layer:03d}.safetensors"


@dataclass(frozen=True)
class Unit:
    path: str  # output file relative to DST
    layer: int | None
    is_experts: bool
    names: tuple[str, ...]  # logical checkpoint tensors it consumes (GPU units write them under these names)
    source_bytes: int


@dataclass
class Plan:
    source: Path
    ckpt: Checkpoint
    config: ModelConfig
    model: MoECausalLM  # on the meta device: names, shapes and the expert-name mapping, no weights
    targets: dict[str, torch.Tensor] = field(default_factory=dict)  # checkpoint name -> meta tensor (shape)
    units: list[Unit] = field(default_factory=list)
    allow_nonfinite: bool = False  # --allow-nonfinite: NaN and inf in the source are converted, not refused
    fused: dict[int, FusedExperts] = field(default_factory=dict)  # MoE layer -> its fused experts (gpt-oss, Qwen3.5)

    def expert_name(self, layer: int, expert: int, role: str) -> str:
        return self.model.routed_expert_name(layer, expert, role)

    def read(self, name: str) -> torch.Tensor:
        """`ckpt.read(name)` (the logical tensor, dequantized), refused when it holds NaN or inf."""
        return self.check_finite(name, self.ckpt.read(name))

    def read_raw(self, stored: str) -> torch.Tensor:
        """`ckpt.read_raw(stored)` (one tensor as stored), refused when it holds NaN or inf."""
        return self.check_finite(stored, self.ckpt.read_raw(stored))

    def check_finite(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` (source tensor `name`, or values that are NaN or inf exactly where it is), unless it holds NaN or
        inf and --allow-nonfinite is off: a NaN weight makes every output it touches NaN."""
        if not self.allow_nonfinite and not is_finite(tensor):
            raise CheckpointError(f"{self.ckpt.file_of(name)}: tensor '{name}' holds NaN or inf values; repair the "
                                  "checkpoint, or pass --allow-nonfinite to convert it as it is")
        return tensor


def has_tokenizer(source: Path) -> bool:
    return any((source / name).is_file() for name in TOKENIZER_FILES)


def build_plan(source: str | Path, allow_nonfinite: bool = False) -> Plan:
    source = Path(source)
    if not source.is_dir():
        raise ConfigError(f"{source}: not a directory (expected a HuggingFace checkpoint)")
    if (source / MANIFEST_FILE).exists():
        raise ConfigError(f"{source}: already a hybrid-convert output ({MANIFEST_FILE} present); convert the "
                          "original HuggingFace checkpoint instead")
    cls, config = load_model_config(source)
    if not config.num_moe_layers:
        raise ConfigError(f"{source}: {config.architecture} has no routed experts, so there is nothing to convert for "
                          "the CPU operator; serve the checkpoint directory as it is")
    with torch.device("meta"):
        model = cls(config)
    ckpt = Checkpoint.open(source, config.fp8_block_size, config.compressed_tensors,
                           prefixes=model.checkpoint_prefixes, is_modelopt=config.is_modelopt)
    fused = {layer: f for layer in config.moe_layer_indices if (f := fused_experts(model, ckpt, layer)) is not None}
    fused_prefixes = tuple(f"{f.prefix}." for f in fused.values())
    check_names(source, model, set(ckpt.parts), lambda name: name.startswith(fused_prefixes))
    _check_fused(ckpt, config, fused)
    _check_shapes(ckpt, model, fused_prefixes)
    plan = Plan(source, ckpt, config, model, model.checkpoint_targets(), allow_nonfinite=allow_nonfinite, fused=fused)
    plan.units = _units(plan)
    return plan


def _check_fused(ckpt: Checkpoint, config: ModelConfig, fused: dict[int, FusedExperts]) -> None:
    """Each fused layer's stored tensors as its reader expects them, and nothing else under its prefix."""
    for f in fused.values():
        f.check(ckpt, config.moe.num_experts, config.hidden_size, config.moe.intermediate_size)
        names = f.names()
        unexpected = sorted(n for n in ckpt.parts if n.startswith(f"{f.prefix}.") and n not in names)
        if unexpected:
            expected = ", ".join(n.rpartition(".")[2] for n in names)
            raise CheckpointError(f"{ckpt.file_of(unexpected[0])}: unexpected tensor '{unexpected[0]}' beside the "
                                  f"fused experts of '{f.prefix}' ({expected})")


def _check_shapes(ckpt: Checkpoint, model: MoECausalLM, skipped: tuple[str, ...] = ()) -> None:
    targets = model.checkpoint_targets()
    for name in ckpt.parts:
        if name.startswith(skipped):
            continue
        if not model.is_ignored_tensor(name):
            ckpt.check_parts(name)
        shape = ckpt.logical_shape(name)
        if name in targets and shape is not None and shape != tuple(targets[name].shape):
            raise CheckpointError(f"{ckpt.file_of(name)}: tensor '{name}' has shape {shape}, expected "
                                  f"{tuple(targets[name].shape)}")


def _units(plan: Plan) -> list[Unit]:
    ckpt, config, model = plan.ckpt, plan.config, plan.model
    used = sorted(name for name in ckpt.parts if not model.is_ignored_tensor(name))
    expert_names = {
        plan.expert_name(layer, e, role): layer
        for layer in range(config.num_layers) if config.moe_layers[layer] and layer not in plan.fused
        for e in range(config.moe.num_experts) for role in ROLES
    }
    expert_names |= {name: layer for layer, f in plan.fused.items() for name in f.names()}
    by_layer: dict[int | None, list[str]] = {}
    for name in used:
        if name in expert_names:
            continue
        match = re.match(r"model\.layers\.(\d+)\.", name)
        by_layer.setdefault(int(match.group(1)) if match else None, []).append(name)

    def size(names) -> int:
        return sum(ckpt.info(part).nbytes for n in names for part in ckpt.parts[n])

    units = [Unit(EMBED_FILE, None, False, tuple(by_layer.get(None, ())), size(by_layer.get(None, ())))]
    for layer in range(config.num_layers):
        names = tuple(by_layer.get(layer, ()))
        units.append(Unit(gpu_layer_file(layer), layer, False, names, size(names)))
        if config.moe_layers[layer]:
            experts = tuple(n for n, lay in expert_names.items() if lay == layer)
            units.append(Unit(expert_layer_file(layer), layer, True, experts, size(experts)))
    return units
