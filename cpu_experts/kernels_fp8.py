"""FP8 (e4m3fn) decode kernels of the CPU MoE operator, for one partition (a slice of I) of one layer.

The work split is `cpu_experts.kernels`': gate/up parallel over (routed expert, row), down parallel over the output
column h, each routed expert's rows streamed once per call. Numerics (the float formats' contract): the matmul
inputs are bfloat16 values (the tokens' rows arrive rounded, act = silu(gate) * up is rounded here), the weights are
decoded exactly, products and sums are float32; so the result equals a float reference on the dequantized weights
with bf16-rounded activations up to float32 summation order.

Decoding: the e4m3 magnitude bits eeeemmm are moved into a float16's bits 13..7 (exponent 0eeee, mantissa
mmm0000000) and the sign to bit 15. float16's exponent bias is 15 against e4m3's 7, and its subnormals sit where
e4m3's do, so that float16 is the e4m3 value times 2^-8 for every code, subnormals (0x01..0x07) and both zeros
included; the 2^8 is put back once per row. float16 -> float32 is one instruction on whole vectors (F16C
`vcvtph2ps`, on every AVX2 CPU; LLVM selects it for the `fpext` below), exact, and its result is a normal float32,
so a flush-to-zero or denormals-are-zero mode set by another library cannot touch the subnormal codes, as it would
the shortcut of reading eeeemmm as a float32 exponent and mantissa. Per 32 weights of a row the loop is (AVX-512)
one sign-extending load, a shift, an and, a lane extract, two conversions and two FMAs. 0x7F and 0xFF (NaN) decode
as 480: no quantizer writes them and the checkpoint readers refuse them.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from cpu_experts.kernels import _as_float32

FLAGS = dict(parallel=True, fastmath=True, nogil=True, cache=True)
FLOAT16_BIAS = np.float32(256.0)  # an e4m3 value / its float16 decoding (2^(15 - 7))
# float16 bits kept of (int16(byte) << 7): the sign (bit 15) and the magnitude (13..7); bit 14 is a copy of the sign
FLOAT16_MASK = np.int16(-16385)  # 0xBFFF
BF16_HALF = np.int32(0x7FFF)
BF16_HIGH = np.int32(-65536)  # 0xFFFF0000


@intrinsic
def _float16_bits_as_float32(typingctx, bits):
    """The float32 value of the float16 whose bit pattern is the int16 `bits` (exact)."""
    def codegen(context, builder, sig, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())
    return types.float32(types.int16), codegen


@intrinsic
def _float32_bits(typingctx, value):
    """The int32 bit pattern of the float32 `value`."""
    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.IntType(32))
    return types.int32(types.float32), codegen


@njit(fastmath=True, cache=True)
def e4m3_over_256(byte):
    """The value of the e4m3fn bit pattern `byte` (uint8) divided by 256, exactly (see the module docstring)."""
    bits = (np.int16(np.int8(byte)) << np.int16(7)) & FLOAT16_MASK
    return _float16_bits_as_float32(bits)


@njit(fastmath=True, cache=True)
def round_bf16(v):
    """float32 -> the nearest bfloat16 value (ties to even), as a float32: torch's rounding; inf and the NaNs that
    arithmetic makes are kept."""
    bits = _float32_bits(np.float32(v))
    bits = (bits + BF16_HALF + ((bits >> np.int32(16)) & np.int32(1))) & BF16_HIGH
    return _as_float32(bits)


# ---- LLVM IR: the scale groups of whole rows ---------------------------------------------------------------------
# One loop per row (or two rows against one activation): per group of whole BLOCK-weight steps, vector accumulators
# of weight x activation, then one FMA of them by the group's scale into the row's accumulators, one horizontal sum
# per row. Written as IR because the same loop in numba, one call per group, paid a horizontal sum and slicing per
# group: as many instructions as the weights' own at group 128. The vectors are BLOCK wide; LLVM splits them into
# whatever the host has (two 512-bit FMAs per row and step on AVX-512, four 256-bit ones on AVX2).

BLOCK = 32
# Bytes ahead of the loads that each row's stream is prefetched (0: none): `kernels_vnni.PREFETCH_BYTES`, measured
# there on the 16-core Xeon (its rows stream the same way, 32 bytes a step).
PREFETCH_BYTES = 1024
I8, I16, I32, F32 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.FloatType()
V_BYTES, V_WORDS = ir.VectorType(I8, BLOCK), ir.VectorType(I16, BLOCK)
V_HALF, V_FLOAT = ir.VectorType(ir.HalfType(), BLOCK), ir.VectorType(F32, BLOCK)


def _pointer(context, builder, ty, val, elem):
    array = context.make_array(ty)(context, builder, val)
    return builder.bitcast(array.data, elem.as_pointer())


def _load(builder, base, offset, vector):
    return builder.load(builder.bitcast(builder.gep(base, [offset]), vector.as_pointer()), align=1)


def _call(builder, name, ret, args):
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, [a.type for a in args]), name)
    return builder.call(fn, args)


def _prefetch(builder, base, offset):
    """A hint to bring the line PREFETCH_BYTES past base[offset] into the caches (no fault past the end)."""
    if PREFETCH_BYTES:
        ahead = builder.gep(base, [builder.add(offset, ir.Constant(offset.type, PREFETCH_BYTES))])
        _call(builder, "llvm.prefetch.p0", ir.VoidType(), [ahead, ir.Constant(I32, 0), ir.Constant(I32, 3),
                                                             ir.Constant(I32, 1)])


def _fma(builder, a, b, acc):
    """acc = a * b + acc on <BLOCK x float> (acc: a pointer to it)."""
    builder.store(_call(builder, f"llvm.fma.v{BLOCK}f32", V_FLOAT, [a, b, builder.load(acc)]), acc)


def _splat(builder, scalar):
    one = builder.insert_element(ir.Constant(V_FLOAT, ir.Undefined), scalar, ir.Constant(I32, 0))
    return builder.shuffle_vector(one, one, ir.Constant(ir.VectorType(I32, BLOCK), [0] * BLOCK))


def _decode_block(builder, bits):
    """<BLOCK x i8> e4m3 bits -> <BLOCK x float> values / 256 (`e4m3_over_256` on whole vectors)."""
    words = builder.shl(builder.sext(bits, V_WORDS), ir.Constant(V_WORDS, [7] * BLOCK))
    words = builder.and_(words, ir.Constant(V_WORDS, [int(FLOAT16_MASK) & 0xFFFF] * BLOCK))
    return builder.fpext(builder.bitcast(words, V_HALF), V_FLOAT)


def _fp8_codegen(num_rows):
    """sum over groups g < num_groups of scales[g] * sum_{j in g} value(row[j]) / 256 * x[j], per row; args: the
    rows, their scales, x, num_groups, group (a multiple of BLOCK)."""
    def codegen(context, builder, sig, args):
        types_ = sig.args
        rows = [_pointer(context, builder, types_[j], args[j], I8) for j in range(num_rows)]
        scales = [_pointer(context, builder, types_[num_rows + j], args[num_rows + j], F32) for j in range(num_rows)]
        x = _pointer(context, builder, types_[2 * num_rows], args[2 * num_rows], F32)
        num_groups, group = args[2 * num_rows + 1], args[2 * num_rows + 2]
        zero = ir.Constant(V_FLOAT, None)
        row_accs = [cgutils.alloca_once_value(builder, zero) for _ in range(num_rows)]
        group_accs = [cgutils.alloca_once_value(builder, zero) for _ in range(num_rows)]
        step = ir.Constant(group.type, BLOCK)
        with cgutils.for_range(builder, num_groups) as groups:
            first = builder.mul(groups.index, group)
            for acc in group_accs:
                builder.store(zero, acc)
            with cgutils.for_range(builder, builder.udiv(group, step)) as blocks:
                offset = builder.add(first, builder.mul(blocks.index, step))
                xv = _load(builder, x, offset, V_FLOAT)
                for row, acc in zip(rows, group_accs, strict=True):
                    _prefetch(builder, row, offset)
                    _fma(builder, _decode_block(builder, _load(builder, row, offset, V_BYTES)), xv, acc)
            for scale, acc, row_acc in zip(scales, group_accs, row_accs, strict=True):
                _fma(builder, builder.load(acc), _splat(builder, builder.load(builder.gep(scale, [groups.index]))),
                     row_acc)
        sums = [_call(builder, f"llvm.vector.reduce.fadd.v{BLOCK}f32", F32, [ir.Constant(F32, 0.0), builder.load(acc)])
                for acc in row_accs]
        return sums[0] if num_rows == 1 else context.make_tuple(builder, sig.return_type, sums)
    return codegen


@intrinsic
def _groups_dot(typingctx, row, scales, x, num_groups, group):
    """The first num_groups groups of a row against x, each group's sum times its scale (/ 256); row uint8,
    scales float32, x float32, each 1-D with unit stride."""
    return types.float32(row, scales, x, num_groups, group), _fp8_codegen(1)


@intrinsic
def _groups_dot2(typingctx, row0, row1, scales0, scales1, x, num_groups, group):
    """`_groups_dot` of two rows (with their own scales) against one x, in one loop."""
    return types.UniTuple(types.float32, 2)(row0, row1, scales0, scales1, x, num_groups, group), _fp8_codegen(2)


# ---- row dot products ------------------------------------------------------------------------------------------

@njit(fastmath=True, cache=True)
def _vector_groups(cols, group):
    """How many leading groups the IR loop covers: the whole groups of a row of `cols`, if a group is whole
    BLOCKs; the rest (a last partial group, or every group of another size) go to `_groups_tail`."""
    return cols // group if group % BLOCK == 0 else 0


@njit(fastmath=True, cache=True)
def _tail(row, x):
    acc = np.float32(0.0)
    for j in range(x.shape[0]):
        acc += e4m3_over_256(row[j]) * x[j]
    return acc


@njit(fastmath=True, cache=True)
def _groups_tail(row, scales, x, group, first):
    """Groups `first`.. one at a time (values / 256)."""
    cols = x.shape[0]
    acc = np.float32(0.0)
    for g in range(first, scales.shape[0]):
        lo = g * group
        hi = min(lo + group, cols)
        acc += _tail(row[lo:hi], x[lo:hi]) * scales[g]
    return acc


@njit(fastmath=True, cache=True)
def dot_fp8(row, scales, x, group):
    """sum_j value(row[j]) * scales[j // group] * x[j]; row uint8 [K] e4m3 bits, scales float32 [ceil(K / group)]."""
    full = _vector_groups(x.shape[0], group)
    acc = _groups_dot(row, scales, x, full, group) + _groups_tail(row, scales, x, group, full)
    return acc * FLOAT16_BIAS


@njit(fastmath=True, cache=True)
def dot2_fp8(row0, scales0, row1, scales1, x, group):
    """(`dot_fp8` of row0, of row1) against one x, the two rows in one loop."""
    full = _vector_groups(x.shape[0], group)
    acc0, acc1 = _groups_dot2(row0, row1, scales0, scales1, x, full, group)
    acc0 += _groups_tail(row0, scales0, x, group, full)
    acc1 += _groups_tail(row1, scales1, x, group, full)
    return acc0 * FLOAT16_BIAS, acc1 * FLOAT16_BIAS


# ---- one partition of one layer, in one call (`kernels_vnni.decode_int8`'s shape) -------------------------------

@njit(**FLAGS)
def decode_fp8(x, experts, offsets, pair_token, pair_weight, gate, gate_s, up, up_s, down, down_s, group_h,
               group_i, out):
    """out[T, H] += this partition's experts on x float32 [T, H] (values already bf16-rounded); gate/up uint8
    [E, Ip, H], down uint8 [E, H, Ip] (e4m3 bits), their scales float32 [E, N, ceil(K / group)]."""
    num_pairs, rows = pair_token.shape[0], gate.shape[1]
    act = np.empty((num_pairs, rows), dtype=np.float32)
    for r in prange(experts.shape[0] * rows):
        gate_up_item_fp8(r, experts, offsets, pair_token, gate, gate_s, up, up_s, x, group_h, act)
    for h in prange(down.shape[1]):
        down_row_fp8(h, experts, offsets, pair_token, pair_weight, down, down_s, act, group_i, out)


# The bodies of decode_fp8's two loops, plain functions so that a decode pool can split the same items over its own
# threads and compute every output element with the same sums in the same order.

@njit(fastmath=True, cache=True)
def gate_up_item_fp8(r, experts, offsets, pair_token, gate, gate_s, up, up_s, x, group_h, act):
    """Work item r = (routed expert u, row i): act[p, i] = bf16(silu(gate . x_t) * (up . x_t)) for u's pairs p."""
    rows = gate.shape[1]
    u, i = r // rows, r % rows
    e = experts[u]
    for p in range(offsets[u], offsets[u + 1]):
        g, v = dot2_fp8(gate[e, i], gate_s[e, i], up[e, i], up_s[e, i], x[pair_token[p]], group_h)
        act[p, i] = round_bf16(g / (np.float32(1.0) + np.exp(-g)) * v)


@njit(fastmath=True, cache=True)
def down_row_fp8(h, experts, offsets, pair_token, pair_weight, down, down_s, a, group_i, out):
    """Output column h: out[t, h] += w * (down[e, h] . act_p) over every routed expert e and its pairs p."""
    rows = down.shape[2]  # a may be wider (a pool's scratch)
    for u in range(experts.shape[0]):
        e = experts[u]
        for p in range(offsets[u], offsets[u + 1]):
            out[pair_token[p], h] += pair_weight[p] * dot_fp8(down[e, h], down_s[e, h], a[p, :rows], group_i)


def decode_partition_fp8(x, routing, part, spec, out) -> None:
    """out += one partition's experts on x float32 [T, H] (rounded to bf16), for `routing` (`operator.Routing`)."""
    r = routing
    decode_fp8(x, r.experts, r.offsets, r.pair_token, r.pair_weight, part.gate, part.gate_scales, part.up,
               part.up_scales, part.down, part.down_scales, spec.group(spec.hidden_size), spec.group(part.size), out)
