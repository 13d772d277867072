"""Prefill of FP8, MXFP4 and NVFP4 experts on AMX-BF16: the grouped GEMM of `cpu_experts.prefill_amx_grouped` with
`tdpbf16ps` (C float32 [16, 16] += A bf16 [16, 32] . B bf16 [16, 32 as 16 pairs]) on weights converted to bf16; the
backend `AmxFloatBackend` of the one prefill driver (`cpu_experts.prefill.Prefill`).

Numerics (the float formats' contract, as the decode kernels `kernels_fp8` / `kernels_fp4` and
`reference.moe_reference(bf16_activations=True)`): every matmul input (the hidden rows, act = silu(gate) * up) is
rounded to bf16, weights are their exact stored values, products exact and sums float32. So:
- e4m3 codes and e2m1 codes are exact in bf16; FP8's group scale is not (e4m3 x float32 has up to 27 significant
  bits), so each group's C tiles are zeroed, accumulated over the group's steps of 32 columns, stored and added to
  float32 accumulators times the row's group scale (group 128: 4 steps).
- NVFP4: e2m1 x its e4m3 block scale (at most 6 significant bits, 2^-10 at least) is exact in bf16, so the block
  scale (group 16, half a step) is folded into the converted weights; the tensor scale multiplies the whole row's
  sum (one "group").
- MXFP4: e2m1 x 2^(s - 127) is folded too where every scale of the task's rows keeps the products normal and finite
  bf16 (s in [MX_FOLD_MIN, MX_FOLD_MAX]: all of a real checkpoint's); otherwise the task's rows are converted
  unscaled and each 32-column group (one step) is scaled as FP8's.
AMX-BF16 treats bf16 subnormal inputs as zero and flushes subnormal results: activations below 2^-126 (none in a
model's hidden states) count as zero here.

Operands (the tile layouts of `prefill_amx`, 64 bytes a tile row = 32 bf16 columns a step):
- A: a task's weight rows converted to bf16 by vector IR into a per-thread buffer: CHUNK columns of its 32 rows at
  a time, multiplied while in L1 (`prefill_amx_float_chunked`). The first kernels converted whole rows into a
  scratch; the chunked ones replaced them at 1.39-1.54x with the same outputs bit for bit (docs/benchmarks.md).
- B: the call's bf16 activations in AMX's pair layout (row r of a tile = the 4-byte column pair r of 16 tokens),
  packed once per call, each partition's bf16 act likewise (`prefill_amx.pack_vnni` on bf16 rows viewed as pairs).
All offsets handed to the tile functions are in bytes. `reference_kernels` replaces the tile instructions by a
plain-numba reference (tests on CPUs without AMX). Needs H and every partition's I to be multiples of 32 and an
FP8 group that is a multiple of 32 (`is_supported`).
"""

from __future__ import annotations

import numba
import numpy as np
import torch
from llvmlite import ir
from numba import njit

from cpu_experts import formats
from cpu_experts.kernels import activation, bf16_bits
from cpu_experts.packed import PackedLayer, PartitionWeights
from cpu_experts.prefill import PrefillCall, float32_rows
from cpu_experts.prefill_amx import (
    TILE_BYTES,
    TILE_ROWS,
    down_task_rows,
    has_amx,
    pack_vnni,
    tile_config,
)

FLAGS = dict(parallel=True, fastmath=True, nogil=True, cache=True)
STEP = TILE_BYTES // 2  # bf16 columns a tile step
CHUNK = 512  # columns `prefill_amx_float_chunked` converts at a time: 32 rows x 512 bf16 = 32 KiB, in L1
C_FLOATS = 4 * TILE_ROWS * TILE_ROWS  # the 4 C tiles of a pass over two column tiles (A0, A1 x B0, B1)
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


# ---- weights to bf16 (vector IR, 32 columns a step) --------------------------------------------------------------

def _splat(builder, vector_type, value):
    return ir.Constant(vector_type, [value] * vector_type.count)


def _store_bf16(builder, values, dst, at):
    """<32 x float> holding bf16 values -> their bits (the high halves: exact) at dst[at] (bytes)."""
    words = builder.bitcast(values, ir.VectorType(I16, 2 * STEP))  # little-endian: word 2j + 1 is float j's high half
    high = ir.Constant(ir.VectorType(I32, STEP), [2 * j + 1 for j in range(STEP)])  # one word permute on AVX-512
    bits = builder.shuffle_vector(words, words, high)
    builder.store(bits, builder.bitcast(builder.gep(dst, [at]), bits.type.as_pointer()), align=1)


def _fp8_step(builder, src):
    """<32 x float>: the values of the 32 e4m3 codes at src (i8*), exact (`_fp8_to_bf16`)."""
    v32b, v32w = ir.VectorType(I8, STEP), ir.VectorType(I16, STEP)
    v32h, v32f = ir.VectorType(ir.HalfType(), STEP), ir.VectorType(F32, STEP)
    codes = builder.load(builder.bitcast(src, v32b.as_pointer()), align=1)
    words = builder.shl(builder.sext(codes, v32w), _splat(builder, v32w, 7))
    words = builder.and_(words, _splat(builder, v32w, 0xBFFF))
    return builder.fmul(builder.fpext(builder.bitcast(words, v32h), v32f), _splat(builder, v32f, 256.0))


# ---- a task's rows and their group scales ------------------------------------------------------------------------

@njit(fastmath=True, cache=True)
def _mx_foldable(s, e, r0, num_rows):
    """Whether every E8M0 scale of rows r0.. of expert e folds into bf16 weights (module docstring). Counted
    without an early exit, so the loop vectorizes (a task's 16 gate and 16 up rows of DeepSeek-V3 hold 7168
    scale bytes); below MX_FOLD_MIN the byte minus MX_FOLD_MIN wraps above the range."""
    rows = s[e, r0:r0 + num_rows]  # [num_rows, G] uint8, contiguous
    num_bad = 0
    for n in range(num_rows):
        for g in range(rows.shape[1]):
            num_bad += np.uint8(rows[n, g] - np.uint8(MX_FOLD_MIN)) > np.uint8(MX_FOLD_MAX - MX_FOLD_MIN)
    return num_bad == 0


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


def reference_kernels():
    """The launcher's kernels (`prefill_amx_float_chunked`) with the tile instructions replaced by their reference."""
    from cpu_experts import prefill_amx_float_chunked  # built on this module's pieces: imported when first needed

    return prefill_amx_float_chunked.reference_kernels()


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


class AmxFloatBackend:
    """The bf16 AMX GEMM of the module docstring, a `prefill.PrefillBackend`; `kernels` (tests): see
    `reference_kernels`. Every call's inputs are checked first: the kernels index without bounds checks."""

    uses_columns = True

    def __init__(self, layer: PackedLayer, kernels=None):
        if not is_supported(layer):
            raise ValueError(f"AmxFloatBackend needs fp8, mxfp4 or nvfp4 experts with H and each partition's I "
                             f"multiples of {STEP} and an fp8 group size that is a multiple of {STEP}")
        _check_layer(layer)
        self.layer = layer
        self.spec = layer.spec
        self.fmt = FORMATS[self.spec.dtype]
        self.cfg = tile_config()
        if kernels is None:
            # the tiles without the process's permission (requested by has_amx_bf16) are an illegal instruction
            if not has_amx_bf16():
                raise RuntimeError("AmxFloatBackend's tile kernels need AMX-BF16 and the tile permission, which "
                                   "this process lacks (has_amx_bf16() is False); pass kernels= to run others")
            from cpu_experts import prefill_amx_float_chunked  # built on this module's pieces: imported here

            kernels = prefill_amx_float_chunked.kernels()
        self.gate_up_kernel, self.down_kernel = kernels
        self.ones = np.ones(self.spec.num_experts, dtype=np.float32)  # the tensor scale of the formats without
        self.width = max(self.spec.hidden_size, *(p.size for p in layer.partitions))

    def _tensor_scale(self, part, role: str) -> np.ndarray:
        ts = getattr(part, f"{role}_tensor_scale")
        return self.ones if ts is None else ts

    def activations(self, hidden: torch.Tensor, call: PrefillCall):
        """(x's B operand as bf16 bits, the kernels' per-thread buffers for this call's column tiles)."""
        ws, r, x = call.workspace, call.routing, float32_rows(hidden)
        _check_call(x, r, self.spec.num_experts, self.spec.hidden_size)
        x_bf16 = ws.tensor("x_bf16", x.shape, torch.bfloat16)
        x_bf16.copy_(torch.from_numpy(x))  # rounded to nearest even
        x_v = ws.array("x_v", (x.shape[1] // 2 * call.num_cols,), np.int32)
        pack_vnni(x_bf16.view(torch.int32).numpy(), r.pair_token, r.offsets, call.col_offsets, x_v)
        num_threads, width = numba.get_num_threads(), self.width
        max_ct = int(np.diff(call.col_offsets).max(initial=0)) // TILE_ROWS
        # per thread: a chunk and the passes' C tiles, in the room the first kernels' whole rows took (what ran on
        # AMX; not tightened without a device run)
        scratch = ws.array("a_bf16", (num_threads, 2 * TILE_ROWS * max(width, CHUNK)), np.uint16)
        floats = max(2 * TILE_ROWS * (width // STEP), 2 * (-(-max_ct // 2)) * C_FLOATS + 2 * TILE_ROWS)
        row_scales = ws.array("a_scales", (num_threads, floats), np.float32)
        factors = ws.array("a_factors", (num_threads, width // FP4_BLOCK), np.float32)
        return x_v.view(np.uint16), (scratch, row_scales, factors)

    def gate_up(self, call: PrefillCall, part: PartitionWeights, epilogue, x) -> np.ndarray:
        """bf16(act) bits [P, Ip]."""
        r, (x_v, buffers) = call.routing, x
        act = call.workspace.array("act_bf16", (len(r.pair_token), part.size), np.uint16)
        self.gate_up_kernel(self.cfg, self.fmt, part.gate, part.gate_scales, self._tensor_scale(part, "gate"),
                            part.up, part.up_scales, self._tensor_scale(part, "up"), self.spec.group_size, r.experts,
                            r.offsets, call.col_offsets, x_v, *buffers, epilogue, act)
        return act, buffers

    def down(self, call: PrefillCall, part: PartitionWeights, act, out: np.ndarray) -> None:
        r, (act_bf16, buffers) = call.routing, act
        a_v = call.workspace.array("a_v", (part.size // 2 * call.num_cols,), np.int32)
        pack_vnni(act_bf16.view(np.int32), call.pair_rows, r.offsets, call.col_offsets, a_v)
        self.down_kernel(self.cfg, self.fmt, part.down, part.down_scales, self._tensor_scale(part, "down"),
                         self.spec.group_size, r.experts, r.offsets, r.pair_token, r.pair_weight, call.col_offsets,
                         a_v.view(np.uint16), down_task_rows(out.shape[1]), *buffers, out)
