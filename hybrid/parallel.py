"""Tensor parallelism: the one place process-wide state lives (this process's rank and the ranks' count, its
process groups, the ranks' shared table of metrics, its share of the host's CPUs), the collectives the layers call,
and how a parameter is split over the ranks.

As vLLM splits a model (Megatron-LM's scheme): each rank holds a slice of every large weight, the layers are built
with per-rank sizes (heads / size, intermediate / size, vocabulary / size padded), and a layer whose last product is
row-parallel (attention's o_proj, an MLP's down_proj, the MoE block as a whole) sums the ranks' partial outputs with
ONE all-reduce. Norms, routers and MLA's low-rank down projections stay replicated: every rank computes them on the
same (reduced) input.

Groups: tensors go over NCCL when the engine's device is CUDA (rank r on `cuda:r`), over gloo otherwise; a gloo
group of its own for the host, whose timeout is long, where the workers wait for each other to be built (each
step's inputs go through shared memory instead: `hybrid.step_channel`). A rank that dies closes its sockets, so
gloo fails the others at once.

How a parameter is split is data (`Shard`): each layer class says which of its parameters are split and how
(`tp_shards()`: its own parameter names -> `Shard`), and `hybrid.models.base.checkpoint_targets_of` wraps each such
destination in a `ShardTarget`, which has the checkpoint's full shape and copies this rank's part, so the loader's
name and shape checks and "loading is a copy" are those of one process.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

from hybrid.errors import ConfigError

# A collective that waits this long has a hung peer (a dead one fails at once over gloo); the host group waits for
# the next step as long as the server idles.
DEVICE_TIMEOUT = timedelta(minutes=10)
HOST_TIMEOUT = timedelta(days=365)


@dataclass(frozen=True)
class TensorParallel:
    """This process's place among the ranks that hold one model: rank 0 drives (scheduler, engine, server)."""

    rank: int = 0
    size: int = 1

    def __post_init__(self):
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ConfigError(f"tensor-parallel rank {self.rank} of {self.size}: need 0 <= rank < size")


SINGLE = TensorParallel()
_state = SINGLE  # the ranks this process joined (`init`)
_device_group = None
_host_group = None
_rank_table = None  # every rank's published numbers (`hybrid.rank_stats.RankTable`, in shared memory)
_rank_cpus = None  # this rank's CPUs (`cpu_experts.topology.RankCpus`), found before any thread was pinned
_building: TensorParallel | None = None  # the place of the model being built (`building`)


def current() -> TensorParallel:
    """What layers read when they are built: the place of the model being built (`building`), else one process."""
    return _building or SINGLE


@contextmanager
def building(tp: TensorParallel):
    """Layers built inside take `tp` (`hybrid.llm.build_model` with the rank's `joined()` place; rank 0 may build a
    one-process model beside its tensor-parallel one)."""
    global _building
    previous, _building = _building, tp
    try:
        yield tp
    finally:
        _building = previous


def is_initialized() -> bool:
    """Whether this process has joined tensor-parallel ranks (`init`)."""
    return _state.size > 1


def joined() -> TensorParallel:
    """This process's place among the ranks it joined (rank 0 of 1 where it joined none)."""
    return _state


def set_nccl_environment() -> None:
    """NVLink multicast (NVLS) off in anything the project starts, before NCCL initialises."""
    os.environ["NCCL_NVLS_ENABLE"] = "0"


def init(rank: int, size: int, init_method: str, device: str, rank_table=None, cpus=None) -> TensorParallel:
    """Joins the ranks (every rank calls this with the same `init_method`: 'tcp://host:port' or 'file://path');
    tensors over NCCL on `device` when it is CUDA (this rank's `cuda:r`), else over gloo. `rank_table`: the shared
    table each rank publishes its metrics into (`hybrid.rank_stats`), the same on every rank; `cpus`: this rank's
    `RankCpus` (`hybrid.tp_workers.find_rank_cpus`)."""
    global _state, _device_group, _host_group, _rank_table, _rank_cpus
    if is_initialized():
        raise RuntimeError(f"tensor parallelism is already initialized in this process ({_state}): close the other "
                           "tensor-parallel LLM first")
    tp = TensorParallel(rank, size)
    is_cuda = torch.device(device).type == "cuda"
    if is_cuda:
        set_nccl_environment()
        torch.cuda.set_device(torch.device(device))
    # device_id: NCCL binds this rank's GPU and connects now, not at the first collective
    dist.init_process_group("nccl" if is_cuda else "gloo", init_method=init_method, rank=rank, world_size=size,
                            timeout=DEVICE_TIMEOUT, device_id=torch.device(device) if is_cuda else None)
    _device_group = dist.group.WORLD
    _host_group = dist.new_group(backend="gloo", timeout=HOST_TIMEOUT)
    _state, _rank_table, _rank_cpus = tp, rank_table, cpus
    return tp


def destroy(is_abort: bool = False) -> None:
    """Leaves the ranks (the process groups); the process is one process again. Over NCCL, and with a peer gone
    (`is_abort`), the groups are aborted, which waits for nobody: on the H200 pair NCCL's destroy waited for the
    peer's, and hung for good once decode graphs had captured the collectives."""
    global _state, _device_group, _host_group, _rank_table, _rank_cpus
    if dist.is_initialized():
        if is_abort or dist.get_backend() == "nccl":
            distributed_c10d._abort_process_group()
        else:
            dist.destroy_process_group()
    _state, _device_group, _host_group, _rank_table, _rank_cpus = SINGLE, None, None, None, None


def host_group():
    return _host_group


def rank_table():
    """The table of the ranks this process joined (`init`), or None."""
    return _rank_table


def rank_cpus():
    """This rank's share of the CPUs (`cpu_experts.topology.RankCpus`) where it joined ranks (`init`), else None."""
    return _rank_cpus


def all_reduce(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """The ranks' partial sums -> their sum, in place on every rank (no-op for one rank)."""
    if tp.size > 1:
        dist.all_reduce(x, group=_device_group)
    return x


def gather_vocab(logits: torch.Tensor, vocab_size: int, tp: TensorParallel) -> torch.Tensor:
    """Each rank's vocabulary shard of the logits [N, V / size padded] -> the whole [N, V] on every rank."""
    if tp.size == 1:
        return logits
    num_rows, shard = logits.shape
    gathered = logits.new_empty(tp.size * num_rows, shard)  # [size * N, V / size]: one tensor, graph-capturable
    _all_gather_single()(gathered, logits.contiguous(), group=_device_group)
    return gathered.view(tp.size, num_rows, shard).transpose(0, 1).reshape(num_rows, -1)[:, :vocab_size]


def _all_gather_single():
    """torch 2.13 renamed all_gather_into_tensor (deprecated there) to all_gather_single; the device has 2.11."""
    return getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def shard_range(n: int, rank: int, size: int) -> tuple[int, int]:
    """Rank `rank`'s [start, end) of `n` items split into `size` equal shards of ceil(n / size) (the last ones
    shorter, or empty, where `size` does not divide `n`)."""
    per = -(-n // size)
    start = min(rank * per, n)
    return start, min(start + per, n)


def local_heads(num_heads: int, tp: TensorParallel) -> int:
    """Heads a rank holds: num_heads / size, or one replicated head where there are fewer heads than ranks."""
    return max(1, num_heads // tp.size)


def check_divisible(what: str, n: int, tp: TensorParallel, fix: str = "") -> None:
    if n % tp.size:
        raise ConfigError(f"{what} {n} is not divisible by tensor_parallel_size {tp.size}"
                          f"{'; ' + fix if fix else ''}")


def check_kv_heads(num_kv_heads: int, tp: TensorParallel) -> None:
    if num_kv_heads % tp.size and tp.size % num_kv_heads:
        raise ConfigError(f"num_key_value_heads {num_kv_heads} and tensor_parallel_size {tp.size}: one must divide "
                          "the other (KV heads split, or each replicated on size / heads ranks)")


def check_tensor_parallel(config, engine, is_converted: bool) -> None:
    """Rank 0, before it starts the others: what tensor parallelism does not split yet is refused here, each with a
    one-line `ConfigError` saying what to change (`config`: the `ModelConfig`, `engine`: the `EngineConfig`)."""
    size = engine.tensor_parallel_size
    tp = TensorParallel(0, size)
    if torch.device(engine.device).type == "cuda":
        if torch.device(engine.device).index is not None:
            raise ConfigError(f"device '{engine.device}' with tensor_parallel_size {size}: pass device 'cuda' (rank r "
                              "runs on cuda:r)")
        if torch.cuda.device_count() < size:
            raise ConfigError(f"tensor_parallel_size {size} needs {size} GPUs, {torch.cuda.device_count()} visible")
    if engine.hot_experts_interval:
        raise ConfigError("hot_experts_interval is not supported with tensor parallelism (each rank's GPU experts "
                          "would have to move together): set hot_experts_interval 0")
    if engine.defer_experts:
        raise ConfigError("defer_experts is not supported with tensor parallelism: set defer_experts 0")
    if config.has_recurrent_layers:
        raise ConfigError(f"{config.architecture}: Gated DeltaNet layers are not split over tensor-parallel ranks: "
                          "run with tensor_parallel_size 1")
    for spec in config.layers:
        attention = spec.attention
        check_divisible("num_attention_heads", attention.num_heads, tp, "pick a tensor_parallel_size that divides it")
        if attention.kind == "gqa":
            if attention.qk_norm == "whole":
                raise ConfigError(f"{config.architecture}: qk_norm over the whole projection needs a distributed RMS: "
                                  "run with tensor_parallel_size 1")
            check_kv_heads(attention.num_kv_heads, tp)
    if not all(config.moe_layers):
        check_divisible("intermediate_size", config.intermediate_size, tp)
    if any(config.moe_layers):
        check_divisible("moe_intermediate_size", config.moe.intermediate_size, tp)
        check_divisible("shared expert intermediate size", config.moe.shared_intermediate_size, tp)
        # the CPU operator's experts read fused storage themselves, and a rank's GPU-resident ones are whole
        if config.moe.has_fused_storage and not (is_converted or engine.is_cpu_placement):
            raise ConfigError("routed experts stored fused (experts.gate_up_proj) are not split over tensor-parallel "
                              "ranks yet: run with tensor_parallel_size 1")


@dataclass(frozen=True)
class Shard:
    """How one parameter is split over the ranks:
    - "split": `dim` in equal parts (column-parallel: dim 0 of a Linear weight; row-parallel: dim 1);
    - "heads": dim 0 by heads, `full` heads in the checkpoint; rank r takes its local heads from head
      r * full // size, so with fewer heads than ranks each head is replicated on size / full ranks (KV heads);
    - "once": whole on rank 0, zero elsewhere (a row-parallel product's bias, added once by the all-reduce);
    - "vocab": dim 0 in equal parts of ceil(full / size) rows, the last padded with zero rows."""

    kind: str
    dim: int = 0
    full: int = 0

    def full_shape(self, local: torch.Size, tp: TensorParallel) -> tuple[int, ...]:
        shape = list(local)
        if self.kind == "split":
            shape[self.dim] *= tp.size
        elif self.kind == "heads":
            shape[0] = shape[0] // local_heads(self.full, tp) * self.full
        elif self.kind == "vocab":
            shape[0] = self.full
        return tuple(shape)

    def part(self, full: torch.Tensor, local: torch.Size, tp: TensorParallel) -> torch.Tensor | None:
        """This rank's part of the full tensor (the vocabulary shard unpadded), or None: zeros."""
        if self.kind == "split":
            n = local[self.dim]
            return full.narrow(self.dim, tp.rank * n, n)
        if self.kind == "heads":
            heads = local_heads(self.full, tp)
            head_rows = local[0] // heads
            return full.narrow(0, tp.rank * self.full // tp.size * head_rows, heads * head_rows)
        if self.kind == "vocab":
            start, end = shard_range(self.full, tp.rank, tp.size)
            return full[start:end]
        return full if tp.rank == 0 else None


COLUMN = Shard("split", 0)
ROW = Shard("split", 1)
ONCE = Shard("once")


def heads(num_heads: int) -> Shard:
    return Shard("heads", 0, num_heads)


def vocab(num_rows: int) -> Shard:
    return Shard("vocab", 0, num_rows)


class ShardTarget:
    """The loader's destination for a split parameter: the checkpoint's full `shape` and `dtype` (what the loader
    checks), and `copy_(full)` copies this rank's part into the local tensor (zeros where it has none)."""

    def __init__(self, local: torch.Tensor, shard: Shard, tp: TensorParallel):
        self.local, self.shard, self.tp = local, shard, tp
        self.shape = torch.Size(shard.full_shape(local.shape, tp))
        self.dtype = local.dtype

    def dim(self) -> int:
        return len(self.shape)

    def copy_(self, full: torch.Tensor) -> None:
        part = self.shard.part(full, self.local.shape, self.tp)
        if part is None:
            self.local.zero_()
            return
        rows = part.shape[0]
        self.local[:rows].copy_(part)
        if rows < self.local.shape[0]:  # the vocabulary's padding rows
            self.local[rows:].zero_()
