"""Engine-side settings (where and how to run), separate from the model's own config."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from cpu_experts.expert_file import EXPERT_DTYPES
from hybrid.errors import ConfigError

EXPERT_ACTIVATIONS = ("int8", "float")
EXPERT_PLACEMENTS = ("auto", "cpu", "device")
KERNELS = ("auto", "triton", "torch")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _help(text: str, choices: tuple | None = None) -> dict:
    return {"help": text, "choices": choices} if choices else {"help": text}


@dataclass(frozen=True)
class EngineConfig:
    device: str = field(default="cpu", metadata=_help("torch device of the dense layers and attention"))
    # weights and activations; routers and norms compute in float32 regardless
    dtype: str = field(default="bfloat16", metadata=_help("weights and activations", tuple(DTYPES)))
    max_model_len: int | None = field(default=None, metadata=_help(
        "prompt + generated tokens per sequence; default min(model limit, 4096)"))
    block_size: int = field(default=16, metadata=_help("tokens per KV-cache page"))
    kv_cache_tokens: int | None = field(default=None, metadata=_help(
        "tokens the paged KV cache holds over all sequences; default 4 x max_model_len"))
    # with kv_cache_tokens these size the sliding-window cache groups (`hybrid.cache_groups`); hybrid-serve sets
    # them from its --max-running-requests and --max-num-batched-tokens
    max_num_seqs: int = field(default=64, metadata=_help("requests the engine runs together"))
    max_num_batched_tokens: int | None = field(default=None, metadata=_help(
        "tokens per engine step (prefill chunk budget); default min(512, max_model_len)"))
    # `hybrid.placement.layerwise_step_tokens`: a long prompt's chunk grows to what the GPU memory holds, so that
    # the experts streamed for it cross PCIe once per chunk instead of once per max_num_batched_tokens
    layerwise_prefill_tokens: int | str = field(default="auto", metadata=_help(
        "where routed experts stream to the GPU for prefill: tokens an engine step without decodes may take (each "
        "layer runs all of them before the next layer, so every streamed expert crosses PCIe once a step; steps "
        "beside a decode keep to max_num_batched_tokens); 'auto': as many as the GPU memory left after weights, KV "
        "cache and gpu_experts holds, up to max_model_len; 0: off"))
    numa_partitions: int | None = field(default=None, metadata=_help(
        "CPU experts: partitions of the intermediate dimension; default one per NUMA node"))
    # int8 CPU experts: "int8" rounds each activation row to int8 (W8A8: VNNI/AMX-INT8 prefill, what llama.cpp and
    # KTransformers do); "float" keeps activations in float, exact to the converted weights, prefill slower
    expert_activations: str = field(default="int8", metadata=_help(
        "int8 CPU experts: activations rounded to int8 (fast) or kept in float (exact)", EXPERT_ACTIVATIONS))
    # A plain checkpoint's routed experts: "cpu" runs them on the CPU operator as a converted directory's (read
    # as stored or quantized at load, `hybrid.direct_experts`), "device" on the engine's device with the dense layers
    # (PyTorch reference or fused-MoE kernel); "auto" is "cpu" on CUDA, the product, and "device" elsewhere, where
    # the models' parity tests run them. Converted directories always use the CPU operator.
    expert_placement: str = field(default="auto", metadata=_help(
        "a plain checkpoint's routed experts: on the CPU operator, no hybrid-convert needed ('cpu'), or on the "
        "engine's device ('device'); auto: cpu on CUDA, device elsewhere", EXPERT_PLACEMENTS))
    expert_dtype: str = field(default="auto", metadata=_help(
        "CPU experts read from a plain checkpoint: auto keeps the checkpoint's own quantized experts as stored "
        "(FP8, MXFP4, NVFP4, compressed-tensors INT4) and quantizes float ones to int8; another value quantizes "
        "every checkpoint's experts to it at load (a second rounding for a quantized one)",
        ("auto", *EXPERT_DTYPES)))
    # "auto" runs gpu_layers' Triton kernels on CUDA and the PyTorch references elsewhere
    kernels: str = field(default="auto", metadata=_help("dense layers and attention", KERNELS))
    cuda_graph: bool = field(default=True, metadata=_help(
        "replay decode steps as CUDA graphs, CPU-expert hand-off included (CUDA only)"))
    # graph steps' CPU experts: a pool of pinned threads that spin on the hand-off's flags and run each layer in
    # compiled code (int8 experts, W8A8 on the integer kernels); off, or for other formats, the executor's thread
    # serves them through Python
    cpu_decode_pool: bool = field(default=True, metadata=_help(
        "serve decode-sized steps' CPU experts (graph and eager) from a pool of pinned spinning threads"))
    enable_prefix_caching: bool = field(default=True, metadata=_help(
        "reuse the KV pages of earlier requests' identical prefixes (keyed by BLAKE2b digests of the tokens)"))
    # models with recurrent layers (Gated DeltaNet): a prefix hit resumes their states from a snapshot taken at a
    # page boundary (`hybrid.block_manager.StateSnapshotPool`), each the size of one sequence's recurrent states and
    # counted with the KV cache's memory
    state_snapshots: int | None = field(default=None, metadata=_help(
        "recurrent models' prefix caching: recurrent-state snapshots kept at page boundaries (least recently used "
        "evicted); default max_num_seqs; 0 turns prefix caching off for them"))
    max_graph_batch: int = field(default=32, metadata=_help(
        "largest decode batch replayed as a graph (buckets 1, 2, 4, 8, ... up to it); larger ones run eagerly"))
    # converted models: routed experts per MoE layer kept on the engine's device (the most routed ones per
    # `routing_stats`, else the first ones); "auto" fills the device memory left after weights and KV cache
    gpu_experts: int | str = field(default=0, metadata=_help(
        "routed experts per MoE layer kept on the GPU: a count, or 'auto' to fill the free GPU memory"))
    # "auto": once a step gives each expert 16 tokens on average (T*K/E >= 16), past the CPU's break-even
    gpu_prefill_tokens: int | str = field(default="auto", metadata=_help(
        "steps of at least this many tokens compute CPU-resident experts on the GPU, streaming their weights over "
        "PCIe as stored (CUDA only; 0: never; 'auto': 16 x experts / top-k tokens)"))
    # `hybrid.prefill_split`: a streamed step's experts with the fewest tokens stay on the CPU, computed while the
    # others stream; "auto" splits only where a model of the step, on the link's and the CPU operator's times
    # measured at start-up, beats streaming all by a margin. Default 0 (stream all): the first device runs' auto was
    # no faster at 512 tokens and 2.3x slower at 2048; the model that replaced it is not yet measured
    prefill_cpu_share: float | str = field(default=0.0, metadata=_help(
        "streamed prefill steps: the fraction of routed CPU-resident experts (fewest tokens first) the CPU computes "
        "while the rest stream to the GPU (0: stream all; 1: none; 'auto': split only where the rates measured at "
        "start-up predict a faster step)"))
    gpu_memory_utilization: float = field(default=0.9, metadata=_help(
        "with --gpu-experts auto or --layerwise-prefill-tokens auto: the fraction of GPU memory the engine may "
        "fill"))
    # capped "auto" (a benchmark's GPU that holds a quarter of the experts)
    max_gpu_experts: int | None = field(default=None, metadata=_help(
        "with --gpu-experts auto: at most this many routed experts per MoE layer on the GPU"))
    # `hybrid.hot_experts`: the GPU-resident experts follow the routers' counts; hot_experts_swaps of the
    # gpu_experts slots per layer stay free for the copies, so gpu_experts must exceed it
    hot_experts_interval: int = field(default=0, metadata=_help(
        "every this many engine steps (and when idle) swap the most routed CPU experts into the GPU slots in place "
        "of the least routed resident ones (0: placement fixed at start-up)"))
    hot_experts_swaps: int = field(default=1, metadata=_help(
        "with --hot-experts-interval: experts swapped per MoE layer at a time (GPU slots kept spare for them)"))
    routing_stats: str | None = field(default=None, metadata=_help(
        "JSON file of per-layer routing counts that picks the GPU-resident experts (from --record-routing)"))
    record_routing: str | None = field(default=None, metadata=_help(
        "count the experts each MoE layer routes to and write them to this JSON file at shutdown"))
    # one process per rank, each holding a slice of the dense model (`hybrid.parallel`); rank 0 starts the others
    # and keeps the scheduler, engine and server; on CUDA rank r runs on cuda:r
    tensor_parallel_size: int = field(default=1, metadata={
        "help": "processes (GPUs on CUDA) the model is split over, attention by heads and MLPs by columns and rows",
        "aliases": ("--tp",)})
    defer_experts: int = field(default=0, metadata=_help(
        "add each token's N lowest-weight routed experts one layer later, overlapping the CPU with the next "
        "layer's attention (0: exact model semantics)"))

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype '{self.dtype}' is not supported; supported: {', '.join(DTYPES)}")
        for name in ("block_size", "max_graph_batch", "max_num_seqs", "tensor_parallel_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.state_snapshots is not None and self.state_snapshots < 0:
            raise ConfigError(f"state_snapshots must be >= 0 (0: no prefix caching for recurrent models), got "
                              f"{self.state_snapshots}")
        for name in ("numa_partitions", "max_model_len", "kv_cache_tokens", "max_num_batched_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"{name} must be >= 1, got {value}")
        if self.layerwise_prefill_tokens != "auto" and not (isinstance(self.layerwise_prefill_tokens, int)
                                                             and self.layerwise_prefill_tokens >= 0):
            raise ConfigError(f"layerwise_prefill_tokens must be a count >= 0 (0: off) or 'auto', got "
                              f"{self.layerwise_prefill_tokens!r}")
        if self.expert_activations not in EXPERT_ACTIVATIONS:
            raise ConfigError(f"expert_activations '{self.expert_activations}' is not one of "
                              f"{', '.join(EXPERT_ACTIVATIONS)}")
        if self.gpu_experts != "auto" and not (isinstance(self.gpu_experts, int) and self.gpu_experts >= 0):
            raise ConfigError(f"gpu_experts must be a count >= 0 or 'auto', got {self.gpu_experts!r}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.gpu_prefill_tokens != "auto" and not (isinstance(self.gpu_prefill_tokens, int)
                                                       and self.gpu_prefill_tokens >= 0):
            raise ConfigError(f"gpu_prefill_tokens must be a count >= 0 or 'auto', got {self.gpu_prefill_tokens!r}")
        if self.cuda_graph and self.gpu_prefill_tokens != "auto" \
                and 0 < self.gpu_prefill_tokens <= self.max_graph_batch:
            raise ConfigError(f"gpu_prefill_tokens {self.gpu_prefill_tokens} must be above max_graph_batch "
                              f"{self.max_graph_batch} (graph steps hand their experts to the CPU), or 0")
        if self.prefill_cpu_share != "auto" and not (isinstance(self.prefill_cpu_share, (int, float))
                                                      and 0 <= self.prefill_cpu_share <= 1):
            raise ConfigError(f"prefill_cpu_share must be a fraction in [0, 1] or 'auto', got "
                              f"{self.prefill_cpu_share!r}")
        if self.hot_experts_interval < 0 or self.hot_experts_swaps < 1:
            raise ConfigError(f"hot_experts_interval must be >= 0 (0: off) and hot_experts_swaps >= 1, got "
                              f"{self.hot_experts_interval} and {self.hot_experts_swaps}")
        if self.max_gpu_experts is not None and self.max_gpu_experts < 0:
            raise ConfigError(f"max_gpu_experts must be >= 0, got {self.max_gpu_experts}")
        if self.defer_experts < 0:
            raise ConfigError(f"defer_experts must be >= 0, got {self.defer_experts}")
        if self.expert_placement not in EXPERT_PLACEMENTS:
            raise ConfigError(f"expert_placement '{self.expert_placement}' is not one of "
                              f"{', '.join(EXPERT_PLACEMENTS)}")
        if self.expert_dtype not in ("auto", *EXPERT_DTYPES):
            raise ConfigError(f"expert_dtype '{self.expert_dtype}' is not one of auto, {', '.join(EXPERT_DTYPES)}")
        if self.kernels not in KERNELS:
            raise ConfigError(f"kernels '{self.kernels}' is not one of {', '.join(KERNELS)}")
        try:
            torch.device(self.device)
        except (RuntimeError, TypeError):
            raise ConfigError(f"device '{self.device}' is not a valid torch device (e.g. 'cpu', 'cuda')") from None

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def is_cuda(self) -> bool:
        return torch.device(self.device).type == "cuda"

    @property
    def cpu_share(self) -> float | None:
        """`prefill_cpu_share` as `hybrid.streaming.StreamedPrefill` takes it: None for "auto"."""
        return None if self.prefill_cpu_share == "auto" else float(self.prefill_cpu_share)

    @property
    def is_cpu_placement(self) -> bool:
        """A plain checkpoint's routed experts run on the CPU operator (`expert_placement`)."""
        return self.expert_placement == "cpu" or self.expert_placement == "auto" and self.is_cuda
