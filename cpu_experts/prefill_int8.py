"""Prefill of per-channel int8 experts on CPUs without AMX: int8 x int8 -> int32 matmuls (W8A8) with the weights as
the left operand; the backend `OneDnnInt8Backend` of the one prefill driver (`cpu_experts.prefill.Prefill`).

oneDNN (`torch._int_mm`, AMX-INT8 or VNNI where the CPU has them) reads its left operand in the layout it is
stored, while the right one is reordered into its blocked form on every call. The expert weights [N, K] are the
large operand, streamed from DRAM once per call, so they go on the left and the call's few activation rows on the
right, transposed: per expert, acc[N, n] = W[N, K] @ X^T[K, n]. With the weights on the right (x @ W^T) oneDNN
reorders every routed expert's weights on every call, which measured 15-30% slower and worse with more row tiles.

Column layout: expert u's (token, slot) pairs (contiguous in `Routing`) are the columns of its blocks, padded to
a multiple of `prefill.COLUMN_TILE` (the shapes oneDNN sees stay few, so its kernels are reused); block u of a
[K, cols] buffer starts at `K * col_offsets[u]` and is [K, n_u] row-major. Once per call, then per partition of I:

1. `pack_columns`: x_q (int8 rows, one scale per token) -> xT blocks                           [H, n_u]
2. per expert: gate_acc = gate[e] @ xT, up_acc = up[e] @ xT                                     [Ip, n_u] int32
3. `act_columns`: act = silu(gate) * up with the scales applied, quantized per pair -> actT    [Ip, n_u] int8
4. per expert: down_acc = down[e] @ actT                                                         [H, n_u] int32
5. `combine_columns`: out[t] += w * scales * down_acc column, parallel over blocks of H rows
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit, prange

from cpu_experts.kernels import activation, quantize_row
from cpu_experts.packed import PackedLayer, PartitionWeights
from cpu_experts.prefill import PrefillCall, float32_rows

H_BLOCK = 64  # rows of H per task in `combine_columns`
FLAGS = dict(parallel=True, fastmath=True, nogil=True, cache=True)


@njit(**FLAGS)
def quantize_rows(x, q, scales):
    """x float32 [T, K] -> q int8 [T, K], scales float32 [T]."""
    for t in prange(x.shape[0]):
        scales[t] = quantize_row(x[t], q[t])


@njit(**FLAGS)
def pack_columns(x_q, offsets, pair_token, col_offsets, x_t):
    """x_q int8 [T, K] -> x_t (flat): block u = [K, n_u], column j = pair offsets[u] + j's token, padding 0."""
    cols = x_q.shape[1]
    for u in prange(offsets.shape[0] - 1):
        n = col_offsets[u + 1] - col_offsets[u]
        base = cols * col_offsets[u]
        p0, m = offsets[u], offsets[u + 1] - offsets[u]
        for k in range(cols):
            row = base + k * n
            for j in range(m):
                x_t[row + j] = x_q[pair_token[p0 + j], k]
            for j in range(m, n):
                x_t[row + j] = 0


@njit(**FLAGS)
def act_columns(gate_acc, up_acc, experts, offsets, pair_token, col_offsets, x_scale, gate_s, up_s, epilogue, act,
                act_t, act_scale):
    """Step 3: act = silu(gate_acc * s) * (up_acc * s') per column (s = token scale * channel scale;
    `kernels.activation`), then each
    pair's act quantized over this partition's Ip rows (absmax / 127, as `quantize_row`) into act_t (flat blocks
    [Ip, n_u]) and act_scale [P]. act: float32 scratch of act_t's size."""
    rows = gate_s.shape[1]
    for u in prange(experts.shape[0]):
        e = experts[u]
        n = col_offsets[u + 1] - col_offsets[u]
        base = rows * col_offsets[u]
        p0, m = offsets[u], offsets[u + 1] - offsets[u]
        amax = np.zeros(m, dtype=np.float32)
        for i in range(rows):
            gs, us = gate_s[e, i, 0], up_s[e, i, 0]
            at = base + i * n
            for j in range(m):
                xs = x_scale[pair_token[p0 + j]]
                g = np.float32(gate_acc[at + j]) * (xs * gs)
                v = np.float32(up_acc[at + j]) * (xs * us)
                a = activation(g, v, epilogue, e, i, True)
                act[at + j] = a
                amax[j] = max(amax[j], abs(a))
        inv = np.zeros(m, dtype=np.float32)
        for j in range(m):
            inv[j] = np.float32(127.0) / amax[j] if amax[j] > 0 else np.float32(0.0)
            act_scale[p0 + j] = amax[j] / np.float32(127.0)
        for i in range(rows):
            at = base + i * n
            for j in range(m):
                act_t[at + j] = np.int8(np.rint(act[at + j] * inv[j]))
            for j in range(m, n):
                act_t[at + j] = 0


@njit(**FLAGS)
def combine_columns(down_acc, experts, offsets, pair_token, pair_weight, col_offsets, act_scale, down_s, out):
    """Step 5: out[t, h] += w * act_scale * down_scale[h] * down_acc; tasks own blocks of H rows, so no two
    threads write one element of `out`."""
    hidden = out.shape[1]
    for block in prange(-(-hidden // H_BLOCK)):
        h0, h1 = block * H_BLOCK, min(hidden, (block + 1) * H_BLOCK)
        for u in range(experts.shape[0]):
            e = experts[u]
            n = col_offsets[u + 1] - col_offsets[u]
            base = hidden * col_offsets[u]
            for j in range(offsets[u + 1] - offsets[u]):
                p = offsets[u] + j
                o = out[pair_token[p]]
                c = pair_weight[p] * act_scale[p]
                for h in range(h0, h1):
                    o[h] += c * down_s[e, h, 0] * np.float32(down_acc[base + h * n + j])


class OneDnnInt8Backend:
    """The steps of the module docstring, a `prefill.PrefillBackend` (its buffers in the call's `Workspace`)."""

    uses_columns = True

    def __init__(self, layer: PackedLayer):
        self.layer = layer

    def activations(self, hidden: torch.Tensor, call: PrefillCall) -> tuple[np.ndarray, np.ndarray]:
        """Step 1: (xT blocks, the tokens' scales)."""
        ws, r, x = call.workspace, call.routing, float32_rows(hidden)
        x_q = ws.array("x_q", x.shape, np.int8)
        x_scale = np.empty(x.shape[0], dtype=np.float32)
        quantize_rows(x, x_q, x_scale)
        x_t = ws.array("x_t", (x.shape[1] * call.num_cols,), np.int8)
        pack_columns(x_q, r.offsets, r.pair_token, call.col_offsets, x_t)
        return x_t, x_scale

    def gate_up(self, call: PrefillCall, part: PartitionWeights, epilogue, x) -> tuple[np.ndarray, np.ndarray]:
        """Steps 2-3: (actT blocks, the pairs' act scales)."""
        ws, r, (x_t, x_scale) = call.workspace, call.routing, x
        size = part.size * call.num_cols
        gate_acc, up_acc = ws.array("gate_acc", (size,), np.int32), ws.array("up_acc", (size,), np.int32)
        _matmuls(((torch.from_numpy(part.gate), x_t, gate_acc), (torch.from_numpy(part.up), x_t, up_acc)),
                 r.experts, call.col_offsets)
        act_t = ws.array("act_t", (size,), np.int8)
        act_scale = np.empty(len(r.pair_token), dtype=np.float32)
        act_columns(gate_acc, up_acc, r.experts, r.offsets, r.pair_token, call.col_offsets, x_scale,
                    part.gate_scales, part.up_scales, epilogue, ws.array("act", (size,), np.float32), act_t,
                    act_scale)
        return act_t, act_scale

    def down(self, call: PrefillCall, part: PartitionWeights, act, out: np.ndarray) -> None:
        """Steps 4-5."""
        ws, r, (act_t, act_scale) = call.workspace, call.routing, act
        down_acc = ws.array("down_acc", (out.shape[1] * call.num_cols,), np.int32)
        _matmuls(((torch.from_numpy(part.down), act_t, down_acc),), r.experts, call.col_offsets)
        combine_columns(down_acc, r.experts, r.offsets, r.pair_token, r.pair_weight, call.col_offsets, act_scale,
                        part.down_scales, out)


def _matmuls(products, experts: np.ndarray, col_offsets: np.ndarray) -> None:
    """acc block u = weight[e] @ columns block u for each (weight [E, N, K], columns, acc) of `products`."""
    bounds = col_offsets.tolist()
    tensors = [(w, torch.from_numpy(c), torch.from_numpy(a)) for w, c, a in products]
    for u, e in enumerate(experts.tolist()):
        c0, n = bounds[u], bounds[u + 1] - bounds[u]
        for weight, cols, acc in tensors:
            rows, inner = weight.shape[1], weight.shape[2]
            torch._int_mm(weight[e], cols[inner * c0:inner * (c0 + n)].view(inner, n),
                          out=acc[rows * c0:rows * (c0 + n)].view(rows, n))
