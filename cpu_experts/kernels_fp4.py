"""Decode kernels for MXFP4 and NVFP4 experts (`cpu_experts.formats`): e2m1 weights decoded in registers, bf16
activations, float32 accumulation. Same work split as `cpu_experts.kernels_vnni` (gate/up over (routed expert, row),
down over the output column h, each routed expert's rows streamed once per call).

Numerics (the contract of the float formats): every matmul input (the token's hidden row; act = silu(gate) * up
before down) is rounded to bf16; the result equals a float32 reference on the dequantized stored weights with
those activations, up to float32 summation order. NVFP4's tensor scale multiplies each row's dot once, at the end.

One 16-byte chunk of a weight row (32 columns, in `_fp4_codegen`'s LLVM IR) decodes with two table lookups:
`pshufb` maps each nibble to 2 * its e2m1 value as an int8 ({0, 1, 2, 3, 4, 6, 8, 12} and their negatives, exact),
widened to float32 and multiplied with the activations split into even and odd columns (`split_bf16`), so the low
nibbles meet x_even and the high ones x_odd, both contiguous. A chunk is one MXFP4 group or two NVFP4 groups; its
16 products are scaled by a vector of the groups' scales (halved, for the doubled codes) taken from 256-entry tables
indexed by the scale byte. E8M0's scale 2^(s - 128) is applied as two normal factors 2^floor((s - 128) / 2) and
2^ceil((s - 128) / 2), never as the subnormal 2^-128 or 2^-127: exact wherever the result is a normal float, and
unaffected by a flush-to-zero mode that some library may have set. `pshufb` is SSSE3, present on every x86-64 CPU
with AVX2; elsewhere the nibbles decode arithmetically in generic IR (`PORTABLE`). Vector widths are LLVM's choice
for the host (two ymm or one zmm a chunk): nothing here can raise an illegal instruction.
"""

from __future__ import annotations

import llvmlite.binding as llvm
import numpy as np
import torch
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from cpu_experts import formats
from cpu_experts.kernels import _as_float32
from cpu_experts.kernels_vnni import _IR

# error_model="numpy": no ZeroDivisionError paths for `//` and `%`, whose raising exits kept numba from pruning the
# reference-count updates of every array argument (atomics, on lines every thread shares: more than a short row).
BODY = dict(fastmath=True, nogil=True, cache=True, error_model="numpy")
FLAGS = dict(BODY, parallel=True)
MX_GROUP, NV_GROUP = 32, 16
CHUNK = 16  # bytes of a weight row a vector step decodes: 32 columns
SERIAL_ROWS = 8  # activation rows below which rounding them is not worth waking the thread pool

I8, I32, I64, F32 = ir.IntType(8), ir.IntType(32), ir.IntType(64), ir.FloatType()
V16B, V16I, V16F = ir.VectorType(I8, 16), ir.VectorType(I32, 16), ir.VectorType(F32, 16)
E2M1_TWICE = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)  # 2 * value of each code (bit 3: sign)
E2M1_TWICE_F32 = np.array(E2M1_TWICE, dtype=np.float32)  # the prefill's dequantizer's copy


# Per scale byte, the factors that scale the doubled codes: MXFP4 two, whose product is the E8M0 scale halved,
# 2^(s - 128), both normal floats (255, NaN, gives NaN); NVFP4 one, the e4m3 scale halved (2^-10 at least: normal).

def _mx_factors() -> np.ndarray:
    exponent = np.arange(256) - 128
    low = np.floor(exponent / 2)
    table = np.stack([np.exp2(low), np.exp2(exponent - low)], axis=1).astype(np.float32)
    table[255] = np.nan
    return table


def _nv_factors() -> np.ndarray:
    return (formats.e4m3_to_float(torch.arange(256, dtype=torch.int32).to(torch.uint8)) / 2).numpy()


MX_FACTORS = _mx_factors()  # [256, 2]
NV_FACTORS = _nv_factors()  # [256]


def has_ssse3() -> bool:
    return bool(llvm.get_host_cpu_features().get("ssse3"))


PORTABLE = not has_ssse3()  # decode the nibbles arithmetically (no `pshufb`); read when a kernel first compiles


# ---- LLVM IR: whole chunks of one or two rows ------------------------------------------------------------------

def _decode_nibbles(g: _IR, nibbles, portable: bool):
    """<16 x i8> codes 0..15 -> <16 x float> twice their e2m1 values."""
    b = g.b
    if not portable:
        table = ir.Constant(V16B, [c & 0xFF for c in E2M1_TWICE])
        doubled = g.call("llvm.x86.ssse3.pshuf.b.128", V16B, [V16B, V16B], [table, nibbles])
        return b.sitofp(doubled, V16F)
    # magnitude m = code & 7: 2 * value = m for m < 2, else (2 + (m & 1)) << ((m >> 1) - 1); bit 3 the sign
    code = b.zext(nibbles, V16I)

    def splat(v):
        return ir.Constant(V16I, [v] * 16)

    m = b.and_(code, splat(7))
    normal = b.shl(b.or_(b.and_(m, splat(1)), splat(2)), b.sub(b.lshr(m, splat(1)), splat(1)))
    magnitude = b.select(b.icmp_unsigned("<", m, splat(2)), m, normal)
    signed = b.select(b.icmp_unsigned(">=", code, splat(8)), b.sub(splat(0), magnitude), magnitude)
    return b.sitofp(signed, V16F)


class _Rows(_IR):
    """`_IR` with pointers to an array's element at runtime indices, so the kernels pass whole arrays and indices
    instead of slicing rows out of them."""

    def item(self, ty, val, index_types, indices, elem):
        array = self.context.make_array(ty)(self.context, self.b, val)
        wide = [self.context.cast(self.b, v, t, types.intp) for v, t in zip(indices, index_types, strict=True)]
        zeros = [ir.Constant(I64, 0)] * (ty.ndim - len(wide))
        ptr = cgutils.get_item_pointer(self.context, self.b, ty, array, wide + zeros, wraparound=False)
        return self.b.bitcast(ptr, elem.as_pointer())


def _scale_vectors(g: _IR, scales, table, first, second, is_mx: bool):
    """A chunk's scale factors as <16 x float> vectors, from the scale bytes at `first` (and `second`): MXFP4 (one
    group) two splats whose product is the group's halved scale, NVFP4 (two groups of 8 lanes) [s0 x 8, s1 x 8]."""
    b = g.b

    def factor(index, which=None):
        byte = b.zext(b.load(b.gep(scales, [index])), I64)
        if which is not None:
            byte = b.add(b.mul(byte, ir.Constant(I64, 2)), ir.Constant(I64, which))
        return b.load(b.gep(table, [byte]))

    if is_mx:
        return [b.shuffle_vector(b.insert_element(ir.Constant(V16F, None), factor(first, k), ir.Constant(I32, 0)),
                                 ir.Constant(V16F, None), ir.Constant(V16I, [0] * 16)) for k in (0, 1)]
    pair = ir.Constant(ir.VectorType(F32, 2), None)
    for k, index in enumerate((first, second)):
        pair = b.insert_element(pair, factor(index), ir.Constant(I32, k))
    return [b.shuffle_vector(pair, pair, ir.Constant(V16I, [0] * 8 + [1] * 8))]


class _RowDots:
    """The IR of one call of a row-dot intrinsic (`_fp4_codegen`): its pointers, accumulators and chunk step."""

    def __init__(self, context, builder, sig, args, num_rows: int, is_mx: bool, portable: bool):
        self.g, self.b = _Rows(context, builder), builder
        self.num_rows, self.is_mx, self.portable = num_rows, is_mx, portable
        at = 2 * num_rows
        row_index = (sig.args[at:at + 2], args[at:at + 2])
        self.rows = [self.g.item(sig.args[2 * j], args[2 * j], *row_index, I8) for j in range(num_rows)]
        self.scales = [self.g.item(sig.args[2 * j + 1], args[2 * j + 1], *row_index, I8) for j in range(num_rows)]
        self.table = self.g.data(sig.args[at + 2], args[at + 2], F32)[0]
        token = ([sig.args[at + 5]], [args[at + 5]])
        self.x_even = self.g.item(sig.args[at + 3], args[at + 3], *token, F32)
        self.x_odd = self.g.item(sig.args[at + 4], args[at + 4], *token, F32)
        self.num_bytes = builder.extract_value(context.make_array(sig.args[0])(context, builder, args[0]).shape, 2)
        self.accs = [[self.g.zeroed(V16F), self.g.zeroed(V16F)] for _ in range(num_rows)]

    def load(self, base, offset, ty):
        return self.b.load(self.b.bitcast(self.b.gep(base, [offset]), ty.as_pointer()), align=1)

    def chunk(self, w_ptrs, xe_ptr, xo_ptr, offset, index, half, second=None):
        """Chunk `index` (of the scales): its bytes at w_ptrs[j] + offset, its activations at x + offset; NVFP4's
        second group's scale at `second` (default: the group after the first)."""
        b = self.b
        xe, xo = self.load(xe_ptr, offset, V16F), self.load(xo_ptr, offset, V16F)
        first = index if self.is_mx else b.add(index, index)
        second = second or b.add(first, ir.Constant(I64, 1))
        for j in range(self.num_rows):
            w = self.load(w_ptrs[j], offset, V16B)
            lo = _decode_nibbles(self.g, b.and_(w, ir.Constant(V16B, [15] * 16)), self.portable)
            hi = _decode_nibbles(self.g, b.lshr(w, ir.Constant(V16B, [4] * 16)), self.portable)
            dot = self.g.call("llvm.fma.v16f32", V16F, [V16F] * 3, [hi, xo, b.fmul(lo, xe)])
            factors = _scale_vectors(self.g, self.scales[j], self.table, first, second, self.is_mx)
            if self.is_mx:
                dot = b.fmul(dot, factors[0])
            acc = self.accs[j][half]
            b.store(self.g.call("llvm.fma.v16f32", V16F, [V16F] * 3, [dot, factors[-1], b.load(acc)]), acc)

    def whole_chunks(self, num_chunks):
        b, c16, two = self.b, ir.Constant(I64, CHUNK), ir.Constant(I64, 2)
        with cgutils.for_range(b, b.sdiv(num_chunks, two)) as loop:
            first = b.mul(loop.index, two)
            offset = b.mul(first, c16)
            for row in self.rows:  # one 64-byte line every other iteration: the repeat is a cheap no-op
                self.g.prefetch(row, offset)
            self.chunk(self.rows, self.x_even, self.x_odd, offset, first, 0)
            self.chunk(self.rows, self.x_even, self.x_odd, b.add(offset, c16), b.add(first, ir.Constant(I64, 1)), 1)
        last = b.sub(num_chunks, ir.Constant(I64, 1))
        with b.if_then(b.icmp_signed("!=", b.srem(num_chunks, two), ir.Constant(I64, 0))):
            self.chunk(self.rows, self.x_even, self.x_odd, b.mul(last, c16), last, 0)

    def partial_chunk(self, num_chunks):
        """The bytes past the whole chunks, copied into zero-padded buffers (code 0 is +0, x 0 past the row)."""
        b = self.b
        done = b.mul(num_chunks, ir.Constant(I64, CHUNK))
        rest = b.sub(self.num_bytes, done)
        w_pad = [cgutils.alloca_once(b, V16B) for _ in range(self.num_rows)]
        xe_pad, xo_pad = cgutils.alloca_once(b, V16F), cgutils.alloca_once(b, V16F)
        with b.if_then(b.icmp_signed(">", rest, ir.Constant(I64, 0))):
            copies = [(pad, row, 1) for pad, row in zip(w_pad, self.rows, strict=True)]
            copies += [(xe_pad, self.x_even, 4), (xo_pad, self.x_odd, 4)]
            for pad, src, size in copies:
                b.store(ir.Constant(pad.type.pointee, None), pad)
                cgutils.raw_memcpy(b, b.bitcast(pad, I8.as_pointer()), b.bitcast(b.gep(src, [done]), I8.as_pointer()),
                                   rest, size)
            # NVFP4: a second group only past 8 bytes (else its scale byte may not exist: reuse the first's)
            first = b.add(num_chunks, num_chunks)
            second = b.select(b.icmp_signed(">", rest, ir.Constant(I64, CHUNK // 2)), b.add(first, ir.Constant(I64, 1)),
                              first)
            self.chunk([b.bitcast(p, I8.as_pointer()) for p in w_pad], b.bitcast(xe_pad, F32.as_pointer()),
                       b.bitcast(xo_pad, F32.as_pointer()), ir.Constant(I64, 0), num_chunks, 1, second)

    def sums(self):
        return [self.g.call("llvm.vector.reduce.fadd.v16f32", F32, [F32, V16F],
                            [ir.Constant(F32, 0.0), self.b.fadd(self.b.load(a0), self.b.load(a1))])
                for a0, a1 in self.accs]


def _fp4_codegen(num_rows: int, is_mx: bool, portable: bool | None = None):
    """The dot of each row w_j[e, n] (uint8 [E, N, B], scale bits s_j [E, N, G]) with x[t] (x_even[t] for the low
    nibbles, x_odd[t] for the high ones), before any tensor scale; args: w_0, s_0, (w_1, s_1,) e, n, the factor
    table, x_even, x_odd, t. 16-byte chunks, two accumulators per row (alternate chunks: two FMA chains in flight);
    a last partial chunk takes the same path from zero-padded copies."""
    def codegen(context, builder, sig, args):
        dots = _RowDots(context, builder, sig, args, num_rows, is_mx, PORTABLE if portable is None else portable)
        num_chunks = builder.sdiv(dots.num_bytes, ir.Constant(I64, CHUNK))
        dots.whole_chunks(num_chunks)
        dots.partial_chunk(num_chunks)
        sums = dots.sums()
        return sums[0] if num_rows == 1 else context.make_tuple(builder, sig.return_type, sums)
    return codegen


def _signature(num_rows):
    def typer(*args):
        ret = types.float32 if num_rows == 1 else types.UniTuple(types.float32, num_rows)
        return ret(*args)
    return typer


# ---- row dot products ------------------------------------------------------------------------------------------
# Rows are named by indices (w[e, n] . x[t]), never sliced out, and each is one piece of IR: a slice (a new array)
# or a call that passes arrays costs reference-count updates (atomics, on lines every thread shares), which measured
# more than the whole of a short row.

@intrinsic
def dot_mxfp4(typingctx, w, s, e, n, table, x_even, x_odd, t):
    """MXFP4 row w[e, n] (packed uint8 [E, N, ceil(K / 2)], E8M0 scale bits s [E, N, ceil(K / 32)]) . x[t] (split
    by `split_bf16`: x_even / x_odd [T, >= ceil(K / 2)]); `table`: MX_FACTORS."""
    return _signature(1)(w, s, e, n, table, x_even, x_odd, t), _fp4_codegen(1, True)


@intrinsic
def dot2_mxfp4(typingctx, w0, s0, w1, s1, e, n, table, x_even, x_odd, t):
    """(w0[e, n] . x[t], w1[e, n] . x[t]) in one pass over x: a token's gate and up rows."""
    return _signature(2)(w0, s0, w1, s1, e, n, table, x_even, x_odd, t), _fp4_codegen(2, True)


@intrinsic
def dot_nvfp4(typingctx, w, s, e, n, table, x_even, x_odd, t):
    """NVFP4 row w[e, n] (e4m3 scale bits s [E, N, ceil(K / 16)]) . x[t], before the tensor scale; `table`:
    NV_FACTORS."""
    return _signature(1)(w, s, e, n, table, x_even, x_odd, t), _fp4_codegen(1, False)


@intrinsic
def dot2_nvfp4(typingctx, w0, s0, w1, s1, e, n, table, x_even, x_odd, t):
    """`dot2_mxfp4` for NVFP4 rows."""
    return _signature(2)(w0, s0, w1, s1, e, n, table, x_even, x_odd, t), _fp4_codegen(2, False)


# ---- activations -----------------------------------------------------------------------------------------------

@intrinsic
def _float_bits(typingctx, value):
    """The int32 bit pattern of the float32 `value`."""
    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], I32)
    return types.int32(types.float32), codegen


@njit(**BODY)
def round_bf16(value):
    """float32 -> the nearest bfloat16 (ties to even, as torch rounds), as a float32; NaN stays NaN."""
    bits = np.int64(_float_bits(np.float32(value)))
    if (bits & 0x7FFFFFFF) > 0x7F800000:
        return np.float32(value)
    return _as_float32(np.int32((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536))


@njit(**BODY)
def split_bf16_row(x, x_even, x_odd):
    """x float32 [K] rounded to bf16 -> x_even / x_odd [ceil(K / 2)] (columns 2b and 2b + 1; x_odd zero past an
    odd K): the weights' low nibbles meet x_even, their high nibbles x_odd."""
    cols = x.shape[0]
    for b in range(cols // 2):
        x_even[b] = round_bf16(x[2 * b])
        x_odd[b] = round_bf16(x[2 * b + 1])
    if cols % 2:
        x_even[cols // 2] = round_bf16(x[cols - 1])
        x_odd[cols // 2] = np.float32(0.0)


@njit(**FLAGS)
def split_bf16(x, x_even, x_odd):
    """`split_bf16_row` for every row of x float32 [T, K]."""
    if x.shape[0] < SERIAL_ROWS:
        for t in range(x.shape[0]):
            split_bf16_row(x[t], x_even[t], x_odd[t])
    else:
        for t in prange(x.shape[0]):
            split_bf16_row(x[t], x_even[t], x_odd[t])


@njit(**BODY)
def silu_mul_bf16(g, v):
    """act = silu(g) * v, rounded to bf16 (the down projection's input)."""
    return round_bf16(g / (np.float32(1.0) + np.exp(-g)) * v)


@njit(**BODY)
def _store_act(act_even, act_odd, p, i, rows, value):
    if i % 2:
        act_odd[p, i // 2] = value
    else:
        act_even[p, i // 2] = value
        if i == rows - 1:  # an odd partition's last column: the high nibble of its byte meets zero
            act_odd[p, i // 2] = np.float32(0.0)


# ---- loop bodies (shared with a decode pool) and one partition in one call ---------------------------------------
# Plain functions (no allocation, nogil-safe), so a pool of threads can split the same items and compute the same
# sums as the parallel loops here. act is stored split, as the down rows read it: act_even[p, i // 2] (even i),
# act_odd (odd i; zero past an odd partition's last column), [P, >= ceil(Ip / 2)].

@njit(**BODY, inline="always")
def gate_up_item_mxfp4(r, experts, offsets, pair_token, gate, gate_s, up, up_s, x_even, x_odd, act_even, act_odd):
    """Work item r = (routed expert u, row i): act[p, i] = silu(gate . x_t) * (up . x_t), bf16, for u's pairs p."""
    rows = gate.shape[1]
    u, i = r // rows, r % rows
    e = experts[u]
    for p in range(offsets[u], offsets[u + 1]):
        g, v = dot2_mxfp4(gate, gate_s, up, up_s, e, i, MX_FACTORS, x_even, x_odd, pair_token[p])
        _store_act(act_even, act_odd, p, i, rows, silu_mul_bf16(g, v))


@njit(**BODY, inline="always")
def gate_up_item_nvfp4(r, experts, offsets, pair_token, gate, gate_s, gate_ts, up, up_s, up_ts, x_even, x_odd,
                       act_even, act_odd):
    """`gate_up_item_mxfp4` for NVFP4 (`gate_ts` / `up_ts` [E]: the tensor scales)."""
    rows = gate.shape[1]
    u, i = r // rows, r % rows
    e = experts[u]
    for p in range(offsets[u], offsets[u + 1]):
        g, v = dot2_nvfp4(gate, gate_s, up, up_s, e, i, NV_FACTORS, x_even, x_odd, pair_token[p])
        _store_act(act_even, act_odd, p, i, rows, silu_mul_bf16(g * gate_ts[e], v * up_ts[e]))


@njit(**BODY, inline="always")
def down_row_mxfp4(h, experts, offsets, pair_token, pair_weight, down, down_s, act_even, act_odd, out):
    """Output column h: out[t, h] += w * (down[e, h] . act_p) over every routed expert e and its pairs p."""
    for u in range(experts.shape[0]):
        e = experts[u]
        for p in range(offsets[u], offsets[u + 1]):
            dot = dot_mxfp4(down, down_s, e, h, MX_FACTORS, act_even, act_odd, p)
            out[pair_token[p], h] += pair_weight[p] * dot


@njit(**BODY, inline="always")
def down_row_nvfp4(h, experts, offsets, pair_token, pair_weight, down, down_s, down_ts, act_even, act_odd, out):
    """`down_row_mxfp4` for NVFP4."""
    for u in range(experts.shape[0]):
        e = experts[u]
        for p in range(offsets[u], offsets[u + 1]):
            dot = dot_nvfp4(down, down_s, e, h, NV_FACTORS, act_even, act_odd, p)
            out[pair_token[p], h] += pair_weight[p] * (dot * down_ts[e])


# One partition in one call (the dispatch of a numba call with a dozen arrays costs microseconds). The scratch
# arrays are made here and passed to the parallel loops as arguments: arrays a function allocates itself cost
# reference-count updates at every call that passes them, here every work item.

@njit(**BODY)
def decode_mxfp4(x, experts, offsets, pair_token, pair_weight, gate, gate_s, up, up_s, down, down_s, out):
    """out[T, H] += this partition's MXFP4 experts on x float32 [T, H]."""
    x_even = np.empty((x.shape[0], gate.shape[2]), dtype=np.float32)  # gate rows: ceil(H / 2) bytes
    x_odd = np.empty_like(x_even)
    split_bf16(x, x_even, x_odd)
    act_even = np.empty((pair_token.shape[0], down.shape[2]), dtype=np.float32)  # down rows: ceil(Ip / 2) bytes
    act_odd = np.empty_like(act_even)
    _loops_mxfp4(experts, offsets, pair_token, pair_weight, gate, gate_s, up, up_s, down, down_s, x_even, x_odd,
                 act_even, act_odd, out)


@njit(**FLAGS)
def _loops_mxfp4(experts, offsets, pair_token, pair_weight, gate, gate_s, up, up_s, down, down_s, x_even, x_odd,
                 act_even, act_odd, out):
    for r in prange(experts.shape[0] * gate.shape[1]):
        gate_up_item_mxfp4(r, experts, offsets, pair_token, gate, gate_s, up, up_s, x_even, x_odd, act_even, act_odd)
    for h in prange(down.shape[1]):
        down_row_mxfp4(h, experts, offsets, pair_token, pair_weight, down, down_s, act_even, act_odd, out)


@njit(**BODY)
def decode_nvfp4(x, experts, offsets, pair_token, pair_weight, gate, gate_s, gate_ts, up, up_s, up_ts, down, down_s,
                 down_ts, out):
    """`decode_mxfp4` for NVFP4 (`*_ts` [E]: each projection's tensor scale)."""
    x_even = np.empty((x.shape[0], gate.shape[2]), dtype=np.float32)
    x_odd = np.empty_like(x_even)
    split_bf16(x, x_even, x_odd)
    act_even = np.empty((pair_token.shape[0], down.shape[2]), dtype=np.float32)
    act_odd = np.empty_like(act_even)
    _loops_nvfp4(experts, offsets, pair_token, pair_weight, gate, gate_s, gate_ts, up, up_s, up_ts, down, down_s,
                 down_ts, x_even, x_odd, act_even, act_odd, out)


@njit(**FLAGS)
def _loops_nvfp4(experts, offsets, pair_token, pair_weight, gate, gate_s, gate_ts, up, up_s, up_ts, down, down_s,
                 down_ts, x_even, x_odd, act_even, act_odd, out):
    for r in prange(experts.shape[0] * gate.shape[1]):
        gate_up_item_nvfp4(r, experts, offsets, pair_token, gate, gate_s, gate_ts, up, up_s, up_ts, x_even, x_odd,
                           act_even, act_odd)
    for h in prange(down.shape[1]):
        down_row_nvfp4(h, experts, offsets, pair_token, pair_weight, down, down_s, down_ts, act_even, act_odd, out)


# ---- the operator's entry: one partition -------------------------------------------------------------------------

def decode_partition_mxfp4(x, routing, part, spec, out) -> None:
    """out += one partition's experts on x float32 [T, H], for `routing` (`operator.Routing`); `spec` (the layer's
    ExpertLayerSpec) is unused: the FP4 formats fix their groups."""
    r = routing
    decode_mxfp4(x, r.experts, r.offsets, r.pair_token, r.pair_weight, part.gate, part.gate_scales, part.up,
                 part.up_scales, part.down, part.down_scales, out)


def decode_partition_nvfp4(x, routing, part, spec, out) -> None:
    r = routing
    decode_nvfp4(x, r.experts, r.offsets, r.pair_token, r.pair_weight, part.gate, part.gate_scales,
                 part.gate_tensor_scale, part.up, part.up_scales, part.up_tensor_scale, part.down, part.down_scales,
                 part.down_tensor_scale, out)


# ---- prefill: whole projections dequantized ----------------------------------------------------------------------

@njit(parallel=True, nogil=True, cache=True, error_model="numpy")
def dequantize_fp4(packed, scales, is_mx, tensor_scale, out):
    """packed uint8 [N, ceil(K / 2)] with MXFP4 (`is_mx`) or NVFP4 scale bits [N, G] -> out float32 [N, K]: the
    reference's values (`formats.dequantize_mxfp4` / `dequantize_nvfp4`, NVFP4 times `tensor_scale` last), exact.
    Not fastmath, so each value is (code * first factor) * second factor, in that order (E8M0: never their
    subnormal product)."""
    cols = out.shape[1]
    group_bytes = (MX_GROUP if is_mx else NV_GROUP) // 2
    whole = cols // 2  # bytes with both columns inside the row
    for n in prange(packed.shape[0]):
        for g in range(scales.shape[1]):
            a, b = _factors(scales[n, g], is_mx, tensor_scale)
            for j in range(g * group_bytes, min((g + 1) * group_bytes, whole)):
                byte = packed[n, j]
                out[n, 2 * j] = E2M1_TWICE_F32[byte & 15] * a * b
                out[n, 2 * j + 1] = E2M1_TWICE_F32[byte >> 4] * a * b
        if cols % 2:
            a, b = _factors(scales[n, scales.shape[1] - 1], is_mx, tensor_scale)
            out[n, cols - 1] = E2M1_TWICE_F32[packed[n, whole] & 15] * a * b


@njit(nogil=True, cache=True)
def _factors(scale, is_mx, tensor_scale):
    if is_mx:
        return MX_FACTORS[scale, 0], MX_FACTORS[scale, 1]
    return NV_FACTORS[scale], tensor_scale
