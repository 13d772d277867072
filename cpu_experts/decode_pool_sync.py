"""The decode pool's control block and its waiting primitives (`cpu_experts.decode_pool`): the words the host and
the threads share, one 64-byte line each, and the spins, barrier and hand-offs built on them. Compiled code only."""

from __future__ import annotations

from numba import njit

from cpu_experts.atomics import (
    LINE_WORDS,
    cpu_relax,
    cycles,
    fetch_add64,
    load_acquire32,
    load_acquire64,
    sched_yield,
    store_release32,
    store_release64,
)
from cpu_experts.flag_worker import DONE, REQUEST

IDLE_SECONDS = 0.005  # a decode step follows the last one within a millisecond; prefill steps park the pool
SPINS_BEFORE_YIELD = 4096  # ~0.2 ms of `pause` on the H200 host's Xeon, longer than any wait inside a layer
# Words of the control block, one 64-byte line each.
(GEN, TOKENS, LAYERS, STOP, PARK, SKIP, BAR_COUNT, BAR_GEN, FINISHED, EPOCH, SERVED, ERROR_LAYER, ERROR_VALUE,
 WAIT_CYCLES, COMPUTE_CYCLES, TOTAL_SERVED) = range(16)
NUM_WORDS = 16
NO_EXPERTS = -(1 << 62)  # ERROR_VALUE of a layer the pool has no experts for
_LINE = 8 * LINE_WORDS
_REQUEST_OFFSET, _DONE_OFFSET = 4 * REQUEST, 4 * DONE  # byte offsets of the int32 flags


# ---- waiting -----------------------------------------------------------------------------------------------------

@njit(nogil=True, cache=True)
def _backoff(spins):
    if spins < SPINS_BEFORE_YIELD:
        cpu_relax()
    else:
        sched_yield()
    return spins + 1


@njit(nogil=True, cache=True)
def _spin_while_equal(ctl, address, value):
    """Until the word at `address` changes, or the pool stops (a thread died: the others must not wait for it)."""
    spins = 0
    while load_acquire64(address) == value and not load_acquire64(ctl + STOP * _LINE):
        spins = _backoff(spins)


@njit(nogil=True, cache=True)
def _barrier(ctl, num_threads):
    generation = load_acquire64(ctl + BAR_GEN * _LINE)  # read before arriving: only our arrival can bump it
    if fetch_add64(ctl + BAR_COUNT * _LINE, 1) == num_threads - 1:
        store_release64(ctl + BAR_COUNT * _LINE, 0)
        store_release64(ctl + BAR_GEN * _LINE, generation + 1)
    else:
        _spin_while_equal(ctl, ctl + BAR_GEN * _LINE, generation)


@njit(nogil=True, cache=True)
def _wait_step(ctl, seen, idle_cycles):
    """The next step's generation, or `seen` after `idle_cycles` without one (or when stopped or parked)."""
    deadline, spins = cycles() + idle_cycles, 0
    while True:
        generation = load_acquire64(ctl + GEN * _LINE)
        if generation != seen:
            return generation
        if load_acquire64(ctl + STOP * _LINE) or load_acquire64(ctl + PARK * _LINE) or cycles() > deadline:
            return seen
        spins = _backoff(spins)


@njit(nogil=True, cache=True)
def _wait_request(ctl, flags, generation):
    """The request flag's value once posted, or 0 if the step was abandoned (a new `arm`) or the pool stopped."""
    spins = 0
    while True:
        value = load_acquire32(flags + _REQUEST_OFFSET)
        if value != 0:
            return value
        if load_acquire64(ctl + GEN * _LINE) != generation or load_acquire64(ctl + STOP * _LINE):
            return 0
        spins = _backoff(spins)


@njit(nogil=True, cache=True)
def wait_done(ctl, flags, max_cycles):
    """The done flag once posted, or 0 after `max_cycles` or when the pool stops: the host's wait for an eager
    layer (`DecodePool.call`), yielding its CPU at every turn to the pool's threads that may share it."""
    deadline = cycles() + max_cycles
    while True:
        value = load_acquire32(flags + _DONE_OFFSET)
        if value != 0 or load_acquire64(ctl + STOP * _LINE) or cycles() > deadline:
            return value
        sched_yield()


@njit(nogil=True, cache=True)
def _finish_layer(ctl, flags, value, num_threads, epoch):
    """Arrive at the layer's end; the last thread clears the request, counts the layer and posts done."""
    if fetch_add64(ctl + FINISHED * _LINE, 1) == num_threads - 1:
        store_release64(ctl + FINISHED * _LINE, 0)
        store_release32(flags + _REQUEST_OFFSET, 0)
        fetch_add64(ctl + SERVED * _LINE, 1)
        fetch_add64(ctl + TOTAL_SERVED * _LINE, 1)
        store_release64(ctl + EPOCH * _LINE, epoch + 1)
        store_release32(flags + _DONE_OFFSET, value)
    else:
        _spin_while_equal(ctl, ctl + EPOCH * _LINE, epoch)


@njit(nogil=True, cache=True)
def _share(total, tid, num_threads):
    return total * tid // num_threads, total * (tid + 1) // num_threads
