"""numba kernels of the CPU MoE operator, for one partition (a slice of I) of one layer.

The work is grouped by expert before it reaches the kernels: `experts` [U] are the distinct experts routed to
here, `offsets` [U + 1] delimit each expert's (token, slot) pairs in `pair_token` / `pair_weight` [P]. So every
expert's rows stream from memory once per call, whatever the number of its tokens (their activations stay in
cache), and each weight row is dequantized in registers, never written back.

1. `gate_up_*`: act[p, i] = silu(gate[e, i] . x[t]) * (up[e, i] . x[t]), parallel over (expert, row); a layer
   with another activation or biases (gpt-oss) computes `activation` instead, its `epilogue` (see there).
2. `down_*`: out[t, h] += w[p] * sum_i down[e, h, i] * act[p, i], parallel over h (no two threads write one
   output element).

Quantization: symmetric, one scale per group of `group` input columns (group = K: per channel), float32 or, for
int4, bfloat16 (as its uint16 bits, widened by `scale_value`); int4 as `nibble - 8` (codes -8..7), even column in
the low nibble. The int4 kernels take their activations split (`split_int4`) into
even and odd columns plus per-group sums, so the unpacked nibbles meet contiguous activations and the `- 8` costs
one multiply per group. Compiled for the host CPU on first use (cached on disk), so the
vector width (AVX2, AVX-512) is whatever the machine has: nothing here can raise an illegal instruction.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

FLAGS = dict(parallel=True, fastmath=True, nogil=True, cache=True)


@intrinsic
def _as_float32(typingctx, bits):
    """The float32 whose bit pattern is the int32 `bits`."""
    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.FloatType())
    return types.float32(types.int32), codegen


@intrinsic
def float32_bits(typingctx, value):
    """The int32 bit pattern of the float32 `value` (the inverse of `_as_float32`)."""
    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.IntType(32))
    return types.int32(types.float32), codegen


@intrinsic
def plain_add(typingctx, a, b):
    """a + b (float32) without fast-math flags: not reassociated with what surrounds it. Its flags alone do not keep
    LLVM from fusing it with a product that feeds it (it did, in parallel loops): such a product goes through
    `fence` first, so every kernel that adds a bias rounds the same way (the decode pool equals the operator bit for
    bit)."""
    def codegen(context, builder, sig, args):
        return builder.fadd(args[0], args[1])
    return types.float32(types.float32, types.float32), codegen


@intrinsic
def fence(typingctx, value):
    """`value` (float32) rounded where it stands: `llvm.arithmetic.fence`, across which LLVM neither contracts nor
    reassociates. A product that feeds a bias add goes through it, so every kernel rounds the product before the add:
    without it LLVM fused the two into an FMA inside the operator's parallel loops (whatever the add's own flags:
    `plain_add`) but not in the decode pool's, and gpt-oss's act values differed by 1-2 ulps between them, which
    moved an act row's int8 scale (its absmax) and every output column of that token."""
    def codegen(context, builder, sig, args):
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.FloatType(), [ir.FloatType()]),
                                            "llvm.arithmetic.fence.f32")
        return builder.call(fn, args)
    return types.float32(types.float32), codegen


@njit(fastmath=True, nogil=True, cache=True, error_model="numpy")
def round_bf16(value):
    """float32 -> the nearest bfloat16 (ties to even, as torch rounds), as a float32; NaN stays NaN. The float
    formats' activation rounding, on every path of theirs."""
    bits = np.int64(float32_bits(np.float32(value)))
    if (bits & 0x7FFFFFFF) > 0x7F800000:
        return np.float32(value)
    return _as_float32(np.int32((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536))


@njit(fastmath=True, nogil=True, cache=True, error_model="numpy")
def bf16_bits(value):
    """float32 -> the bits of the nearest bfloat16 (`round_bf16`'s value)."""
    return np.uint16((np.int64(float32_bits(round_bf16(value))) >> 16) & 0xFFFF)


def scale_value(scale):
    """A weight scale as float32: a float32 as it is, a bfloat16 (an element of a uint16 array: its bits) widened,
    exactly. For numba-compiled kernels only, which take either scale array."""
    raise TypeError("scale_value is only available in numba-compiled code")


@overload(scale_value, inline="always")
def _scale_value(scale):
    if scale == types.uint16:
        return lambda scale: _as_float32(np.int32(scale) << np.int32(16))
    if isinstance(scale, types.Float):
        return lambda scale: np.float32(scale)
    return None


@njit(fastmath=True, cache=True)
def fast_exp(x):
    """exp(x) for float32 x, within 5e-7 relative on [-87, 88] (clamped there: silu needs no more): 2^k times a
    degree-6 polynomial of the rest. numba has no vector exp (libm's is called per element), so the prefill
    epilogues, which take millions of exponentials per call, spent more time in exp than in everything else."""
    x = min(max(x, np.float32(-87.0)), np.float32(88.0))
    k = np.rint(x * np.float32(1.4426950408889634))
    f = (x - k * np.float32(0.693145751953125)) - k * np.float32(1.428606765330187e-06)  # x - k ln 2, in 2 parts
    p = np.float32(1.0) + f * (np.float32(1.0) + f * (np.float32(0.5) + f * (np.float32(1.0 / 6.0) + f * (
        np.float32(1.0 / 24.0) + f * (np.float32(1.0 / 120.0) + f * np.float32(1.0 / 720.0))))))
    return p * _as_float32(np.int32((np.int32(k) + np.int32(127)) << np.int32(23)))


@njit(fastmath=True, cache=True)
def silu_mul(g, v):
    """silu(g) * v through `fast_exp` (the prefill epilogues)."""
    return g / (np.float32(1.0) + fast_exp(-g)) * v


# ---- the expert activation, every kernel's ----------------------------------------------------------------------
# A layer's `epilogue` is None for silu without biases: the kernels compile that specialization exactly as before
# (the `is None` test is resolved at compile time, numba prunes the other branch), so silu layers keep their code.
# Otherwise a tuple (kind, alpha, limit, gate_bias, up_bias): kind ACT_SILU / ACT_SWIGLU_OAI, float32 alpha and
# limit, the partition's biases [E, Ip] float32 (zeros where the layer has none), built once per layer
# (`epilogues`).

ACT_SILU, ACT_SWIGLU_OAI = 0, 1
ACT_KINDS = {"silu": ACT_SILU, "swiglu_oai": ACT_SWIGLU_OAI}


@njit(fastmath=True, cache=True, error_model="numpy")
def activation(g, v, epilogue, e, i, is_fast):
    """act of expert e's row i from its gate and up dots g, v (float32): silu(g) * v, or the epilogue's. `is_fast`:
    exp through `fast_exp` (the prefill epilogues and the int4 decode kernels), else numpy's."""
    if epilogue is None:
        if is_fast:
            return silu_mul(g, v)
        return g / (np.float32(1.0) + np.exp(-g)) * v
    kind, alpha, limit, gate_bias, up_bias = epilogue
    g = plain_add(fence(np.float32(g)), gate_bias[e, i])
    v = plain_add(fence(np.float32(v)), up_bias[e, i])
    if kind == ACT_SWIGLU_OAI:
        g = min(g, limit)
        v = min(max(v, -limit), limit)
        z = -alpha * g
        return (v + np.float32(1.0)) * (g / (np.float32(1.0) + (fast_exp(z) if is_fast else np.exp(z))))
    return g / (np.float32(1.0) + (fast_exp(-g) if is_fast else np.exp(-g))) * v


@njit(fastmath=True, cache=True, error_model="numpy")
def add_down_bias(lo, hi, experts, offsets, pair_token, pair_weight, down_bias, out):
    """out[t, h] += w * down_bias[e, h] for columns lo..hi, every routed expert e and its pairs (t, w): the down
    projection's bias, weighted like its matmul, once per layer after the partitions' sums."""
    for u in range(experts.shape[0]):
        e = experts[u]
        for p in range(offsets[u], offsets[u + 1]):
            t, weight = pair_token[p], pair_weight[p]
            for h in range(lo, hi):
                out[t, h] = plain_add(out[t, h], fence(weight * down_bias[e, h]))


@njit(**FLAGS)
def add_down_bias_all(experts, offsets, pair_token, pair_weight, down_bias, out):
    """`add_down_bias` over every column, in blocks of 64 (no two threads write one element)."""
    hidden = out.shape[1]
    for block in prange(-(-hidden // 64)):
        add_down_bias(block * 64, min(hidden, block * 64 + 64), experts, offsets, pair_token, pair_weight, down_bias,
                      out)


@njit(**FLAGS)
def activation_rows(gate, up, experts, offsets, epilogue, act):
    """act[p, i] = activation(gate[p, i], up[p, i]) for the pairs of every routed expert (rows grouped by expert,
    `operator.Routing`): the dequantize-and-multiply prefill's epilogue, for layers with an `epilogue`."""
    for u in prange(experts.shape[0]):
        e = experts[u]
        for p in range(offsets[u], offsets[u + 1]):
            for i in range(gate.shape[1]):
                act[p, i] = activation(gate[p, i], up[p, i], epilogue, e, i, True)


def epilogues(layer) -> list:
    """Per partition of `layer` (a `PackedLayer`), the kernels' `epilogue` argument (see `activation`)."""
    spec = layer.spec
    if spec.is_plain:
        return [None] * len(layer.partitions)
    act = spec.activation
    out = []
    for part in layer.partitions:
        zeros = None if spec.has_bias else np.zeros((spec.num_experts, part.size), dtype=np.float32)
        out.append((np.int64(ACT_KINDS[act.kind]), np.float32(act.alpha), np.float32(act.limit),
                    part.gate_bias if spec.has_bias else zeros, part.up_bias if spec.has_bias else zeros))
    return out


# The dot products are separate functions over whole 1-D arrays with a plain trip count: that is the form LLVM
# vectorizes (int8 -> int32 -> float32 widening and FMA over full vector registers); the same loop written over a
# sub-range inside the group loop measured 20x slower.

@njit(fastmath=True, cache=True)
def _dot8(row, x):
    acc = np.float32(0.0)
    for j in range(x.shape[0]):
        acc += np.float32(row[j]) * x[j]
    return acc


@njit(fastmath=True, cache=True)
def _dot4(row, x_even, x_odd):
    """row: uint8 [n] packed pairs; x_even / x_odd: float32 [n], the activation's even and odd columns. Unsigned
    nibbles: the caller subtracts 8 * sum(x) once per group instead of 8 per element. The nibbles are split in
    float (byte = 16 hi + lo, exact): numba widens integer `&` and `>>` to int64, which vectorizes at half width."""
    acc = np.float32(0.0)
    for b in range(row.shape[0]):
        byte = np.float32(row[b])
        hi = np.floor(byte * np.float32(0.0625))
        acc += (byte - np.float32(16.0) * hi) * x_even[b] + hi * x_odd[b]
    return acc


@njit(fastmath=True, cache=True)
def _dot_int8(row, scales, x, group):
    if scales.shape[0] == 1:
        return _dot8(row, x) * scales[0]
    acc = np.float32(0.0)
    for g in range(scales.shape[0]):
        lo = g * group
        hi = min(lo + group, x.shape[0])
        acc += _dot8(row[lo:hi], x[lo:hi]) * scales[g]
    return acc


@njit(fastmath=True, cache=True)
def _dot_int4(row, scales, x_even, x_odd, x_sum, group):
    # group is even, so a group covers whole bytes; an odd K's last byte pairs its column with x_odd = 0
    half = group // 2
    acc = np.float32(0.0)
    for g in range(scales.shape[0]):
        lo = g * half
        hi = min(lo + half, row.shape[0])
        acc += (_dot4(row[lo:hi], x_even[lo:hi], x_odd[lo:hi]) - np.float32(8.0) * x_sum[g]) * scale_value(scales[g])
    return acc


@njit(**FLAGS)
def split_int4(x, group, x_even, x_odd, x_sum):
    """Activations x float32 [T, K] -> the int4 kernels' form: x_even / x_odd [T, ceil(K / 2)] (columns 2b and
    2b + 1; x_odd zero past an odd K) and x_sum [T, G], each group's sum."""
    cols = x.shape[1]
    for t in prange(x.shape[0]):
        for b in range(x_even.shape[1]):
            x_even[t, b] = x[t, 2 * b]
            x_odd[t, b] = x[t, 2 * b + 1] if 2 * b + 1 < cols else np.float32(0.0)
        for g in range(x_sum.shape[1]):
            total = np.float32(0.0)
            for j in range(g * group, min((g + 1) * group, cols)):
                total += x[t, j]
            x_sum[t, g] = total


@njit(fastmath=True, cache=True)
def quantize_row(src, q):
    """src float32 [K] -> q int8 [K], returns the scale (symmetric, absmax / 127)."""
    amax = np.float32(0.0)
    for j in range(src.shape[0]):
        amax = max(amax, abs(src[j]))
    inv = np.float32(127.0) / amax if amax > 0 else np.float32(0.0)
    for j in range(src.shape[0]):
        q[j] = np.int8(np.rint(src[j] * inv))
    return amax / np.float32(127.0)


@njit(**FLAGS)
def round_rows_int8(x):
    """In place: each row of x float32 [T, K] rounded to its int8 grid, absmax / 127 (the W8A8 activations, kept
    in float: the same values the prefill path multiplies as int8)."""
    for t in prange(x.shape[0]):
        amax = np.float32(0.0)
        for j in range(x.shape[1]):
            amax = max(amax, abs(x[t, j]))
        if amax == 0:
            continue
        scale = amax / np.float32(127.0)
        inv = np.float32(127.0) / amax
        for j in range(x.shape[1]):
            x[t, j] = np.rint(x[t, j] * inv) * scale


@njit(**FLAGS)
def gate_up_int8(x, experts, offsets, pair_token, gate, gate_s, up, up_s, group, epilogue, act):
    rows = gate.shape[1]
    for r in prange(experts.shape[0] * rows):
        u, i = r // rows, r % rows
        e = experts[u]
        for p in range(offsets[u], offsets[u + 1]):
            xt = x[pair_token[p]]
            g = _dot_int8(gate[e, i], gate_s[e, i], xt, group)
            v = _dot_int8(up[e, i], up_s[e, i], xt, group)
            act[p, i] = activation(g, v, epilogue, e, i, False)


@njit(**FLAGS)
def gate_up_int4(x_even, x_odd, x_sum, experts, offsets, pair_token, gate, gate_s, up, up_s, group, epilogue, act):
    rows = gate.shape[1]
    for r in prange(experts.shape[0] * rows):
        u, i = r // rows, r % rows
        e = experts[u]
        for p in range(offsets[u], offsets[u + 1]):
            t = pair_token[p]
            g = _dot_int4(gate[e, i], gate_s[e, i], x_even[t], x_odd[t], x_sum[t], group)
            v = _dot_int4(up[e, i], up_s[e, i], x_even[t], x_odd[t], x_sum[t], group)
            act[p, i] = activation(g, v, epilogue, e, i, False)


@njit(**FLAGS)
def down_int8(act, experts, offsets, pair_token, pair_weight, down, down_s, group, out):
    for h in prange(down.shape[1]):
        for u in range(experts.shape[0]):
            e = experts[u]
            for p in range(offsets[u], offsets[u + 1]):
                out[pair_token[p], h] += pair_weight[p] * _dot_int8(down[e, h], down_s[e, h], act[p], group)


@njit(**FLAGS)
def down_int4(act_even, act_odd, act_sum, experts, offsets, pair_token, pair_weight, down, down_s, group, out):
    for h in prange(down.shape[1]):
        for u in range(experts.shape[0]):
            e = experts[u]
            for p in range(offsets[u], offsets[u + 1]):
                dot = _dot_int4(down[e, h], down_s[e, h], act_even[p], act_odd[p], act_sum[p], group)
                out[pair_token[p], h] += pair_weight[p] * dot


