"""Prefill of group-wise quantized experts (int4, and int8 with groups) on AMX: the grouped GEMM of
`cpu_experts.prefill_amx`, with one scale per weight row per group of input columns; the backend
`AmxGroupedBackend` of the one prefill driver (`cpu_experts.prefill.Prefill`).

W8A8 with group scales: y[n, t] = x_scale[t] * sum_g w_scale[n, g] * (sum_{k in g} w_q[n, k] * x_q[t, k]). The
integer sum of a group is exact in int32, so each group's tiles are zeroed, accumulated over the group's 64-column
steps with `tdpbssd`, stored, and added to float accumulators with the row's group scale. The decode kernels
(`kernels_vnni`) compute the same sums, so a token gets the same result on either path.

Operands (see `prefill_amx` for the tile layouts):
- A: the weight rows of a task unpacked to int8 in a per-thread scratch: int4 nibbles become `nibble - 8` (codes
  -8..7); within each unit of 64 columns (32 for group 32) the unit's low nibbles (even columns) come first, then
  its high nibbles (odd columns), so the unpacking is two contiguous vector loops and never interleaves.
- B: the call's int8 activations with their columns permuted the same way within each unit (a dot product does
  not care about the order of its terms, as long as both sides agree), packed as in `prefill_amx`. Grouped int8
  weights are copied as they are and their activations are not permuted.

Group 32 (Kimi-K2's INT4) is half a 64-column step: its tiles are configured for half steps (`tile_config(32)`:
A 16 x 32 bytes, B 8 rows), a group is one `_half_block` (B's first or last 8 rows of its step's tile), and the
permutation unit is 32 columns, so each group's columns stay in its own half. Scales are float32 or, for int4,
bfloat16 (widened by `scale_value`).

Needs H and every partition's I to be multiples of 64, the group size 32 or a multiple of 64 (`is_supported`).
"""

from __future__ import annotations

import functools

import numba
import numpy as np
import torch
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from cpu_experts.kernels import activation, scale_value
from cpu_experts.packed import PackedLayer, PartitionWeights
from cpu_experts.prefill import PrefillCall, float32_rows
from cpu_experts.prefill_amx import (
    TILE_BYTES,
    TILE_ROWS,
    _block,
    _half_block,
    _ptr,
    _tile_begin,
    _tile_end,
    down_task_rows,
    int8_operand,
    replace_tiles,
    tile_config,
)

FLAGS = dict(parallel=True, fastmath=True, nogil=True, cache=True)
HALF_GROUP = TILE_BYTES // 2  # group 32: half a 64-column step
HALF_B_BYTES = TILE_ROWS // 2 * TILE_BYTES  # the B tile's last 8 rows (columns 32-63 of its step) start here


def is_supported(layer: PackedLayer) -> bool:
    spec = layer.spec
    return (spec.dtype in ("int4", "int8") and (spec.group_size == HALF_GROUP or (
        spec.group_size > 0 and spec.group_size % TILE_BYTES == 0))
        and spec.hidden_size % TILE_BYTES == 0 and all(p.size % TILE_BYTES == 0 for p in layer.partitions))


def permutation_unit(group: int) -> int:
    """Columns of the unit within which unpacked int4 rows (and their activations) put even columns first."""
    return min(group, TILE_BYTES)


def _unpack_codegen(unit_bytes: int):
    """For each of num_units units of `unit_bytes` packed bytes: dst[2 u B:2 u B + B] = low nibbles - 8 and
    dst[2 u B + B:2 (u + 1) B] = high nibbles - 8 of src[u B:(u + 1) B] (B = unit_bytes, byte offsets). Written as
    vector IR: numba widens the integer operations of the equivalent loop to int64 and it ran at about a byte per
    ns, slower than the GEMM it feeds."""
    def codegen(context, builder, sig, args):
        i8 = ir.IntType(8)
        vec = ir.VectorType(i8, unit_bytes)
        src_p = _ptr(context, builder, sig.args[0], args[0], args[1])
        dst_p = _ptr(context, builder, sig.args[2], args[2], args[3])
        low, eight, four = (ir.Constant(vec, [v] * unit_bytes) for v in (15, 8, 4))
        with cgutils.for_range(builder, args[4]) as loop:
            at = builder.mul(loop.index, ir.Constant(loop.index.type, unit_bytes))
            v = builder.load(builder.bitcast(builder.gep(src_p, [at]), vec.as_pointer()), align=1)
            out = builder.gep(dst_p, [builder.add(at, at)])
            lo = builder.sub(builder.and_(v, low), eight)
            hi = builder.sub(builder.lshr(v, four), eight)
            builder.store(lo, builder.bitcast(out, vec.as_pointer()), align=1)
            high = builder.gep(out, [ir.Constant(loop.index.type, unit_bytes)])
            builder.store(hi, builder.bitcast(high, vec.as_pointer()), align=1)
        return context.get_dummy_value()
    return codegen


@intrinsic
def _unpack_int4(typingctx, src, src_off, dst, dst_off, num_units):
    """`_unpack_codegen` over 64-column units (32 packed bytes)."""
    return types.void(src, src_off, dst, dst_off, num_units), _unpack_codegen(TILE_BYTES // 2)


@intrinsic
def _unpack_int4_half(typingctx, src, src_off, dst, dst_off, num_units):
    """`_unpack_codegen` over 32-column units (16 packed bytes: group 32)."""
    return types.void(src, src_off, dst, dst_off, num_units), _unpack_codegen(HALF_GROUP // 2)


@njit(fastmath=True, cache=True)
def unpack_rows(w, e, r0, num_rows, is_int4, unit, out):
    """out[r * K:(r + 1) * K] = row r0 + r of expert e as int8 in the A order (module docstring) for permutation
    units of `unit` columns (64 or 32); w is [E, N, K] int8, or [E, N, K / 2] packed int4."""
    num_bytes = w.shape[2]
    cols = 2 * num_bytes if is_int4 else num_bytes
    for r in range(num_rows):
        src = (e * w.shape[1] + r0 + r) * num_bytes
        if is_int4 and unit == HALF_GROUP:
            _unpack_int4_half(w, src, out, r * cols, cols // HALF_GROUP)
        elif is_int4:
            _unpack_int4(w, src, out, r * cols, cols // TILE_BYTES)
        else:
            out[r * cols:(r + 1) * cols] = w[e, r0 + r]


def permute_columns(q: np.ndarray, unit: int = TILE_BYTES) -> np.ndarray:
    """int8 [R, K] -> [R, K] with each `unit`-column unit's even columns first, then its odd ones (the A order of
    unpacked int4 rows)."""
    rows, cols = q.shape
    units = q.reshape(rows, cols // unit, unit // 2, 2)  # [R, K / unit, unit / 2, (even, odd)]
    return np.ascontiguousarray(units.transpose(0, 1, 3, 2)).reshape(rows, cols)


@njit(**FLAGS)
def gate_up_grouped(cfg, gate, up, gate_s, up_s, experts, offsets, pair_token, col_offsets, x_v, x_scale, group,
                    is_int4, scratch, epilogue, act):
    """act[p, i] = silu(gate[e, i] . x) * (up[e, i] . x) (`kernels.activation`) for every pair p of expert e; tasks
    are (expert, 16 rows
    of I); `scratch` [threads, 2 * 16 * H] int8 holds each task's unpacked gate and up rows."""
    rows, hidden = gate.shape[1], scratch.shape[1] // (2 * TILE_ROWS)
    num_rb, steps, unit = rows // TILE_ROWS, group // TILE_BYTES, min(group, TILE_BYTES)
    num_groups = -(-hidden // group)
    for task in prange(experts.shape[0] * num_rb):
        u, rb = task // num_rb, task % num_rb
        e, p0, m = experts[u], offsets[u], offsets[u + 1] - offsets[u]
        num_ct = (col_offsets[u + 1] - col_offsets[u]) // TILE_ROWS
        a = scratch[numba.get_thread_id()]
        a_gate, a_up = a[:TILE_ROWS * hidden], a[TILE_ROWS * hidden:]
        unpack_rows(gate, e, rb * TILE_ROWS, TILE_ROWS, is_int4, unit, a_gate)
        unpack_rows(up, e, rb * TILE_ROWS, TILE_ROWS, is_int4, unit, a_up)
        c = np.empty(4 * TILE_ROWS * TILE_ROWS, dtype=np.int32)
        acc = np.empty(4 * TILE_ROWS * TILE_ROWS, dtype=np.float32)
        b_step = num_ct * TILE_ROWS * TILE_BYTES
        _tile_begin(cfg)
        for ct in range(0, num_ct, 2):
            num_b = min(2, num_ct - ct)
            b_off = hidden * col_offsets[u] + ct * TILE_ROWS * TILE_BYTES
            acc[:] = 0
            for g in range(num_groups):
                if group == HALF_GROUP:  # (the branch sits here, not in a helper: `replace_tiles` swaps the blocks)
                    _half_block(a_gate, g * group, a_up, g * group, hidden, x_v,
                                b_off + g // 2 * b_step + g % 2 * HALF_B_BYTES, num_b, c)
                else:
                    num_k = min(steps, (hidden - g * group) // TILE_BYTES)
                    _block(a_gate, g * group, a_up, g * group, hidden, x_v, b_off + g * steps * b_step, b_step, num_k,
                           num_b, False, c)
                _scale_add(c, acc, num_b, gate_s, rb * TILE_ROWS, up_s, rb * TILE_ROWS, e, g)
            _act_from_acc(acc, min(num_b * TILE_ROWS, m - ct * TILE_ROWS), p0 + ct * TILE_ROWS, e, rb * TILE_ROWS,
                          pair_token, x_scale, epilogue, act)
        _tile_end()


@njit(fastmath=True, cache=True)
def _scale_add(c, acc, num_b, scales0, row0, scales1, row1, e, g):
    """acc += C with each tile row scaled by its weight row's group-g scale: tiles alternate A0, A1 per column tile
    (`prefill_amx._tiles_codegen`); A0's rows start at row0 of scales0, A1's at row1 of scales1."""
    for t in range(2 * num_b):
        scales, first = (scales0, row0) if t % 2 == 0 else (scales1, row1)
        base = t * TILE_ROWS * TILE_ROWS
        for r in range(TILE_ROWS):
            s = scale_value(scales[e, first + r, g])
            at = base + r * TILE_ROWS
            for col in range(TILE_ROWS):
                acc[at + col] += np.float32(c[at + col]) * s


@njit(fastmath=True, cache=True)
def _act_from_acc(acc, num_cols, p_first, e, i0, pair_token, x_scale, epilogue, act):
    for j in range(num_cols):
        p = p_first + j
        xs = x_scale[pair_token[p]]
        at = (j // TILE_ROWS) * 512 + j % TILE_ROWS
        for r in range(TILE_ROWS):
            act[p, i0 + r] = activation(acc[at + r * TILE_ROWS] * xs, acc[at + 256 + r * TILE_ROWS] * xs, epilogue, e,
                                        i0 + r, True)


@njit(**FLAGS)
def down_grouped(cfg, down, down_s, experts, offsets, pair_token, pair_weight, col_offsets, a_v, a_scale, group,
                 is_int4, task_rows, scratch, out):
    """out[t, h] += w * (down[e, h] . act) for every pair; tasks own `task_rows` rows of H across all experts (no
    two threads write one element of `out`); `scratch` [threads, 32 * Ip] int8 holds 32 unpacked rows."""
    hidden, rows = down.shape[1], scratch.shape[1] // (2 * TILE_ROWS)
    steps, unit = group // TILE_BYTES, min(group, TILE_BYTES)
    num_groups = -(-rows // group)
    for task in prange(-(-hidden // task_rows)):
        a = scratch[numba.get_thread_id()]
        c = np.empty(4 * TILE_ROWS * TILE_ROWS, dtype=np.int32)
        acc = np.empty(4 * TILE_ROWS * TILE_ROWS, dtype=np.float32)
        _tile_begin(cfg)
        for u in range(experts.shape[0]):
            e, p0, m = experts[u], offsets[u], offsets[u + 1] - offsets[u]
            num_ct = (col_offsets[u + 1] - col_offsets[u]) // TILE_ROWS
            b_step = num_ct * TILE_ROWS * TILE_BYTES
            for h0 in range(task * task_rows, min(hidden, (task + 1) * task_rows), 2 * TILE_ROWS):
                unpack_rows(down, e, h0, 2 * TILE_ROWS, is_int4, unit, a)
                for ct in range(0, num_ct, 2):
                    num_b = min(2, num_ct - ct)
                    b_off = rows * col_offsets[u] + ct * TILE_ROWS * TILE_BYTES
                    acc[:] = 0
                    for g in range(num_groups):
                        if group == HALF_GROUP:
                            _half_block(a, g * group, a, TILE_ROWS * rows + g * group, rows, a_v,
                                        b_off + g // 2 * b_step + g % 2 * HALF_B_BYTES, num_b, c)
                        else:
                            num_k = min(steps, (rows - g * group) // TILE_BYTES)
                            _block(a, g * group, a, TILE_ROWS * rows + g * group, rows, a_v,
                                   b_off + g * steps * b_step, b_step, num_k, num_b, False, c)
                        _scale_add(c, acc, num_b, down_s, h0, down_s, h0 + TILE_ROWS, e, g)
                    _down_from_acc(acc, min(num_b * TILE_ROWS, m - ct * TILE_ROWS), p0 + ct * TILE_ROWS, h0,
                                   pair_token, pair_weight, a_scale, out)
        _tile_end()


@njit(fastmath=True, cache=True)
def _down_from_acc(acc, num_cols, p_first, h0, pair_token, pair_weight, a_scale, out):
    for j in range(num_cols):
        p = p_first + j
        o = out[pair_token[p]]
        coef = pair_weight[p] * a_scale[p]
        at = (j // TILE_ROWS) * 512 + j % TILE_ROWS
        for r in range(2 * TILE_ROWS):  # A0 then A1: rows h0 .. h0 + 31
            o[h0 + r] += coef * acc[at + r * TILE_ROWS]


def reference_kernels():
    """(gate_up_grouped, down_grouped) with the tile instructions replaced by their plain-numba reference:
    unpacking, permutation, group scaling and epilogues of this module, testable on any CPU."""
    return replace_tiles(gate_up_grouped), replace_tiles(down_grouped)


class AmxGroupedBackend:
    """The W8A8 grouped GEMM of the module docstring, a `prefill.PrefillBackend`; `kernels` (tests): see
    `reference_kernels`."""

    uses_columns = True

    def __init__(self, layer: PackedLayer, kernels=None):
        if not is_supported(layer):
            raise ValueError("AmxGroupedBackend needs int4 or grouped int8 experts with H and each partition's I "
                             f"multiples of {TILE_BYTES} and a group size of {HALF_GROUP} or a multiple of "
                             f"{TILE_BYTES}")
        self.layer = layer
        self.spec = layer.spec
        self.is_int4 = self.spec.dtype == "int4"
        # int4 weights are unpacked even columns first within each unit: their activations are permuted alike
        unit = permutation_unit(self.spec.group_size)
        self.permute = functools.partial(permute_columns, unit=unit) if self.is_int4 else None
        self.cfg = tile_config(HALF_GROUP if self.spec.group_size == HALF_GROUP else TILE_BYTES)
        self.gate_up_kernel, self.down_kernel = kernels or (gate_up_grouped, down_grouped)

    def activations(self, hidden: torch.Tensor, call: PrefillCall) -> tuple[np.ndarray, np.ndarray]:
        return int8_operand(call, float32_rows(hidden), call.routing.pair_token, "x", self.permute)

    def gate_up(self, call: PrefillCall, part: PartitionWeights, epilogue, x) -> np.ndarray:
        ws, r, (x_v, x_scale) = call.workspace, call.routing, x
        hidden = self.spec.hidden_size
        act = ws.array("act", (len(r.pair_token), part.size), np.float32)
        scratch = ws.array("a_gate_up", (numba.get_num_threads(), 2 * TILE_ROWS * hidden), np.int8)
        self.gate_up_kernel(self.cfg, part.gate, part.up, part.gate_scales, part.up_scales, r.experts, r.offsets,
                            r.pair_token, call.col_offsets, x_v, x_scale, self.spec.group_size, self.is_int4,
                            scratch, epilogue, act)
        return act

    def down(self, call: PrefillCall, part: PartitionWeights, act: np.ndarray, out: np.ndarray) -> None:
        ws, r = call.workspace, call.routing
        a_v, a_scale = int8_operand(call, act, call.pair_rows, "a", self.permute)
        scratch = ws.array("a_down", (numba.get_num_threads(), 2 * TILE_ROWS * part.size), np.int8)
        self.down_kernel(self.cfg, part.down, part.down_scales, r.experts, r.offsets, r.pair_token, r.pair_weight,
                         call.col_offsets, a_v, a_scale, self.spec.group_size, self.is_int4,
                         down_task_rows(out.shape[1]), scratch, out)
