"""The one path from a MoE layer to its CPU experts: `CpuHandoff.submit(cpu, hidden, ids, weights)`, then
`collect(like)`. How the layer's routed tokens reach the CPU is the step's mode, which the model runner sets
explicitly (`step_mode`), never inferred from ambient state:

- `StepMode.EAGER`: the model's executor thread (`cpu_experts.executor.AsyncExperts`): submit stages the tokens in
  its pinned buffers and returns, so the GPU's own work (shared and GPU-resident experts) overlaps the CPU's;
  collect waits. Without an executor (a model built by hand, debugging) the experts run inline at submit.
- `StepMode.GRAPH`: a decode step captured into a CUDA graph (`hybrid.cuda_graphs`): device work only. Submit
  copies the tokens into the `FlagWorker`'s pinned buffers and posts the layer on a flag in page-locked memory;
  collect waits on the GPU for the worker's done flag and copies the output back (`GraphHandoff`: a staging kernel
  and the flag's on the way in, the flag's wait and a fetching kernel on the way out, `gpu_layers.handoff`). The
  host arms the worker (or the decode pool serving the same flags) before each replay.

One submit may be in flight at a time: the CPU experts run one layer after another.
"""

from __future__ import annotations

import contextlib
import enum

import torch

from cpu_experts.flag_worker import DONE, REQUEST, FlagWorker
from cpu_experts.module import CpuExperts
from gpu_layers.handoff import fetch_rows, post_flag, stage_tokens, wait_flag


class StepMode(enum.Enum):
    EAGER = "eager"
    GRAPH = "graph"


class GraphHandoff:
    """The graph side of the hand-off: only device work, no host decisions. Rows at or past the step's batch
    (`valid_rows` False) are routed nowhere (ids -1). Takes the layer's tensors as they come (ids int32 or int64,
    hidden in the activation dtype): the staging kernel converts them into the worker's buffers."""

    def __init__(self, worker: FlagWorker, device: torch.device):
        self.worker = worker
        self.dtype = worker.dtype
        self.valid_rows = torch.zeros(worker.max_tokens, 1, dtype=torch.bool, device=device)
        self.request_flag = worker.flags[REQUEST:REQUEST + 1]
        self.done_flag = worker.flags[DONE:DONE + 1]
        self._pending: tuple[int, int] | None = None

    def submit(self, layer: int, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> None:
        num_tokens, w = hidden.shape[0], self.worker
        if num_tokens > w.max_tokens:
            raise ValueError(f"hidden has {num_tokens} rows, the graph hand-off's buffers {w.max_tokens}")
        stage_tokens(hidden, topk_ids, topk_weights.float(), self.valid_rows[:num_tokens],
                     w.hidden_buffer[:num_tokens], w.ids_buffer[:num_tokens], w.weights_buffer[:num_tokens])
        post_flag(self.request_flag, layer + 1)  # stream order: after the staged rows have landed
        self._pending = (layer, num_tokens)

    def sync(self, like: torch.Tensor) -> torch.Tensor:
        """The layer's output [T, H], a new tensor in `like`'s dtype on its device."""
        layer, num_tokens = self._pending
        self._pending = None
        wait_flag(self.done_flag, layer + 1)
        return fetch_rows(self.worker.out_buffer[:num_tokens], like.dtype, like.device)


class CpuHandoff:
    """One per model: hands each MoE layer's CPU part to the CPU in the current step mode (module docstring)."""

    def __init__(self):
        self.executor = None  # `AsyncExperts` once bound (`LLM`); None: inline
        self.graph: GraphHandoff | None = None  # set by the CUDA-graph runner that owns the flag worker
        self.mode = StepMode.EAGER
        self._inline: torch.Tensor | None = None  # the output of an inline submit

    @contextlib.contextmanager
    def step_mode(self, mode: StepMode):
        """Steps run inside take `mode` (the runner: capture and graph-equivalent eager steps use GRAPH)."""
        if mode is StepMode.GRAPH and self.graph is None:
            raise RuntimeError("graph steps need the graph hand-off: the CUDA-graph runner sets CpuHandoff.graph")
        previous, self.mode = self.mode, mode
        try:
            yield
        finally:
            self.mode = previous

    def _target(self):
        """Who takes this step's submits: the graph hand-off, the executor, or None (inline)."""
        return self.graph if self.mode is StepMode.GRAPH else self.executor

    def submit(self, cpu: CpuExperts, hidden: torch.Tensor, topk_ids: torch.Tensor,
               topk_weights: torch.Tensor) -> None:
        cpu.check_loaded()
        target = self._target()
        if target is None:
            self._inline = cpu(hidden, topk_ids, topk_weights)
        elif target is self.graph:  # converts as it stages
            target.submit(cpu.layer_idx, hidden.detach(), topk_ids, topk_weights)
        else:
            target.submit(cpu.layer_idx, hidden.detach().to(target.dtype), topk_ids.long(), topk_weights.float())

    def collect(self, like: torch.Tensor) -> torch.Tensor:
        """The submitted layer's output [T, H] on `like`'s device and dtype (a copy: the buffers are reused)."""
        target = self._target()
        if target is None:
            out, self._inline = self._inline, None
            return out.to(device=like.device, dtype=like.dtype)
        if target is self.graph:
            return target.sync(like)
        return target.sync().to(device=like.device, dtype=like.dtype, copy=True)
