"""The AMX-BF16 kernels of `cpu_experts.prefill_amx_float` that run: a task's 32 weight rows converted to bf16 a
chunk of CHUNK columns at a time, each chunk multiplied against all of the task's column tiles while it is in L1.

Why (DeepSeek-V3 at 512 tokens: ~16 tokens an expert, one column tile): the first kernels (replaced by these:
1.39-1.54x, the same outputs bit for bit) converted a task's whole rows (32 x 7168 bf16 = 448 KiB for gate/up) into a
per-thread scratch, then ran the tiles over it. A core streams only ~6-7 GB/s from DRAM, and it streamed only
while converting: the tile and scaling phases left its share of the bandwidth idle, and the scratch went through
L2 twice (written, then read by the tile loads). Per FP8 group (4 tile steps) `_scale_add` then ran a scalar loop
over 1024 floats with an index computation per row. Here:
- the conversion of a chunk (`_fp8_rows`, `_fp4_rows`: vector IR over 16 rows a call, FP4 factors looked up from
  the scale bytes inside the loop) prefetches the rows' bytes PREFETCH_CHUNKS chunks ahead, so the next chunks'
  lines arrive while this one's tiles run: the stream never stops;
- the converted chunk (32 rows x CHUNK bf16, 32 KiB) is read by the tile loads from L1;
- a scale group's C tiles are stored once per group and added to the float32 accumulators times the rows' group
  scales by vector IR (`_scale_add_tiles`: a broadcast and a multiply-add per tile row of 16 floats). A group
  longer than a chunk (NVFP4's and folded MXFP4's whole row, FP8 groups above CHUNK) keeps accumulating in its C
  tiles across chunks: they are stored and reloaded (`tileloadd` of float32 C is exact), never rounded.
Numerics are the module's: the same tile products in the same order, the same group sums and scales.
"""

from __future__ import annotations

import types as pytypes

import numba
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from cpu_experts.kernels import scale_value
from cpu_experts.kernels_fp4_ir import V16B, V16I, _decode_bytes, decode_mode
from cpu_experts.kernels_vnni import _IR
from cpu_experts.prefill_amx import (
    TILE_BYTES,
    TILE_ROWS,
    _call,
    _no_tile_begin,
    _no_tile_end,
    _ptr,
    _tile_begin,
    _tile_end,
)
from cpu_experts.prefill_amx_float import (
    C_FLOATS,
    CHUNK,
    F32,
    FP8,
    I8,
    I32,
    MX_HALF,
    MX_SCALE,
    MXFP4,
    NV_HALF,
    NVFP4,
    STEP,
    _act_epilogue,
    _down_epilogue,
    _fp8_step,
    _mx_foldable,
    _store_bf16,
    _task_groups,
)

FLAGS = dict(parallel=True, fastmath=True, nogil=True, cache=True)
PREFETCH_CHUNKS = 1  # chunks ahead that the source rows are prefetched (a chunk: ~2 us of work per core)
HALF = np.full(256, 0.5, dtype=np.float32)  # the doubled codes' factor of MXFP4 rows whose scales do not fold
FP4_SHIFT = {NVFP4: 4, MXFP4: 5}  # log2 of the columns a scale byte covers


# ---- tiles -------------------------------------------------------------------------------------------------------

def _segment_codegen(num_b: int, is_fresh: bool):
    """C tiles t = 0 .. 2 num_b - 1 at c (bytes from c_off, 1 KiB each: A0 B0, A1 B0, A0 B1, A1 B1) zeroed
    (`is_fresh`) or loaded, then += A0 . Bj, A1 . Bj over num_k steps, stored back. A0: 16 rows of bf16 at a
    (bytes from a_off, row stride lda), A1 the 16 rows after; Bj at b_off + j KiB, the next step b_step further."""
    def codegen(context, builder, sig, args):
        (a, a_off, lda, b, b_off, b_step, num_k, c, c_off) = args
        i8, i64, ptr = ir.IntType(8), ir.IntType(64), ir.IntType(8).as_pointer()
        p_a0 = _ptr(context, builder, sig.args[0], a, a_off)
        p_a1 = builder.gep(p_a0, [builder.mul(lda, ir.Constant(i64, TILE_ROWS))])
        p_b, p_c = _ptr(context, builder, sig.args[3], b, b_off), _ptr(context, builder, sig.args[7], c, c_off)
        stride = ir.Constant(i64, TILE_BYTES)
        c_tiles = [builder.gep(p_c, [ir.Constant(i64, t * TILE_ROWS * TILE_BYTES)]) for t in range(2 * num_b)]
        for t in range(2 * num_b):
            if is_fresh:
                _call(builder, "llvm.x86.tilezero", [i8], [ir.Constant(i8, t)])
            else:
                _call(builder, "llvm.x86.tileloadd64", [i8, ptr, i64], [ir.Constant(i8, t), c_tiles[t], stride])
        with cgutils.for_range(builder, num_k) as loop:
            k_off = builder.mul(loop.index, ir.Constant(i64, TILE_BYTES))
            for half, p_a in enumerate((p_a0, p_a1)):
                _call(builder, "llvm.x86.tileloadd64", [i8, ptr, i64],
                      [ir.Constant(i8, 4 + half), builder.gep(p_a, [k_off]), lda])
            b_ptr = builder.gep(p_b, [builder.mul(loop.index, b_step)])
            for j in range(num_b):
                b_tile = builder.gep(b_ptr, [ir.Constant(i64, j * TILE_ROWS * TILE_BYTES)])
                _call(builder, "llvm.x86.tileloadd64", [i8, ptr, i64], [ir.Constant(i8, 6 + j), b_tile, stride])
                for half in range(2):
                    operands = [ir.Constant(i8, 2 * j + half), ir.Constant(i8, 4 + half), ir.Constant(i8, 6 + j)]
                    _call(builder, "llvm.x86.tdpbf16ps", [i8, i8, i8], operands)
        for t in range(2 * num_b):
            _call(builder, "llvm.x86.tilestored64", [i8, ptr, i64], [ir.Constant(i8, t), c_tiles[t], stride])
        return context.get_dummy_value()
    return codegen


def _segment_intrinsic(num_b: int, is_fresh: bool):
    def typer(typingctx, a, a_off, lda, b, b_off, b_step, num_k, c, c_off):
        return types.void(a, a_off, lda, b, b_off, b_step, num_k, c, c_off), _segment_codegen(num_b, is_fresh)
    return intrinsic(typer)


_segment1_fresh, _segment2_fresh = _segment_intrinsic(1, True), _segment_intrinsic(2, True)
_segment1_more, _segment2_more = _segment_intrinsic(1, False), _segment_intrinsic(2, False)


@njit(fastmath=True, cache=True)
def _bf16_segment(a, a_off, lda, b, b_off, b_step, num_k, num_b, is_fresh, c, c_off):
    """`_segment_codegen` over num_b (1 or 2) column tiles."""
    if num_b == 2 and is_fresh:
        _segment2_fresh(a, a_off, lda, b, b_off, b_step, num_k, c, c_off)
    elif num_b == 2:
        _segment2_more(a, a_off, lda, b, b_off, b_step, num_k, c, c_off)
    elif is_fresh:
        _segment1_fresh(a, a_off, lda, b, b_off, b_step, num_k, c, c_off)
    else:
        _segment1_more(a, a_off, lda, b, b_off, b_step, num_k, c, c_off)


@njit(cache=True)
def _bf16_segment_reference(a, a_off, lda, b, b_off, b_step, num_k, num_b, is_fresh, c, c_off):
    """`_bf16_segment` in plain numba, element by element (uint16 arrays of bf16 bits, byte offsets): its oracle on
    CPUs without AMX-BF16."""
    fa, fb, fc = a.ravel(), b.ravel(), c.ravel()
    c0 = c_off // 4
    for t in range(2 * num_b):
        j, half = t // 2, t % 2
        for r in range(TILE_ROWS):
            row = (a_off + (half * TILE_ROWS + r) * lda) // 2
            for col in range(TILE_ROWS):
                at = c0 + t * TILE_ROWS * TILE_ROWS + r * TILE_ROWS + col
                s = np.float32(0.0) if is_fresh else fc[at]
                for kc in range(num_k):
                    b_tile = (b_off + kc * b_step + j * TILE_ROWS * TILE_BYTES) // 2
                    for k in range(STEP):  # B row k // 2 holds columns k & ~1, k | 1 of each token (a pair)
                        s += scale_value(fa[row + kc * STEP + k]) * scale_value(fb[b_tile + (k // 2) * STEP + col * 2
                                                                                   + k % 2])
                fc[at] = s


# ---- conversion and scaling (vector IR) ----------------------------------------------------------------------------

def _prefetch_line(builder, row, at, ahead):
    """A hint for the line `ahead` bytes past row[at] (i8*), once per 64 bytes of `at` (the steps read 16 or 32)."""
    i32 = ir.IntType(32)
    hint = [ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)]  # read, keep in all levels, data
    is_line = builder.icmp_unsigned("==", builder.and_(at, ir.Constant(at.type, 63)), ir.Constant(at.type, 0))
    with builder.if_then(is_line):
        ptr = builder.gep(row, [builder.add(at, ahead)])
        _call(builder, "llvm.prefetch.p0", [I8.as_pointer(), i32, i32, i32], [ptr, *hint])


@intrinsic
def _fp8_rows(typingctx, src, src_off, src_stride, dst, dst_off, dst_stride, num_rows, num_steps, ahead):
    """For each of num_rows rows r: dst[dst_off + r dst_stride:] (bytes) = bf16 bits of the num_steps * 32 e4m3
    codes at src[src_off + r src_stride:] (`prefill_amx_float._fp8_step`), prefetching each step's bytes `ahead`
    further."""
    def codegen(context, builder, sig, args):
        src_p = _ptr(context, builder, sig.args[0], args[0], args[1])
        dst_p = _ptr(context, builder, sig.args[3], args[3], args[4])
        with cgutils.for_range(builder, args[6]) as row:
            src_r = builder.gep(src_p, [builder.mul(row.index, args[2])])
            dst_r = builder.gep(dst_p, [builder.mul(row.index, args[5])])
            with cgutils.for_range(builder, args[7]) as loop:
                at = builder.mul(loop.index, ir.Constant(loop.index.type, STEP))
                _prefetch_line(builder, src_r, at, args[8])
                _store_bf16(builder, _fp8_step(builder, builder.gep(src_r, [at])), dst_r, builder.add(at, at))
        return context.get_dummy_value()
    sig = types.void(src, src_off, src_stride, dst, dst_off, dst_stride, num_rows, num_steps, ahead)
    return sig, codegen


@intrinsic
def _fp4_rows(typingctx, src, src_off, src_stride, scales, s_off, s_stride, col0, shift, table, dst, dst_off,
              dst_stride, num_rows, num_steps, ahead):
    """For each of num_rows rows r: dst[dst_off + r dst_stride:] (bytes) = bf16 bits of 2 * e2m1 value x
    table[scale byte] of the num_steps * 32 columns packed at src[src_off + r src_stride:] (bytes; the first is
    column col0 of the row), the scale byte of column j at scales[s_off + r s_stride + (j >> shift)]; prefetching
    the packed bytes `ahead` further. Nibbles decoded as the decode kernels do (`kernels_fp4_ir._decode_bytes`:
    `vpermps` on AVX-512, 4 instructions for 32 weights)."""
    def codegen(context, builder, sig, args):
        i64 = ir.IntType(64)
        src_p = _ptr(context, builder, sig.args[0], args[0], args[1])
        s_p = _ptr(context, builder, sig.args[3], args[3], args[4])
        table_p = builder.bitcast(context.make_array(sig.args[8])(context, builder, args[8]).data, F32.as_pointer())
        dst_p = _ptr(context, builder, sig.args[9], args[9], args[10])
        with cgutils.for_range(builder, args[12]) as row:
            src_r = builder.gep(src_p, [builder.mul(row.index, args[2])])
            s_r = builder.gep(s_p, [builder.mul(row.index, args[5])])
            dst_r = builder.gep(dst_p, [builder.mul(row.index, args[11])])
            with cgutils.for_range(builder, args[13]) as loop:
                at = builder.mul(loop.index, ir.Constant(i64, STEP // 2))
                _prefetch_line(builder, src_r, at, args[14])
                col = builder.add(args[6], builder.mul(loop.index, ir.Constant(i64, STEP)))
                factors = ir.Constant(ir.VectorType(F32, 2), None)
                for j in range(2):
                    index = builder.lshr(builder.add(col, ir.Constant(i64, j * STEP // 2)), args[7])
                    code = builder.zext(builder.load(builder.gep(s_r, [index])), i64)
                    factor = builder.load(builder.gep(table_p, [code]))
                    factors = builder.insert_element(factors, factor, ir.Constant(I32, j))
                # lane i of the decoded vectors: columns 2i (low nibbles) and 2i + 1 (high), so 0-7 are block 0's
                factors = builder.shuffle_vector(factors, factors, ir.Constant(V16I, [0] * 8 + [1] * 8))
                packed = builder.load(builder.bitcast(builder.gep(src_r, [at]), V16B.as_pointer()), align=1)
                low, high = _decode_bytes(_IR(context, builder), packed, mode)
                _store_bf16_pair(builder, builder.fmul(low, factors), builder.fmul(high, factors), dst_r,
                                 builder.mul(at, ir.Constant(i64, 4)))
        return context.get_dummy_value()
    mode = decode_mode()
    sig = types.void(src, src_off, src_stride, scales, s_off, s_stride, col0, shift, table, dst, dst_off, dst_stride,
                     num_rows, num_steps, ahead)
    return sig, codegen


def _store_bf16_pair(builder, even, odd, dst, at):
    """<16 x float> columns 2i and 2i + 1 holding bf16 values -> their 32 bits in column order at dst[at] (bytes):
    the high halves of both, interleaved by one word permute (`vpermt2w` on AVX-512)."""
    v32w = ir.VectorType(ir.IntType(16), 2 * TILE_ROWS)
    pick = [(2 * (j // 2) + 1) + (j % 2) * 2 * TILE_ROWS for j in range(STEP)]  # float j // 2 of even, then of odd
    bits = builder.shuffle_vector(builder.bitcast(even, v32w), builder.bitcast(odd, v32w),
                                  ir.Constant(ir.VectorType(I32, STEP), pick))
    builder.store(bits, builder.bitcast(builder.gep(dst, [at]), bits.type.as_pointer()), align=1)


@intrinsic
def _scale_add_tiles(typingctx, c, c_off, acc, acc_off, rs, num_tiles):
    """acc[acc_off + t 256 + r 16 + col] += c[c_off + ...] * rs[r + 16 (t % 2)] for the num_tiles C tiles t
    (float32 arrays, offsets in floats): tiles alternate A0 (rows 0-15 of rs), A1 (16-31)."""
    def codegen(context, builder, sig, args):
        i64, v16f = ir.IntType(64), ir.VectorType(F32, TILE_ROWS)

        def floats(k, offset):
            data = context.make_array(sig.args[k])(context, builder, args[k]).data
            return builder.gep(builder.bitcast(data, F32.as_pointer()), [offset])
        p_c, p_acc, p_rs = floats(0, args[1]), floats(2, args[3]), floats(4, ir.Constant(i64, 0))
        with cgutils.for_range(builder, args[5]) as loop:
            base = builder.mul(loop.index, ir.Constant(i64, TILE_ROWS * TILE_ROWS))
            s_base = builder.mul(builder.and_(loop.index, ir.Constant(i64, 1)), ir.Constant(i64, TILE_ROWS))
            for r in range(TILE_ROWS):
                at = builder.add(base, ir.Constant(i64, r * TILE_ROWS))
                s = builder.load(builder.gep(p_rs, [builder.add(s_base, ir.Constant(i64, r))]))
                one = builder.insert_element(ir.Constant(v16f, None), s, ir.Constant(I32, 0))
                splat = builder.shuffle_vector(one, ir.Constant(v16f, None), ir.Constant(V16I, [0] * TILE_ROWS))
                c_row = builder.bitcast(builder.gep(p_c, [at]), v16f.as_pointer())
                acc_row = builder.bitcast(builder.gep(p_acc, [at]), v16f.as_pointer())
                # contracted to one FMA (one rounding), as numba's fastmath loop of the first kernels was
                product = builder.fmul(builder.load(c_row, align=4), splat, flags=("contract",))
                total = builder.fadd(builder.load(acc_row, align=4), product, flags=("contract",))
                builder.store(total, acc_row, align=4)
        return context.get_dummy_value()
    return types.void(c, c_off, acc, acc_off, rs, num_tiles), codegen


# ---- a task's rows -----------------------------------------------------------------------------------------------

@njit(fastmath=True, cache=True)
def _convert_chunk(fmt, w, s, e, row0, k0, num_cols, is_folded, a, a_row0):
    """Columns k0 .. k0 + num_cols of rows row0 .. row0 + 15 of expert e -> bf16 rows a_row0 .. of a (uint16, row
    length CHUNK); FP4 codes times their folded factor (`prefill_amx_float` docstring) doubled back by the table."""
    num_bytes = w.shape[2]
    src = (e * w.shape[1] + row0) * num_bytes
    if fmt == FP8:
        _fp8_rows(w, src + k0, num_bytes, a, a_row0 * 2 * CHUNK, 2 * CHUNK, TILE_ROWS, num_cols // STEP,
                  PREFETCH_CHUNKS * CHUNK)
        return
    if fmt == NVFP4:
        table = NV_HALF
    elif is_folded:
        table = MX_HALF
    else:
        table = HALF
    _fp4_rows(w, src + k0 // 2, num_bytes, s, (e * s.shape[1] + row0) * s.shape[2], s.shape[2], k0,
              4 if fmt == NVFP4 else 5, table, a, a_row0 * 2 * CHUNK, 2 * CHUNK, TILE_ROWS, num_cols // STEP,
              PREFETCH_CHUNKS * CHUNK // 2)


@njit(fastmath=True, cache=True)
def _group_scales(fmt, s0, ts0, s1, ts1, e, row0, row1, g, is_folded, rs):
    """rs[0:16] (rows row0 .. of A0's arrays), rs[16:32] (rows row1 .. of A1's) = the scales of the rows' group-g
    sums: FP8's group scale, NVFP4's tensor scale, unfolded MXFP4's 2^(s - 127), folded MXFP4's 1."""
    for half in range(2):
        s, ts, first = (s0, ts0, row0) if half == 0 else (s1, ts1, row1)
        at = half * TILE_ROWS
        if fmt == FP8:
            for r in range(TILE_ROWS):
                rs[at + r] = np.float32(s[e, first + r, g])
        elif fmt == NVFP4 or is_folded:
            rs[at:at + TILE_ROWS] = ts[e] if fmt == NVFP4 else np.float32(1.0)
        else:
            for r in range(TILE_ROWS):
                rs[at + r] = MX_SCALE[np.int64(s[e, first + r, g])]


@njit(fastmath=True, cache=True)
def _rows_product(fmt, w0, s0, ts0, w1, s1, ts1, e, row0, row1, cols, size, is_folded, b, b_base, num_ct, a, cb,
                  acc, rs):
    """acc[q * 1024:(q + 1) * 1024] = the C tiles of pass q (column tiles 2q, 2q + 1 of b from byte b_base) of A0
    (rows row0 .. + 15 of w0) and A1 (rows row1 .. + 15 of w1) of expert e over `cols` columns, each scale group
    of `size` columns times its rows' scale (module docstring). a: the chunk (32 x CHUNK uint16), cb: the passes'
    C tiles, rs: 32 row scales."""
    num_pass = (num_ct + 1) // 2
    b_step = num_ct * TILE_ROWS * TILE_BYTES
    acc[:num_pass * C_FLOATS] = 0
    for k0 in range(0, cols, CHUNK):
        num_cols = min(CHUNK, cols - k0)
        _convert_chunk(fmt, w0, s0, e, row0, k0, num_cols, is_folded, a, 0)
        _convert_chunk(fmt, w1, s1, e, row1, k0, num_cols, is_folded, a, TILE_ROWS)
        k = k0
        while k < k0 + num_cols:  # segments: the chunk's parts of scale groups
            g = k // size
            end = min(k0 + num_cols, (g + 1) * size)
            is_last = end == min(cols, (g + 1) * size)
            if is_last:
                _group_scales(fmt, s0, ts0, s1, ts1, e, row0, row1, g, is_folded, rs)
            for q in range(num_pass):
                num_b = min(2, num_ct - 2 * q)
                b_off = b_base + 2 * q * TILE_ROWS * TILE_BYTES + k // STEP * b_step
                _bf16_segment(a, 2 * (k - k0), 2 * CHUNK, b, b_off, b_step, (end - k) // STEP, num_b, k == g * size,
                              cb, 4 * q * C_FLOATS)
                if is_last:
                    _scale_add_tiles(cb, q * C_FLOATS, acc, q * C_FLOATS, rs, 2 * num_b)
            k = end


@njit(fastmath=True, cache=True)
def _thread_buffers(scratch, floats, tid, num_pass):
    """This thread's chunk (uint16), num_pass passes' C tiles, accumulators and row scales (float32)."""
    f = floats[tid]
    end = 2 * num_pass * C_FLOATS
    return (scratch[tid, :2 * TILE_ROWS * CHUNK], f[:num_pass * C_FLOATS], f[num_pass * C_FLOATS:end],
            f[end:end + 2 * TILE_ROWS])


# ---- kernels -----------------------------------------------------------------------------------------------------
# Signatures as `prefill_amx_float.gate_up_bf16` / `down_bf16` (the launcher runs either pair): scratch [threads,
# >= 32 * CHUNK] uint16, floats [threads, >= 2 * passes * C_FLOATS + 32] float32 (passes: of the largest expert's
# column tiles, two a pass); `factors` is not used.

@njit(**FLAGS)
def gate_up_chunked(cfg, fmt, gate, gate_s, gate_ts, up, up_s, up_ts, group, experts, offsets, col_offsets, x_v,
                    scratch, floats, factors, epilogue, act):
    """act[p, i] = bf16(silu(gate[e, i] . x) * (up[e, i] . x)) (uint16 bits) for every pair p of expert e; tasks
    are (expert, 16 rows of I): A0 the gate rows, A1 the up rows."""
    rows, hidden = gate.shape[1], gate.shape[2] * (1 if fmt == FP8 else 2)
    num_rb = rows // TILE_ROWS
    max_pass = (floats.shape[1] - 2 * TILE_ROWS) // (2 * C_FLOATS)
    for task in prange(experts.shape[0] * num_rb):
        u, rb = task // num_rb, task % num_rb
        e, p0, m, r0 = experts[u], offsets[u], offsets[u + 1] - offsets[u], rb * TILE_ROWS
        num_ct = (col_offsets[u + 1] - col_offsets[u]) // TILE_ROWS
        a, cb, acc, rs = _thread_buffers(scratch, floats, numba.get_thread_id(), max_pass)
        is_folded = fmt == NVFP4 or (fmt == MXFP4 and _mx_foldable(gate_s, e, r0, TILE_ROWS)
                                     and _mx_foldable(up_s, e, r0, TILE_ROWS))
        size, _ = _task_groups(fmt, group, hidden, is_folded)
        _tile_begin(cfg)
        _rows_product(fmt, gate, gate_s, gate_ts, up, up_s, up_ts, e, r0, r0, hidden, size, is_folded, x_v,
                      2 * hidden * col_offsets[u], num_ct, a, cb, acc, rs)
        _tile_end()
        for q in range((num_ct + 1) // 2):
            _act_epilogue(acc[q * C_FLOATS:], min(2 * TILE_ROWS, m - 2 * q * TILE_ROWS), p0 + 2 * q * TILE_ROWS, e,
                          r0, epilogue, act)


@njit(**FLAGS)
def down_chunked(cfg, fmt, down, down_s, down_ts, group, experts, offsets, pair_token, pair_weight, col_offsets, a_v,
                 task_rows, scratch, floats, factors, out):
    """out[t, h] += w * (down[e, h] . act) for every pair; tasks own `task_rows` rows of H across all experts (no
    two threads write one element of `out`), 32 rows of an expert at a time (A0, A1: 16 each)."""
    hidden, rows = down.shape[1], down.shape[2] * (1 if fmt == FP8 else 2)
    max_pass = (floats.shape[1] - 2 * TILE_ROWS) // (2 * C_FLOATS)
    for task in prange(-(-hidden // task_rows)):
        a, cb, acc, rs = _thread_buffers(scratch, floats, numba.get_thread_id(), max_pass)
        _tile_begin(cfg)
        for u in range(experts.shape[0]):
            e, p0, m = experts[u], offsets[u], offsets[u + 1] - offsets[u]
            num_ct = (col_offsets[u + 1] - col_offsets[u]) // TILE_ROWS
            for h0 in range(task * task_rows, min(hidden, (task + 1) * task_rows), 2 * TILE_ROWS):
                is_folded = fmt == NVFP4 or (fmt == MXFP4 and _mx_foldable(down_s, e, h0, 2 * TILE_ROWS))
                size, _ = _task_groups(fmt, group, rows, is_folded)
                _rows_product(fmt, down, down_s, down_ts, down, down_s, down_ts, e, h0, h0 + TILE_ROWS, rows, size,
                              is_folded, a_v, 2 * rows * col_offsets[u], num_ct, a, cb, acc, rs)
                for q in range((num_ct + 1) // 2):
                    _down_epilogue(acc[q * C_FLOATS:], min(2 * TILE_ROWS, m - 2 * q * TILE_ROWS),
                                   p0 + 2 * q * TILE_ROWS, h0, pair_token, pair_weight, out)
        _tile_end()


def _recompiled(fn, overrides: dict, is_parallel: bool):
    env = {**fn.py_func.__globals__, **overrides}
    return njit(parallel=is_parallel, fastmath=True)(pytypes.FunctionType(fn.py_func.__code__, env, fn.__name__))


def kernels():
    """(gate_up_chunked, down_chunked): the pair `prefill_amx_float.AmxFloatBackend` runs."""
    return gate_up_chunked, down_chunked


def reference_kernels():
    """`kernels()` with the tile instructions replaced by `_bf16_segment_reference` (no AMX needed): conversion,
    chunking, group scaling and epilogues of this module, testable on any CPU."""
    product = _recompiled(_rows_product, {"_bf16_segment": _bf16_segment_reference}, False)
    env = {"_rows_product": product, "_tile_begin": _no_tile_begin, "_tile_end": _no_tile_end}
    return _recompiled(gate_up_chunked, env, True), _recompiled(down_chunked, env, True)
