"""Integer decode kernels (W8A8) for CPUs with VNNI: int8 x int8 dot products with `vpdpbusd` (32 multiply-adds
per instruction on 256-bit vectors), which the float kernels in `cpu_experts.kernels` need ~12 instructions for.
Same work split and results as those kernels on rounded activations, up to float summation order (the integer
sums here are exact).

The activations arrive quantized per row (`prepare`): x_q int8 [T, K], x_scale [T], and x_sum [T, G], each scale
group's sum of x_q over the columns the vector loop covers (whole 32s). `vpdpbusd` multiplies unsigned by
signed bytes, so int8 weights enter with their sign bit flipped (w + 128) and the dot is corrected by
128 * x_sum; int4 nibbles are unsigned already (nibble = q + 8) and are corrected by 8 * x_sum.

Only `has_vnni()` machines may call these: LLVM compiles the intrinsic for the host CPU on first use and has no
fallback for it. `operator.CpuMoE` dispatches on it once, at construction.
"""

from __future__ import annotations

import llvmlite.binding as llvm
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from cpu_experts.kernels import quantize_row

FLAGS = dict(parallel=True, fastmath=True, nogil=True, cache=True)
VNNI = "llvm.x86.avx512.vpdpbusd.256"  # also selected as the VEX (AVX-VNNI) form where AVX-512 is absent


def has_vnni() -> bool:
    features = llvm.get_host_cpu_features()
    return bool(features.get("avxvnni") or (features.get("avx512vnni") and features.get("avx512vl")))


def _vnni_codegen(is_int4: bool):
    """LLVM IR for sum over 32-byte blocks of vpdpbusd; int8: (w ^ 0x80) . x; int4: lo . x_even + hi . x_odd."""
    def codegen(context, builder, signature, args):
        arrays = [context.make_array(ty)(context, builder, val) for ty, val in zip(signature.args, args, strict=True)]
        n = builder.extract_value(arrays[0].shape, 0)
        v8 = ir.VectorType(ir.IntType(32), 8)
        bytes_ptr = ir.IntType(8).as_pointer()
        ptrs = [builder.bitcast(a.data, bytes_ptr) for a in arrays]
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(v8, [v8, v8, v8]), VNNI)
        acc_ptr = cgutils.alloca_once_value(builder, ir.Constant(v8, [0] * 8))
        nibble = ir.Constant(v8, [0x0F0F0F0F] * 8)
        sign = ir.Constant(v8, [-0x7F7F7F80] * 8)  # 0x80808080
        with cgutils.for_range(builder, builder.sdiv(n, ir.Constant(n.type, 32))) as loop:
            offset = builder.mul(loop.index, ir.Constant(n.type, 32))
            v = [builder.load(builder.bitcast(builder.gep(p, [offset]), v8.as_pointer()), align=1) for p in ptrs]
            acc = builder.load(acc_ptr)
            if is_int4:
                acc = builder.call(fn, [acc, builder.and_(v[0], nibble), v[1]])
                high = builder.and_(builder.lshr(v[0], ir.Constant(v8, [4] * 8)), nibble)
                acc = builder.call(fn, [acc, high, v[2]])
            else:
                acc = builder.call(fn, [acc, builder.xor(v[0], sign), v[1]])
            builder.store(acc, acc_ptr)
        acc = builder.load(acc_ptr)
        total = builder.extract_element(acc, ir.Constant(ir.IntType(32), 0))
        for k in range(1, 8):
            total = builder.add(total, builder.extract_element(acc, ir.Constant(ir.IntType(32), k)))
        return builder.sext(total, ir.IntType(64))
    return codegen


@intrinsic
def _vnni_int8(typingctx, w, x):
    """sum_j (w[j] + 128) * x[j] over the first len(w) // 32 * 32 columns; w, x int8 1-D, unit stride."""
    return types.int64(w, x), _vnni_codegen(is_int4=False)


@intrinsic
def _vnni_int4(typingctx, w, x_even, x_odd):
    """sum_b lo(w[b]) * x_even[b] + hi(w[b]) * x_odd[b] over the first len(w) // 32 * 32 bytes."""
    return types.int64(w, x_even, x_odd), _vnni_codegen(is_int4=True)


@njit(fastmath=True, cache=True)
def _dot_int8(row, scales, x_q, x_sum, group):
    cols = x_q.shape[0]
    acc = np.float32(0.0)
    for g in range(scales.shape[0]):
        lo = g * group
        hi = min(lo + group, cols)
        vec_end = lo + (hi - lo) // 32 * 32
        s = _vnni_int8(row[lo:vec_end], x_q[lo:vec_end]) - 128 * x_sum[g]
        for j in range(vec_end, hi):
            s += np.int64(row[j]) * np.int64(x_q[j])
        acc += np.float32(s) * scales[g]
    return acc


@njit(fastmath=True, cache=True)
def _dot_int4(row, scales, x_even, x_odd, x_sum, group):
    # row: ceil(K / 2) packed bytes; group is even, so a group is whole bytes; x_odd is zero past an odd K
    half = group // 2
    num_bytes = row.shape[0]
    acc = np.float32(0.0)
    for g in range(scales.shape[0]):
        lo = g * half
        hi = min(lo + half, num_bytes)
        vec_end = lo + (hi - lo) // 32 * 32
        s = _vnni_int4(row[lo:vec_end], x_even[lo:vec_end], x_odd[lo:vec_end]) - 8 * x_sum[g]
        for b in range(vec_end, hi):
            byte = np.int64(row[b])
            s += ((byte & 15) - 8) * np.int64(x_even[b]) + ((byte >> 4) - 8) * np.int64(x_odd[b])
        acc += np.float32(s) * scales[g]
    return acc


@njit(**FLAGS)
def prepare_int8(x, group, x_q, x_scale, x_sum):
    """x float32 [T, K] -> x_q int8 [T, K] (per-row absmax / 127), x_scale [T], x_sum int64 [T, G]."""
    cols = x.shape[1]
    for t in prange(x.shape[0]):
        x_scale[t] = quantize_row(x[t], x_q[t])
        for g in range(x_sum.shape[1]):
            lo = g * group
            total = 0
            for j in range(lo, lo + (min(lo + group, cols) - lo) // 32 * 32):
                total += x_q[t, j]
            x_sum[t, g] = total


@njit(**FLAGS)
def prepare_int4(x, group, x_even, x_odd, x_scale, x_sum):
    """x float32 [T, K] -> x_even / x_odd int8 [T, ceil(K / 2)] (columns 2b and 2b + 1 of the rounded row; x_odd
    zero past an odd K), x_scale [T], x_sum int64 [T, G]: each group's sum of both over its whole 32-byte blocks
    (the vector loop's columns)."""
    cols = x.shape[1]
    half = group // 2
    for t in prange(x.shape[0]):
        amax = np.float32(0.0)
        for j in range(cols):
            amax = max(amax, abs(x[t, j]))
        inv = np.float32(127.0) / amax if amax > 0 else np.float32(0.0)
        for b in range(x_even.shape[1]):
            x_even[t, b] = np.int8(np.rint(x[t, 2 * b] * inv))
            x_odd[t, b] = np.int8(np.rint(x[t, 2 * b + 1] * inv)) if 2 * b + 1 < cols else np.int8(0)
        x_scale[t] = amax / np.float32(127.0)
        for g in range(x_sum.shape[1]):
            lo = g * half
            total = 0
            for b in range(lo, lo + (min(lo + half, x_even.shape[1]) - lo) // 32 * 32):
                total += np.int64(x_even[t, b]) + np.int64(x_odd[t, b])
            x_sum[t, g] = total


@njit(**FLAGS)
def gate_up_int8(x_q, x_scale, x_sum, experts, offsets, pair_token, gate, gate_s, up, up_s, group, act):
    rows = gate.shape[1]
    for r in prange(experts.shape[0] * rows):
        u, i = r // rows, r % rows
        e = experts[u]
        for p in range(offsets[u], offsets[u + 1]):
            t = pair_token[p]
            g = _dot_int8(gate[e, i], gate_s[e, i], x_q[t], x_sum[t], group) * x_scale[t]
            v = _dot_int8(up[e, i], up_s[e, i], x_q[t], x_sum[t], group) * x_scale[t]
            act[p, i] = g / (np.float32(1.0) + np.exp(-g)) * v


@njit(**FLAGS)
def gate_up_int4(x_even, x_odd, x_scale, x_sum, experts, offsets, pair_token, gate, gate_s, up, up_s, group, act):
    rows = gate.shape[1]
    for r in prange(experts.shape[0] * rows):
        u, i = r // rows, r % rows
        e = experts[u]
        for p in range(offsets[u], offsets[u + 1]):
            t = pair_token[p]
            g = _dot_int4(gate[e, i], gate_s[e, i], x_even[t], x_odd[t], x_sum[t], group) * x_scale[t]
            v = _dot_int4(up[e, i], up_s[e, i], x_even[t], x_odd[t], x_sum[t], group) * x_scale[t]
            act[p, i] = g / (np.float32(1.0) + np.exp(-g)) * v


@njit(**FLAGS)
def down_int8(a_q, a_scale, a_sum, experts, offsets, pair_token, pair_weight, down, down_s, group, out):
    for h in prange(down.shape[1]):
        for u in range(experts.shape[0]):
            e = experts[u]
            for p in range(offsets[u], offsets[u + 1]):
                dot = _dot_int8(down[e, h], down_s[e, h], a_q[p], a_sum[p], group)
                out[pair_token[p], h] += pair_weight[p] * a_scale[p] * dot


@njit(**FLAGS)
def down_int4(a_even, a_odd, a_scale, a_sum, experts, offsets, pair_token, pair_weight, down, down_s, group, out):
    for h in prange(down.shape[1]):
        for u in range(experts.shape[0]):
            e = experts[u]
            for p in range(offsets[u], offsets[u + 1]):
                dot = _dot_int4(down[e, h], down_s[e, h], a_even[p], a_odd[p], a_sum[p], group)
                out[pair_token[p], h] += pair_weight[p] * a_scale[p] * dot
