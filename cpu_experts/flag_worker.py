"""The CPU side of the CUDA-graph hand-off: a worker that serves MoE layers requested through flags in page-locked
memory, so a captured decode graph can hand routed tokens to the CPU experts and wait for their result without
the host launching anything.

Protocol, per step (the device side is `hybrid.cpu_handoff.GraphHandoff` with the kernels of
`gpu_layers.handoff`):
1. the host `arm(num_tokens, num_layers)`s the worker (a job on the `AsyncExperts` thread, the one that runs every
   CPU-expert kernel), then replays the graph;
2. for each MoE layer the graph copies hidden [T, H], topk_ids [T, K] and topk_weights [T, K] into the fixed
   pinned buffers, then stores layer + 1 into the request flag;
3. the worker, spinning on that flag without the GIL (`spin_until_nonzero`), clears it, runs `compute` on the
   buffers, and stores layer + 1 into the done flag;
4. the graph, spinning on the done flag (bounded), clears it and copies `out_buffer` back.
Each flag value is written by one side and cleared by the other, and the next layer's request is only posted
after the previous layer's done was consumed, so the fixed values a graph bakes in are enough: no counters.

A compute error does not stall the GPU: the worker still posts done (the step's output is then garbage) and
`finish_step` raises it once the host has synchronised; so does a step whose layers were not all served (a
device-side wait that timed out, a dead worker).
"""

from __future__ import annotations

import ctypes
import functools
import threading
import time

import torch
from numba import njit

from cpu_experts.atomics import load_acquire32
from cpu_experts.executor import AsyncExperts, CpuExpertsError, _ExpertsBase

# int32 slots of the flags tensor: request and done on separate 64-byte lines
REQUEST, DONE = 0, 16
# Spins per nogil call before the worker looks at its stop flag again (about a millisecond).
_SPINS_PER_CALL = 1 << 20


@njit(nogil=True, cache=True)
def spin_until_nonzero(address: int, max_spins: int) -> int:
    """The int32 at `address` once it is nonzero, or 0 after `max_spins` reads."""
    for _ in range(max_spins):
        value = load_acquire32(address)
        if value != 0:
            return value
    return 0


class FlagWorker(_ExpertsBase):
    """Pinned staging buffers ([max_tokens, ...], as `AsyncExperts`) and flags, served on `executor`'s thread (the
    one that launches every CPU-expert kernel, `AsyncExperts.call_soon`) with `executor`'s compute."""

    def __init__(self, executor: AsyncExperts, max_tokens: int, pin_memory: bool | None = None):
        super().__init__(executor.compute, max_tokens, executor.hidden_size, executor.top_k, executor.dtype,
                         pin_memory)
        self.executor = executor
        self.flags = torch.zeros(32, dtype=torch.int32, pin_memory=self.pin_memory)
        self._request = ctypes.c_int32.from_address(self.flag_address(REQUEST))
        self._done = ctypes.c_int32.from_address(self.flag_address(DONE))
        self._step_done = threading.Event()
        self._step_done.set()
        self._stop = False
        self._served = 0
        self._expected = 0
        # Totals over all steps, for benchmarks' breakdowns: the worker's time waiting for the GPU to reach a MoE
        # layer (the GPU's work before and between them, plus the hand-off); its time computing them is the base
        # class's `compute_seconds`.
        self.wait_seconds = 0.0

    def flag_address(self, slot: int) -> int:
        return self.flags.data_ptr() + slot * self.flags.element_size()

    def arm(self, num_tokens: int, num_layers: int) -> None:
        """Serve the next `num_layers` requests over the first `num_tokens` rows of the buffers."""
        if not 1 <= num_tokens <= self.max_tokens:
            raise ValueError(f"num_tokens must be in [1, {self.max_tokens}], got {num_tokens}")
        if not self._step_done.is_set():
            raise RuntimeError("arm() called while the previous step is still being served: call finish_step()")
        self._served, self._expected, self._error = 0, num_layers, None
        self._step_done.clear()
        try:
            self.executor.call_soon(functools.partial(self._serve, num_tokens, num_layers))
        except BaseException:
            self._step_done.set()
            raise

    def finish_step(self, timeout: float = 10.0) -> None:
        """After the host synchronised with the step's GPU work: raise if a layer failed or was not served."""
        if not self._step_done.wait(timeout):
            served, expected = self._served, self._expected
            self._expected = served  # abandon the step: the serving loop ends within a spin call
            self.flags.zero_()
            raise CpuExpertsError(f"CPU experts served {served} of {expected} MoE layers of the step (a "
                                  f"device-side wait timed out, or the worker hung)")
        if self._error is not None:
            error, self._error = self._error, None
            raise CpuExpertsError(f"CPU experts failed: {type(error).__name__}: {error}") from error

    def close(self) -> None:
        """Ends a step being served; the executor's thread itself belongs to the executor."""
        self._stop = True

    def _serve(self, num_tokens: int, num_layers: int) -> None:
        waiting_since = time.perf_counter()
        try:
            while self._served < min(num_layers, self._expected) and not self._stop:
                value = spin_until_nonzero(self.flag_address(REQUEST), _SPINS_PER_CALL)
                if value == 0:
                    continue
                self._request.value = 0
                start = time.perf_counter()
                self.wait_seconds += start - waiting_since
                try:
                    self._run(value - 1, num_tokens)
                except Exception as exc:  # reported by finish_step; done is still posted so the GPU moves on
                    self._error = self._error or exc
                waiting_since = time.perf_counter()
                self._done.value = value
                self._served += 1
        finally:
            self._step_done.set()
