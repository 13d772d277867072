"""Prefill of per-channel int8 experts on AMX (Intel Sapphire Rapids and later): our own grouped int8 GEMM over the
experts' stored layout, through LLVM's AMX intrinsics from numba; the backend `AmxInt8Backend` of the one prefill
driver (`cpu_experts.prefill.Prefill`).

Why not oneDNN (`cpu_experts.prefill_int8`, the path CPUs without AMX take): one `_int_mm` call per expert and
projection, each with its own thread fork/join and a reorder of its right operand, spent more time around the
multiplications than in them. Here one parallel loop covers every expert of a projection.

Operands (an AMX tile is 16 rows of 64 bytes; `tdpbssd` C[16, 16] int32 += A[16, 64] int8 . B[16, 64] int8):
- A: 16 weight rows x 64 columns, loaded in place from the [E, N, K] weights (row stride K): nothing is repacked.
- B: 16 tokens x 64 columns in the VNNI layout AMX wants (row r = 4-byte words r of the 16 tokens): the call's
  activations (and each partition's act) are packed (`int8_operand`, `pack_vnni`): expert u's block holds its n_u
  columns (pairs, padded to 16) as [K / 64][n_u / 16][16][16] int32 words, starting at word K / 4 * col_offsets[u].
- C: 16 weight rows x 16 tokens, stored to a scratch and finished by numba epilogues (scales, SiLU, combine).

The micro-kernel (`_tiles`) runs two weight row blocks A0, A1 against one or two column tiles B0, B1 over all of
K: C0 = A0 B0, C1 = A1 B0, C2 = A0 B1, C3 = A1 B1 (8 tile registers). Gate/up: A0 = gate rows, A1 = up rows of the
same 16 outputs; down: A0, A1 = two consecutive 16-row blocks of H, tasks own blocks of H (no write conflicts).

Needs K and every partition's I to be multiples of 64 (all the supported models); `is_supported` says so.
Linux grants a process AMX state only on request (`arch_prctl(ARCH_REQ_XCOMP_PERM)`), which `has_amx` makes.
"""

from __future__ import annotations

import ctypes
import functools
import sys
import types as pytypes

import llvmlite.binding as llvm
import numba
import numpy as np
import torch
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from cpu_experts.kernels import activation
from cpu_experts.packed import PackedLayer, PartitionWeights
from cpu_experts.prefill import PrefillCall, float32_rows
from cpu_experts.prefill_int8 import quantize_rows

FLAGS = dict(parallel=True, fastmath=True, nogil=True, cache=True)
TILE_ROWS, TILE_BYTES = 16, 64
# Bytes ahead along K that the weight rows of the A tiles are prefetched: when an expert has one column tile of
# tokens (DeepSeek-V3 at 512 tokens) every A tile comes from DRAM once, as 16 short row streams per tile, more than
# the hardware prefetchers follow.
A_PREFETCH_BYTES = 512
_ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA, _SYS_ARCH_PRCTL = 0x1023, 18, 158


def has_amx(kind: str = "int8") -> bool:
    """AMX-INT8 (`kind` "bf16": AMX-BF16) in the CPU and LLVM, and the kernel's permission to use it."""
    features = llvm.get_host_cpu_features()
    return bool(features.get("amx-tile") and features.get(f"amx-{kind}")) and _has_tile_permission()


@functools.cache
def _has_tile_permission() -> bool:
    """Linux's permission for this process to use the AMX tile state (asked for here, once)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA) == 0
    except (OSError, AttributeError):
        return False


def is_supported(layer: PackedLayer) -> bool:
    spec = layer.spec
    return (spec.dtype == "int8" and spec.group_size == 0 and spec.hidden_size % TILE_BYTES == 0
            and all(p.size % TILE_BYTES == 0 for p in layer.partitions))


def tile_config(k_bytes: int = TILE_BYTES) -> np.ndarray:
    """The 64-byte `ldtilecfg` operand: palette 1, all 8 tiles 16 rows x 64 bytes; with `k_bytes` 32 (half steps
    along K: `prefill_amx_grouped`'s group 32), the A tiles (4, 5) 16 rows x 32 bytes and the B tiles (6, 7) 8 rows
    x 64 bytes (K / 4 rows of 16 tokens' 4-byte words), the C tiles unchanged."""
    cfg = np.zeros(64, dtype=np.uint8)
    cfg[0] = 1
    colsb, rows = cfg[16:32].view(np.uint16), cfg[48:64]
    colsb[:8] = TILE_BYTES
    rows[:8] = TILE_ROWS
    colsb[4:6] = k_bytes
    rows[6:8] = k_bytes // 4
    return cfg


# ---- LLVM intrinsics -------------------------------------------------------------------------------------------

def _call(builder, name, arg_types, args):
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), arg_types), name)
    builder.call(fn, args)


def _ptr(context, builder, ty, val, offset=None):
    data = builder.bitcast(context.make_array(ty)(context, builder, val).data, ir.IntType(8).as_pointer())
    return data if offset is None else builder.gep(data, [offset])


@intrinsic
def _tile_begin(typingctx, cfg):
    def codegen(context, builder, sig, args):
        _call(builder, "llvm.x86.ldtilecfg", [ir.IntType(8).as_pointer()], [_ptr(context, builder, sig.args[0],
                                                                                  args[0])])
        return context.get_dummy_value()
    return types.void(cfg), codegen


@intrinsic
def _tile_end(typingctx):
    def codegen(context, builder, sig, args):
        _call(builder, "llvm.x86.tilerelease", [], [])
        return context.get_dummy_value()
    return types.void(), codegen


def _prefetch_rows(builder, p_a0, p_a1, lda, k_off):
    """Prefetch hints for the 16 rows of A0 and A1, A_PREFETCH_BYTES past this k-step (past a row's end they
    touch the next row, harmless)."""
    i32, i64, ptr = ir.IntType(32), ir.IntType(64), ir.IntType(8).as_pointer()
    ahead = builder.add(k_off, ir.Constant(i64, A_PREFETCH_BYTES))
    hint = [ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)]  # read, keep in all levels, data
    for base in (p_a0, p_a1):
        for r in range(TILE_ROWS):
            at = builder.gep(base, [builder.add(builder.mul(lda, ir.Constant(i64, r)), ahead)])
            _call(builder, "llvm.prefetch.p0", [ptr, i32, i32, i32], [at, *hint])


def _tiles_codegen(num_b: int, is_prefetch: bool = False, k_bytes: int = TILE_BYTES, op: str = "tdpbssd"):
    """`k_bytes` per step along K: 64, or 32 under `tile_config(32)` (B's half step: its tile's first or last 8
    rows, which the caller's b_off picks); `op` the tile product (`tdpbf16ps`: `prefill_amx_float`)."""
    def codegen(context, builder, sig, args):
        (a0, a0_off, a1, a1_off, lda, b, b_off, b_step, num_k, c) = args
        ty = sig.args
        i8, i64, ptr = ir.IntType(8), ir.IntType(64), ir.IntType(8).as_pointer()
        p_a0, p_a1 = _ptr(context, builder, ty[0], a0, a0_off), _ptr(context, builder, ty[2], a1, a1_off)
        p_b, p_c = _ptr(context, builder, ty[5], b, b_off), _ptr(context, builder, ty[9], c)
        tile = functools.partial(ir.Constant, i8)
        stride = ir.Constant(i64, TILE_BYTES)
        for t in range(2 * num_b):
            _call(builder, "llvm.x86.tilezero", [i8], [tile(t)])
        with cgutils.for_range(builder, num_k) as loop:
            k_off = builder.mul(loop.index, ir.Constant(i64, k_bytes))
            if is_prefetch:
                _prefetch_rows(builder, p_a0, p_a1, lda, k_off)
            _call(builder, "llvm.x86.tileloadd64", [i8, ptr, i64], [tile(4), builder.gep(p_a0, [k_off]), lda])
            _call(builder, "llvm.x86.tileloadd64", [i8, ptr, i64], [tile(5), builder.gep(p_a1, [k_off]), lda])
            b_ptr = builder.gep(p_b, [builder.mul(loop.index, b_step)])
            for j in range(num_b):
                b_tile = builder.gep(b_ptr, [ir.Constant(i64, j * TILE_ROWS * TILE_BYTES)])
                _call(builder, "llvm.x86.tileloadd64", [i8, ptr, i64], [tile(6 + j), b_tile, stride])
                _call(builder, f"llvm.x86.{op}", [i8, i8, i8], [tile(2 * j), tile(4), tile(6 + j)])
                _call(builder, f"llvm.x86.{op}", [i8, i8, i8], [tile(2 * j + 1), tile(5), tile(6 + j)])
        for t in range(2 * num_b):
            out = builder.gep(p_c, [ir.Constant(i64, t * TILE_ROWS * TILE_BYTES)])
            _call(builder, "llvm.x86.tilestored64", [i8, ptr, i64], [tile(t), out, stride])
        return context.get_dummy_value()
    return codegen


@intrinsic
def _tiles1(typingctx, a0, a0_off, a1, a1_off, lda, b, b_off, b_step, num_k, c):
    """c[0:256] = A0 . B0, c[256:512] = A1 . B0 over num_k steps of 64 columns (byte offsets, int32 c)."""
    return types.void(a0, a0_off, a1, a1_off, lda, b, b_off, b_step, num_k, c), _tiles_codegen(1)


@intrinsic
def _tiles2(typingctx, a0, a0_off, a1, a1_off, lda, b, b_off, b_step, num_k, c):
    """`_tiles1` and c[512:768] = A0 . B1, c[768:1024] = A1 . B1 (B1: the tile after B0)."""
    return types.void(a0, a0_off, a1, a1_off, lda, b, b_off, b_step, num_k, c), _tiles_codegen(2)


@intrinsic
def _tiles1_prefetch(typingctx, a0, a0_off, a1, a1_off, lda, b, b_off, b_step, num_k, c):
    """`_tiles1`, prefetching A's rows ahead (their first pass, from DRAM)."""
    return types.void(a0, a0_off, a1, a1_off, lda, b, b_off, b_step, num_k, c), _tiles_codegen(1, True)


@intrinsic
def _tiles2_prefetch(typingctx, a0, a0_off, a1, a1_off, lda, b, b_off, b_step, num_k, c):
    """`_tiles2`, prefetching A's rows ahead (their first pass, from DRAM)."""
    return types.void(a0, a0_off, a1, a1_off, lda, b, b_off, b_step, num_k, c), _tiles_codegen(2, True)


@intrinsic
def _half_tiles1(typingctx, a0, a0_off, a1, a1_off, lda, b, b_off, b_step, num_k, c):
    """`_tiles1` over num_k steps of 32 columns (`tile_config(32)`)."""
    return types.void(a0, a0_off, a1, a1_off, lda, b, b_off, b_step, num_k, c), _tiles_codegen(1, k_bytes=32)


@intrinsic
def _half_tiles2(typingctx, a0, a0_off, a1, a1_off, lda, b, b_off, b_step, num_k, c):
    """`_tiles2` over num_k steps of 32 columns (`tile_config(32)`)."""
    return types.void(a0, a0_off, a1, a1_off, lda, b, b_off, b_step, num_k, c), _tiles_codegen(2, k_bytes=32)


@njit(fastmath=True, cache=True)
def _half_block(a0, a0_off, a1, a1_off, lda, b, b_off, num_b, c):
    """The micro-kernel over one 32-column half step (tiles as `tile_config(32)`): A's 32 bytes from a0_off /
    a1_off, B's 8 rows from b_off (the B tile's first 8 rows hold columns 0-31 of its 64-column step, its last 8
    columns 32-63; column tile j's at b_off + j * 1024)."""
    if num_b == 2:
        _half_tiles2(a0, a0_off, a1, a1_off, lda, b, b_off, 0, 1, c)
    else:
        _half_tiles1(a0, a0_off, a1, a1_off, lda, b, b_off, 0, 1, c)


@njit(cache=True)
def _half_block_reference(a0, a0_off, a1, a1_off, lda, b, b_off, num_b, c):
    """`_half_block` in plain numba, element by element (its oracle on CPUs without AMX)."""
    fa0, fa1, fb = a0.ravel(), a1.ravel(), b.ravel()
    for t in range(num_b):
        for r in range(TILE_ROWS):
            for col in range(TILE_ROWS):
                s0, s1 = 0, 0
                b_tile = b_off + t * TILE_ROWS * TILE_BYTES
                for k in range(TILE_BYTES // 2):
                    bv = np.int64(fb[b_tile + (k // 4) * TILE_BYTES + col * 4 + k % 4])
                    s0 += np.int64(fa0[a0_off + r * lda + k]) * bv
                    s1 += np.int64(fa1[a1_off + r * lda + k]) * bv
                c[t * 512 + r * TILE_ROWS + col] = s0
                c[t * 512 + 256 + r * TILE_ROWS + col] = s1


@njit(fastmath=True, cache=True)
def _block(a0, a0_off, a1, a1_off, lda, b, b_off, b_step, num_k, num_b, is_prefetch, c):
    """The micro-kernel over num_b (1 or 2) column tiles; `is_prefetch` on the first pass over weights in DRAM
    (later passes find them in cache, where the hints only cost instructions)."""
    if num_b == 2 and is_prefetch:
        _tiles2_prefetch(a0, a0_off, a1, a1_off, lda, b, b_off, b_step, num_k, c)
    elif num_b == 2:
        _tiles2(a0, a0_off, a1, a1_off, lda, b, b_off, b_step, num_k, c)
    elif is_prefetch:
        _tiles1_prefetch(a0, a0_off, a1, a1_off, lda, b, b_off, b_step, num_k, c)
    else:
        _tiles1(a0, a0_off, a1, a1_off, lda, b, b_off, b_step, num_k, c)


@njit(cache=True)
def _block_reference(a0, a0_off, a1, a1_off, lda, b, b_off, b_step, num_k, num_b, is_prefetch, c):
    """`_block` in plain numba, element by element: the oracle of the micro-kernel on CPUs without AMX."""
    fa0, fa1, fb = a0.ravel(), a1.ravel(), b.ravel()
    for t in range(num_b):
        for r in range(TILE_ROWS):
            for col in range(TILE_ROWS):
                s0, s1 = 0, 0
                for kc in range(num_k):
                    b_tile = b_off + kc * b_step + t * TILE_ROWS * TILE_BYTES
                    for k in range(TILE_BYTES):  # B row k // 4 holds 4 columns of each token: word col
                        bv = np.int64(fb[b_tile + (k // 4) * TILE_BYTES + col * 4 + k % 4])
                        s0 += np.int64(fa0[a0_off + r * lda + kc * TILE_BYTES + k]) * bv
                        s1 += np.int64(fa1[a1_off + r * lda + kc * TILE_BYTES + k]) * bv
                c[t * 512 + r * TILE_ROWS + col] = s0
                c[t * 512 + 256 + r * TILE_ROWS + col] = s1


@njit(cache=True)
def _no_tile_begin(cfg):
    pass


@njit(cache=True)
def _no_tile_end():
    pass


# ---- kernels ---------------------------------------------------------------------------------------------------

@njit(**FLAGS)
def pack_vnni(words, src_rows, offsets, col_offsets, out):
    """words int32 [R, K / 4] (int8 rows viewed as 4-byte words) -> out int32 (flat) in the B layout of the module
    docstring; column c of expert u is row src_rows[offsets[u] + c], padding columns are zero."""
    num_words = words.shape[1]
    num_kc = num_words // TILE_ROWS
    for task in prange((offsets.shape[0] - 1) * num_kc):
        u, kc = task // num_kc, task % num_kc
        num_ct = (col_offsets[u + 1] - col_offsets[u]) // TILE_ROWS
        m = offsets[u + 1] - offsets[u]
        for ct in range(num_ct):
            at = num_words * col_offsets[u] + (kc * num_ct + ct) * TILE_ROWS * TILE_ROWS
            for c in range(TILE_ROWS):
                col = ct * TILE_ROWS + c
                row = src_rows[offsets[u] + col] if col < m else -1
                for r in range(TILE_ROWS):
                    out[at + r * TILE_ROWS + c] = words[row, kc * TILE_ROWS + r] if row >= 0 else 0


@njit(fastmath=True, cache=True)
def _act_epilogue(c, num_cols, p_first, e, i0, pair_token, x_scale, gate_s, up_s, epilogue, act):
    """act[p, i0:i0 + 16] = silu(gate) * up (`kernels.activation`), scales applied, for the pass's columns that are
    pairs. (Computing
    whole tile rows first and scattering after measured slower on the 16-core Xeon.)"""
    for j in range(num_cols):
        p = p_first + j
        xs = x_scale[pair_token[p]]
        at = (j // TILE_ROWS) * 512 + j % TILE_ROWS
        for r in range(TILE_ROWS):
            i = i0 + r
            g = np.float32(c[at + r * TILE_ROWS]) * (xs * gate_s[e, i, 0])
            v = np.float32(c[at + 256 + r * TILE_ROWS]) * (xs * up_s[e, i, 0])
            act[p, i] = activation(g, v, epilogue, e, i, True)


@njit(fastmath=True, cache=True)
def _down_epilogue(c, num_cols, p_first, e, h0, pair_token, pair_weight, a_scale, down_s, out):
    """out[t, h0:h0 + 32] += w * act_scale * down_scale * C for the pass's columns that are pairs."""
    for j in range(num_cols):
        p = p_first + j
        o = out[pair_token[p]]
        coef = pair_weight[p] * a_scale[p]
        at = (j // TILE_ROWS) * 512 + j % TILE_ROWS
        for r in range(2 * TILE_ROWS):  # C0 then C1: rows h0 .. h0 + 31
            o[h0 + r] += coef * down_s[e, h0 + r, 0] * np.float32(c[at + r * TILE_ROWS])


@njit(**FLAGS)
def gate_up_amx(cfg, gate, up, gate_s, up_s, experts, offsets, pair_token, col_offsets, x_v, x_scale, epilogue,
                act):
    """act[p, i] = silu(gate[e, i] . x) * (up[e, i] . x) for every pair p of expert e, scales applied; tasks are
    (expert, block of 16 rows of I)."""
    rows, hidden = gate.shape[1], gate.shape[2]
    num_rb, num_k = rows // TILE_ROWS, hidden // TILE_BYTES
    for task in prange(experts.shape[0] * num_rb):
        u, rb = task // num_rb, task % num_rb
        e, p0, m = experts[u], offsets[u], offsets[u + 1] - offsets[u]
        num_ct = (col_offsets[u + 1] - col_offsets[u]) // TILE_ROWS
        a_off = (e * rows + rb * TILE_ROWS) * hidden
        c = np.empty(4 * TILE_ROWS * TILE_ROWS, dtype=np.int32)
        _tile_begin(cfg)
        for ct in range(0, num_ct, 2):
            num_b = min(2, num_ct - ct)
            b_off = hidden * col_offsets[u] + ct * TILE_ROWS * TILE_BYTES
            _block(gate, a_off, up, a_off, hidden, x_v, b_off, num_ct * TILE_ROWS * TILE_BYTES, num_k, num_b, ct == 0,
                   c)
            _act_epilogue(c, min(num_b * TILE_ROWS, m - ct * TILE_ROWS), p0 + ct * TILE_ROWS, e,
                          rb * TILE_ROWS, pair_token, x_scale, gate_s, up_s, epilogue, act)
        _tile_end()


@njit(**FLAGS)
def down_amx(cfg, down, down_s, experts, offsets, pair_token, pair_weight, col_offsets, a_v, a_scale, task_rows,
             out):
    """out[t, h] += w * (down[e, h] . act) for every pair. Tasks own `task_rows` rows of H (a multiple of 32)
    across all experts, so no two threads write one element of `out`; within a task, expert by expert, so the
    expert's packed activations are read from memory once per task and reused from cache by its row blocks."""
    hidden, rows = down.shape[1], down.shape[2]
    num_k = rows // TILE_BYTES
    for task in prange(-(-hidden // task_rows)):
        c = np.empty(4 * TILE_ROWS * TILE_ROWS, dtype=np.int32)
        _tile_begin(cfg)
        for u in range(experts.shape[0]):
            e, p0, m = experts[u], offsets[u], offsets[u + 1] - offsets[u]
            num_ct = (col_offsets[u + 1] - col_offsets[u]) // TILE_ROWS
            for h0 in range(task * task_rows, min(hidden, (task + 1) * task_rows), 2 * TILE_ROWS):
                a_off = (e * hidden + h0) * rows
                for ct in range(0, num_ct, 2):
                    num_b = min(2, num_ct - ct)
                    b_off = rows * col_offsets[u] + ct * TILE_ROWS * TILE_BYTES
                    _block(down, a_off, down, a_off + TILE_ROWS * rows, rows, a_v, b_off,
                           num_ct * TILE_ROWS * TILE_BYTES, num_k, num_b, ct == 0, c)
                    _down_epilogue(c, min(num_b * TILE_ROWS, m - ct * TILE_ROWS), p0 + ct * TILE_ROWS, e, h0,
                                   pair_token, pair_weight, a_scale, down_s, out)
        _tile_end()


def replace_tiles(kernel):
    """`kernel` recompiled with the tile instructions replaced by `_block_reference` / `_half_block_reference` (no
    AMX needed)."""
    env = {**kernel.py_func.__globals__, "_block": _block_reference, "_half_block": _half_block_reference,
           "_tile_begin": _no_tile_begin, "_tile_end": _no_tile_end}
    return njit(parallel=True, fastmath=True)(pytypes.FunctionType(kernel.py_func.__code__, env, kernel.__name__))


def reference_kernels():
    """(gate_up_amx, down_amx) with the tile instructions replaced by `_block_reference`: the packing and the
    epilogues of this module, testable on any CPU."""
    return replace_tiles(gate_up_amx), replace_tiles(down_amx)


def down_task_rows(hidden: int) -> int:
    """Rows of H a down task of the AMX kernels owns: pairs of 16-row blocks, one task per thread."""
    return 2 * TILE_ROWS * -(-(hidden // (2 * TILE_ROWS)) // numba.get_num_threads())


def int8_operand(call: PrefillCall, rows: np.ndarray, src_rows: np.ndarray, name: str,
                 permute=None) -> tuple[np.ndarray, np.ndarray]:
    """float32 rows [R, K] -> (their B operand (int8 view of `pack_vnni`'s words), their scales [R]): each row
    rounded to int8 with its own scale (`quantize_rows`), column c of expert u = row src_rows[offsets[u] + c];
    `permute` (`prefill_amx_grouped`): applied to the int8 rows before packing. Buffers `{name}_q`, `{name}_v`."""
    ws, r = call.workspace, call.routing
    q = ws.array(f"{name}_q", rows.shape, np.int8)
    scales = np.empty(rows.shape[0], dtype=np.float32)
    quantize_rows(rows, q, scales)
    if permute is not None:
        q = permute(q)
    packed = ws.array(f"{name}_v", (rows.shape[1] // 4 * call.num_cols,), np.int32)
    pack_vnni(q.view(np.int32), src_rows, r.offsets, call.col_offsets, packed)
    return packed.view(np.int8), scales


class AmxInt8Backend:
    """The W8A8 grouped GEMM of the module docstring, a `prefill.PrefillBackend`; `kernels` (tests): see
    `reference_kernels`."""

    uses_columns = True

    def __init__(self, layer: PackedLayer, kernels=None):
        if not is_supported(layer):
            raise ValueError("AmxInt8Backend needs per-channel int8 experts with H and each partition's I multiples "
                             f"of {TILE_BYTES}")
        self.layer = layer
        self.cfg = tile_config()
        self.gate_up_kernel, self.down_kernel = kernels or (gate_up_amx, down_amx)

    def activations(self, hidden: torch.Tensor, call: PrefillCall) -> tuple[np.ndarray, np.ndarray]:
        return int8_operand(call, float32_rows(hidden), call.routing.pair_token, "x")

    def gate_up(self, call: PrefillCall, part: PartitionWeights, epilogue, x) -> np.ndarray:
        r, (x_v, x_scale) = call.routing, x
        act = call.workspace.array("act", (len(r.pair_token), part.size), np.float32)
        self.gate_up_kernel(self.cfg, part.gate, part.up, part.gate_scales, part.up_scales, r.experts, r.offsets,
                            r.pair_token, call.col_offsets, x_v, x_scale, epilogue, act)
        return act

    def down(self, call: PrefillCall, part: PartitionWeights, act: np.ndarray, out: np.ndarray) -> None:
        r = call.routing
        a_v, a_scale = int8_operand(call, act, call.pair_rows, "a")
        self.down_kernel(self.cfg, part.down, part.down_scales, r.experts, r.offsets, r.pair_token, r.pair_weight,
                         call.col_offsets, a_v, a_scale, down_task_rows(out.shape[1]), out)
