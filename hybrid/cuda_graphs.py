"""Decode steps replayed as CUDA graphs, one per batch-size bucket, with the CPU experts' hand-off inside them.

A decode step (every sequence runs one token) has fixed shapes once its batch is padded to a bucket (1, 2, 4, 8,
... up to `max_graph_batch`), so its launches are captured once and replayed: the GPU no longer waits on Python
launching a few hundred kernels per token. Inputs live in static device buffers (a slot mapping and block table
per cache group) that each step overwrites with the runner's prepared inputs (`_fill`); padded rows write no KV
(slot -1), attend to one key and route no token to the CPU. The decode kernels size their grids by the largest
context (`max_model_len`), so one graph serves every context length.

CPU experts inside the graph: while capturing, each `CpuExperts` module is bound to a `GraphHandoff` (the
executor API, `submit`/`sync`, done with device work only): submit copies the layer's routed tokens into the
`FlagWorker`'s pinned buffers and posts the layer on a flag; the shared and GPU-resident experts run; sync waits
on the GPU for the worker's done flag and copies the output back. The host arms the worker before each replay and
checks it once the step has synchronised (`finish_step`). Where the layers' experts suit it, the same flags and
buffers are served by `cpu_experts.decode_pool.DecodePool` instead (steps below the prefill kernels' threshold);
the device side cannot tell the two apart.

Contract with the model runner (`hybrid.model_runner`, which owns this object): `can_run(num_seqs)`,
`run(inputs, input_ids) -> logits [num_seqs, V]` (inputs: `StepInputs.prepare` of a decode step; a view of the
graph's output, valid until the next step), then `finish_step()` after the host has read what it needs.
"""

from __future__ import annotations

import contextlib

import torch

from cpu_experts.decode_pool import DecodePool, supports
from cpu_experts.flag_worker import DONE, REQUEST, FlagWorker
from cpu_experts.module import CpuExperts
from cpu_experts.topology import allowed_cpus
from gpu_layers.handoff import post_flag, wait_flag
from hybrid.block_manager import blocks_needed
from hybrid.forward_batch import ForwardBatch, StepInputs, padded
from hybrid.layers.moe import SparseMoE


class GraphHandoff:
    """The executor API of `cpu_experts.executor` for captured graphs: only device work and copies, no host
    decisions. Rows at or past the step's batch (`valid_rows` False) are routed nowhere (ids -1)."""

    def __init__(self, worker: FlagWorker, device: torch.device):
        self.worker = worker
        self.dtype = worker.dtype
        self.valid_rows = torch.zeros(worker.max_tokens, 1, dtype=torch.bool, device=device)
        self.out = torch.zeros(worker.max_tokens, worker.hidden_size, dtype=worker.dtype, device=device)
        self.request_flag = worker.flags[REQUEST:REQUEST + 1]
        self.done_flag = worker.flags[DONE:DONE + 1]
        self._pending: tuple[int, int] | None = None

    def submit(self, layer: int, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> None:
        num_tokens = hidden.shape[0]
        w = self.worker
        w._validate(hidden, topk_ids, topk_weights)
        topk_ids = topk_ids.masked_fill(~self.valid_rows[:num_tokens], -1)
        w.hidden_buffer[:num_tokens].copy_(hidden, non_blocking=True)
        w.ids_buffer[:num_tokens].copy_(topk_ids, non_blocking=True)
        w.weights_buffer[:num_tokens].copy_(topk_weights, non_blocking=True)
        post_flag(self.request_flag, layer + 1)  # stream order: after the copies have landed
        self._pending = (layer, num_tokens)

    def sync(self) -> torch.Tensor:
        layer, num_tokens = self._pending
        self._pending = None
        wait_flag(self.done_flag, layer + 1)
        self.out[:num_tokens].copy_(self.worker.out_buffer[:num_tokens], non_blocking=True)
        return self.out[:num_tokens]


def graph_buckets(max_batch: int) -> list[int]:
    buckets, size = [], 1
    while size < max_batch:
        buckets.append(size)
        size *= 2
    return buckets + [max_batch]


class CudaGraphRunner:
    def __init__(self, llm, max_batch: int):
        self.llm = llm
        self.model = llm.model
        cfg = llm.engine_config
        self.device = torch.device(cfg.device)
        self.block_size = cfg.block_size
        self.max_model_len = llm.max_model_len
        self.buckets = graph_buckets(max_batch)
        max_blocks = blocks_needed(self.max_model_len, self.block_size)
        n = self.buckets[-1]
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=self.device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=self.device)
        num_groups = len(llm.blocks.groups)
        self.slot_mappings = tuple(torch.full((n,), -1, dtype=torch.int64, device=self.device)
                                   for _ in range(num_groups))
        self.block_tables = tuple(torch.zeros(n, max_blocks, dtype=torch.int32, device=self.device)
                                  for _ in range(num_groups))
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=self.device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=self.device)
        self.cpu_modules = [m for m in self.model.modules() if isinstance(m, CpuExperts)]
        self.worker = self.handoff = self.pool = None
        if self.cpu_modules:
            executor = llm.cpu_executor
            self.worker = FlagWorker(executor, n)
            self.handoff = GraphHandoff(self.worker, self.device)
            self.pool = self._decode_pool(executor) if cfg.cpu_decode_pool else None
        self._armed = None  # who serves the step in flight: the pool or the worker
        # CPU requests per step: one per MoE layer, two where the layer defers experts to the next one
        self.num_requests = sum(1 + m.is_deferring for m in self.model.modules()
                                if isinstance(m, SparseMoE) and getattr(m.experts, "is_async", False))
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.num_replays = 0

    def can_run(self, num_seqs: int) -> bool:
        return num_seqs <= self.buckets[-1]

    def _batch(self, size: int) -> ForwardBatch:
        # Host lengths only size the decode grids: the largest context any step can have.
        return ForwardBatch(
            positions=self.positions[:size], slot_mappings=tuple(s[:size] for s in self.slot_mappings),
            block_tables_by_group=tuple(t[:size] for t in self.block_tables), seq_lens=self.seq_lens[:size],
            query_start_loc=self.query_start_loc[:size + 1], block_size=self.block_size,
            seq_lens_cpu=[self.max_model_len] * size, query_lens_cpu=[1] * size)

    def _forward(self, size: int) -> torch.Tensor:
        hidden = self.model(self.input_ids[:size], self._batch(size))
        return self.model.compute_logits(hidden)  # [size, V] float32

    def _decode_pool(self, executor) -> DecodePool | None:
        """The pool on the CPUs the executor's kernels use; None where a layer's experts do not suit it (int4 or
        bf16 experts, float activations, a CPU without VNNI): the worker then serves every graph step."""
        ops = {m.layer_idx: m.op for m in self.cpu_modules}
        if not all(supports(op) for op in ops.values()):
            return None
        return DecodePool(self.worker, ops, allowed_cpus()[:executor.num_threads or len(allowed_cpus())])

    def _arm(self, size: int) -> None:
        if self.worker is not None:
            self._armed = self.pool if self.pool is not None and self.pool.serves(size) else self.worker
            self._armed.arm(size, self.num_requests)

    def finish_step(self) -> None:
        """After the host synchronised with the step: raise if the CPU side failed."""
        armed, self._armed = self._armed, None
        if armed is not None:
            armed.finish_step()

    def park(self) -> None:
        """Before an eager step: the pool's threads stop spinning, leaving the CPUs to its kernels."""
        if self.pool is not None:
            self.pool.park()

    @torch.inference_mode()
    def capture(self) -> None:
        """Largest bucket first, all sharing one memory pool; each is run eagerly first (kernel compilation, the
        allocator's warm-up) with every row padding, so nothing is written to the KV cache."""
        pool = None
        with self._handoff_bound():
            for size in reversed(self.buckets):
                for _ in range(2):
                    self._arm(size)
                    self._forward(size)
                    torch.cuda.synchronize(self.device)
                    self.finish_step()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.logits[size] = self._forward(size)
                pool = graph.pool()
                self.graphs[size] = graph

    def run(self, inputs: StepInputs, input_ids: list[int]) -> torch.Tensor:
        """One decode step (one new token per sequence) -> float32 logits [num_seqs, V]."""
        size = self._fill(inputs, input_ids)
        self._arm(size)
        self.graphs[size].replay()
        self.num_replays += 1
        return self.logits[size][:len(input_ids)]

    @torch.inference_mode()
    def run_eagerly(self, inputs: StepInputs, input_ids: list[int]) -> torch.Tensor:
        """The step `run` replays, launched op by op (same buffers, shapes and hand-off): checks and debugging."""
        size = self._fill(inputs, input_ids)
        with self._handoff_bound():
            self._arm(size)
            return self._forward(size)[:len(input_ids)]

    @contextlib.contextmanager
    def _handoff_bound(self):
        """The CPU experts bound to the graph hand-off (what a captured step calls), then back to the executor."""
        for module in self.cpu_modules:
            module.bind(self.handoff)
        try:
            yield
        finally:
            for module in self.cpu_modules:
                module.bind(self.llm.cpu_executor)

    def _fill(self, inputs: StepInputs, input_ids: list[int]) -> int:
        """Copies the prepared step into the static buffers of the smallest bucket that holds it (padded rows: no
        KV write, one key); returns that bucket."""
        num_seqs = len(input_ids)
        size = next(b for b in self.buckets if b >= num_seqs)
        num_pad = size - num_seqs
        self.input_ids[:size].copy_(torch.tensor(input_ids + [0] * num_pad))
        self.positions[:size].copy_(torch.tensor(inputs.positions + [0] * num_pad))
        self.seq_lens[:size].copy_(torch.tensor(inputs.seq_lens + [1] * num_pad, dtype=torch.int32))
        for group, (slots, tables) in enumerate(zip(inputs.slot_mappings, inputs.block_tables, strict=True)):
            self.slot_mappings[group][:size].copy_(torch.tensor(slots + [-1] * num_pad))
            width = self.block_tables[group].shape[1]
            self.block_tables[group][:size].copy_(torch.tensor(padded(tables + [[]] * num_pad, width),
                                                               dtype=torch.int32))
        if self.handoff is not None:
            self.handoff.valid_rows[:size].copy_(torch.arange(size)[:, None] < num_seqs)
        return size

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
        if self.worker is not None:
            self.worker.close()
