"""Engine-side settings (where and how to run), separate from the model's own config."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybrid.errors import ConfigError

EXPERT_ACTIVATIONS = ("int8", "float")
KERNELS = ("auto", "triton", "torch")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class EngineConfig:
    device: str = "cpu"
    dtype: str = "bfloat16"  # weights and activations; routers and norms compute in float32 regardless
    max_model_len: int | None = None  # prompt + generated tokens per sequence; None: min(model limit, 4096)
    block_size: int = 16  # tokens per KV-cache page
    numa_partitions: int | None = None  # CPU experts: partitions of I; None: one per NUMA node
    # int8 CPU experts: "int8" rounds each activation row to int8 (W8A8: VNNI/AMX-INT8 prefill, what llama.cpp and
    # KTransformers do); "float" keeps activations in float, exact to the converted weights, prefill slower
    expert_activations: str = "int8"
    # dense layers and attention: "auto" runs gpu_layers' Triton kernels on CUDA and the PyTorch references
    # elsewhere; "torch" keeps the references on CUDA too; "triton" forces the kernels
    kernels: str = "auto"
    # converted models: routed experts per MoE layer kept on the engine's device (the most routed ones per
    # `routing_stats`, a JSON file of per-layer expert counts, else the first ones); the rest run on the CPU
    gpu_experts: int = 0
    routing_stats: str | None = None

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype '{self.dtype}' is not supported; supported: {', '.join(DTYPES)}")
        if self.block_size < 1:
            raise ConfigError(f"block_size must be >= 1, got {self.block_size}")
        if self.numa_partitions is not None and self.numa_partitions < 1:
            raise ConfigError(f"numa_partitions must be >= 1, got {self.numa_partitions}")
        if self.expert_activations not in EXPERT_ACTIVATIONS:
            raise ConfigError(f"expert_activations '{self.expert_activations}' is not one of "
                              f"{', '.join(EXPERT_ACTIVATIONS)}")
        if self.gpu_experts < 0:
            raise ConfigError(f"gpu_experts must be >= 0, got {self.gpu_experts}")
        if self.kernels not in KERNELS:
            raise ConfigError(f"kernels '{self.kernels}' is not one of {', '.join(KERNELS)}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ConfigError(f"max_model_len must be >= 1, got {self.max_model_len}")
        try:
            torch.device(self.device)
        except (RuntimeError, TypeError):
            raise ConfigError(f"device '{self.device}' is not a valid torch device (e.g. 'cpu', 'cuda')") from None

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]
