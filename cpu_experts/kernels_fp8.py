"""FP8 (e4m3fn) decode kernels of the CPU MoE operator, for one partition (a slice of I) of one layer.

The work split is `cpu_experts.kernels_vnni_int4`'s: gate/up parallel over ranges of (routed expert, row) items,
down over ranges of output columns (four rows a call), each routed expert's rows streamed once per call. Numerics
(the float formats' contract): the matmul inputs are bfloat16 values (the tokens' rows arrive rounded, act =
silu(gate) * up is rounded here), the weights are decoded exactly, products and sums are float32; so the result
equals a float reference on the dequantized weights with bf16-rounded activations up to float32 summation order.

Decoding: the e4m3 magnitude bits eeeemmm are moved into a float16's bits 13..7 (exponent 0eeee, mantissa
mmm0000000) and the sign to bit 15. float16's exponent bias is 15 against e4m3's 7, and its subnormals sit where
e4m3's do, so that float16 is the e4m3 value times 2^-8 for every code, subnormals (0x01..0x07) and both zeros
included; the 2^8 is put back once per row. float16 -> float32 is one instruction on whole vectors (F16C
`vcvtph2ps`, on every AVX2 CPU; LLVM selects it for the `fpext` below), exact, and its result is a normal float32,
so a flush-to-zero or denormals-are-zero mode set by another library cannot touch the subnormal codes, as it would
the shortcut of reading eeeemmm as a float32 exponent and mantissa. Per 32 weights of a row the loop is (AVX-512)
one sign-extending load, a shift, an and, a lane extract, two conversions and two FMAs: that decode, not the loop
around it, bounds a core's in-cache rate (see `_fp8_codegen`). 0x7F and 0xFF (NaN) decode
as 480: no quantizer writes them and the checkpoint readers refuse them.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from cpu_experts.kernels import activation, round_bf16
from cpu_experts.kernels_vnni import _IR, has_vnni512
from cpu_experts.kernels_vnni_int4 import FOUR_ROWS, GATE_UP, ONE_ROW, _sum_lanes

# error_model="numpy": no ZeroDivisionError paths for `//`, whose raising exits keep numba from pruning the
# reference-count updates of the array arguments (atomics every thread contends on)
BODY = dict(fastmath=True, nogil=True, cache=True, error_model="numpy")
FLAGS = dict(BODY, parallel=True)
GATE_UP_ROWS = 16  # (expert, row) items of gate/up a work item owns
DOWN_ROWS = 16  # output columns a work item of the down projection owns (its rows run four a call)
FLOAT16_BIAS = np.float32(256.0)  # an e4m3 value / its float16 decoding (2^(15 - 7))
# float16 bits kept of (int16(byte) << 7): the sign (bit 15) and the magnitude (13..7); bit 14 is a copy of the sign
FLOAT16_MASK = np.int16(-16385)  # 0xBFFF


@intrinsic
def _float16_bits_as_float32(typingctx, bits):
    """The float32 value of the float16 whose bit pattern is the int16 `bits` (exact)."""
    def codegen(context, builder, sig, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())
    return types.float32(types.int16), codegen


@njit(fastmath=True, cache=True)
def e4m3_over_256(byte):
    """The value of the e4m3fn bit pattern `byte` (uint8) divided by 256, exactly (see the module docstring)."""
    bits = (np.int16(np.int8(byte)) << np.int16(7)) & FLOAT16_MASK
    return _float16_bits_as_float32(bits)


# ---- LLVM IR: whole rows -------------------------------------------------------------------------------------------
# One intrinsic call per row (gate and up together, down four rows a call), its rows addressed in place (array and
# indices, `kernels_vnni._IR.item_pointer`: a numba row slice costs atomic reference-count updates on the parent,
# which threads contend on). Per group: vector accumulators of weight x activation over its whole vectors, folded to
# one register and multiplied by the group's scale into the row's accumulator; one horizontal sum a row (written
# out, `_sum_lanes`, so a row's result does not depend on the rows it shares a call with).

# Bytes of a weight vector step: 64 where the CPU has 512-bit vectors, else 32 (LLVM splits the ops to the host's
# registers); groups of any other multiple of SMALL_BLOCK take a loop of SMALL_BLOCK steps.
BLOCK = 64 if has_vnni512() else 32
SMALL_BLOCK = 32
LANES = 16 if BLOCK == 64 else 8  # float32 lanes of one register
# The row accumulators' width: two registers (independent FMA chains; one register made LLVM, allowed to
# reassociate, chain the whole group's products through it), four rows of them fit the registers with the group's.
ACC_LANES = 2 * LANES
COMMON_GROUP = 128  # DeepSeek-V3's and Qwen3's FP8 group: its blocks unrolled (no inner loop)
I8, I16, I32, F32 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.FloatType()
V_ACC = ir.VectorType(F32, ACC_LANES)


def _load(builder, base, offset, vector):
    return builder.load(builder.bitcast(builder.gep(base, [offset]), vector.as_pointer()), align=1)


def _splat(builder, scalar, lanes):
    one = builder.insert_element(ir.Constant(ir.VectorType(F32, lanes), ir.Undefined), scalar, ir.Constant(I32, 0))
    return builder.shuffle_vector(one, one, ir.Constant(ir.VectorType(I32, lanes), [0] * lanes))


def _decode_block(builder, bits, width):
    """<width x i8> e4m3 bits -> <width x float> values / 256 (`e4m3_over_256` on whole vectors)."""
    words_type = ir.VectorType(I16, width)
    words = builder.shl(builder.sext(bits, words_type), ir.Constant(words_type, [7] * width))
    words = builder.and_(words, ir.Constant(words_type, [int(FLOAT16_MASK) & 0xFFFF] * width))
    return builder.fpext(builder.bitcast(words, ir.VectorType(ir.HalfType(), width)), ir.VectorType(F32, width))


def _fold(builder, vec):
    """<k * ACC_LANES x float> -> <ACC_LANES x float>, halves added."""
    width = vec.type.count
    while width > ACC_LANES:
        width //= 2
        halves = [builder.shuffle_vector(vec, vec, ir.Constant(ir.VectorType(I32, width), list(range(k, k + width))))
                  for k in (0, width)]
        vec = builder.fadd(*halves)
    return vec


def _fp8_codegen(weights, width, blocks_per_group=None):
    """Intrinsic arguments: weight and scale arrays [E, N, ...], then e, n, x [T, >= K] float32, t, num_groups,
    group. `weights`: (weight argument, scale argument, row offset) of each row dotted (row n + offset of expert e).
    Returns, per row, sum over its first num_groups groups of scale * sum_j value(w[j]) / 256 * x[t, j], in steps of
    `width` bytes: `blocks_per_group` of them a group (unrolled), or group / width (a loop)."""
    v_bytes, v_float = ir.VectorType(I8, width), ir.VectorType(F32, width)

    def codegen(context, builder, sig, args):
        g = _IR(context, builder)
        num_arrays = 1 + max(max(w, s) for w, s, _ in weights)
        e, n, x, t, num_groups, group = args[num_arrays:]
        ty = dict(enumerate(sig.args))
        rows, scales = [], []
        for w_arg, s_arg, offset in weights:
            row = builder.add(n, ir.Constant(n.type, offset))
            rows.append(g.item_pointer(ty[w_arg], args[w_arg], (e, row), I8))
            scales.append(g.item_pointer(ty[s_arg], args[s_arg], (e, row), F32))
        x_ptr = g.item_pointer(ty[num_arrays + 2], x, (t,), F32)
        row_accs = [g.zeroed(V_ACC) for _ in rows]
        group_accs = [g.zeroed(v_float) for _ in rows]
        step = ir.Constant(group.type, width)

        def block(offset, is_first):
            xv = _load(builder, x_ptr, offset, v_float)
            for row, acc in zip(rows, group_accs, strict=True):
                g.prefetch(row, offset)
                product = builder.fmul(_decode_block(builder, _load(builder, row, offset, v_bytes), width), xv)
                builder.store(product if is_first else builder.fadd(product, builder.load(acc)), acc)

        with cgutils.for_range(builder, num_groups) as groups:
            first = builder.mul(groups.index, group)
            if blocks_per_group is not None:
                for k in range(blocks_per_group):
                    block(builder.add(first, ir.Constant(group.type, k * width)), k == 0)
            else:
                for acc in group_accs:
                    builder.store(ir.Constant(v_float, None), acc)
                with cgutils.for_range(builder, builder.udiv(group, step)) as blocks:
                    block(builder.add(first, builder.mul(blocks.index, step)), False)
            for scale, acc, row_acc in zip(scales, group_accs, row_accs, strict=True):
                factor = _splat(builder, builder.load(builder.gep(scale, [groups.index])), ACC_LANES)
                fma = g.call(f"llvm.fma.v{ACC_LANES}f32", V_ACC, [V_ACC] * 3,
                             [_fold(builder, builder.load(acc)), factor, builder.load(row_acc)])
                builder.store(fma, row_acc)
        totals = [_sum_lanes(builder, builder.load(acc), V_ACC) for acc in row_accs]
        return totals[0] if len(totals) == 1 else context.make_tuple(builder, sig.return_type, totals)
    return codegen


def _dispatch(weights):
    """COMMON_GROUP unrolled in BLOCK steps; any other group (a multiple of SMALL_BLOCK) a loop of SMALL_BLOCKs."""
    common = _fp8_codegen(weights, BLOCK, COMMON_GROUP // BLOCK)
    other = _fp8_codegen(weights, SMALL_BLOCK)

    def codegen(context, builder, sig, args):
        group = args[-1]
        is_common = builder.icmp_signed("==", group, ir.Constant(group.type, COMMON_GROUP))
        with builder.if_else(is_common) as (then, otherwise):
            with then:
                value_common, block_common = common(context, builder, sig, args), builder.block
            with otherwise:
                value_other, block_other = other(context, builder, sig, args), builder.block
        phi = builder.phi(value_common.type)
        phi.add_incoming(value_common, block_common)
        phi.add_incoming(value_other, block_other)
        return phi
    return codegen


@intrinsic
def _row_dot(typingctx, w, s, e, n, x, t, num_groups, group):
    """Row w[e, n] (e4m3 bits; float32 scales s[e, n]) . x[t] over its first num_groups groups, / 256."""
    return types.float32(w, s, e, n, x, t, num_groups, group), _dispatch(ONE_ROW)


@intrinsic
def _gate_up_dots(typingctx, gate, up, gate_s, up_s, e, n, x, t, num_groups, group):
    """`_row_dot` of gate[e, n] and up[e, n] in one loop."""
    sig = types.UniTuple(types.float32, 2)(gate, up, gate_s, up_s, e, n, x, t, num_groups, group)
    return sig, _dispatch(GATE_UP)


@intrinsic
def _four_dots(typingctx, w, s, e, n, x, t, num_groups, group):
    """`_row_dot` of rows n..n + 3 of w[e] in one loop."""
    return types.UniTuple(types.float32, 4)(w, s, e, n, x, t, num_groups, group), _dispatch(FOUR_ROWS)


# ---- row dot products ------------------------------------------------------------------------------------------

@njit(**BODY)
def row_layout(cols, group):
    """(groups the vector loops cover, whether groups follow them) for rows of `cols` with this group: whole
    groups if a group is whole SMALL_BLOCKs, else none (`_groups_tail` takes the rest); once per call."""
    full = cols // group if group % SMALL_BLOCK == 0 else 0
    return full, full * group < cols


@njit(**BODY)
def _groups_tail(w, s, e, n, x, t, group, first):
    """Row w[e, n] . x[t] over groups `first`.. one element at a time (values / 256), indexed in place."""
    cols = w.shape[2]
    acc = np.float32(0.0)
    for g in range(first, s.shape[2]):
        part = np.float32(0.0)
        for j in range(g * group, min(g * group + group, cols)):
            part += e4m3_over_256(w[e, n, j]) * x[t, j]
        acc += part * s[e, n, g]
    return acc


@njit(**BODY)
def dot_fp8(row, scales, x, group):
    """sum_j value(row[j]) * scales[j // group] * x[j]; row uint8 [K] e4m3 bits, scales float32 [ceil(K / group)]
    (the decode loops' arithmetic, on one row)."""
    w, s, xs = row.reshape((1, 1, row.shape[0])), scales.reshape((1, 1, scales.shape[0])), x.reshape((1, x.shape[0]))
    full, has_tail = row_layout(row.shape[0], group)
    acc = _row_dot(w, s, 0, 0, xs, 0, full, group)
    if has_tail:
        acc += _groups_tail(w, s, 0, 0, xs, 0, group, full)
    return acc * FLOAT16_BIAS


@njit(**BODY)
def dot2_fp8(row0, scales0, row1, scales1, x, group):
    """(`dot_fp8` of row0, of row1) against one x, the two rows in one loop."""
    cols = row0.shape[0]
    w0, w1 = row0.reshape((1, 1, cols)), row1.reshape((1, 1, cols))
    s0, s1 = scales0.reshape((1, 1, scales0.shape[0])), scales1.reshape((1, 1, scales1.shape[0]))
    xs = x.reshape((1, x.shape[0]))
    full, has_tail = row_layout(cols, group)
    acc0, acc1 = _gate_up_dots(w0, w1, s0, s1, 0, 0, xs, 0, full, group)
    if has_tail:
        acc0 += _groups_tail(w0, s0, 0, 0, xs, 0, group, full)
        acc1 += _groups_tail(w1, s1, 0, 0, xs, 0, group, full)
    return acc0 * FLOAT16_BIAS, acc1 * FLOAT16_BIAS


# ---- one partition of one layer, in one call (`kernels_vnni_int4.decode_int4`'s shape) ---------------------------

@njit(**FLAGS)
def decode_fp8(x, experts, offsets, pair_token, pair_weight, gate, gate_s, up, up_s, down, down_s, group_h,
               group_i, epilogue, out):
    """out[T, H] += this partition's experts on x float32 [T, H] (values already bf16-rounded); gate/up uint8
    [E, Ip, H], down uint8 [E, H, Ip] (e4m3 bits), their scales float32 [E, N, ceil(K / group)]."""
    num_pairs, rows = pair_token.shape[0], gate.shape[1]
    act = np.empty((num_pairs, rows), dtype=np.float32)
    num_items = experts.shape[0] * rows
    for chunk in prange(-(-num_items // GATE_UP_ROWS)):
        gate_up_rows_fp8(chunk * GATE_UP_ROWS, min(chunk * GATE_UP_ROWS + GATE_UP_ROWS, num_items), experts, offsets,
                         pair_token, gate, gate_s, up, up_s, x, group_h, epilogue, act)
    num_hidden = down.shape[1]
    for block in prange(-(-num_hidden // DOWN_ROWS)):
        down_rows_fp8(block * DOWN_ROWS, min(block * DOWN_ROWS + DOWN_ROWS, num_hidden), experts, offsets,
                      pair_token, pair_weight, down, down_s, act, group_i, out)


# The bodies of decode_fp8's two loops, over ranges of work items, so that a decode pool can split the same items
# over its own threads and compute every output element with the same sums in the same order. The intrinsics are
# called here directly (a numba-level helper per row cost its array copies' reference counts).

@njit(**BODY, inline="always")
def gate_up_rows_fp8(lo, hi, experts, offsets, pair_token, gate, gate_s, up, up_s, x, group_h, epilogue, act):
    """Work items lo..hi, item r = (routed expert u, row i) = divmod(r, I): act[p, i] = bf16(activation(gate . x_t,
    up . x_t)) (`kernels.activation`: silu(g) * v or the layer's epilogue) for u's pairs p."""
    rows = gate.shape[1]
    full, has_tail = row_layout(gate.shape[2], group_h)
    r = lo
    while r < hi:
        u = r // rows
        first = r - u * rows
        last = min(rows, first + hi - r)
        e = experts[u]
        for i in range(first, last):
            for p in range(offsets[u], offsets[u + 1]):
                t = pair_token[p]
                g, v = _gate_up_dots(gate, up, gate_s, up_s, e, i, x, t, full, group_h)
                if has_tail:
                    g += _groups_tail(gate, gate_s, e, i, x, t, group_h, full)
                    v += _groups_tail(up, up_s, e, i, x, t, group_h, full)
                act[p, i] = round_bf16(activation(g * FLOAT16_BIAS, v * FLOAT16_BIAS, epilogue, e, i, False))
        r += last - first


@njit(**BODY, inline="always")
def down_rows_fp8(lo, hi, experts, offsets, pair_token, pair_weight, down, down_s, a, group_i, out):
    """Output columns lo..hi: out[t, h] += w * (down[e, h] . act_p) over every routed expert e and its pairs p, four
    rows of down a call (one pass over act_p for four weight rows). a may be wider than down's rows (a pool's
    scratch): only the first columns are read."""
    full, has_tail = row_layout(down.shape[2], group_i)
    four_end = lo + (hi - lo) // 4 * 4
    for u in range(experts.shape[0]):
        e = experts[u]
        for p in range(offsets[u], offsets[u + 1]):
            t, weight = pair_token[p], pair_weight[p] * FLOAT16_BIAS
            for h in range(lo, four_end, 4):
                d0, d1, d2, d3 = _four_dots(down, down_s, e, h, a, p, full, group_i)
                if has_tail:
                    d0 += _groups_tail(down, down_s, e, h, a, p, group_i, full)
                    d1 += _groups_tail(down, down_s, e, h + 1, a, p, group_i, full)
                    d2 += _groups_tail(down, down_s, e, h + 2, a, p, group_i, full)
                    d3 += _groups_tail(down, down_s, e, h + 3, a, p, group_i, full)
                out[t, h] += weight * d0
                out[t, h + 1] += weight * d1
                out[t, h + 2] += weight * d2
                out[t, h + 3] += weight * d3
            for h in range(four_end, hi):
                d = _row_dot(down, down_s, e, h, a, p, full, group_i)
                if has_tail:
                    d += _groups_tail(down, down_s, e, h, a, p, group_i, full)
                out[t, h] += weight * d


def decode_partition_fp8(x, routing, part, spec, epilogue, out) -> None:
    """out += one partition's experts on x float32 [T, H] (rounded to bf16), for `routing` (`operator.Routing`)."""
    r = routing
    decode_fp8(x, r.experts, r.offsets, r.pair_token, r.pair_weight, part.gate, part.gate_scales, part.up,
               part.up_scales, part.down, part.down_scales, spec.group(spec.hidden_size), spec.group(part.size),
               epilogue, out)
