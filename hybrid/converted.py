"""Reading a `hybrid-convert` output directory: its manifest (`hybrid.json`) and its routed-expert files.

The GPU weights of a converted directory are an ordinary (possibly compressed-tensors) checkpoint that
`hybrid.checkpoint` reads; the experts live in `experts/layer-NNN.safetensors` (layout in
`cpu_experts.expert_file`). The runtime hands each layer's packed tensors to its `CpuExperts` module
(`load_cpu_experts`); `ConvertedExperts.read` dequantizes one expert at a time, for models with stacked expert
parameters (the reference backend, `hybrid-convert verify`).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from cpu_experts import memory, topology
from cpu_experts.executor import AsyncExperts
from cpu_experts.expert_file import ROLES, ExpertLayerSpec, dequantize_matrix
from cpu_experts.module import CpuExperts
from cpu_experts.packed import PackedLayer
from hybrid.errors import CheckpointError
from hybrid.safetensors_io import SafetensorsFile

MANIFEST_FILE = "hybrid.json"
MANIFEST_FORMAT = "hybrid-converted"
MANIFEST_VERSION = 1


def read_manifest(directory: Path) -> dict | None:
    """The manifest of a converted directory, or None for a plain checkpoint."""
    path = Path(directory) / MANIFEST_FILE
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: unreadable manifest ({exc})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
        raise CheckpointError(f"{path}: not a {MANIFEST_FORMAT} manifest")
    if manifest.get("format_version") != MANIFEST_VERSION:
        raise CheckpointError(f"{path}: format_version {manifest.get('format_version')!r} is not supported (this "
                              f"hybrid reads version {MANIFEST_VERSION}); convert the model again")
    return manifest


class ConvertedExperts:
    """Logical expert tensors (`model.layers.N.mlp.experts.E.gate_proj.weight`, ...) read from the expert files."""

    def __init__(self, directory: Path, manifest: dict, model):
        self.directory = Path(directory)
        self.layers: dict[int, tuple[SafetensorsFile, ExpertLayerSpec]] = {}
        try:
            layer_files = {int(k): v for k, v in manifest["experts"]["files"].items()}
        except (KeyError, TypeError, ValueError, AttributeError):
            manifest_path = self.directory / MANIFEST_FILE
            raise CheckpointError(f"{manifest_path}: 'experts.files' is missing or malformed") from None
        self._names: dict[str, tuple[int, int, str]] = {}
        for layer, rel in sorted(layer_files.items()):
            path = self.directory / rel
            if not path.is_file():
                raise CheckpointError(f"{path}: expert file listed in {MANIFEST_FILE} is missing")
            file = SafetensorsFile(path)
            try:
                spec = ExpertLayerSpec.from_metadata(file.metadata)
            except (KeyError, ValueError) as exc:
                raise CheckpointError(f"{path}: {exc}") from None
            self._check_layout(file, spec)
            self.layers[layer] = (file, spec)
            for e in range(spec.num_experts):
                for role in ROLES:
                    self._names[model.routed_expert_name(layer, e, role)] = (layer, e, role)

    def _check_layout(self, file: SafetensorsFile, spec: ExpertLayerSpec) -> None:
        for name, (shape, dtype) in spec.tensor_shapes().items():
            info = file.tensors.get(name)
            if info is None or info.shape != shape or info.dtype != dtype:
                found = "missing" if info is None else f"{info.dtype} {info.shape}"
                raise CheckpointError(f"{file.path}: tensor '{name}' is {found}, expected {dtype} {shape}")

    def file_names(self) -> set[str]:
        return {file.path.name for file, _ in self.layers.values()}

    def names(self) -> set[str]:
        return set(self._names)

    def file_of(self, name: str) -> Path:
        return self.layers[self._names[name][0]][0].path

    def logical_shape(self, name: str) -> tuple[int, ...]:
        layer, _, role = self._names[name]
        return self.layers[layer][1].matrix_shape(role)

    def read(self, name: str) -> torch.Tensor:
        layer, expert, role = self._names[name]
        file, spec = self.layers[layer]
        scales = file.read(f"{role}.scales", expert) if spec.dtype != "bf16" else None
        weight = file.read(f"{role}.weight", expert)
        tensor_scale = file.read(f"{role}.tensor_scale", expert) if spec.dtype == "nvfp4" else None
        return weight if spec.dtype == "bf16" else dequantize_matrix(weight, scales, role, spec, tensor_scale)


def load_cpu_experts(model, experts: ConvertedExperts, num_partitions: int, progress=None, rank: int = 0,
                     num_ranks: int = 1) -> None:
    """Hands every `CpuExperts` module of `model` its layer's packed weights, split into `num_partitions`; a
    tensor-parallel rank keeps only its slice of I (`cpu_experts.packed.rank_slice`: each layer is read whole, then
    sliced and dropped). `progress`: wraps the list of modules (a progress bar)."""
    topology.set_worker_spin()
    modules = [module for module in model.modules() if isinstance(module, CpuExperts)]
    for module in progress(modules) if progress is not None else modules:
        if module.layer_idx not in experts.layers:
            raise CheckpointError(f"{experts.directory / MANIFEST_FILE}: no expert file for MoE layer "
                                  f"{module.layer_idx}")
        file, spec = experts.layers[module.layer_idx]
        tensors = {name: file.read_into(name, memory.empty_tensor(shape, dtype))
                   for name, (shape, dtype) in spec.tensor_shapes().items()}
        module.load(PackedLayer.from_file_tensors(tensors, spec, num_partitions, rank, num_ranks))
        del tensors  # where the partitions are copies, the whole layer goes before the next one is read


def cpu_executor(model, max_tokens: int, dtype: torch.dtype, num_threads: int | None = None,
                 worker_cpus: tuple[int, ...] | None = None) -> AsyncExperts | None:
    """One asynchronous executor for every `CpuExperts` of `model` (they run one layer at a time; the model's
    `CpuHandoff` submits to it), so the MoE blocks overlap their shared expert with the CPU's routed experts; None
    if the model has none. `num_threads`: of the kernels' pool (`cpu_experts.topology.use_kernel_threads`);
    `worker_cpus`: the CPUs its thread, the kernels' pool it starts and the CUDA graphs' decode pool run on (a
    tensor-parallel rank's, `topology.rank_nodes`); None: wherever the process may run."""
    modules = {m.layer_idx: m for m in model.modules() if isinstance(m, CpuExperts)}
    if not modules:
        return None
    config = model.config

    def compute(layer, hidden, topk_ids, topk_weights, out):
        modules[layer].compute(hidden, topk_ids, topk_weights, out)

    return AsyncExperts(compute, max_tokens, config.hidden_size, config.moe.top_k, dtype, worker_cpus=worker_cpus,
                        num_threads=num_threads)
