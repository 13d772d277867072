"""Asynchronous front end of the CPU experts: the engine submits a layer's routed tokens, keeps the GPU busy, and
collects the result with `sync()`.

Contract:
- `compute(layer, hidden [T, H], topk_ids [T, K] int64, topk_weights [T, K] float32, out [T, H])` writes the
  layer's routed-experts output into `out`; it always receives views of the executor's fixed buffers.
- The buffers (`hidden_buffer`, `ids_buffer`, `weights_buffer`, `out_buffer`, all [max_tokens, ...]) are allocated
  once, page-locked when `pin_memory` (default: CUDA available), so a CUDA graph can copy into and out of them.
- `submit(...)` validates and stages the inputs into the buffers and returns at once; exactly one submit may be
  in flight. `sync()` waits and returns `out_buffer[:T]`, a view valid until the next submit. A failure in
  `compute` surfaces at `sync()` as `CpuExpertsError` (chained to the cause) and the executor stays usable.
  `sync()` never hangs: a dead worker or a closed executor makes it raise.
- CUDA inputs are copied without blocking into pinned buffers; an event recorded on the current stream after the
  copies is waited on by the worker before `compute`. Because that event also follows any earlier work on the
  same stream, a non-blocking copy of the previous `out_buffer` result issued on that stream is finished before
  the worker overwrites it. Copies made on other streams are the caller's to order.
- `submit`/`sync`/`close` are meant to be called from one thread (the engine's); they are not reentrant.
- `decode_pool`, once the engine sets it (`hybrid.cuda_graphs`): steps it `serves` (decode-sized) run on its pinned
  threads instead of `compute` (`DecodePool.call`), eager steps as graph steps do; the same kernels' loop bodies,
  so the results are the same bit for bit.
- `SyncExperts` has the same API and runs `compute` inline inside `submit` (debugging, comparisons).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import torch

from cpu_experts.topology import pin_current_thread, use_kernel_threads

Compute = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]

# How often a waiting sync() checks that the worker is still alive; Event.wait returns as soon as the result is
# ready, so this only bounds how long a dead worker goes unnoticed, not the latency of a normal sync.
_LIVENESS_POLL_S = 0.05


class CpuExpertsError(RuntimeError):
    """The CPU experts failed for one submitted layer (or can no longer run); the cause is chained."""


class _ExpertsBase:
    """Fixed staging buffers, input validation and the submit/sync bookkeeping shared by both executors."""

    def __init__(
        self,
        compute: Compute,
        max_tokens: int,
        hidden_size: int,
        top_k: int,
        dtype: torch.dtype = torch.float32,
        pin_memory: bool | None = None,
    ):
        for name, value in (("max_tokens", max_tokens), ("hidden_size", hidden_size), ("top_k", top_k)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not dtype.is_floating_point:
            raise ValueError(f"dtype must be a floating-point dtype, got {dtype}")
        self.compute = compute
        self.max_tokens, self.hidden_size, self.top_k, self.dtype = max_tokens, hidden_size, top_k, dtype
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else bool(pin_memory)
        pin = self.pin_memory
        self.hidden_buffer = torch.zeros(max_tokens, hidden_size, dtype=dtype, pin_memory=pin)
        self.ids_buffer = torch.zeros(max_tokens, top_k, dtype=torch.int64, pin_memory=pin)
        self.weights_buffer = torch.zeros(max_tokens, top_k, dtype=torch.float32, pin_memory=pin)
        self.out_buffer = torch.zeros(max_tokens, hidden_size, dtype=dtype, pin_memory=pin)
        self._layer: int | None = None  # layer of the submit in flight; None when nothing is pending
        self._num_tokens = 0
        self._error: BaseException | None = None  # the compute error sync() reports
        # total seconds in compute (on the thread that runs it; read once the layer is synced), for the metrics
        self.compute_seconds = 0.0
        # the engine's decode pool (`cpu_experts.decode_pool.DecodePool`), once it has one: it serves the layers of
        # the steps it `serves`, eager as well as graph steps; `compute` the rest
        self.decode_pool = None

    def _validate(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> int:
        """Check shapes, dtypes and devices; return T."""
        if hidden.dim() != 2 or hidden.shape[1] != self.hidden_size or hidden.shape[0] > self.max_tokens:
            raise ValueError(
                f"hidden must be [T, {self.hidden_size}] with T <= max_tokens={self.max_tokens}, "
                f"got shape {tuple(hidden.shape)}"
            )
        num_tokens = hidden.shape[0]
        expected = (num_tokens, self.top_k)
        for name, tensor, dtype in (
            ("hidden", hidden, self.dtype),
            ("topk_ids", topk_ids, torch.int64),
            ("topk_weights", topk_weights, torch.float32),
        ):
            if name != "hidden" and tuple(tensor.shape) != expected:
                raise ValueError(f"{name} must have shape {expected} (T from hidden, top_k), got {tuple(tensor.shape)}")
            if tensor.dtype != dtype:
                raise ValueError(f"{name} must be {dtype}, got {tensor.dtype}")
            if tensor.device != hidden.device:
                raise ValueError(f"{name} is on {tensor.device} but hidden is on {hidden.device}")
        return num_tokens

    def _stage(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> object:
        """Copy the inputs into the fixed buffers; return a CUDA event the worker must wait on, or None."""
        num_tokens = hidden.shape[0]
        non_blocking = hidden.is_cuda and self.pin_memory
        self.hidden_buffer[:num_tokens].copy_(hidden, non_blocking=non_blocking)
        self.ids_buffer[:num_tokens].copy_(topk_ids, non_blocking=non_blocking)
        self.weights_buffer[:num_tokens].copy_(topk_weights, non_blocking=non_blocking)
        if not non_blocking:
            return None  # copies from CPU, or into pageable memory, are complete when copy_ returns
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(hidden.device))
        return event

    def _begin(self, layer: int, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> object:
        """The common first half of submit: refuse a second submit, validate, stage."""
        if self._layer is not None:
            raise RuntimeError(f"layer {self._layer} is still in flight: call sync() before the next submit()")
        num_tokens = self._validate(hidden, topk_ids, topk_weights)
        event = self._stage(hidden, topk_ids, topk_weights)
        self._layer, self._num_tokens = layer, num_tokens
        return event

    def _run(self, layer: int, num_tokens: int) -> None:
        """Run compute on views of the fixed buffers (its seconds added to `compute_seconds`, failed or not)."""
        start = time.perf_counter()
        pool = self.decode_pool
        run = pool.call if pool is not None and pool.serves(num_tokens) else self.compute
        try:
            run(
                layer,
                self.hidden_buffer[:num_tokens],
                self.ids_buffer[:num_tokens],
                self.weights_buffer[:num_tokens],
                self.out_buffer[:num_tokens],
            )
        finally:
            self.compute_seconds += time.perf_counter() - start

    def _finish(self, error: BaseException | None) -> torch.Tensor:
        """The common end of sync: clear the pending submit, raise the compute error or return the output view."""
        layer, num_tokens = self._layer, self._num_tokens
        self._layer = None
        if error is not None:
            raise CpuExpertsError(f"CPU experts failed at layer {layer}: {type(error).__name__}: {error}") from error
        return self.out_buffer[:num_tokens]

    def _check_pending(self) -> None:
        if self._layer is None:
            raise RuntimeError("sync() called without a pending submit()")

    def __enter__(self):
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def close(self) -> None:
        """Release the executor (subclasses stop their worker)."""


class SyncExperts(_ExpertsBase):
    """Same API as `AsyncExperts`, but `compute` runs inside `submit`; its error is still reported by `sync`."""

    def submit(self, layer: int, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> None:
        """Stage the inputs and run compute now; a compute error is kept for sync()."""
        event = self._begin(layer, hidden, topk_ids, topk_weights)
        try:
            if event is not None:
                event.synchronize()
            self._run(layer, self._num_tokens)
            self._error = None
        except Exception as exc:  # reported by sync(), like the async executor does
            self._error = exc

    def sync(self) -> torch.Tensor:
        """Return out_buffer[:T] of the last submit or raise its CpuExpertsError."""
        self._check_pending()
        error, self._error = self._error, None
        return self._finish(error)


class AsyncExperts(_ExpertsBase):
    """Runs `compute` on a daemon worker thread so the caller can overlap it with GPU work."""

    def __init__(
        self,
        compute: Compute,
        max_tokens: int,
        hidden_size: int,
        top_k: int,
        dtype: torch.dtype = torch.float32,
        pin_memory: bool | None = None,
        worker_cpus: tuple[int, ...] | None = None,
        name: str = "cpu-experts",
        num_threads: int | None = None,
    ):
        super().__init__(compute, max_tokens, hidden_size, top_k, dtype, pin_memory)
        self.worker_cpus = worker_cpus
        self.num_threads = num_threads  # of the kernels' pool, per `topology.use_kernel_threads`; None: all
        self._wake = threading.Condition()
        # (layer, T, CUDA event or None), or a callable from `call_soon`; guarded by _wake
        self._job: tuple[int, int, object] | Callable[[], None] | None = None
        self._stop = False
        self._done = threading.Event()
        self._closed = False
        self._thread = threading.Thread(target=self._worker, name=name, daemon=True)
        self._thread.start()

    def submit(self, layer: int, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> None:
        """Stage the inputs and hand them to the worker; returns without waiting for compute."""
        if self._closed:
            raise CpuExpertsError("the CPU experts executor is closed")
        if not self._thread.is_alive():
            raise CpuExpertsError("the CPU experts worker thread is not running")
        event = self._begin(layer, hidden, topk_ids, topk_weights)
        self._done.clear()
        with self._wake:
            self._job = (layer, self._num_tokens, event)
            self._wake.notify()

    def call_soon(self, fn: Callable[[], None]) -> None:
        """Runs fn() on the worker thread, between submits (the CUDA-graph hand-off serves a whole step from here).
        One thread launches every CPU-expert kernel: numba's OpenMP layer keeps a pool of threads per launching
        thread, and two pools outnumber the CPUs, which makes libgomp's idle threads sleep instead of spin."""
        if self._closed or not self._thread.is_alive():
            raise CpuExpertsError("the CPU experts executor is closed or its worker thread is not running")
        with self._wake:
            if self._layer is not None or self._job is not None:
                raise RuntimeError("call_soon() while a layer is in flight: call sync() first")
            self._job = fn
            self._wake.notify()

    def sync(self) -> torch.Tensor:
        """Wait for the submitted layer; return out_buffer[:T] or raise CpuExpertsError."""
        if self._closed:
            raise CpuExpertsError("the CPU experts executor is closed")
        self._check_pending()
        while not self._done.wait(_LIVENESS_POLL_S):
            if self._closed:
                raise CpuExpertsError(f"the CPU experts executor was closed while layer {self._layer} was running")
            if not self._thread.is_alive():
                layer, self._layer = self._layer, None
                raise CpuExpertsError(f"the CPU experts worker thread died while running layer {layer}")
        error, self._error = self._error, None
        return self._finish(error)

    def close(self, timeout: float | None = 5.0) -> None:
        """Stop the worker (idempotent). Waits up to `timeout` s for a compute in progress to return."""
        if self._closed:
            return
        self._closed = True
        with self._wake:
            self._stop = True
            self._wake.notify()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def _worker(self) -> None:
        pin_current_thread(self.worker_cpus)
        use_kernel_threads(self.num_threads)
        # inference mode is per thread: buffers made under it (a tensor-parallel worker builds its graph runner
        # inside `torch.inference_mode()`) take in-place writes only from a thread in it
        with torch.inference_mode():
            self._serve_jobs()

    def _serve_jobs(self) -> None:
        while True:
            with self._wake:
                self._wake.wait_for(lambda: self._job is not None or self._stop)
                if self._stop:
                    return
                job, self._job = self._job, None
            if callable(job):
                job()  # reports its own errors (FlagWorker.finish_step)
                continue
            layer, num_tokens, event = job
            try:
                if event is not None:
                    event.synchronize()  # the non-blocking device-to-host copies have landed
                self._run(layer, num_tokens)
            except Exception as exc:  # handed to sync(); the worker lives on for the next layer
                self._error = exc
            except BaseException as exc:  # SystemExit and the like: report it, then let the worker end
                self._error = exc
                self._done.set()
                return
            self._done.set()
