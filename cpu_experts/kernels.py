"""numba kernels of the CPU MoE operator, for one partition (a slice of I) of one layer.

The work is grouped by expert before it reaches the kernels: `experts` [U] are the distinct experts routed to
here, `offsets` [U + 1] delimit each expert's (token, slot) pairs in `pair_token` / `pair_weight` [P]. So every
expert's rows stream from memory once per call, whatever the number of its tokens (their activations stay in
cache), and each weight row is dequantized in registers, never written back.

1. `gate_up_*`: act[p, i] = silu(gate[e, i] . x[t]) * (up[e, i] . x[t]), parallel over (expert, row).
2. `down_*`: out[t, h] += w[p] * sum_i down[e, h, i] * act[p, i], parallel over h (no two threads write one
   output element).

Quantization: symmetric, one float32 scale per group of `group` input columns (group = K: per channel); int4 as
`nibble - 8`, even column in the low nibble. Compiled for the host CPU on first use (cached on disk), so the
vector width (AVX2, AVX-512) is whatever the machine has: nothing here can raise an illegal instruction.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

FLAGS = dict(parallel=True, fastmath=True, nogil=True, cache=True)


@njit(fastmath=True, cache=True)
def _silu(v):
    return v / (np.float32(1.0) + np.exp(-v))


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
def _dot4(row, x):
    """row: uint8 [n // 2] packed pairs, x: float32 [n] with n even."""
    acc = np.float32(0.0)
    for b in range(x.shape[0] // 2):
        byte = np.int32(row[b])
        acc += np.float32((byte & 15) - 8) * x[2 * b] + np.float32((byte >> 4) - 8) * x[2 * b + 1]
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
def _dot_int4(row, scales, x, group):
    # row: uint8 [ceil(K / 2)]; group is even, so a group covers whole bytes; an odd K leaves one last column
    cols = x.shape[0]
    acc = np.float32(0.0)
    for g in range(scales.shape[0]):
        lo = g * group
        hi = min(lo + group, cols)
        even = lo + (hi - lo) // 2 * 2
        part = _dot4(row[lo // 2:even // 2], x[lo:even])
        if even < hi:
            part += np.float32((np.int32(row[even // 2]) & 15) - 8) * x[even]
        acc += part * scales[g]
    return acc


@njit(**FLAGS)
def gate_up_int8(x, experts, offsets, pair_token, gate, gate_s, up, up_s, group, act):
    rows = gate.shape[1]
    for r in prange(experts.shape[0] * rows):
        u, i = r // rows, r % rows
        e = experts[u]
        for p in range(offsets[u], offsets[u + 1]):
            xt = x[pair_token[p]]
            g = _dot_int8(gate[e, i], gate_s[e, i], xt, group)
            v = _dot_int8(up[e, i], up_s[e, i], xt, group)
            act[p, i] = _silu(g) * v


@njit(**FLAGS)
def gate_up_int4(x, experts, offsets, pair_token, gate, gate_s, up, up_s, group, act):
    rows = gate.shape[1]
    for r in prange(experts.shape[0] * rows):
        u, i = r // rows, r % rows
        e = experts[u]
        for p in range(offsets[u], offsets[u + 1]):
            xt = x[pair_token[p]]
            g = _dot_int4(gate[e, i], gate_s[e, i], xt, group)
            v = _dot_int4(up[e, i], up_s[e, i], xt, group)
            act[p, i] = _silu(g) * v


@njit(**FLAGS)
def down_int8(act, experts, offsets, pair_token, pair_weight, down, down_s, group, out):
    for h in prange(down.shape[1]):
        for u in range(experts.shape[0]):
            e = experts[u]
            for p in range(offsets[u], offsets[u + 1]):
                out[pair_token[p], h] += pair_weight[p] * _dot_int8(down[e, h], down_s[e, h], act[p], group)


@njit(**FLAGS)
def down_int4(act, experts, offsets, pair_token, pair_weight, down, down_s, group, out):
    for h in prange(down.shape[1]):
        for u in range(experts.shape[0]):
            e = experts[u]
            for p in range(offsets[u], offsets[u + 1]):
                out[pair_token[p], h] += pair_weight[p] * _dot_int4(down[e, h], down_s[e, h], act[p], group)


KERNELS = {"int8": (gate_up_int8, down_int8), "int4": (gate_up_int4, down_int4)}
