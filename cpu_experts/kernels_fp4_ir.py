"""The LLVM IR of the MXFP4 / NVFP4 row dot products (`cpu_experts.kernels_fp4`'s intrinsics): 16-byte chunks of
one, two or four rows against split bf16 activations, nibbles decoded by table lookups (see that module).

Two ways to apply a group's scale. AVX-512 ("permute", `decode_mode`): the lookup itself yields value * scale, from
a 16-float table per scale byte (`scaled_tables`, 64-byte aligned constants in the code), so a chunk of a row costs
a widening load, a shift, two permutes and two FMAs (6 vector instructions for 32 weights, against 8 with the
scale multiplied after the lookup). An MXFP4 chunk is one group (`vpermps` on its scale's table); an NVFP4 chunk is
two, lanes 0..7 of the first and 8..15 of the second, so its indices carry the lane's group in bit 4 and `vpermi2ps`
reads the pair of tables as one of 32 floats. Elsewhere ("shuffle", "portable") the lookup yields twice the e2m1
value and the chunk's products are multiplied by the groups' factors (`kernels_fp4.MX_FACTORS`, `NV_FACTORS`, the
intrinsics' `table` argument, which the permute path does not read). "lanes" is the permute path's arithmetic with
the lookups written lane by lane in generic IR: any CPU, for the tests of machines without AVX-512.
"""

from __future__ import annotations

import llvmlite.binding as llvm
import numpy as np
import torch
from llvmlite import ir
from numba import types
from numba.core import cgutils, config

from cpu_experts import formats
from cpu_experts.kernels_vnni import _IR
from cpu_experts.kernels_vnni_int4 import _sum_lanes

CHUNK = 16  # bytes of a weight row a vector step decodes: 32 columns
I8, I32, I64, F32 = ir.IntType(8), ir.IntType(32), ir.IntType(64), ir.FloatType()
V16B, V16I, V16F = ir.VectorType(I8, 16), ir.VectorType(I32, 16), ir.VectorType(F32, 16)
E2M1_TWICE = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)  # 2 * value of each code (bit 3: sign)
SCALED_MODES = ("permute", "lanes")  # the modes whose lookups yield value * scale (`scaled_tables`)
NV_LANE_GROUP = [0] * 8 + [16] * 8  # index bit 4 of an NVFP4 chunk's lanes: its second group's table


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


def _decode_bytes(g: _IR, w, mode: str):
    """<16 x i8> packed bytes -> (low nibbles', high nibbles') <16 x float> twice their e2m1 values. "permute"
    (AVX-512F): each byte widened to an int32 lane indexes a 16-float table with `vpermps`, which reads only the
    lane's low 4 bits, so the low nibble needs no mask and the high one a shift: 4 instructions for 32 weights,
    against 9 through `pshufb` and int8 -> float conversions ("shuffle", SSSE3) or generic IR ("portable")."""
    b = g.b
    if mode == "permute":
        table = ir.Constant(V16F, [float(c) for c in E2M1_TWICE])
        wide = b.zext(w, V16I)
        return tuple(g.call("llvm.x86.avx512.permvar.sf.512", V16F, [V16F, V16I], [table, index])
                     for index in (wide, b.lshr(wide, ir.Constant(V16I, [4] * 16))))
    portable = mode == "portable"
    return (_decode_nibbles(g, b.and_(w, ir.Constant(V16B, [15] * 16)), portable),
            _decode_nibbles(g, b.lshr(w, ir.Constant(V16B, [4] * 16)), portable))


def decode_mode() -> str:
    """The nibble decoding compiled for numba's target CPU (`_decode_bytes`): the host's, or with NUMBA_CPU_NAME
    set (a cache built for other machines) what NUMBA_CPU_FEATURES grants, so that an AVX2 target never gets
    `vpermps` on an AVX-512 build machine."""
    if config.CPU_NAME not in (None, "host"):
        granted = (config.CPU_FEATURES or "").split(",")
        if "+avx512f" in granted:
            return "permute"
        # a named CPU (haswell, znver2, ...) has SSSE3; the baselines may not
        has_ssse3 = "+ssse3" in granted or config.CPU_NAME not in ("generic", "x86-64")
        return "shuffle" if has_ssse3 else "portable"
    features = llvm.get_host_cpu_features()
    if features.get("avx512f"):
        return "permute"
    return "shuffle" if features.get("ssse3") else "portable"


def scaled_tables(is_mx: bool) -> np.ndarray:
    """float32 [256, 16]: row s holds each e2m1 code's value times the scale whose byte is s (E8M0 2^(s - 127), 255
    NaN; e4m3), computed in float64 and rounded once: exactly the dequantized weight wherever that is a float32 (an
    E8M0 scale of 2^126 or more overflows the larger codes to infinity, as the dequantized reference does)."""
    twice = np.array(E2M1_TWICE, dtype=np.float64)
    if is_mx:
        scale = np.exp2(np.arange(256, dtype=np.float64) - 128)  # halved: the codes are doubled
        scale[255] = np.nan
    else:
        scale = formats.e4m3_to_float(torch.arange(256, dtype=torch.int32).to(torch.uint8)).double().numpy() / 2
    with np.errstate(over="ignore"):
        return (scale[:, None] * twice[None, :]).astype(np.float32)


def _table_row(g: _IR, scales, index, is_mx: bool):
    """<16 x float>: the row of `scaled_tables` for the scale byte at scales[index], from a constant global of the
    module (64-byte aligned: one cache line a row, whatever the array's allocation)."""
    b = g.b
    name = "fp4_scaled_tables_" + ("mx" if is_mx else "nv")
    table = b.module.globals.get(name)
    if table is None:
        rows = scaled_tables(is_mx)
        value = ir.Constant(ir.ArrayType(V16F, 256), [ir.Constant(V16F, [float(v) for v in row]) for row in rows])
        table = ir.GlobalVariable(b.module, value.type, name)
        table.linkage, table.global_constant, table.initializer, table.align = "internal", True, value, 64
    byte = b.zext(b.load(b.gep(scales, [index])), I64)
    return b.load(b.gep(table, [ir.Constant(I64, 0), byte]), align=64)


def _lookup(g: _IR, tables, index, mode: str):
    """tables[index[i]] for each lane i: one table (<16 x float>, 4 index bits) or a pair (32 floats, 5 bits), as
    AVX-512's `vpermps` / `vpermi2ps` read them ("permute"), or lane by lane in generic IR ("lanes")."""
    b = g.b
    if mode == "permute":
        if len(tables) == 1:
            return g.call("llvm.x86.avx512.permvar.sf.512", V16F, [V16F, V16I], [tables[0], index])
        return g.call("llvm.x86.avx512.vpermi2var.ps.512", V16F, [V16F, V16I, V16F], [tables[0], index, tables[1]])
    joined = tables[0] if len(tables) == 1 else b.shuffle_vector(
        tables[0], tables[1], ir.Constant(ir.VectorType(I32, 32), list(range(32))))
    mask, out = ir.Constant(I32, 16 * len(tables) - 1), ir.Constant(V16F, None)
    for lane in range(16):
        at = ir.Constant(I32, lane)
        out = b.insert_element(out, b.extract_element(joined, b.and_(b.extract_element(index, at), mask)), at)
    return out


def _scaled_values(g: _IR, w, scales, first, second, is_mx: bool, mode: str):
    """<16 x i8> packed bytes of a chunk -> (low nibbles', high nibbles') <16 x float> values times their groups'
    scales (scale bytes at `first`, NVFP4's second group's at `second`)."""
    b = g.b
    wide = b.zext(w, V16I)
    high = b.lshr(wide, ir.Constant(V16I, [4] * 16))
    if is_mx:  # the permutes read the low 4 bits: the low nibble needs no mask
        tables = [_table_row(g, scales, first, True)]
        return _lookup(g, tables, wide, mode), _lookup(g, tables, high, mode)
    tables = [_table_row(g, scales, index, False) for index in (first, second)]
    group = ir.Constant(V16I, NV_LANE_GROUP)
    low = b.or_(b.and_(wide, ir.Constant(V16I, [15] * 16)), group)
    return _lookup(g, tables, low, mode), _lookup(g, tables, b.or_(high, group), mode)


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

    def __init__(self, context, builder, sig, args, weights, is_mx: bool, mode: str, is_scaled: bool):
        self.g, self.b = _IR(context, builder), builder
        self.num_rows, self.is_mx, self.mode, self.is_scaled = len(weights), is_mx, mode, is_scaled
        at = 1 + max(max(w, s) for w, s, _ in weights)
        (e_type, n_type), (e, n) = sig.args[at:at + 2], args[at:at + 2]
        self.rows, self.scales = [], []
        for w_arg, s_arg, offset in weights:
            index = ((e_type, n_type), (e, builder.add(n, ir.Constant(n.type, offset))))
            self.rows.append(self.g.item_pointer(sig.args[w_arg], args[w_arg], index[1], I8, index[0]))
            self.scales.append(self.g.item_pointer(sig.args[s_arg], args[s_arg], index[1], I8, index[0]))
        self.table = self.g.data(sig.args[at + 2], args[at + 2], F32)[0]
        token = ([sig.args[at + 5]], [args[at + 5]])
        self.x_even = self.g.item_pointer(sig.args[at + 3], args[at + 3], token[1], F32, token[0])
        self.x_odd = self.g.item_pointer(sig.args[at + 4], args[at + 4], token[1], F32, token[0])
        self.num_bytes = builder.extract_value(context.make_array(sig.args[0])(context, builder, args[0]).shape, 2)
        self.accs = [[self.g.zeroed(V16F), self.g.zeroed(V16F)] for _ in range(self.num_rows)]

    def load(self, base, offset, ty):
        return self.b.load(self.b.bitcast(self.b.gep(base, [offset]), ty.as_pointer()), align=1)

    def chunk(self, w_ptrs, xe_ptr, xo_ptr, offset, index, half, second=None):
        """Chunk `index` (of the scales): its bytes at w_ptrs[j] + offset, its activations at x + offset; NVFP4's
        second group's scale at `second` (default: the group after the first). The factored modes alternate the
        row's two accumulators by `half`; the scaled ones keep the low nibbles' products in the first, the high
        ones' in the second."""
        b = self.b
        xe, xo = self.load(xe_ptr, offset, V16F), self.load(xo_ptr, offset, V16F)
        first = index if self.is_mx else b.add(index, index)
        second = second or b.add(first, ir.Constant(I64, 1))
        for j in range(self.num_rows):
            w = self.load(w_ptrs[j], offset, V16B)
            if not self.is_scaled:
                self._factored(w, xe, xo, j, first, second, self.accs[j][half], self.mode)
                continue
            if not self.is_mx:
                self._scaled(w, xe, xo, j, first, second)
                continue
            # E8M0 bytes 0 and 1 make subnormal table entries, which a denormals-are-zero mode would read as zero:
            # such groups (in no real checkpoint) take the factored path, whose factors are normal floats
            is_tiny = b.icmp_unsigned("<", b.load(b.gep(self.scales[j], [first])), ir.Constant(I8, 2))
            with b.if_else(is_tiny, likely=False) as (tiny, ordinary):
                with tiny:
                    unscaled = "permute" if self.mode == "permute" else "portable"
                    self._factored(w, xe, xo, j, first, second, self.accs[j][0], unscaled)
                with ordinary:
                    self._scaled(w, xe, xo, j, first, second)

    def _scaled(self, w, xe, xo, j, first, second):
        """Row j's chunk by value * scale lookups (`_scaled_values`): the low and the high nibbles' own chains."""
        b = self.b
        lo, hi = _scaled_values(self.g, w, self.scales[j], first, second, self.is_mx, self.mode)
        for acc, values, xv in zip(self.accs[j], (lo, hi), (xe, xo), strict=True):
            b.store(self.g.call("llvm.fma.v16f32", V16F, [V16F] * 3, [values, xv, b.load(acc)]), acc)

    def _factored(self, w, xe, xo, j, first, second, acc, mode):
        """Row j's chunk by twice-the-value lookups (`_decode_bytes` in `mode`), its products times the groups'
        factors (the `table` argument) into `acc`."""
        b = self.b
        lo, hi = _decode_bytes(self.g, w, mode)
        dot = self.g.call("llvm.fma.v16f32", V16F, [V16F] * 3, [hi, xo, b.fmul(lo, xe)])
        factors = _scale_vectors(self.g, self.scales[j], self.table, first, second, self.is_mx)
        if self.is_mx:
            dot = b.fmul(dot, factors[0])
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
        """Each row's lanes summed in a fixed tree (`_sum_lanes`): a row's dot is the same in a call of one row or
        four (the pool's range splits must not change results)."""
        return [_sum_lanes(self.b, self.b.fadd(self.b.load(a0), self.b.load(a1)), V16F) for a0, a1 in self.accs]


ONE_ROW = ((0, 1, 0),)
TWO_ROWS = ((0, 1, 0), (2, 3, 0))  # w0, s0, w1, s1: a token's gate and up rows
FOUR_ROWS = tuple((0, 1, k) for k in range(4))  # rows n..n + 3 of one projection


def _fp4_codegen(weights, is_mx: bool, mode: str | None = None, is_scaled: bool | None = None):
    """The dot of each row w[e, n + offset] (uint8 [E, N, B], scale bits s [E, N, G]) with x[t] (x_even[t] for the
    low nibbles, x_odd[t] for the high ones), before any tensor scale; `weights`: (weight argument, scale argument,
    row offset) of each row; args: the arrays, then e, n, the factor table, x_even, x_odd, t. 16-byte chunks, two
    accumulators per row (two FMA chains in flight: alternate chunks, or the scaled modes' low and high nibbles); a
    last partial chunk takes the same path from zero-padded copies. `mode`: `_decode_bytes`' or "lanes" (default:
    this CPU's, `decode_mode`); `is_scaled`: whether the lookups yield value * scale (default: the modes that can,
    SCALED_MODES; "permute" with False is the factored AVX-512 kernel, kept for `probe_float_decode`'s A/B)."""
    def codegen(context, builder, sig, args):
        chosen = mode or decode_mode()
        scaled = chosen in SCALED_MODES if is_scaled is None else is_scaled
        dots = _RowDots(context, builder, sig, args, weights, is_mx, chosen, scaled)
        num_chunks = builder.sdiv(dots.num_bytes, ir.Constant(I64, CHUNK))
        dots.whole_chunks(num_chunks)
        dots.partial_chunk(num_chunks)
        sums = dots.sums()
        return sums[0] if len(sums) == 1 else context.make_tuple(builder, sig.return_type, sums)
    return codegen


def _signature(num_rows):
    def typer(*args):
        ret = types.float32 if num_rows == 1 else types.UniTuple(types.float32, num_rows)
        return ret(*args)
    return typer
