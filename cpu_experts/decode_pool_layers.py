"""The decode pool's per-layer work for the packed formats (`cpu_experts.decode_pool` runs int8 itself and calls
here for the others): int4 (W8A8, `kernels_vnni_int4`) and the float formats FP8, MXFP4 and NVFP4 (bf16
activations, `kernels_fp8`, `kernels_fp4`), each on its kernels' own work-range bodies, so a step served by the
pool equals one served by the operator bit for bit. Every thread runs the same phases on its static share,
separated by `decode_pool_sync._barrier`s; the slot table (one row per partition: array addresses, then
dimensions) is built by `layer_tables`.

Activation: a pool whose layers are all silu without biases runs with `mode` None, the kernels' plain
specialization; otherwise (gpt-oss) `mode` is an int and each slot's epilogue (`kernels.activation`) is built from
its table row (ACT_KIND, ALPHA, LIMIT, the bias addresses; zeros where a layer has no bias), and each thread adds the
down bias over its own output columns after the layer's partitions, as `CpuMoE` does.
"""

from __future__ import annotations

import numpy as np
from numba import carray, njit

from cpu_experts.atomics import float32_pointer, pointer_like, uint8_pointer
from cpu_experts.decode_pool_sync import _barrier, _share
from cpu_experts.kernels import ACT_KINDS, _as_float32, add_down_bias, round_bf16
from cpu_experts.kernels_fp4 import (
    down_rows_mxfp4,
    down_rows_nvfp4,
    gate_up_rows_mxfp4,
    gate_up_rows_nvfp4,
    split_bf16_row,
)
from cpu_experts.kernels_fp8 import down_rows_fp8, gate_up_rows_fp8
from cpu_experts.kernels_vnni_int4 import down_rows_int4, gate_up_rows_int4, num_corrections, quantize_int4_row

# Columns of the slot table (one row per partition of a layer): the arrays' addresses, then their dimensions
# (GATE_COLS, DOWN_COLS: the stored rows' lengths, halved for int4).
# (GATE_TS, UP_TS, DOWN_TS: NVFP4's tensor scales [E], 0 for other formats; ACT_KIND, ALPHA, LIMIT (float32 bits),
# GATE_B, UP_B [E, Ip] and DOWN_B [E, H]: the activation, `kernels.epilogues`).
(GATE, GATE_S, UP, UP_S, DOWN, DOWN_S, NUM_EXPERTS, ROWS, HIDDEN, GROUPS_H, GROUPS_I, GROUP_H, GROUP_I, GATE_COLS,
 DOWN_COLS, GATE_TS, UP_TS, DOWN_TS, ACT_KIND, ALPHA, LIMIT, GATE_B, UP_B, DOWN_B) = range(24)
# The pool's weight format, one for all its layers (`kind_of`); its layer code is compiled per format.
INT8, INT4, INT4_BF16, FP8, MXFP4, NVFP4 = range(6)
FLOAT_KINDS = {"fp8": FP8, "mxfp4": MXFP4, "nvfp4": NVFP4}


# ---- the activation -----------------------------------------------------------------------------------------------

@njit(nogil=True, cache=True)
def slot_epilogue(slots, s, mode):
    """Slot s's `kernels.activation` epilogue: None in a plain pool (`mode` None), else from its table row."""
    if mode is None:
        return None
    shape = (slots[s, NUM_EXPERTS], slots[s, ROWS])
    return (slots[s, ACT_KIND], _as_float32(np.int32(slots[s, ALPHA])), _as_float32(np.int32(slots[s, LIMIT])),
            carray(float32_pointer(slots[s, GATE_B]), shape), carray(float32_pointer(slots[s, UP_B]), shape))


@njit(nogil=True, cache=True, fastmath=True)
def down_bias(tid, num_threads, slots, first, routing, mode, out):
    """This thread's output columns (the down rows' share) += each pair's weighted down bias; nothing in a plain
    pool."""
    if mode is None:
        return
    experts, offsets, pair_token, pair_weight = routing
    hidden = slots[first, HIDDEN]
    bias = carray(float32_pointer(slots[first, DOWN_B]), (slots[first, NUM_EXPERTS], hidden))
    lo, hi = _share(hidden, tid, num_threads)
    add_down_bias(lo, hi, experts, offsets, pair_token, pair_weight, bias, out)


# ---- int4 -------------------------------------------------------------------------------------------------------

@njit(nogil=True, cache=True)
def _packed_dims(slots, s):
    e, rows, hidden = slots[s, NUM_EXPERTS], slots[s, ROWS], slots[s, HIDDEN]
    return (e, rows, slots[s, GATE_COLS]), (e, rows, slots[s, GROUPS_H]), (e, hidden, slots[s, DOWN_COLS]), \
        (e, hidden, slots[s, GROUPS_I])


@njit(nogil=True, cache=True)
def _packed_arrays(slots, s, scale_like):
    """Slot s's gate, gate_s, up, up_s, down, down_s as unowned arrays: uint8 weights (int4 nibbles, e4m3 or e2m1
    codes), scales of `scale_like`'s dtype (float32; bfloat16 as uint16 bits; E8M0 / e4m3 as uint8)."""
    gate_dims, gate_s_dims, down_dims, down_s_dims = _packed_dims(slots, s)
    return (carray(uint8_pointer(slots[s, GATE]), gate_dims),
            carray(pointer_like(slots[s, GATE_S], scale_like), gate_s_dims),
            carray(uint8_pointer(slots[s, UP]), gate_dims),
            carray(pointer_like(slots[s, UP_S], scale_like), gate_s_dims),
            carray(uint8_pointer(slots[s, DOWN]), down_dims),
            carray(pointer_like(slots[s, DOWN_S], scale_like), down_s_dims))


@njit(nogil=True, cache=True, fastmath=True)
def _quantize_rows_int4(tid, num_threads, src, num_rows, num_cols, group, q_even, q_odd, scale, corr):
    lo, hi = _share(num_rows, tid, num_threads)
    half = (num_cols + 1) // 2
    for r in range(lo, hi):
        scale[r] = quantize_int4_row(src[r, :num_cols], q_even[r, :half], q_odd[r, :half], corr[r], group)


@njit(nogil=True, cache=True, fastmath=True)
def _partition_int4(tid, num_threads, ctl, slots, s, routing, num_tokens, gate, gate_s, up, up_s, down, down_s, x4,
                    act, a4, out, mode):
    """One partition of an int4 layer: gate/up items, act to int8, down columns (`kernels_vnni_int4`'s bodies)."""
    experts, offsets, pair_token, pair_weight = routing
    x_even, x_odd, x_corr, x_scale = x4
    a_even, a_odd, a_corr, a_scale = a4
    lo, hi = _share(experts.shape[0] * gate.shape[1], tid, num_threads)
    gate_up_rows_int4(lo, hi, experts, offsets, pair_token, gate, gate_s, up, up_s, x_even, x_odd, x_corr, x_scale,
                      slots[s, GROUP_H], slot_epilogue(slots, s, mode), act)
    _barrier(ctl, num_threads)
    _quantize_rows_int4(tid, num_threads, act, pair_token.shape[0], slots[s, ROWS], slots[s, GROUP_I], a_even, a_odd,
                        a_scale, a_corr)
    _barrier(ctl, num_threads)
    lo, hi = _share(down.shape[1], tid, num_threads)
    down_rows_int4(lo, hi, experts, offsets, pair_token, pair_weight, down, down_s, a_even, a_odd, a_corr, a_scale,
                   slots[s, GROUP_I], out)


@njit(nogil=True, cache=True, fastmath=True)
def layer_int4(tid, num_threads, ctl, kind, first, count, slots, routing, num_tokens, hidden, out, x4, act, a4,
               mode):
    """This thread's share of one int4 MoE layer (after routing): the rows to int8, then partition by partition."""
    x_even, x_odd, x_corr, x_scale = x4
    _quantize_rows_int4(tid, num_threads, hidden, num_tokens, hidden.shape[1], slots[first, GROUP_H], x_even, x_odd,
                        x_scale, x_corr)
    lo, hi = _share(out.shape[1], tid, num_threads)
    out[:num_tokens, lo:hi] = 0
    _barrier(ctl, num_threads)
    for s in range(first, first + count):
        if kind == INT4_BF16:
            arrays = _packed_arrays(slots, s, np.empty(0, np.uint16))
            _partition_int4(tid, num_threads, ctl, slots, s, routing, num_tokens, *arrays, x4, act, a4, out, mode)
        else:
            arrays = _packed_arrays(slots, s, np.empty(0, np.float32))
            _partition_int4(tid, num_threads, ctl, slots, s, routing, num_tokens, *arrays, x4, act, a4, out, mode)
    down_bias(tid, num_threads, slots, first, routing, mode, out)


# ---- float formats ----------------------------------------------------------------------------------------------

@njit(nogil=True, cache=True)
def _tensor_scales(slots, s):
    e = slots[s, NUM_EXPERTS]
    return (carray(float32_pointer(slots[s, GATE_TS]), (e,)), carray(float32_pointer(slots[s, UP_TS]), (e,)),
            carray(float32_pointer(slots[s, DOWN_TS]), (e,)))


@njit(nogil=True, cache=True, fastmath=True)
def _round_rows(tid, num_threads, src, num_rows, kind, x_f, x_even, x_odd):
    """This thread's share of the tokens' rows rounded to bf16: as they are (FP8) or split into even and odd
    columns (the FP4 formats)."""
    lo, hi = _share(num_rows, tid, num_threads)
    for r in range(lo, hi):
        if kind == FP8:
            for j in range(src.shape[1]):
                x_f[r, j] = round_bf16(src[r, j])
        else:
            split_bf16_row(src[r], x_even[r], x_odd[r])


@njit(nogil=True, cache=True, fastmath=True)
def _partition_float(tid, num_threads, ctl, kind, slots, s, routing, out, xf4, mode):
    """One partition of a float-format layer: gate/up ranges (act rounded to bf16 by them), then down columns."""
    experts, offsets, pair_token, pair_weight = routing
    x_f, x_even, x_odd, act, act_even, act_odd = xf4
    items = _share(experts.shape[0] * slots[s, ROWS], tid, num_threads)
    columns = _share(slots[s, HIDDEN], tid, num_threads)
    epilogue = slot_epilogue(slots, s, mode)
    if kind == FP8:
        gate, gate_s, up, up_s, down, down_s = _packed_arrays(slots, s, np.empty(0, np.float32))
        gate_up_rows_fp8(items[0], items[1], experts, offsets, pair_token, gate, gate_s, up, up_s, x_f,
                         slots[s, GROUP_H], epilogue, act)
        _barrier(ctl, num_threads)
        down_rows_fp8(columns[0], columns[1], experts, offsets, pair_token, pair_weight, down, down_s, act,
                      slots[s, GROUP_I], out)
        return
    gate, gate_s, up, up_s, down, down_s = _packed_arrays(slots, s, np.empty(0, np.uint8))
    if kind == MXFP4:
        gate_up_rows_mxfp4(items[0], items[1], experts, offsets, pair_token, gate, gate_s, up, up_s, x_even, x_odd,
                           epilogue, act_even, act_odd)
        _barrier(ctl, num_threads)
        down_rows_mxfp4(columns[0], columns[1], experts, offsets, pair_token, pair_weight, down, down_s, act_even,
                        act_odd, out)
        return
    gate_ts, up_ts, down_ts = _tensor_scales(slots, s)
    gate_up_rows_nvfp4(items[0], items[1], experts, offsets, pair_token, gate, gate_s, gate_ts, up, up_s, up_ts,
                       x_even, x_odd, epilogue, act_even, act_odd)
    _barrier(ctl, num_threads)
    down_rows_nvfp4(columns[0], columns[1], experts, offsets, pair_token, pair_weight, down, down_s, down_ts,
                    act_even, act_odd, out)


@njit(nogil=True, cache=True, fastmath=True)
def layer_float(tid, num_threads, ctl, kind, first, count, slots, routing, num_tokens, hidden, out, xf4, mode):
    """This thread's share of one float-format MoE layer (after routing): the rows to bf16, then partition by
    partition; a barrier between partitions, since down reads the act rows the next partition's gate/up writes."""
    x_f, x_even, x_odd = xf4[0], xf4[1], xf4[2]
    _round_rows(tid, num_threads, hidden, num_tokens, kind, x_f, x_even, x_odd)
    lo, hi = _share(out.shape[1], tid, num_threads)
    out[:num_tokens, lo:hi] = 0
    _barrier(ctl, num_threads)
    for s in range(first, first + count):
        if s > first:
            _barrier(ctl, num_threads)
        _partition_float(tid, num_threads, ctl, kind, slots, s, routing, out, xf4, mode)
    down_bias(tid, num_threads, slots, first, routing, mode, out)


# ---- the slot table and scratch (host side, at the pool's start) -------------------------------------------------

def layer_tables(ops: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[np.ndarray]]:
    """`ops` ({layer: CpuMoE}) -> per layer its first slot and slot count ([max layer + 1], -1: none); the slot
    table (see GATE ...); and the arrays the table points into, which the pool keeps alive."""
    num_layers = max(ops) + 1
    first_slot = np.full(num_layers, -1, dtype=np.int64)
    num_slots = np.zeros(num_layers, dtype=np.int64)
    rows, keep = [], []
    for layer in sorted(ops):
        op = ops[layer]
        first_slot[layer], num_slots[layer] = len(rows), len(op.layer.partitions)
        for part in op.layer.partitions:
            arrays = [np.ascontiguousarray(a) for a in (part.gate, part.gate_scales, part.up, part.up_scales,
                                                          part.down, part.down_scales)]
            tensor_scales = [np.ascontiguousarray(a) for a in (part.gate_tensor_scale, part.up_tensor_scale,
                                                                 part.down_tensor_scale) if a is not None]
            keep += arrays + tensor_scales
            num_experts, size, gate_cols = part.gate.shape
            hidden = op.spec.hidden_size
            biases = _biases(op, part)
            keep += biases
            act = op.spec.activation
            rows.append([a.ctypes.data for a in arrays] + [
                num_experts, size, hidden, part.gate_scales.shape[2], part.down_scales.shape[2],
                op.spec.group(op.spec.hidden_size), op.spec.group_size or part.size, gate_cols, part.down.shape[2]]
                + ([a.ctypes.data for a in tensor_scales] or [0, 0, 0])
                + [ACT_KINDS[act.kind], _float32_bits(act.alpha), _float32_bits(act.limit)]
                + [a.ctypes.data for a in biases])
    return first_slot, num_slots, np.array(rows, dtype=np.int64), keep


def _biases(op, part) -> list[np.ndarray]:
    """gate, up [E, Ip] and down [E, H] biases of one partition's slot: the layer's, or zeros (also the down bias
    of a tensor-parallel rank other than 0, which leaves it to rank 0)."""
    spec = op.spec
    zeros_down = np.zeros((spec.num_experts, spec.hidden_size), np.float32)
    if spec.has_bias:
        down = zeros_down if op.layer.down_bias is None else op.layer.down_bias
        return [np.ascontiguousarray(a) for a in (part.gate_bias, part.up_bias, down)]
    zeros = np.zeros((spec.num_experts, part.size), np.float32)
    return [zeros, zeros, zeros_down]


def _float32_bits(value: float) -> int:
    return int(np.array(value, dtype=np.float32).view(np.int32))


def scratch_int8(ops: dict, max_tokens: int, top_k: int) -> tuple:
    """Buffers the threads share: x_q, x_scale, x_sum [T, G_h]; act, a_q [P, I_part], a_scale, a_sum [P, G_i]."""
    parts = [(op, part) for op in ops.values() for part in op.layer.partitions]
    hidden = parts[0][0].spec.hidden_size
    max_rows = max(part.size for _, part in parts)
    groups_h = max(part.gate_scales.shape[2] for _, part in parts)
    groups_i = max(part.down_scales.shape[2] for _, part in parts)
    max_pairs = max_tokens * top_k
    return (np.zeros((max_tokens, hidden), np.int8), np.zeros(max_tokens, np.float32),
            np.zeros((max_tokens, groups_h), np.int64), np.zeros((max_pairs, max_rows), np.float32),
            np.zeros((max_pairs, max_rows), np.int8), np.zeros(max_pairs, np.float32),
            np.zeros((max_pairs, groups_i), np.int64))



def scratch_int4(ops: dict, max_tokens: int, top_k: int, is_int4: bool) -> tuple:
    """The int4 layers' activation buffers: x_even, x_odd [T, ceil(H / 2)], x_corr [T, U_h * 8]; a_even, a_odd
    [P, ceil(I_part / 2)], a_corr [P, U_i * 8] (`kernels_vnni_int4`); one-element stand-ins for int8 layers."""
    if not is_int4:
        return (np.zeros((1, 1), np.int8), np.zeros((1, 1), np.int8), np.zeros((1, 1), np.int32)) * 2
    parts = [(op, part) for op in ops.values() for part in op.layer.partitions]
    spec = parts[0][0].spec
    gate_bytes = max(part.gate.shape[2] for _, part in parts)
    down_bytes = max(part.down.shape[2] for _, part in parts)
    max_pairs = max_tokens * top_k
    corr_h = max(num_corrections(part.gate.shape[2], spec.group(spec.hidden_size)) for _, part in parts)
    corr_i = max(num_corrections(part.down.shape[2], spec.group_size) for _, part in parts)
    return (np.zeros((max_tokens, gate_bytes), np.int8), np.zeros((max_tokens, gate_bytes), np.int8),
            np.zeros((max_tokens, corr_h), np.int32), np.zeros((max_pairs, down_bytes), np.int8),
            np.zeros((max_pairs, down_bytes), np.int8), np.zeros((max_pairs, corr_i), np.int32))


def scratch_float(ops: dict, max_tokens: int, top_k: int, is_float: bool) -> tuple:
    """The float formats' activation buffers (float32): x_f [T, H] (FP8), x_even, x_odd [T, ceil(H / 2)] and
    act_even, act_odd [P, ceil(I_part / 2)] (FP4; FP8's act rows are the pool's act); stand-ins otherwise."""
    if not is_float:
        return (np.zeros((1, 1), np.float32),) * 5
    parts = [(op, part) for op in ops.values() for part in op.layer.partitions]
    hidden = parts[0][0].spec.hidden_size
    half_h, half_i = -(-hidden // 2), -(-max(part.size for _, part in parts) // 2)
    max_pairs = max_tokens * top_k
    return (np.zeros((max_tokens, hidden), np.float32), np.zeros((max_tokens, half_h), np.float32),
            np.zeros((max_tokens, half_h), np.float32), np.zeros((max_pairs, half_i), np.float32),
            np.zeros((max_pairs, half_i), np.float32))
