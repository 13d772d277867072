"""`DecodePool`: pinned threads that serve the CUDA-graph hand-off's decode layers in compiled code, end to end.

Why: the executor-thread path (`cpu_experts.flag_worker.FlagWorker`) returns to Python for every layer (routing,
conversions, the kernel's dispatch: ~100 us a call, measured in the engine on the H200 host) and its kernel forks
and joins numba's OpenMP team three times a layer, waking threads that slept through the GPU's part of the step.
Here every thread of the pool watches the request flag itself, and a layer's phases are separated by spinning
barriers instead of fork/join: no Python and no wake-ups between the layers of a step.

Protocol (the device side is unchanged: `hybrid.cpu_handoff.GraphHandoff` on the `FlagWorker`'s flags and buffers):
1. `arm(num_tokens, num_layers)` publishes the step in the control block and bumps its generation;
2. every thread sees the request flag (layer + 1) and routes the step's (token, slot) pairs itself (at most a few
   hundred ids: cheaper than sharing them);
3. phases, each split statically over the threads and closed by a barrier: the tokens' rows to int8, then per
   partition the gate/up rows (-> act), act's rows to int8, the down rows (each thread owns a slice of H, so the
   output needs no reduction);
4. the last thread to finish clears the request flag, counts the layer, opens the next one (the epoch word) and
   posts done = layer + 1.
Numerics: the executor's kernels' own loop bodies (`kernels_vnni.gate_up_item_int8`, `down_row_int8`;
`kernels_vnni_int4.gate_up_rows_int4`, `down_rows_int4`), so a graph step served here equals one served by the
executor, bit for bit. Scope: the layers whose decode kernel is one of the pool's (`kernel_table.POOL_DECODE`:
W8A8 int8 or int4 on the integer kernels, int4 scales float32 or bfloat16; FP8, MXFP4, NVFP4), one format for all
the pool's layers, steps below every layer's prefill threshold (`serves`); other steps stay with the `FlagWorker`.
Eager steps the pool `serves` come through the executor (`AsyncExperts.decode_pool`): `call` posts one layer from
the host as the graph would, so a decode step computes the same whether it was replayed or run eagerly.

Idle: a thread that sees no step for `IDLE_SECONDS` (or is `park`ed, before an eager step it does not serve)
returns to Python and sleeps until the next `arm`; spinning past `decode_pool_sync.SPINS_BEFORE_YIELD` it yields
its CPU at every turn, so an oversubscribed machine still makes progress (the control block and the waits:
`cpu_experts.decode_pool_sync`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import numpy as np
import torch
from numba import carray, njit

from cpu_experts.atomics import (
    LINE_WORDS,
    cycles,
    fetch_add64,
    float32_pointer,
    int8_pointer,
    int32_pointer,
    int64_pointer,
    load_acquire64,
    store_release64,
)
from cpu_experts.decode_pool_layers import (
    DOWN,
    DOWN_S,
    FLOAT_KINDS,
    GATE,
    GATE_S,
    GROUP_H,
    GROUP_I,
    GROUPS_H,
    GROUPS_I,
    HIDDEN,
    INT4,
    INT4_BF16,
    INT8,
    NUM_EXPERTS,
    ROWS,
    UP,
    UP_S,
    down_bias,
    layer_float,
    layer_int4,
    layer_tables,
    scratch_float,
    scratch_int4,
    scratch_int8,
    slot_epilogue,
)
from cpu_experts.decode_pool_sync import (
    _LINE,
    COMPUTE_CYCLES,
    EPOCH,
    ERROR_LAYER,
    ERROR_VALUE,
    GEN,
    IDLE_SECONDS,
    LAYERS,
    NO_EXPERTS,
    NUM_WORDS,
    PARK,
    SERVED,
    SKIP,
    STOP,
    TOKENS,
    TOTAL_SERVED,
    WAIT_CYCLES,
    _barrier,
    _finish_layer,
    _share,
    _wait_request,
    _wait_step,
    wait_done,
)
from cpu_experts.executor import CpuExpertsError
from cpu_experts.flag_worker import DONE, REQUEST, FlagWorker
from cpu_experts.kernels import quantize_row
from cpu_experts.kernels_vnni import _block_sums, down_row_int8, gate_up_item_int8
from cpu_experts.operator import CpuMoE, _route
from cpu_experts.topology import pin_current_thread

EAGER_TIMEOUT_SECONDS = 30.0  # an eager layer not served by then is reported (`call`), as a graph step's would be

# ---- one layer ---------------------------------------------------------------------------------------------------

@njit(nogil=True, cache=True, fastmath=True)
def _gate_up(tid, num_threads, experts, offsets, pair_token, gate, gate_s, up, up_s, x_q, x_scale, x_sum, group_h,
             epilogue, act):
    lo, hi = _share(experts.shape[0] * gate.shape[1], tid, num_threads)
    for r in range(lo, hi):
        gate_up_item_int8(r, experts, offsets, pair_token, gate, gate_s, up, up_s, x_q, x_scale, x_sum, group_h,
                          epilogue, act)


@njit(nogil=True, cache=True, fastmath=True)
def _down(tid, num_threads, experts, offsets, pair_token, pair_weight, down, down_s, a_q, a_scale, a_sum, group_i,
          out, num_tokens, is_first):
    lo, hi = _share(down.shape[1], tid, num_threads)
    if is_first:
        out[:num_tokens, lo:hi] = 0
    for h in range(lo, hi):
        down_row_int8(h, experts, offsets, pair_token, pair_weight, down, down_s, a_q, a_scale, a_sum, group_i, out)


@njit(nogil=True, cache=True, fastmath=True)
def _quantize_rows(tid, num_threads, src, num_rows, num_cols, group, q, scale, sums):
    lo, hi = _share(num_rows, tid, num_threads)
    for r in range(lo, hi):
        scale[r] = quantize_row(src[r, :num_cols], q[r, :num_cols])
        _block_sums(q[r, :num_cols], group, sums[r])




@njit(nogil=True, cache=True)
def _slot_arrays(slots, s):
    """Slot s's gate, gate_s, up, up_s, down, down_s as unowned arrays (`atomics.int8_pointer`)."""
    e, rows, hidden = slots[s, NUM_EXPERTS], slots[s, ROWS], slots[s, HIDDEN]
    weights_h, scales_h = (e, rows, hidden), (e, rows, slots[s, GROUPS_H])
    return (carray(int8_pointer(slots[s, GATE]), weights_h), carray(float32_pointer(slots[s, GATE_S]), scales_h),
            carray(int8_pointer(slots[s, UP]), weights_h), carray(float32_pointer(slots[s, UP_S]), scales_h),
            carray(int8_pointer(slots[s, DOWN]), (e, hidden, rows)),
            carray(float32_pointer(slots[s, DOWN_S]), (e, hidden, slots[s, GROUPS_I])))


@njit(nogil=True, cache=True, fastmath=True)
def _layer(tid, num_threads, ctl, layer, num_tokens, hidden, ids, weights, out, first_slot, num_slots, slots, x_q,
           x_scale, x_sum, act, a_q, a_scale, a_sum, kind, x4, a4, xf4, mode):
    """This thread's share of one MoE layer: out[:num_tokens] = the routed experts of `layer` (see the module)."""
    top_k = ids.shape[1]
    first = first_slot[layer] if layer < first_slot.shape[0] else -1
    if first < 0:
        if tid == 0:
            store_release64(ctl + ERROR_LAYER * _LINE, layer + 1)
            store_release64(ctl + ERROR_VALUE * _LINE, NO_EXPERTS)
        return
    flat_ids = ids.reshape(-1)[:num_tokens * top_k]
    flat_weights = weights.reshape(-1)[:num_tokens * top_k]
    experts, offsets, pair_token, pair_weight, bad = _route(flat_ids, flat_weights, top_k, slots[first, NUM_EXPERTS])
    if bad >= 0:
        if tid == 0:
            store_release64(ctl + ERROR_LAYER * _LINE, layer + 1)
            store_release64(ctl + ERROR_VALUE * _LINE, flat_ids[bad])
        return
    if load_acquire64(ctl + SKIP * _LINE):  # the benchmark's GPU-alone step: answer zeros at once
        lo, hi = _share(out.shape[1], tid, num_threads)
        out[:num_tokens, lo:hi] = 0
        return
    if kind != INT8:
        routing = (experts, offsets, pair_token, pair_weight)
        if kind in (INT4, INT4_BF16):
            layer_int4(tid, num_threads, ctl, kind, first, num_slots[layer], slots, routing, num_tokens, hidden, out,
                       x4, act, a4, mode)
        else:
            layer_float(tid, num_threads, ctl, kind, first, num_slots[layer], slots, routing, num_tokens, hidden,
                        out, xf4, mode)
        return
    num_groups_h = slots[first, GROUPS_H]
    _quantize_rows(tid, num_threads, hidden, num_tokens, hidden.shape[1], slots[first, GROUP_H], x_q, x_scale,
                   x_sum[:, :num_groups_h])
    _barrier(ctl, num_threads)
    for s in range(first, first + num_slots[layer]):
        gate, gate_s, up, up_s, down, down_s = _slot_arrays(slots, s)
        _gate_up(tid, num_threads, experts, offsets, pair_token, gate, gate_s, up, up_s, x_q, x_scale,
                 x_sum[:, :num_groups_h], slots[s, GROUP_H], slot_epilogue(slots, s, mode), act)
        _barrier(ctl, num_threads)
        a_sums = a_sum[:, :slots[s, GROUPS_I]]
        _quantize_rows(tid, num_threads, act, pair_token.shape[0], slots[s, ROWS], slots[s, GROUP_I], a_q, a_scale,
                       a_sums)
        _barrier(ctl, num_threads)
        _down(tid, num_threads, experts, offsets, pair_token, pair_weight, down, down_s, a_q, a_scale, a_sums,
              slots[s, GROUP_I], out, num_tokens, s == first)
    down_bias(tid, num_threads, slots, first, (experts, offsets, pair_token, pair_weight), mode, out)


@njit(nogil=True, cache=True)
def _unowned_f32(a):
    return carray(float32_pointer(a.ctypes.data), a.shape)


@njit(nogil=True, cache=True)
def _unowned_i8(a):
    return carray(int8_pointer(a.ctypes.data), a.shape)


@njit(nogil=True, cache=True)
def _unowned_i32(a):
    return carray(int32_pointer(a.ctypes.data), a.shape)


@njit(nogil=True, cache=True)
def _unowned_i64(a):
    return carray(int64_pointer(a.ctypes.data), a.shape)


@njit(nogil=True, cache=True)
def _serve(tid, num_threads, ctl, flags, seen, idle_cycles, hidden, ids, weights, out, first_slot, num_slots, slots,
           x_q, x_scale, x_sum, act, a_q, a_scale, a_sum, kind, x_even, x_odd, x_corr, a_even, a_odd, a_corr, x_f,
           xf_even, xf_odd, af_even, af_odd, mode):
    """Serves steps until none comes for `idle_cycles` (or parked, or stopped); returns the last generation seen.
    Every array the threads share is used through an unowned view (`atomics.int8_pointer`)."""
    hidden, weights, out, act = _unowned_f32(hidden), _unowned_f32(weights), _unowned_f32(out), _unowned_f32(act)
    x_scale, a_scale = _unowned_f32(x_scale), _unowned_f32(a_scale)
    ids, x_sum, a_sum, slots = _unowned_i64(ids), _unowned_i64(x_sum), _unowned_i64(a_sum), _unowned_i64(slots)
    first_slot, num_slots = _unowned_i64(first_slot), _unowned_i64(num_slots)
    x_q, a_q = _unowned_i8(x_q), _unowned_i8(a_q)
    x4 = (_unowned_i8(x_even), _unowned_i8(x_odd), _unowned_i32(x_corr), x_scale)
    a4 = (_unowned_i8(a_even), _unowned_i8(a_odd), _unowned_i32(a_corr), a_scale)
    xf4 = (_unowned_f32(x_f), _unowned_f32(xf_even), _unowned_f32(xf_odd), act, _unowned_f32(af_even),
           _unowned_f32(af_odd))
    while True:
        generation = _wait_step(ctl, seen, idle_cycles)
        if generation == seen:
            return seen
        seen = generation
        num_tokens = load_acquire64(ctl + TOKENS * _LINE)
        for _ in range(load_acquire64(ctl + LAYERS * _LINE)):
            epoch = load_acquire64(ctl + EPOCH * _LINE)
            waiting = cycles()
            value = _wait_request(ctl, flags, generation)
            if value == 0:
                break  # abandoned: the next step (or the stop) is read by _wait_step
            started = cycles()
            _layer(tid, num_threads, ctl, value - 1, num_tokens, hidden, ids, weights, out, first_slot, num_slots,
                   slots, x_q, x_scale, x_sum, act, a_q, a_scale, a_sum, kind, x4, a4, xf4, mode)
            _finish_layer(ctl, flags, value, num_threads, epoch)
            if tid == 0:
                fetch_add64(ctl + WAIT_CYCLES * _LINE, started - waiting)
                fetch_add64(ctl + COMPUTE_CYCLES * _LINE, cycles() - started)


# ---- the pool ----------------------------------------------------------------------------------------------------

def supports(op: CpuMoE) -> bool:
    """Whether the pool can serve this layer's decode steps: its decode kernel is one of the pool's
    (`kernel_table.POOL_DECODE`: W8A8 int8 or int4 on the integer kernels, or a float format on its decode
    kernels); silu or another activation with biases (gpt-oss)."""
    if not op.layer.partitions:  # a tensor-parallel rank with an empty slice of I: the worker serves its zeros
        return False
    return op.kernels.is_pool_decode


def _kind(op: CpuMoE) -> int:
    decode = op.kernels.decode
    if decode in FLOAT_KINDS:
        return FLOAT_KINDS[decode]
    if decode == "int8-vnni":
        return INT8
    return INT4_BF16 if op.spec.scale_dtype == "bfloat16" else INT4


class DecodePool:
    """One thread per CPU of `cpus`, serving `worker`'s flags and buffers for the layers `ops` ({layer: CpuMoE},
    every one `supports`-ed). The host's calls mirror the worker's: `arm`, then `finish_step` once synchronised."""

    def __init__(self, worker: FlagWorker, ops: dict[int, CpuMoE], cpus: Sequence[int],
                 idle_seconds: float = IDLE_SECONDS):
        unsupported = sorted(layer for layer, op in ops.items() if not supports(op))
        if not ops or unsupported or not cpus:
            raise ValueError(f"DecodePool needs CPUs and layers it can serve (`supports`); layers {unsupported} are "
                             f"not, cpus={list(cpus)}")
        kinds = {_kind(op) for op in ops.values()}
        if len(kinds) > 1:
            raise ValueError("DecodePool serves layers of one expert format (int4: with one scale dtype)")
        self.kind = kinds.pop()
        if worker.dtype != torch.float32:
            raise ValueError(f"DecodePool serves float32 staging buffers, got {worker.dtype}")
        self.worker, self.cpus = worker, tuple(cpus)
        self.num_threads = len(self.cpus)
        # steps of at least this many tokens take the prefill kernels, which the pool does not have
        self.max_tokens = min(min(op.prefill_min_tokens for op in ops.values()) - 1, worker.max_tokens)
        *self._weights, self._weight_arrays = layer_tables(ops)
        # the activation's compile-time choice (`decode_pool_layers.slot_epilogue`): None keeps silu layers' code
        self._mode = None if all(op.spec.is_plain for op in ops.values()) else np.int64(1)
        self._scratch = scratch_int8(ops, worker.max_tokens, worker.top_k)
        self._scratch_int4 = scratch_int4(ops, worker.max_tokens, worker.top_k, self.kind in (INT4, INT4_BF16))
        self._scratch_float = scratch_float(ops, worker.max_tokens, worker.top_k, self.kind in FLOAT_KINDS.values())
        self._buffers = tuple(b.numpy() for b in (worker.hidden_buffer, worker.ids_buffer, worker.weights_buffer,
                                                  worker.out_buffer))
        raw = np.zeros((NUM_WORDS + 1) * LINE_WORDS, dtype=np.int64)
        skip = (-raw.ctypes.data % _LINE) // 8
        self.ctl = raw[skip:skip + NUM_WORDS * LINE_WORDS]  # 64-byte aligned: word w at ctl[w * LINE_WORDS]
        self._raw = raw
        self._cycles_per_second = _cycle_rate()
        self._idle_cycles = int(idle_seconds * self._cycles_per_second)
        self._timeout_cycles = int(EAGER_TIMEOUT_SECONDS * self._cycles_per_second)
        self._expected = 0
        self._armed = False
        self._cond = threading.Condition()
        self._stopping = False
        self.error: BaseException | None = None  # a thread's crash; the pool then serves nothing
        self._compile()
        self._threads = [threading.Thread(target=self._thread_main, args=(tid,), name=f"decode-pool-{tid}",
                                          daemon=True) for tid in range(self.num_threads)]
        for thread in self._threads:
            thread.start()

    # -- host side, one thread (the engine's) --

    def serves(self, num_tokens: int) -> bool:
        return self.error is None and 1 <= num_tokens <= self.max_tokens

    def arm(self, num_tokens: int, num_layers: int) -> None:
        if not self.serves(num_tokens):
            raise ValueError(f"the decode pool serves steps of 1 to {self.max_tokens} tokens, got {num_tokens}")
        if self._armed:
            raise RuntimeError("arm() called while the previous step is still being served: call finish_step()")
        with self._cond:
            for word, value in ((TOKENS, num_tokens), (LAYERS, num_layers), (SERVED, 0), (ERROR_LAYER, 0),
                                (PARK, 0)):
                self._set(word, value)
            self._set(GEN, self._get(GEN) + 1)  # last: the threads read the step once they see it
            self._cond.notify_all()
        self._expected, self._armed = num_layers, True

    def finish_step(self) -> None:
        """After the host synchronised with the step's GPU work: raise if a layer failed or was not served."""
        if not self._armed:
            return
        self._armed = False
        served, layer = self._get(SERVED), self._get(ERROR_LAYER)
        if served != self._expected:
            self.worker.flags.zero_()  # abandon the step: the threads drop it at the next arm
            raise CpuExpertsError(f"the decode pool served {served} of {self._expected} MoE layers of the step "
                                  f"(a device-side wait timed out{', or ' + repr(self.error) if self.error else ''})")
        if layer:
            value = self._get(ERROR_VALUE)
            what = "no experts in the decode pool" if value == NO_EXPERTS else f"topk_ids holds expert {value}"
            raise CpuExpertsError(f"CPU experts failed at layer {layer - 1}: {what}")

    def call(self, layer: int, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
             out: torch.Tensor) -> None:
        """One layer of an eager step, served as a graph step's is: the rows copied into the hand-off's buffers,
        the request posted and done awaited here, on the host (the executor's thread, `AsyncExperts`, which arms
        the pool; never while a graph step is in flight). `out` [T, H] receives the layer's output."""
        num_tokens, worker = hidden.shape[0], self.worker
        for buffer, tensor in ((worker.hidden_buffer, hidden), (worker.ids_buffer, topk_ids),
                               (worker.weights_buffer, topk_weights)):
            if buffer.data_ptr() != tensor.data_ptr():
                buffer[:num_tokens].copy_(tensor)
        self.arm(num_tokens, 1)
        worker.flags[DONE] = 0
        worker.flags[REQUEST] = layer + 1  # the threads see it once they have read the step armed above
        wait_done(self.ctl.ctypes.data, worker.flag_address(0), self._timeout_cycles)
        worker.flags[DONE] = 0
        self.finish_step()  # raises if the layer failed or was not served
        out.copy_(worker.out_buffer[:num_tokens])

    def park(self) -> None:
        """Ends the threads' idle spinning now (an eager step's kernels want the CPUs)."""
        self._set(PARK, 1)

    @property
    def skip_compute(self) -> bool:
        return bool(self._get(SKIP))

    @skip_compute.setter
    def skip_compute(self, value: bool) -> None:
        """Answer every layer with zeros at once (the benchmark's GPU-alone step)."""
        self._set(SKIP, int(value))

    @property
    def compute_seconds(self) -> float:
        """Total seconds from seeing a layer's request to its end (thread 0's view)."""
        return self._get(COMPUTE_CYCLES) / self._cycles_per_second

    @property
    def layers_served(self) -> int:
        """Layers served since the pool started."""
        return self._get(TOTAL_SERVED)

    @property
    def wait_seconds(self) -> float:
        """Total seconds waiting for the GPU to post a layer (thread 0's view)."""
        return self._get(WAIT_CYCLES) / self._cycles_per_second

    def close(self) -> None:
        with self._cond:
            self._stopping = True
            self._set(STOP, 1)
            self._cond.notify_all()
        for thread in self._threads:
            thread.join(timeout=5)

    # -- threads --

    def _get(self, word: int) -> int:
        return int(self.ctl[word * LINE_WORDS])

    def _set(self, word: int, value: int) -> None:
        self.ctl[word * LINE_WORDS] = value

    def _compile(self) -> None:
        """Compiles (or loads from numba's cache) the threads' code here, at start-up: compiled by the threads on
        the first step, it took longer than the device waits for a layer (tens of seconds on a cold cache)."""
        self._set(STOP, 1)  # the call returns at once
        self._serve_call(0, 0)
        self._set(STOP, 0)

    def _serve_call(self, tid: int, seen: int) -> int:
        return _serve(tid, self.num_threads, self.ctl.ctypes.data, self.worker.flags.data_ptr(), seen,
                      self._idle_cycles, *self._buffers, *self._weights, *self._scratch, self.kind, *self._scratch_int4,
                      *self._scratch_float, self._mode)

    def _thread_main(self, tid: int) -> None:
        pin_current_thread([self.cpus[tid]])
        seen = 0
        try:
            while True:
                with self._cond:
                    while self._get(GEN) == seen and not self._stopping:
                        self._cond.wait()
                if self._stopping:
                    return
                seen = self._serve_call(tid, seen)
        except BaseException as exc:  # noqa: BLE001 (reported by finish_step; the engine falls back)
            self.error = exc
            self._set(STOP, 1)  # the other threads leave their barriers instead of waiting for this one


@njit(nogil=True, cache=True)
def _read_cycles():
    return cycles()


def _cycle_rate(seconds: float = 0.02) -> float:
    """Cycle-counter ticks per second, against the wall clock."""
    _read_cycles()  # compiled (or loaded) outside the timing
    start_t, start_c = time.perf_counter(), _read_cycles()
    time.sleep(seconds)
    return (_read_cycles() - start_c) / (time.perf_counter() - start_t)
