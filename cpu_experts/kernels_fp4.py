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
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from cpu_experts.formats import E4M3_MAX
from cpu_experts.kernels import _as_float32
from cpu_experts.kernels_vnni import _IR

FLAGS = dict(parallel=True, fastmath=True, nogil=True, cache=True)
MX_GROUP, NV_GROUP = 32, 16
CHUNK = 16  # bytes of a weight row a vector step decodes: 32 columns
SERIAL_ROWS = 8  # activation rows below which rounding them is not worth waking the thread pool

I8, I32, I64, F32 = ir.IntType(8), ir.IntType(32), ir.IntType(64), ir.FloatType()
V16B, V16I, V16F = ir.VectorType(I8, 16), ir.VectorType(I32, 16), ir.VectorType(F32, 16)
E2M1_TWICE = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)  # 2 * value of each code (bit 3: sign)
# The scalar tails' copy of it, and the per-scale-byte factors: MXFP4 two (their product 2^(s - 128), the E8M0
# scale halved, as two normal floats; 255, NaN, gives NaN), NVFP4 one (the e4m3 scale halved: at least 2^-10, normal).
E2M1_TWICE_F32 = np.array(E2M1_TWICE, dtype=np.float32)


def _mx_factors() -> np.ndarray:
    exponent = np.arange(256) - 128
    low = np.floor(exponent / 2)
    table = np.stack([np.exp2(low), np.exp2(exponent - low)], axis=1).astype(np.float32)
    table[255] = np.nan
    return table


def _nv_factors() -> np.ndarray:
    bits = np.arange(256, dtype=np.uint8)
    sign = np.where(bits & 0x80, -1.0, 1.0)
    exponent, mantissa = (bits >> 3) & 15, bits & 7
    value = np.where(exponent > 0, (8 + mantissa) * np.exp2(exponent - 10.0), mantissa * 2.0 ** -9) * sign
    value[(bits & 0x7F) == 0x7F] = np.nan
    assert np.nanmax(value) == E4M3_MAX
    return (value / 2).astype(np.float32)


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


def _scale_vector(g: _IR, scales, table, chunk, is_mx: bool):
    """The chunk's scale factors as <16 x float> vectors: MXFP4 (one group) two splats whose product is the group's
    halved scale, NVFP4 (two groups of 8 lanes) one vector [s0 x 8, s1 x 8]."""
    b = g.b
    if is_mx:
        index = b.zext(b.load(b.gep(scales, [chunk])), I64)
        first = b.mul(index, ir.Constant(I64, 2))
        factors = [b.load(b.gep(table, [k])) for k in (first, b.add(first, ir.Constant(I64, 1)))]
        return [b.shuffle_vector(b.insert_element(ir.Constant(V16F, None), f, ir.Constant(I32, 0)),
                                 ir.Constant(V16F, None), ir.Constant(V16I, [0] * 16)) for f in factors]
    pair = b.add(chunk, chunk)
    pair_vec = ir.Constant(ir.VectorType(F32, 2), None)
    for k in range(2):
        index = b.zext(b.load(b.gep(scales, [b.add(pair, ir.Constant(I64, k))])), I64)
        pair_vec = b.insert_element(pair_vec, b.load(b.gep(table, [index])), ir.Constant(I32, k))
    return [b.shuffle_vector(pair_vec, pair_vec, ir.Constant(V16I, [0] * 8 + [1] * 8))]


def _fp4_codegen(num_rows: int, is_mx: bool, portable: bool | None = None):
    """sum over the first `num_chunks` 16-byte chunks of each row of the chunk's scaled dot with x_even (low
    nibbles) and x_odd (high ones); args: rows, their scale rows (uint8 bits), the factor table, x_even, x_odd,
    num_chunks. Two accumulators per row (alternate chunks) keep two FMA chains in flight."""
    def codegen(context, builder, sig, args):
        is_portable = PORTABLE if portable is None else portable
        g = _IR(context, builder)
        rows = [g.data(sig.args[j], args[j])[0] for j in range(num_rows)]
        scales = [g.data(sig.args[num_rows + j], args[num_rows + j])[0] for j in range(num_rows)]
        table = g.data(sig.args[2 * num_rows], args[2 * num_rows], F32)[0]
        x_even = g.data(sig.args[2 * num_rows + 1], args[2 * num_rows + 1], F32)[0]
        x_odd = g.data(sig.args[2 * num_rows + 2], args[2 * num_rows + 2], F32)[0]
        num_chunks = builder.sext(args[-1], I64) if args[-1].type != I64 else args[-1]
        accs = [[g.zeroed(V16F), g.zeroed(V16F)] for _ in range(num_rows)]
        nibble, four = ir.Constant(V16B, [15] * 16), ir.Constant(V16B, [4] * 16)

        def load(base, offset, ty):
            return builder.load(builder.bitcast(builder.gep(base, [offset]), ty.as_pointer()), align=1)

        def chunk(index, half):
            offset = builder.mul(index, ir.Constant(I64, CHUNK))
            xe, xo = load(x_even, offset, V16F), load(x_odd, offset, V16F)
            for j in range(num_rows):
                w = load(rows[j], offset, V16B)
                lo = _decode_nibbles(g, builder.and_(w, nibble), is_portable)
                hi = _decode_nibbles(g, builder.lshr(w, four), is_portable)
                dot = g.call("llvm.fma.v16f32", V16F, [V16F] * 3, [hi, xo, builder.fmul(lo, xe)])
                factors = _scale_vector(g, scales[j], table, index, is_mx)
                if is_mx:
                    dot = builder.fmul(dot, factors[0])
                acc = accs[j][half]
                builder.store(g.call("llvm.fma.v16f32", V16F, [V16F] * 3, [dot, factors[-1], builder.load(acc)]),
                              acc)

        two = ir.Constant(I64, 2)
        with cgutils.for_range(builder, builder.sdiv(num_chunks, two)) as loop:
            first = builder.mul(loop.index, two)
            for row in rows:  # one 64-byte line every other iteration: the repeat is a cheap no-op
                g.prefetch(row, builder.mul(first, ir.Constant(I64, CHUNK)))
            chunk(first, 0)
            chunk(builder.add(first, ir.Constant(I64, 1)), 1)
        with builder.if_then(builder.icmp_signed("!=", builder.srem(num_chunks, two), ir.Constant(I64, 0))):
            chunk(builder.sub(num_chunks, ir.Constant(I64, 1)), 0)
        sums = []
        for pair in accs:
            vec = builder.fadd(builder.load(pair[0]), builder.load(pair[1]))
            sums.append(g.call("llvm.vector.reduce.fadd.v16f32", F32, [F32, V16F], [ir.Constant(F32, 0.0), vec]))
        return sums[0] if num_rows == 1 else context.make_tuple(builder, sig.return_type, sums)
    return codegen


def _signature(num_rows):
    def typer(*args):
        ret = types.float32 if num_rows == 1 else types.UniTuple(types.float32, num_rows)
        return ret(*args)
    return typer


@intrinsic
def _mx_chunks(typingctx, w, s, table, x_even, x_odd, num_chunks):
    return _signature(1)(w, s, table, x_even, x_odd, num_chunks), _fp4_codegen(1, True)


@intrinsic
def _mx_chunks2(typingctx, w0, w1, s0, s1, table, x_even, x_odd, num_chunks):
    return _signature(2)(w0, w1, s0, s1, table, x_even, x_odd, num_chunks), _fp4_codegen(2, True)


@intrinsic
def _nv_chunks(typingctx, w, s, table, x_even, x_odd, num_chunks):
    return _signature(1)(w, s, table, x_even, x_odd, num_chunks), _fp4_codegen(1, False)


@intrinsic
def _nv_chunks2(typingctx, w0, w1, s0, s1, table, x_even, x_odd, num_chunks):
    return _signature(2)(w0, w1, s0, s1, table, x_even, x_odd, num_chunks), _fp4_codegen(2, False)


# ---- row dot products ------------------------------------------------------------------------------------------

@njit(cache=True)
def _tail(row, scales, x_even, x_odd, first_chunk, is_mx):
    """The bytes past the whole chunks, group by group (a last partial group; NVFP4's last 8-byte group). Not
    fastmath: each group's sum is scaled by the factors in order, so E8M0's tiny scales stay exact."""
    group_bytes = (MX_GROUP if is_mx else NV_GROUP) // 2
    num_bytes = row.shape[0]
    acc = np.float32(0.0)
    for g in range(first_chunk * CHUNK // group_bytes, scales.shape[0]):
        s = np.float32(0.0)
        for b in range(g * group_bytes, min((g + 1) * group_bytes, num_bytes)):
            byte = row[b]
            s += E2M1_TWICE_F32[byte & 15] * x_even[b] + E2M1_TWICE_F32[byte >> 4] * x_odd[b]
        if is_mx:
            acc += s * MX_FACTORS[scales[g], 0] * MX_FACTORS[scales[g], 1]
        else:
            acc += s * NV_FACTORS[scales[g]]
    return acc


@njit(fastmath=True, cache=True)
def dot_mxfp4(row, scales, x_even, x_odd):
    """An MXFP4 row (packed uint8 [ceil(K / 2)], E8M0 scales [ceil(K / 32)]) . x (split: `split_bf16`)."""
    num_chunks = row.shape[0] // CHUNK
    return _mx_chunks(row, scales, MX_FACTORS, x_even, x_odd, num_chunks) + \
        _tail(row, scales, x_even, x_odd, num_chunks, True)


@njit(fastmath=True, cache=True)
def dot_nvfp4(row, scales, x_even, x_odd):
    """An NVFP4 row (e4m3 scales [ceil(K / 16)]) . x, before its tensor scale."""
    num_chunks = row.shape[0] // CHUNK
    return _nv_chunks(row, scales, NV_FACTORS, x_even, x_odd, num_chunks) + \
        _tail(row, scales, x_even, x_odd, num_chunks, False)


@njit(fastmath=True, cache=True)
def _dot2_mxfp4(w0, s0, w1, s1, x_even, x_odd):
    num_chunks = w0.shape[0] // CHUNK
    a, b = _mx_chunks2(w0, w1, s0, s1, MX_FACTORS, x_even, x_odd, num_chunks)
    return (a + _tail(w0, s0, x_even, x_odd, num_chunks, True),
            b + _tail(w1, s1, x_even, x_odd, num_chunks, True))


@njit(fastmath=True, cache=True)
def _dot2_nvfp4(w0, s0, w1, s1, x_even, x_odd):
    num_chunks = w0.shape[0] // CHUNK
    a, b = _nv_chunks2(w0, w1, s0, s1, NV_FACTORS, x_even, x_odd, num_chunks)
    return (a + _tail(w0, s0, x_even, x_odd, num_chunks, False),
            b + _tail(w1, s1, x_even, x_odd, num_chunks, False))


# ---- activations -----------------------------------------------------------------------------------------------

@intrinsic
def _float_bits(typingctx, value):
    """The int32 bit pattern of the float32 `value`."""
    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], I32)
    return types.int32(types.float32), codegen


@njit(fastmath=True, cache=True)
def round_bf16(value):
    """float32 -> the nearest bfloat16 (ties to even, as torch rounds), as a float32; NaN stays NaN."""
    bits = np.int64(_float_bits(np.float32(value)))
    if (bits & 0x7FFFFFFF) > 0x7F800000:
        return np.float32(value)
    return _as_float32(np.int32((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536))


@njit(fastmath=True, cache=True)
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


@njit(fastmath=True, cache=True)
def _store_act(p, i, rows, g, v, act_even, act_odd):
    """act[p, i] = silu(g) * v, rounded to bf16, into the split form the down rows read (`split_bf16_row`)."""
    a = round_bf16(g / (np.float32(1.0) + np.exp(-g)) * v)
    if i % 2:
        act_odd[p, i // 2] = a
    else:
        act_even[p, i // 2] = a
        if i == rows - 1:  # an odd partition's last byte: its high nibble meets zero
            act_odd[p, i // 2] = np.float32(0.0)


# ---- loop bodies (shared with a decode pool) and one partition in one call ---------------------------------------
# Plain functions (no allocation, nogil-safe), so a pool of threads can split the same items and compute the same
# sums as the parallel loops here.

@njit(fastmath=True, cache=True)
def gate_up_item_mxfp4(r, experts, offsets, pair_token, gate, gate_s, up, up_s, x_even, x_odd, act_even, act_odd):
    """Work item r = (routed expert u, row i): act[p, i] = silu(gate . x_t) * (up . x_t), bf16, for u's pairs p;
    act stored split (`act_even` / `act_odd` [P, >= ceil(Ip / 2)])."""
    rows = gate.shape[1]
    u, i = r // rows, r % rows
    e = experts[u]
    for p in range(offsets[u], offsets[u + 1]):
        t = pair_token[p]
        g, v = _dot2_mxfp4(gate[e, i], gate_s[e, i], up[e, i], up_s[e, i], x_even[t], x_odd[t])
        _store_act(p, i, rows, g, v, act_even, act_odd)


@njit(fastmath=True, cache=True)
def gate_up_item_nvfp4(r, experts, offsets, pair_token, gate, gate_s, gate_ts, up, up_s, up_ts, x_even, x_odd,
                       act_even, act_odd):
    """`gate_up_item_mxfp4` for NVFP4 (`gate_ts` / `up_ts` [E]: the tensor scales)."""
    rows = gate.shape[1]
    u, i = r // rows, r % rows
    e = experts[u]
    for p in range(offsets[u], offsets[u + 1]):
        t = pair_token[p]
        g, v = _dot2_nvfp4(gate[e, i], gate_s[e, i], up[e, i], up_s[e, i], x_even[t], x_odd[t])
        _store_act(p, i, rows, g * gate_ts[e], v * up_ts[e], act_even, act_odd)


@njit(fastmath=True, cache=True)
def down_row_mxfp4(h, experts, offsets, pair_token, pair_weight, down, down_s, act_even, act_odd, out):
    """Output column h: out[t, h] += w * (down[e, h] . act_p) over every routed expert e and its pairs p."""
    num_bytes = down.shape[2]  # act may be wider (a pool's scratch)
    for u in range(experts.shape[0]):
        e = experts[u]
        for p in range(offsets[u], offsets[u + 1]):
            dot = dot_mxfp4(down[e, h], down_s[e, h], act_even[p, :num_bytes], act_odd[p, :num_bytes])
            out[pair_token[p], h] += pair_weight[p] * dot


@njit(fastmath=True, cache=True)
def down_row_nvfp4(h, experts, offsets, pair_token, pair_weight, down, down_s, down_ts, act_even, act_odd, out):
    """`down_row_mxfp4` for NVFP4."""
    num_bytes = down.shape[2]
    for u in range(experts.shape[0]):
        e = experts[u]
        for p in range(offsets[u], offsets[u + 1]):
            dot = dot_nvfp4(down[e, h], down_s[e, h], act_even[p, :num_bytes], act_odd[p, :num_bytes])
            out[pair_token[p], h] += pair_weight[p] * (dot * down_ts[e])


@njit(**FLAGS)
def decode_mxfp4(x, experts, offsets, pair_token, pair_weight, gate, gate_s, up, up_s, down, down_s, out):
    """out[T, H] += this partition's MXFP4 experts on x float32 [T, H]."""
    num_pairs, rows = pair_token.shape[0], gate.shape[1]
    x_even = np.empty((x.shape[0], gate.shape[2]), dtype=np.float32)  # gate rows: ceil(H / 2) bytes
    x_odd = np.empty_like(x_even)
    split_bf16(x, x_even, x_odd)
    act_even = np.empty((num_pairs, down.shape[2]), dtype=np.float32)  # down rows: ceil(Ip / 2) bytes
    act_odd = np.empty_like(act_even)
    for r in prange(experts.shape[0] * rows):
        gate_up_item_mxfp4(r, experts, offsets, pair_token, gate, gate_s, up, up_s, x_even, x_odd, act_even, act_odd)
    for h in prange(down.shape[1]):
        down_row_mxfp4(h, experts, offsets, pair_token, pair_weight, down, down_s, act_even, act_odd, out)


@njit(**FLAGS)
def decode_nvfp4(x, experts, offsets, pair_token, pair_weight, gate, gate_s, gate_ts, up, up_s, up_ts, down, down_s,
                 down_ts, out):
    """`decode_mxfp4` for NVFP4 (`*_ts` [E]: each projection's tensor scale)."""
    num_pairs, rows = pair_token.shape[0], gate.shape[1]
    x_even = np.empty((x.shape[0], gate.shape[2]), dtype=np.float32)
    x_odd = np.empty_like(x_even)
    split_bf16(x, x_even, x_odd)
    act_even = np.empty((num_pairs, down.shape[2]), dtype=np.float32)
    act_odd = np.empty_like(act_even)
    for r in prange(experts.shape[0] * rows):
        gate_up_item_nvfp4(r, experts, offsets, pair_token, gate, gate_s, gate_ts, up, up_s, up_ts, x_even, x_odd,
                           act_even, act_odd)
    for h in prange(down.shape[1]):
        down_row_nvfp4(h, experts, offsets, pair_token, pair_weight, down, down_s, down_ts, act_even, act_odd, out)


# ---- the operator's entry: one partition -------------------------------------------------------------------------

def decode_partition_mxfp4(x, routing, part, out) -> None:
    """out += one partition's experts on x float32 [T, H], for `routing` (`operator.Routing`)."""
    r = routing
    decode_mxfp4(x, r.experts, r.offsets, r.pair_token, r.pair_weight, part.gate, part.gate_scales, part.up,
                 part.up_scales, part.down, part.down_scales, out)


def decode_partition_nvfp4(x, routing, part, out) -> None:
    r = routing
    decode_nvfp4(x, r.experts, r.offsets, r.pair_token, r.pair_weight, part.gate, part.gate_scales,
                 part.gate_tensor_scale, part.up, part.up_scales, part.up_tensor_scale, part.down, part.down_scales,
                 part.down_tensor_scale, out)


# ---- prefill: whole projections dequantized ----------------------------------------------------------------------

@njit(parallel=True, nogil=True, cache=True)
def dequantize_fp4(packed, scales, is_mx, tensor_scale, out):
    """packed uint8 [N, ceil(K / 2)] with MXFP4 (`is_mx`) or NVFP4 scales [N, G] -> out float32 [N, K]: the
    reference's values (`formats.dequantize_mxfp4` / `dequantize_nvfp4`, NVFP4 times `tensor_scale` last), exact.
    Not fastmath, so the scale factors multiply in order (see `_tail`)."""
    cols = out.shape[1]
    group = MX_GROUP if is_mx else NV_GROUP
    for n in prange(packed.shape[0]):
        for j in range(cols):
            code = (np.int32(packed[n, j >> 1]) >> ((j & 1) * 4)) & 15
            s = scales[n, j // group]
            if is_mx:
                out[n, j] = E2M1_TWICE_F32[code] * MX_FACTORS[s, 0] * MX_FACTORS[s, 1]
            else:
                out[n, j] = E2M1_TWICE_F32[code] * NV_FACTORS[s] * tensor_scale
