"""Decode steps replayed as CUDA graphs, one per batch-size bucket, with the CPU experts' hand-off inside them.

A decode step (every sequence runs one token) has fixed shapes once its batch is padded to a bucket (1, 2, 4, 8,
... up to `max_graph_batch`), so its launches are captured once and replayed: the GPU no longer waits on Python
launching a few hundred kernels per token. Inputs live in static device buffers (a slot mapping and block table
per cache group) that each step overwrites with the runner's prepared inputs (`_fill`); padded rows write no KV
(slot -1), attend to one key and route no token to the CPU. The decode kernels size their grids by the largest
context (`max_model_len`), so one graph serves every context length.

CPU experts inside the graph: capture (and `run_eagerly`) runs the model's `CpuHandoff` in `StepMode.GRAPH`
(`hybrid.cpu_handoff.GraphHandoff`, device work only): submit copies the layer's routed tokens into the
`FlagWorker`'s pinned buffers and posts the layer on a flag; the shared and GPU-resident experts run; collect
waits on the GPU for the worker's done flag and copies the output back. The host arms the worker before each replay and
checks it once the step has synchronised (`finish_step`). Where the layers' experts suit it, the same flags and
buffers are served by `cpu_experts.decode_pool.DecodePool` instead (steps below the prefill kernels' threshold);
the device side cannot tell the two apart.

Contract with the model runner (`hybrid.model_runner`, which owns this object): `can_run(num_seqs)`,
`run(inputs, input_ids) -> logits [num_seqs, V]` (inputs: `StepInputs.prepare` of a decode step; a view of the
graph's output, valid until the next step), then `finish_step()` after the host has read what it needs.
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch

from cpu_experts.decode_pool import DecodePool, supports
from cpu_experts.flag_worker import FlagWorker
from cpu_experts.module import CpuExperts
from cpu_experts.topology import allowed_cpus
from hybrid.block_manager import blocks_needed
from hybrid.cpu_handoff import GraphHandoff, StepMode
from hybrid.forward_batch import ForwardBatch, StepInputs
from hybrid.layers.moe import SparseMoE
from hybrid.placement import NO_ROW_LIMIT
from hybrid.routed_experts import RoutedExperts


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
        # recurrent layers' state slots (-1: a padding row, which the decode kernels skip); every row resumes
        self.has_recurrent_layers = llm.config.has_recurrent_layers
        self.state_slots = torch.full((n,), -1, dtype=torch.int32, device=self.device)
        self.has_initial_state = torch.ones(n, dtype=torch.bool, device=self.device)
        self.cpu_modules = [m for m in self.model.modules() if isinstance(m, CpuExperts)]
        self.worker = self.handoff = self.pool = None
        if self.cpu_modules:
            executor = llm.cpu_executor
            self.worker = FlagWorker(executor, n)
            self.handoff = llm.cpu_handoff.graph = GraphHandoff(self.worker, self.device)
            self.pool = self._decode_pool(executor) if cfg.cpu_decode_pool else None
            executor.decode_pool = self.pool  # eager decode steps too: one decode driver in the engine
        self._armed = None  # who serves the step in flight: the pool or the worker
        # routing counts (`record_routing`, hot experts): a replay counts its batch's rows, not the bucket's padding
        recorder = llm.routing_recorder
        self.row_limit = recorder.limit_rows(self.device) if recorder is not None else None
        # CPU requests per step: one per layer with CPU experts, two where the layer defers experts to the next one
        modules = list(self.model.modules())
        self.num_requests = (sum(isinstance(m, RoutedExperts) and m.has_cpu_part for m in modules)
                             + sum(isinstance(m, SparseMoE) and m.is_deferring for m in modules))
        # tensor parallel: the collectives are captured too, while NCCL's watchdog thread queries its events, which a
        # "global" capture forbids to every thread
        self.capture_error_mode = "thread_local" if getattr(llm, "tp", None) and llm.tp.size > 1 else "global"
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
            seq_lens_cpu=[self.max_model_len] * size, query_lens_cpu=[1] * size,
            state_slots=self.state_slots[:size], has_initial_state=self.has_initial_state[:size],
            state_slots_cpu=[-1] * size, has_initial_state_cpu=[True] * size)

    def _forward(self, size: int) -> torch.Tensor:
        hidden = self.model(self.input_ids[:size], self._batch(size))
        return self.model.compute_logits(hidden)  # [size, V] float32

    def _decode_pool(self, executor) -> DecodePool | None:
        """The pool on the CPUs the executor's kernels use; None where a layer's experts do not suit it (int4 or
        bf16 experts, float activations, a CPU without VNNI): the worker then serves every graph step."""
        ops = {m.layer_idx: m.op for m in self.cpu_modules}
        if not all(supports(op) for op in ops.values()):
            return None
        cpus = executor.worker_cpus or allowed_cpus()  # a tensor-parallel rank's own CPUs, else the process's
        return DecodePool(self.worker, ops, cpus[:executor.num_threads or len(cpus)])

    def _arm(self, size: int) -> None:
        if self.worker is not None:
            self._armed = self.pool if self.pool is not None and self.pool.serves(size) else self.worker
            self._armed.arm(size, self.num_requests)

    def finish_step(self) -> None:
        """After the host synchronised with the step: raise if the CPU side failed."""
        armed, self._armed = self._armed, None
        if armed is not None:
            armed.finish_step()

    def before_eager(self, num_tokens: int) -> None:
        """Before an eager step of `num_tokens`: the pool serves it if it can (`DecodePool.call`, through the
        executor); otherwise its threads stop spinning, leaving the CPUs to the prefill kernels."""
        if self.pool is not None and not self.pool.serves(num_tokens):
            self.pool.park()

    @torch.inference_mode()
    def capture(self) -> None:
        """Largest bucket first, all sharing one memory pool; each is run eagerly first (kernel compilation, the
        allocator's warm-up) with every row padding, so nothing is written to the KV cache."""
        pool = None
        with self._graph_mode():
            for size in reversed(self.buckets):
                for _ in range(2):
                    self._arm(size)
                    self._forward(size)
                    torch.cuda.synchronize(self.device)
                    self.finish_step()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, capture_error_mode=self.capture_error_mode):
                    self.logits[size] = self._forward(size)
                pool = graph.pool()
                self.graphs[size] = graph

    def run(self, inputs: StepInputs, input_ids: list[int]) -> torch.Tensor:
        """One decode step (one new token per sequence) -> float32 logits [num_seqs, V]."""
        size = self._fill(inputs, input_ids)
        self._arm(size)
        self.graphs[size].replay()
        self.num_replays += 1
        if self.row_limit is not None:  # after the replay on the stream: eager steps count every row
            self.row_limit.fill_(NO_ROW_LIMIT)
        return self.logits[size][:len(input_ids)]

    @torch.inference_mode()
    def run_eagerly(self, inputs: StepInputs, input_ids: list[int]) -> torch.Tensor:
        """The step `run` replays, launched op by op (same buffers, shapes and hand-off): checks and debugging."""
        size = self._fill(inputs, input_ids)
        with self._graph_mode():
            self._arm(size)
            logits = self._forward(size)[:len(input_ids)]
        if self.row_limit is not None:
            self.row_limit.fill_(NO_ROW_LIMIT)
        return logits

    def _graph_mode(self):
        """The CPU experts reached through the graph hand-off (what a captured step does)."""
        if self.handoff is None:
            return contextlib.nullcontext()
        return self.llm.cpu_handoff.step_mode(StepMode.GRAPH)

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
            full = np.zeros((size, self.block_tables[group].shape[1]), dtype=np.int32)  # [bucket, max pages]
            full[:num_seqs, :tables.shape[1]] = tables
            self.block_tables[group][:size].copy_(torch.from_numpy(full))
        if self.has_recurrent_layers:
            self.state_slots[:size].copy_(torch.tensor(inputs.state_slots + [-1] * num_pad, dtype=torch.int32))
        if self.handoff is not None:
            self.handoff.valid_rows[:size].copy_(torch.arange(size)[:, None] < num_seqs)
        if self.row_limit is not None:
            self.row_limit.fill_(num_seqs)
        return size

    def close(self) -> None:
        """Stops the CPU side and releases the graphs: tensor parallel, graphs that captured NCCL collectives and
        outlive them hang the communicator's abort when the ranks are left (seen on the H200 pair)."""
        if self.pool is not None:
            self.worker.executor.decode_pool = None
            self.pool.close()
        if self.worker is not None:
            self.worker.close()
        torch.cuda.synchronize(self.device)
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()
        self.logits.clear()
