"""Integer decode kernels (W8A8) for CPUs with VNNI: int8 x int8 dot products with `vpdpbusd` (32 multiply-adds
per instruction on 256-bit vectors), which the float kernels in `cpu_experts.kernels` need ~12 instructions for.
Same work split and results as those kernels on rounded activations, up to float summation order (the integer
sums here are exact).

The activations arrive quantized per row (`prepare_int8`): x_q int8 [T, K], x_scale [T], and x_sum [T, G], each
scale group's sum of x_q over the columns the vector loop covers (whole 32s). `vpdpbusd` multiplies unsigned by
signed bytes, so int8 weights enter with their sign bit flipped (w + 128) and the dot is corrected by 128 * x_sum.

Each weight row is one call into LLVM IR (`_int8_dot`, `_int8_dot2`): the gate and up rows of a token run in
the same loop (two independent dependency chains per vector, so the loop is not bound by `vpdpbusd`'s latency).
The int4 kernels (`cpu_experts.kernels_vnni_int4`) build on the IR helpers here.

On a CPU without VNNI the same sums are compiled from generic widening multiplies (exact, slower): `operator.CpuMoE`
runs these kernels only where `has_vnni()` (its float kernels are faster elsewhere), and tests run them anywhere.
"""

from __future__ import annotations

import llvmlite.binding as llvm
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from cpu_experts.kernels import activation, quantize_row

FLAGS = dict(parallel=True, fastmath=True, nogil=True, cache=True)
VNNI = "llvm.x86.avx512.vpdpbusd.256"  # also selected as the VEX (AVX-VNNI) form where AVX-512 is absent
SERIAL_ROWS = 8  # activation rows below which quantizing them is not worth waking the thread pool
# Bytes ahead of the loads that each row's stream is prefetched (0: none, the hardware prefetchers alone).
PREFETCH_BYTES = 1024

I8, I16, I32, F32 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.FloatType()
V8, F8 = ir.VectorType(I32, 8), ir.VectorType(F32, 8)


def has_vnni512() -> bool:
    """512-bit `vpdpbusd` (AVX512-VNNI with AVX512BW)."""
    features = llvm.get_host_cpu_features()
    return bool(features.get("avx512vnni") and features.get("avx512bw") and features.get("avx512f"))


def has_vnni() -> bool:
    features = llvm.get_host_cpu_features()
    return bool(features.get("avxvnni") or (features.get("avx512vnni") and features.get("avx512vl")))


# ---- LLVM IR: whole-row dot products ---------------------------------------------------------------------------

class _IR:
    """Helpers for one codegen call: typed data pointers of numba arrays, unaligned 32-byte loads, intrinsics."""

    def __init__(self, context, builder):
        self.context, self.b = context, builder

    def data(self, ty, val, elem=I8):
        array = self.context.make_array(ty)(self.context, self.b, val)
        return self.b.bitcast(array.data, elem.as_pointer()), array

    def load(self, base, offset):
        return self.b.load(self.b.bitcast(self.b.gep(base, [offset]), V8.as_pointer()), align=1)

    def call(self, name, ret, arg_types, args):
        fn = cgutils.get_or_insert_function(self.b.module, ir.FunctionType(ret, arg_types), name)
        return self.b.call(fn, args)

    def prefetch(self, base, offset):
        """A hint to bring the line PREFETCH_BYTES past base[offset] into the caches (no fault if past the end)."""
        if PREFETCH_BYTES:
            ahead = self.b.gep(base, [self.b.add(offset, ir.Constant(offset.type, PREFETCH_BYTES))])
            self.call("llvm.prefetch.p0", ir.VoidType(), [I8.as_pointer(), I32, I32, I32],
                      [ahead, ir.Constant(I32, 0), ir.Constant(I32, 3), ir.Constant(I32, 1)])

    def vnni(self, acc, unsigned, signed):
        if has_vnni():
            return self.call(VNNI, V8, [V8, V8, V8], [acc, unsigned, signed])
        return self.b.add(acc, self._dot4_bytes(unsigned, signed))

    def _dot4_bytes(self, unsigned, signed):
        """What `vpdpbusd` adds, in generic IR (exact: a u8 x s8 product fits in i16, four of them in i32), for
        CPUs without VNNI: LLVM selects widening multiply-adds (AVX2 `vpmaddwd`) for it."""
        b = self.b
        v32b, v32w, v32d = ir.VectorType(I8, 32), ir.VectorType(ir.IntType(16), 32), ir.VectorType(I32, 32)
        product = b.mul(b.zext(b.bitcast(unsigned, v32b), v32w), b.sext(b.bitcast(signed, v32b), v32w))
        wide = b.sext(product, v32d)
        lanes = [b.shuffle_vector(wide, wide, ir.Constant(V8, [4 * k + j for k in range(8)])) for j in range(4)]
        return b.add(b.add(lanes[0], lanes[1]), b.add(lanes[2], lanes[3]))

    def zeroed(self, ty):
        return cgutils.alloca_once_value(self.b, ir.Constant(ty, None))

    def item_pointer(self, ty, val, indices, elem, index_types=None):
        """&array[indices...] (the leading dimensions; the rest 0) as an `elem` pointer. Kernels pass whole arrays
        and indices, not numba row slices: a slice holds a reference to its parent, and that count's atomic add
        and subtract, on a line every thread's rows share, cost more than a short row's dot product.
        `index_types`: the indices' numba types, where they may be narrower than intp."""
        array = self.context.make_array(ty)(self.context, self.b, val)
        if index_types is not None:
            indices = [self.context.cast(self.b, v, t, types.intp) for v, t in zip(indices, index_types, strict=True)]
        zeros = [ir.Constant(ir.IntType(64), 0)] * (ty.ndim - len(indices))
        ptr = cgutils.get_item_pointer(self.context, self.b, ty, array, [*indices, *zeros], wraparound=False)
        return self.b.bitcast(ptr, elem.as_pointer())

    def load_scale(self, scales, index, count=1):
        """scales[index] as a float32, or with `count` > 1 scales[index:index + count] as a float32 vector
        (bfloat16 widened: its bits are the high half of the float32's)."""
        ptr, is_bf16 = scales
        elem = I16 if is_bf16 else F32
        at = self.b.gep(ptr, [index])
        if count > 1:
            at = self.b.bitcast(at, ir.VectorType(elem, count).as_pointer())
        value = self.b.load(at, align=1 if count > 1 else None)
        if is_bf16:
            wide, out = (I32, F32) if count == 1 else (ir.VectorType(I32, count), ir.VectorType(F32, count))
            sixteen = ir.Constant(wide, 16 if count == 1 else [16] * count)
            value = self.b.bitcast(self.b.shl(self.b.zext(value, wide), sixteen), out)
        return value


def _int8_codegen(num_rows: int):
    """sum_j (w[j] + 128) * x[j] for each of `num_rows` rows over the first len(w) // 32 * 32 columns; two
    accumulators per row (alternate 32-byte blocks) keep two `vpdpbusd` chains in flight."""
    def codegen(context, builder, sig, args):
        g = _IR(context, builder)
        ptrs = [g.data(ty, val) for ty, val in zip(sig.args, args, strict=True)]
        rows, x = [p for p, _ in ptrs[:num_rows]], ptrs[num_rows][0]
        n = builder.extract_value(ptrs[0][1].shape, 0)
        c32, c64 = ir.Constant(n.type, 32), ir.Constant(n.type, 64)
        sign = ir.Constant(V8, [-0x7F7F7F80] * 8)  # 0x80 in every byte
        accs = [g.zeroed(V8) for _ in range(2 * num_rows)]

        def block(offset, half):
            xv = g.load(x, offset)
            for j, row in enumerate(rows):
                acc = accs[2 * j + half]
                builder.store(g.vnni(builder.load(acc), builder.xor(g.load(row, offset), sign), xv), acc)

        with cgutils.for_range(builder, builder.sdiv(n, c64)) as loop:
            offset = builder.mul(loop.index, c64)
            for row in rows:  # one line per row per iteration
                g.prefetch(row, offset)
            block(offset, 0)
            block(builder.add(offset, c32), 1)
        with builder.if_then(builder.icmp_signed(">=", builder.srem(n, c64), c32)):
            block(builder.mul(builder.sdiv(n, c64), c64), 0)
        sums = []
        for j in range(num_rows):
            vec = builder.add(builder.load(accs[2 * j]), builder.load(accs[2 * j + 1]))
            total = g.call("llvm.vector.reduce.add.v8i32", I32, [V8], [vec])
            sums.append(builder.sext(total, ir.IntType(64)))
        return sums[0] if num_rows == 1 else context.make_tuple(builder, sig.return_type, sums)
    return codegen


@intrinsic
def _int8_dot(typingctx, w, x):
    """sum_j (w[j] + 128) * x[j] over the first len(w) // 32 * 32 columns; w, x int8 1-D, unit stride."""
    return types.int64(w, x), _int8_codegen(1)


@intrinsic
def _int8_dot2(typingctx, w0, w1, x):
    """`_int8_dot` of two rows against one x, in one loop."""
    return types.UniTuple(types.int64, 2)(w0, w1, x), _int8_codegen(2)


# ---- row dot products ------------------------------------------------------------------------------------------

@njit(fastmath=True, cache=True)
def _tail_int8(row, x_q, lo, hi):
    s = 0
    for j in range(lo, hi):
        s += np.int64(row[j]) * np.int64(x_q[j])
    return s


@njit(fastmath=True, cache=True)
def _dot_int8(row, scales, x_q, x_sum, group):
    cols = x_q.shape[0]
    if scales.shape[0] == 1:  # per channel: the whole row in one call
        vec_end = cols // 32 * 32
        s = _int8_dot(row, x_q) - 128 * x_sum[0] + _tail_int8(row, x_q, vec_end, cols)
        return np.float32(s) * scales[0]
    acc = np.float32(0.0)
    for g in range(scales.shape[0]):
        lo = g * group
        hi = min(lo + group, cols)
        vec_end = lo + (hi - lo) // 32 * 32
        s = _int8_dot(row[lo:vec_end], x_q[lo:vec_end]) - 128 * x_sum[g] + _tail_int8(row, x_q, vec_end, hi)
        acc += np.float32(s) * scales[g]
    return acc


@njit(fastmath=True, cache=True)
def _dot2_int8(w0, s0, w1, s1, x_q, x_sum, group):
    """(w0 . x, w1 . x) scaled, for the gate and up rows of one token."""
    if s0.shape[0] != 1:
        return _dot_int8(w0, s0, x_q, x_sum, group), _dot_int8(w1, s1, x_q, x_sum, group)
    cols = x_q.shape[0]
    vec_end = cols // 32 * 32
    a, b = _int8_dot2(w0, w1, x_q)
    a += _tail_int8(w0, x_q, vec_end, cols) - 128 * x_sum[0]
    b += _tail_int8(w1, x_q, vec_end, cols) - 128 * x_sum[0]
    return np.float32(a) * s0[0], np.float32(b) * s1[0]


# ---- activations -----------------------------------------------------------------------------------------------

@njit(fastmath=True, cache=True)
def _block_sums(q, group, x_sum):
    """x_sum[g] = sum of q over group g's whole 32-element blocks (the columns the vector loop covers)."""
    cols = q.shape[0]
    for g in range(x_sum.shape[0]):
        lo = g * group
        total = 0
        for j in range(lo, lo + (min(lo + group, cols) - lo) // 32 * 32):
            total += q[j]
        x_sum[g] = total


@njit(**FLAGS)
def prepare_int8(x, group, x_q, x_scale, x_sum):
    """x float32 [T, K] -> x_q int8 [T, K] (per-row absmax / 127), x_scale [T], x_sum int64 [T, G]."""
    if x.shape[0] < SERIAL_ROWS:
        for t in range(x.shape[0]):
            x_scale[t] = quantize_row(x[t], x_q[t])
            _block_sums(x_q[t], group, x_sum[t])
    else:
        for t in prange(x.shape[0]):
            x_scale[t] = quantize_row(x[t], x_q[t])
            _block_sums(x_q[t], group, x_sum[t])


# ---- one partition of one layer, in one call -------------------------------------------------------------------
# One compiled call per partition instead of one per step: the dispatch of a numba call with a dozen arrays costs
# microseconds, which a small-expert decode call (hundreds of microseconds in all) notices.

@njit(**FLAGS)
def decode_int8(x, experts, offsets, pair_token, pair_weight, gate, gate_s, up, up_s, down, down_s, group_h,
                group_i, epilogue, out):
    """out[T, H] += this partition's experts on x float32 [T, H] (see `cpu_experts.kernels` for the split;
    `epilogue`: `kernels.activation`'s)."""
    num_tokens, num_pairs, rows = x.shape[0], pair_token.shape[0], gate.shape[1]
    x_q = np.empty(x.shape, dtype=np.int8)
    x_scale = np.empty(num_tokens, dtype=np.float32)
    x_sum = np.empty((num_tokens, gate_s.shape[2]), dtype=np.int64)
    prepare_int8(x, group_h, x_q, x_scale, x_sum)
    act = np.empty((num_pairs, rows), dtype=np.float32)
    for r in prange(experts.shape[0] * rows):
        gate_up_item_int8(r, experts, offsets, pair_token, gate, gate_s, up, up_s, x_q, x_scale, x_sum, group_h,
                          epilogue, act)
    a_q = np.empty(act.shape, dtype=np.int8)
    a_scale = np.empty(num_pairs, dtype=np.float32)
    a_sum = np.empty((num_pairs, down_s.shape[2]), dtype=np.int64)
    prepare_int8(act, group_i, a_q, a_scale, a_sum)
    for h in prange(down.shape[1]):
        down_row_int8(h, experts, offsets, pair_token, pair_weight, down, down_s, a_q, a_scale, a_sum, group_i, out)


# The bodies of decode_int8's two loops, shared with `cpu_experts.decode_pool` (which splits the same items over its
# own threads), so the two compute every output element with the same sums in the same order.

@njit(fastmath=True, cache=True)
def gate_up_item_int8(r, experts, offsets, pair_token, gate, gate_s, up, up_s, x_q, x_scale, x_sum, group_h, epilogue,
                      act):
    """Work item r = (routed expert u, row i): act[p, i] = silu(gate . x_t) * (up . x_t) (or the epilogue's
    activation) for u's pairs p."""
    rows = gate.shape[1]
    u, i = r // rows, r % rows
    e = experts[u]
    for p in range(offsets[u], offsets[u + 1]):
        t = pair_token[p]
        g, v = _dot2_int8(gate[e, i], gate_s[e, i], up[e, i], up_s[e, i], x_q[t], x_sum[t], group_h)
        act[p, i] = activation(g * x_scale[t], v * x_scale[t], epilogue, e, i, False)


@njit(fastmath=True, cache=True)
def down_row_int8(h, experts, offsets, pair_token, pair_weight, down, down_s, a_q, a_scale, a_sum, group_i, out):
    """Output column h: out[t, h] += w * (down[e, h] . act_p) over every routed expert e and its pairs p."""
    rows = down.shape[2]  # a_q may be wider (the pool's scratch)
    for u in range(experts.shape[0]):
        e = experts[u]
        for p in range(offsets[u], offsets[u + 1]):
            dot = _dot_int8(down[e, h], down_s[e, h], a_q[p, :rows], a_sum[p], group_i)
            out[pair_token[p], h] += pair_weight[p] * a_scale[p] * dot
