"""Prefill of FP8, MXFP4 and NVFP4 experts on AMX-BF16: the grouped GEMM of `cpu_experts.prefill_amx_grouped` with
`tdpbf16ps` (C float32 [16, 16] += A bf16 [16, 32] . B bf16 [16, 32 as 16 pairs]) on weights converted to bf16.

Numerics (the float formats' contract, as the decode kernels `kernels_fp8` / `kernels_fp4` and
`reference.moe_reference(bf16_activations=True)`): every matmul input (the hidden rows, act = silu(gate) * up) is
rounded to bf16, weights are their exact stored values, products exact and sums float32. So:
- e4m3 codes and e2m1 codes are exact in bf16; FP8's group scale is not (e4m3 x float32 has up to 27 significant
  bits), so each group's C tiles are zeroed, accumulated over the group's steps of 32 columns, stored and added to
  float32 accumulators times the row's group scale (`_scale_add`; group 128: 4 steps).
- NVFP4: e2m1 x its e4m3 block scale (at most 6 significant bits, 2^-10 at least) is exact in bf16, so the block
  scale (group 16, half a step) is folded into the converted weights; the tensor scale multiplies the whole row's
  sum (one "group").
- MXFP4: e2m1 x 2^(s - 127) is folded too where every scale of the task's rows keeps the products normal and finite
  bf16 (s in [MX_FOLD_MIN, MX_FOLD_MAX]: all of a real checkpoint's); otherwise the task's rows are converted
  unscaled and each 32-column group (one step) is scaled as FP8's.
AMX-BF16 treats bf16 subnormal inputs as zero and flushes subnormal results: activations below 2^-126 (none in a
model's hidden states) count as zero here.

Operands (the tile layouts of `prefill_amx`, 64 bytes a tile row = 32 bf16 columns a step):
- A: a task's weight rows converted to bf16 in a per-thread scratch by vector IR (`_fp8_to_bf16`, `_fp4_to_bf16`).
- B: the call's bf16 activations in AMX's pair layout (row r of a tile = the 4-byte column pair r of 16 tokens),
  packed once per call (`prefill_amx.pack_vnni` on bf16 rows viewed as pairs).
All offsets handed to the tile functions are in bytes. `reference_kernels` replaces the tile instructions by
`_bf16_block_reference` (tests on CPUs without AMX). Needs H and every partition's I to be multiples of 32 and an
FP8 group that is a multiple of 32 (`is_supported`).
"""

from __future__ import annotations

import types as pytypes

import numba
import numpy as np
import torch
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from cpu_experts import formats
from cpu_experts.kernels import activation, bf16_bits, epilogues, scale_value
from cpu_experts.packed import PackedLayer
from cpu_experts.prefill import Workspace
from cpu_experts.prefill_amx import (
    TILE_BYTES,
    TILE_ROWS,
    _no_tile_begin,
    _no_tile_end,
    _ptr,
    _tile_begin,
    _tile_end,
    _tiles_codegen,
    has_amx,
    pack_vnni,
    tile_config,
)
from cpu_experts.prefill_int8 import COLUMN_TILE

FLAGS = dict(parallel=True, fastmath=True, nogil=True, cache=True)
STEP = TILE_BYTES // 2  # bf16 columns a tile step
FP8, MXFP4, NVFP4 = 0, 1, 2
FORMATS = {"fp8": FP8, "mxfp4": MXFP4, "nvfp4": NVFP4}
FP4_BLOCK = 16  # columns a converted FP4 factor covers (an NVFP4 group, half an MXFP4 one)
MX_FOLD_MIN, MX_FOLD_MAX = 2, 252  # E8M0 scales whose products with e2m1 (0.5 .. 6) are normal, finite bf16
# Factors of the doubled e2m1 codes (2 * value: small integers): NVFP4 the e4m3 block scale / 2, MXFP4 2^(s - 128)
NV_HALF = (formats.e4m3_to_float(torch.arange(256).to(torch.uint8)) / 2).numpy()
MX_HALF = np.exp2(np.arange(256, dtype=np.float64) - 128).astype(np.float32)
# 2^(s - 127), 2^-127 exact in float32; 255 (NaN) is never stored
MX_SCALE = np.exp2(np.minimum(np.arange(256, dtype=np.float64), 254) - 127).astype(np.float32)

I8, I16, I32, F32 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.FloatType()


def has_amx_bf16() -> bool:
    """AMX-BF16 in the CPU and LLVM, and the kernel's permission to use the tiles."""
    return has_amx("bf16")


def is_supported(layer: PackedLayer) -> bool:
    spec = layer.spec
    return (spec.dtype in FORMATS and spec.hidden_size % STEP == 0 and all(p.size % STEP == 0 for p in layer.partitions)
            and (spec.dtype != "fp8" or spec.group_size % STEP == 0))


# ---- tiles -------------------------------------------------------------------------------------------------------

@intrinsic
def _bf16_tiles1(typingctx, a0, a0_off, a1, a1_off, lda, b, b_off, b_step, num_k, c):
    """c[0:256] = A0 . B0, c[256:512] = A1 . B0 over num_k steps of 32 bf16 columns (float32 c)."""
    return types.void(a0, a0_off, a1, a1_off, lda, b, b_off, b_step, num_k, c), _tiles_codegen(1, op="tdpbf16ps")


@intrinsic
def _bf16_tiles2(typingctx, a0, a0_off, a1, a1_off, lda, b, b_off, b_step, num_k, c):
    """`_bf16_tiles1` and c[512:768] = A0 . B1, c[768:1024] = A1 . B1."""
    return types.void(a0, a0_off, a1, a1_off, lda, b, b_off, b_step, num_k, c), _tiles_codegen(2, op="tdpbf16ps")


@njit(fastmath=True, cache=True)
def _bf16_block(a0, a0_off, a1, a1_off, lda, b, b_off, b_step, num_k, num_b, c):
    """The micro-kernel (`prefill_amx._tiles_codegen`) with `tdpbf16ps` over num_b (1 or 2) column tiles."""
    if num_b == 2:
        _bf16_tiles2(a0, a0_off, a1, a1_off, lda, b, b_off, b_step, num_k, c)
    else:
        _bf16_tiles1(a0, a0_off, a1, a1_off, lda, b, b_off, b_step, num_k, c)


@njit(cache=True)
def _bf16_block_reference(a0, a0_off, a1, a1_off, lda, b, b_off, b_step, num_k, num_b, c):
    """`_bf16_block` in plain numba, element by element (uint16 arrays of bf16 bits, byte offsets): its oracle on
    CPUs without AMX-BF16."""
    fa0, fa1, fb = a0.ravel(), a1.ravel(), b.ravel()
    for t in range(num_b):
        for r in range(TILE_ROWS):
            row0, row1 = (a0_off + r * lda) // 2, (a1_off + r * lda) // 2
            for col in range(TILE_ROWS):
                s0, s1 = np.float32(0.0), np.float32(0.0)
                for kc in range(num_k):
                    b_tile = (b_off + kc * b_step + t * TILE_ROWS * TILE_BYTES) // 2
                    for k in range(STEP):  # B row k // 2 holds columns k & ~1, k | 1 of each token (a pair)
                        bv = scale_value(fb[b_tile + (k // 2) * STEP + col * 2 + k % 2])
                        s0 += scale_value(fa0[row0 + kc * STEP + k]) * bv
                        s1 += scale_value(fa1[row1 + kc * STEP + k]) * bv
                c[t * 512 + r * TILE_ROWS + col] = s0
                c[t * 512 + 256 + r * TILE_ROWS + col] = s1


# ---- weights to bf16 (vector IR, 32 columns a step) --------------------------------------------------------------

def _splat(builder, vector_type, value):
    return ir.Constant(vector_type, [value] * vector_type.count)


def _store_bf16(builder, values, dst, at):
    """<32 x float> holding bf16 values -> their bits (the high halves: exact) at dst[at] (bytes)."""
    v32i, v32s = ir.VectorType(I32, STEP), ir.VectorType(I16, STEP)
    bits = builder.trunc(builder.lshr(builder.bitcast(values, v32i), _splat(builder, v32i, 16)), v32s)
    builder.store(bits, builder.bitcast(builder.gep(dst, [at]), v32s.as_pointer()), align=1)


@intrinsic
def _fp8_to_bf16(typingctx, src, src_off, dst, dst_off, num_steps):
    """dst (bytes from dst_off) = bf16 bits of the num_steps * 32 e4m3 codes at src (bytes from src_off), exact:
    the e4m3 bits become a float16's (value / 256, subnormals included: `kernels_fp8`'s decoding), widened and
    times 256."""
    def codegen(context, builder, sig, args):
        v32b, v32w = ir.VectorType(I8, STEP), ir.VectorType(I16, STEP)
        v32h, v32f = ir.VectorType(ir.HalfType(), STEP), ir.VectorType(F32, STEP)
        src_p = _ptr(context, builder, sig.args[0], args[0], args[1])
        dst_p = _ptr(context, builder, sig.args[2], args[2], args[3])
        with cgutils.for_range(builder, args[4]) as loop:
            at = builder.mul(loop.index, ir.Constant(loop.index.type, STEP))
            codes = builder.load(builder.bitcast(builder.gep(src_p, [at]), v32b.as_pointer()), align=1)
            words = builder.shl(builder.sext(codes, v32w), _splat(builder, v32w, 7))
            words = builder.and_(words, _splat(builder, v32w, 0xBFFF))
            values = builder.fmul(builder.fpext(builder.bitcast(words, v32h), v32f), _splat(builder, v32f, 256.0))
            _store_bf16(builder, values, dst_p, builder.add(at, at))
        return context.get_dummy_value()
    return types.void(src, src_off, dst, dst_off, num_steps), codegen


def _doubled_e2m1(builder, codes):
    """<32 x i8> e2m1 codes 0..15 -> <32 x float> twice their values (m = code & 7: m for m < 2, else
    (2 + (m & 1)) << ((m >> 1) - 1); bit 3 the sign)."""
    v32i = ir.VectorType(I32, STEP)
    code = builder.zext(codes, v32i)

    def splat(v):
        return _splat(builder, v32i, v)
    m = builder.and_(code, splat(7))
    normal = builder.shl(builder.or_(builder.and_(m, splat(1)), splat(2)), builder.sub(builder.lshr(m, splat(1)),
                                                                                          splat(1)))
    magnitude = builder.select(builder.icmp_unsigned("<", m, splat(2)), m, normal)
    signed = builder.select(builder.icmp_unsigned(">=", code, splat(8)), builder.sub(splat(0), magnitude), magnitude)
    return builder.sitofp(signed, ir.VectorType(F32, STEP))


@intrinsic
def _fp4_to_bf16(typingctx, src, src_off, dst, dst_off, factors, num_steps):
    """dst (bytes from dst_off) = bf16 bits of 2 * e2m1 value x factors[j // 16] for the num_steps * 32 columns j
    packed at src (bytes from src_off; even column in the low nibble), in column order; exact where the products
    are normal bf16 (the callers' factors see to it)."""
    def codegen(context, builder, sig, args):
        v16b = ir.VectorType(I8, STEP // 2)
        src_p = _ptr(context, builder, sig.args[0], args[0], args[1])
        dst_p = _ptr(context, builder, sig.args[2], args[2], args[3])
        fac_p = builder.bitcast(context.make_array(sig.args[4])(context, builder, args[4]).data, F32.as_pointer())
        interleave = ir.Constant(ir.VectorType(I32, STEP), [j // 2 + (j % 2) * 16 for j in range(STEP)])
        halves = ir.Constant(ir.VectorType(I32, STEP), [j // FP4_BLOCK for j in range(STEP)])
        with cgutils.for_range(builder, args[5]) as loop:
            at = builder.mul(loop.index, ir.Constant(loop.index.type, STEP // 2))
            packed = builder.load(builder.bitcast(builder.gep(src_p, [at]), v16b.as_pointer()), align=1)
            low = builder.and_(packed, _splat(builder, v16b, 15))
            high = builder.lshr(packed, _splat(builder, v16b, 4))
            doubled = _doubled_e2m1(builder, builder.shuffle_vector(low, high, interleave))
            first = builder.add(loop.index, loop.index)
            pair = ir.Constant(ir.VectorType(F32, 2), None)
            for j in range(2):
                index = builder.add(first, ir.Constant(first.type, j))
                pair = builder.insert_element(pair, builder.load(builder.gep(fac_p, [index])), ir.Constant(I32, j))
            factor = builder.shuffle_vector(pair, pair, halves)
            _store_bf16(builder, builder.fmul(doubled, factor), dst_p, builder.mul(at, ir.Constant(at.type, 4)))
        return context.get_dummy_value()
    return types.void(src, src_off, dst, dst_off, factors, num_steps), codegen


# ---- a task's rows and their group scales ------------------------------------------------------------------------

@njit(fastmath=True, cache=True)
def _mx_foldable(s, e, r0, num_rows):
    """Whether every E8M0 scale of rows r0.. of expert e folds into bf16 weights (module docstring)."""
    for n in range(r0, r0 + num_rows):
        for g in range(s.shape[2]):
            v = np.int64(s[e, n, g])
            if v < MX_FOLD_MIN or v > MX_FOLD_MAX:
                return False
    return True


@njit(fastmath=True, cache=True)
def _task_groups(fmt, group, cols, is_folded):
    """(columns, number) of the groups whose C tiles are scaled apart: FP8's groups, MXFP4's unfolded ones, else
    the whole row."""
    if fmt == FP8:
        size = group
    elif fmt == MXFP4 and not is_folded:
        size = STEP
    else:
        size = cols
    return size, -(-cols // size)


@njit(fastmath=True, cache=True)
def _fp4_factors(s, e, n, fmt, is_folded, out):
    """out[b]: the factor of the doubled codes of columns 16 b .. 16 b + 15 of row n of expert e."""
    for b in range(out.shape[0]):
        if fmt == NVFP4:
            out[b] = NV_HALF[np.int64(s[e, n, b])]
        elif is_folded:
            out[b] = MX_HALF[np.int64(s[e, n, b // 2])]
        else:
            out[b] = np.float32(0.5)


@njit(fastmath=True, cache=True)
def _convert_rows(fmt, w, s, ts, e, r0, num_rows, cols, is_folded, a, a_row0, rs, num_gs, factors):
    """Rows r0 .. r0 + num_rows of expert e (`cols` columns) -> bf16 rows a_row0 .. of `a` (uint16, row length
    cols); rs[(a_row0 + r) * num_gs + g] = the scale of their group g's sums."""
    num_bytes = w.shape[2]
    for r in range(num_rows):
        n = r0 + r
        src, dst, at = (e * w.shape[1] + n) * num_bytes, (a_row0 + r) * cols * 2, (a_row0 + r) * num_gs
        if fmt == FP8:
            _fp8_to_bf16(w, src, a, dst, cols // STEP)
            for g in range(num_gs):
                rs[at + g] = np.float32(s[e, n, g])
            continue
        _fp4_factors(s, e, n, fmt, is_folded, factors[:cols // FP4_BLOCK])
        _fp4_to_bf16(w, src, a, dst, factors, cols // STEP)
        if fmt == NVFP4:
            rs[at] = ts[e]
        elif is_folded:
            rs[at] = np.float32(1.0)
        else:
            for g in range(num_gs):
                rs[at + g] = MX_SCALE[np.int64(s[e, n, g])]


@njit(fastmath=True, cache=True)
def _scale_add(c, acc, num_b, rs, num_gs, g):
    """acc += C with each tile row times its group-g scale: tiles alternate A0 (rows 0-15 of rs), A1 (16-31)."""
    for t in range(2 * num_b):
        base = t * TILE_ROWS * TILE_ROWS
        for r in range(TILE_ROWS):
            s = rs[(r + (t % 2) * TILE_ROWS) * num_gs + g]
            at = base + r * TILE_ROWS
            for col in range(TILE_ROWS):
                acc[at + col] += c[at + col] * s


@njit(fastmath=True, cache=True)
def _act_epilogue(acc, num_cols, p_first, e, i0, epilogue, act):
    """act[p, i0:i0 + 16] = bf16(silu(gate) * up) (`kernels.activation`) for the pass's columns that are pairs."""
    for j in range(num_cols):
        p = p_first + j
        at = (j // TILE_ROWS) * 512 + j % TILE_ROWS
        for r in range(TILE_ROWS):
            act[p, i0 + r] = bf16_bits(activation(acc[at + r * TILE_ROWS], acc[at + 256 + r * TILE_ROWS], epilogue, e,
                                                  i0 + r, True))


@njit(fastmath=True, cache=True)
def _down_epilogue(acc, num_cols, p_first, h0, pair_token, pair_weight, out):
    for j in range(num_cols):
        p = p_first + j
        o = out[pair_token[p]]
        w = pair_weight[p]
        at = (j // TILE_ROWS) * 512 + j % TILE_ROWS
        for r in range(2 * TILE_ROWS):  # A0 then A1: rows h0 .. h0 + 31
            o[h0 + r] += w * acc[at + r * TILE_ROWS]


# ---- kernels -----------------------------------------------------------------------------------------------------
# The tile calls sit in the kernels' own bodies, not in helpers: `replace_tiles` swaps the kernels' globals only.

@njit(**FLAGS)
def gate_up_bf16(cfg, fmt, gate, gate_s, gate_ts, up, up_s, up_ts, group, experts, offsets, col_offsets, x_v,
                 scratch, row_scales, factors, epilogue, act):
    """act[p, i] = bf16(silu(gate[e, i] . x) * (up[e, i] . x)) (uint16 bits) for every pair p of expert e; tasks
    are (expert, 16 rows of I); per thread, `scratch` holds the task's gate and up rows in bf16, `row_scales` their
    group scales, `factors` a row's FP4 factors."""
    rows, hidden = gate.shape[1], gate.shape[2] * (1 if fmt == FP8 else 2)
    num_rb = rows // TILE_ROWS
    for task in prange(experts.shape[0] * num_rb):
        u, rb = task // num_rb, task % num_rb
        e, p0, m, r0 = experts[u], offsets[u], offsets[u + 1] - offsets[u], rb * TILE_ROWS
        num_ct = (col_offsets[u + 1] - col_offsets[u]) // TILE_ROWS
        tid = numba.get_thread_id()
        a, rs, fb = scratch[tid], row_scales[tid], factors[tid]
        is_folded = fmt == NVFP4 or (fmt == MXFP4 and _mx_foldable(gate_s, e, r0, TILE_ROWS)
                                     and _mx_foldable(up_s, e, r0, TILE_ROWS))
        size, num_gs = _task_groups(fmt, group, hidden, is_folded)
        _convert_rows(fmt, gate, gate_s, gate_ts, e, r0, TILE_ROWS, hidden, is_folded, a, 0, rs, num_gs, fb)
        _convert_rows(fmt, up, up_s, up_ts, e, r0, TILE_ROWS, hidden, is_folded, a, TILE_ROWS, rs, num_gs, fb)
        c = np.empty(4 * TILE_ROWS * TILE_ROWS, dtype=np.float32)
        acc = np.empty(4 * TILE_ROWS * TILE_ROWS, dtype=np.float32)
        b_step = num_ct * TILE_ROWS * TILE_BYTES
        _tile_begin(cfg)
        for ct in range(0, num_ct, 2):
            num_b = min(2, num_ct - ct)
            b_off = 2 * hidden * col_offsets[u] + ct * TILE_ROWS * TILE_BYTES
            acc[:] = 0
            for g in range(num_gs):
                k0 = g * size
                num_k = min(size, hidden - k0) // STEP
                _bf16_block(a, 2 * k0, a, 2 * (TILE_ROWS * hidden + k0), 2 * hidden, x_v, b_off + k0 // STEP * b_step,
                            b_step, num_k, num_b, c)
                _scale_add(c, acc, num_b, rs, num_gs, g)
            _act_epilogue(acc, min(num_b * TILE_ROWS, m - ct * TILE_ROWS), p0 + ct * TILE_ROWS, e, r0, epilogue, act)
        _tile_end()


@njit(**FLAGS)
def down_bf16(cfg, fmt, down, down_s, down_ts, group, experts, offsets, pair_token, pair_weight, col_offsets, a_v,
              task_rows, scratch, row_scales, factors, out):
    """out[t, h] += w * (down[e, h] . act) for every pair; tasks own `task_rows` rows of H across all experts (no
    two threads write one element of `out`), converting 32 rows of an expert at a time."""
    hidden, rows = down.shape[1], down.shape[2] * (1 if fmt == FP8 else 2)
    for task in prange(-(-hidden // task_rows)):
        tid = numba.get_thread_id()
        a, rs, fb = scratch[tid], row_scales[tid], factors[tid]
        c = np.empty(4 * TILE_ROWS * TILE_ROWS, dtype=np.float32)
        acc = np.empty(4 * TILE_ROWS * TILE_ROWS, dtype=np.float32)
        _tile_begin(cfg)
        for u in range(experts.shape[0]):
            e, p0, m = experts[u], offsets[u], offsets[u + 1] - offsets[u]
            num_ct = (col_offsets[u + 1] - col_offsets[u]) // TILE_ROWS
            b_step = num_ct * TILE_ROWS * TILE_BYTES
            for h0 in range(task * task_rows, min(hidden, (task + 1) * task_rows), 2 * TILE_ROWS):
                is_folded = fmt == NVFP4 or (fmt == MXFP4 and _mx_foldable(down_s, e, h0, 2 * TILE_ROWS))
                size, num_gs = _task_groups(fmt, group, rows, is_folded)
                _convert_rows(fmt, down, down_s, down_ts, e, h0, 2 * TILE_ROWS, rows, is_folded, a, 0, rs, num_gs, fb)
                for ct in range(0, num_ct, 2):
                    num_b = min(2, num_ct - ct)
                    b_off = 2 * rows * col_offsets[u] + ct * TILE_ROWS * TILE_BYTES
                    acc[:] = 0
                    for g in range(num_gs):
                        k0 = g * size
                        _bf16_block(a, 2 * k0, a, 2 * (TILE_ROWS * rows + k0), 2 * rows, a_v,
                                    b_off + k0 // STEP * b_step, b_step, min(size, rows - k0) // STEP, num_b, c)
                        _scale_add(c, acc, num_b, rs, num_gs, g)
                    _down_epilogue(acc, min(num_b * TILE_ROWS, m - ct * TILE_ROWS), p0 + ct * TILE_ROWS, h0,
                                   pair_token, pair_weight, out)
        _tile_end()


def replace_tiles(kernel):
    """`kernel` recompiled with the tile instructions replaced by `_bf16_block_reference` (no AMX needed)."""
    env = {**kernel.py_func.__globals__, "_bf16_block": _bf16_block_reference, "_tile_begin": _no_tile_begin,
           "_tile_end": _no_tile_end}
    return njit(parallel=True, fastmath=True)(pytypes.FunctionType(kernel.py_func.__code__, env, kernel.__name__))


def reference_kernels():
    """(gate_up_bf16, down_bf16) with the tile instructions replaced by their plain-numba reference: conversion,
    packing, group scaling and epilogues of this module, testable on any CPU."""
    return replace_tiles(gate_up_bf16), replace_tiles(down_bf16)


# ---- the launcher ------------------------------------------------------------------------------------------------

def _check_layer(layer: PackedLayer) -> None:
    """The array shapes and dtypes the kernels index without bounds checks (a mismatch would read out of bounds)."""
    spec = layer.spec
    per_byte = 1 if spec.dtype == "fp8" else 2
    scale_dtype = np.float32 if spec.dtype == "fp8" else np.uint8
    for p in layer.partitions:
        for role, (n, k) in (("gate", (p.size, spec.hidden_size)), ("up", (p.size, spec.hidden_size)),
                             ("down", (spec.hidden_size, p.size))):
            w, s, ts = getattr(p, role), getattr(p, f"{role}_scales"), getattr(p, f"{role}_tensor_scale")
            want = [((spec.num_experts, n, k // per_byte), np.uint8, w),
                    ((spec.num_experts, n, -(-k // spec.group(k))), scale_dtype, s)]
            if spec.dtype == "nvfp4":
                want.append(((spec.num_experts,), np.float32, ts))
            for shape, dtype, array in want:
                if array is None or array.shape != shape or array.dtype != dtype or not array.flags.c_contiguous:
                    got = None if array is None else (array.shape, array.dtype)
                    raise ValueError(f"{role} of partition [{p.start}, {p.end}): expected a C-contiguous {shape} "
                                     f"{np.dtype(dtype)} array, got {got}")


def _check_call(x: np.ndarray, routing, num_experts: int, hidden: int) -> None:
    r = routing
    if x.dtype != np.float32 or x.ndim != 2 or x.shape[1] != hidden or not x.flags.c_contiguous:
        raise ValueError(f"x must be C-contiguous float32 [T, {hidden}], got {x.dtype} {x.shape}")
    arrays = (r.experts, r.offsets, r.pair_token)
    if any(a.dtype != np.int64 for a in arrays) or r.pair_weight.dtype != np.float32:
        raise ValueError("routing arrays must be int64 (experts, offsets, pair_token) and float32 (pair_weight)")
    if (len(r.offsets) != len(r.experts) + 1 or r.offsets[0] != 0 or r.offsets[-1] != len(r.pair_token)
            or len(r.pair_weight) != len(r.pair_token) or np.any(np.diff(r.offsets) < 1)):
        raise ValueError("routing offsets must run from 0 to the number of pairs, at least one pair per expert")
    if len(r.pair_token) and (r.pair_token.min() < 0 or r.pair_token.max() >= x.shape[0]):
        raise ValueError(f"routing pair_token outside [0, {x.shape[0]})")
    if len(r.experts) and (r.experts.min() < 0 or r.experts.max() >= num_experts):
        raise ValueError(f"routing experts outside [0, {num_experts})")


class FloatAmxPrefill:
    """The bf16 AMX prefill of the module docstring over a `Workspace`; `kernels` (tests): see
    `reference_kernels`. Every call's inputs are checked first: the kernels index without bounds checks."""

    def __init__(self, layer: PackedLayer, workspace: Workspace, kernels=None):
        if not is_supported(layer):
            raise ValueError(f"FloatAmxPrefill needs fp8, mxfp4 or nvfp4 experts with H and each partition's I "
                             f"multiples of {STEP} and an fp8 group size that is a multiple of {STEP}")
        _check_layer(layer)
        self.layer = layer
        self.spec = layer.spec
        self.fmt = FORMATS[self.spec.dtype]
        self.ws = workspace
        self.cfg = tile_config()
        self.gate_up, self.down = kernels or (gate_up_bf16, down_bf16)
        self.ones = np.ones(self.spec.num_experts, dtype=np.float32)  # the tensor scale of the formats without
        self.epilogues = epilogues(layer)

    def _tensor_scale(self, part, role: str) -> np.ndarray:
        ts = getattr(part, f"{role}_tensor_scale")
        return self.ones if ts is None else ts

    def __call__(self, x: np.ndarray, routing) -> np.ndarray:
        ws, r, spec = self.ws, routing, self.spec
        _check_call(x, r, spec.num_experts, spec.hidden_size)
        num_tokens, hidden = x.shape
        num_pairs = len(r.pair_token)
        col_offsets = np.zeros(len(r.experts) + 1, dtype=np.int64)
        np.cumsum(-(-np.diff(r.offsets) // COLUMN_TILE) * COLUMN_TILE, out=col_offsets[1:])
        num_cols = int(col_offsets[-1])
        x_bf16 = ws.tensor("x_bf16", x.shape, torch.bfloat16)
        x_bf16.copy_(torch.from_numpy(x))  # rounded to nearest even
        x_v = ws.array("x_v", (hidden // 2 * num_cols,), np.int32)
        pack_vnni(x_bf16.view(torch.int32).numpy(), r.pair_token, r.offsets, col_offsets, x_v)
        num_threads = numba.get_num_threads()
        width = max(hidden, *(p.size for p in self.layer.partitions))
        scratch = ws.array("a_bf16", (num_threads, 2 * TILE_ROWS * width), np.uint16)
        row_scales = ws.array("a_scales", (num_threads, 2 * TILE_ROWS * (width // STEP)), np.float32)
        factors = ws.array("a_factors", (num_threads, width // FP4_BLOCK), np.float32)
        task_rows = 2 * TILE_ROWS * -(-(hidden // (2 * TILE_ROWS)) // num_threads)  # one down task per thread
        pair_rows = np.arange(num_pairs, dtype=np.int64)
        group = spec.group_size
        out = np.zeros(x.shape, dtype=np.float32)
        for part, epilogue in zip(self.layer.partitions, self.epilogues, strict=True):
            act = ws.array("act_bf16", (num_pairs, part.size), np.uint16)
            self.gate_up(self.cfg, self.fmt, part.gate, part.gate_scales, self._tensor_scale(part, "gate"), part.up,
                         part.up_scales, self._tensor_scale(part, "up"), group, r.experts, r.offsets, col_offsets,
                         x_v.view(np.uint16), scratch, row_scales, factors, epilogue, act)
            a_v = ws.array("a_v", (part.size // 2 * num_cols,), np.int32)
            pack_vnni(act.view(np.int32), pair_rows, r.offsets, col_offsets, a_v)
            self.down(self.cfg, self.fmt, part.down, part.down_scales, self._tensor_scale(part, "down"), group,
                      r.experts, r.offsets, r.pair_token, r.pair_weight, col_offsets, a_v.view(np.uint16), task_rows,
                      scratch, row_scales, factors, out)
        return out
