"""Prefill of per-channel int8 experts: int8 x int8 -> int32 matmuls (W8A8) with the weights as the left operand.

oneDNN (`torch._int_mm`, AMX-INT8 or VNNI where the CPU has them) reads its left operand in the layout it is
stored, while the right one is reordered into its blocked form on every call. The expert weights [N, K] are the
large operand, streamed from DRAM once per call, so they go on the left and the call's few activation rows on the
right, transposed: per expert, acc[N, n] = W[N, K] @ X^T[K, n]. With the weights on the right (x @ W^T) oneDNN
reorders every routed expert's weights on every call, which measured 15-30% slower and worse with more row tiles.

Column layout: expert u's (token, slot) pairs (contiguous in `Routing`) are the columns of its blocks, padded to
a multiple of `COLUMN_TILE` (the shapes oneDNN sees stay few, so its kernels are reused); block u of a [K, cols]
buffer starts at `K * col_offsets[u]` and is [K, n_u] row-major. Per partition of I:

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

from cpu_experts.kernels import activation, epilogues, quantize_row
from cpu_experts.packed import PackedLayer
from cpu_experts.prefill import Workspace

COLUMN_TILE = 16  # columns per expert block are padded to a multiple of this
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


class Int8Prefill:
    """The steps of the module docstring over a `Workspace` (no buffer is allocated per call once it has grown)."""

    def __init__(self, layer: PackedLayer, workspace: Workspace):
        self.layer = layer
        self.ws = workspace
        self.views = [tuple(torch.from_numpy(w) for w in (p.gate, p.up, p.down)) for p in layer.partitions]
        self.epilogues = epilogues(layer)

    def __call__(self, x: np.ndarray, routing) -> np.ndarray:
        ws, r = self.ws, routing
        hidden = x.shape[1]
        counts = np.diff(r.offsets)
        col_offsets = np.zeros(len(counts) + 1, dtype=np.int64)
        np.cumsum(-(-counts // COLUMN_TILE) * COLUMN_TILE, out=col_offsets[1:])
        num_cols = int(col_offsets[-1])
        x_q = ws.array("x_q", x.shape, np.int8)
        x_scale = np.empty(x.shape[0], dtype=np.float32)
        quantize_rows(x, x_q, x_scale)
        x_t = ws.array("x_t", (hidden * num_cols,), np.int8)
        pack_columns(x_q, r.offsets, r.pair_token, col_offsets, x_t)
        act_scale = np.empty(len(r.pair_token), dtype=np.float32)
        out = np.zeros(x.shape, dtype=np.float32)
        for part, (gate, up, down), epilogue in zip(self.layer.partitions, self.views, self.epilogues, strict=True):
            size = part.size
            gate_acc = ws.array("gate_acc", (size * num_cols,), np.int32)
            up_acc = ws.array("up_acc", (size * num_cols,), np.int32)
            self._matmuls(((gate, x_t, gate_acc), (up, x_t, up_acc)), r.experts, col_offsets)
            act_t = ws.array("act_t", (size * num_cols,), np.int8)
            act_columns(gate_acc, up_acc, r.experts, r.offsets, r.pair_token, col_offsets, x_scale,
                        part.gate_scales, part.up_scales, epilogue, ws.array("act", (size * num_cols,), np.float32),
                        act_t, act_scale)
            down_acc = ws.array("down_acc", (hidden * num_cols,), np.int32)
            self._matmuls(((down, act_t, down_acc),), r.experts, col_offsets)
            combine_columns(down_acc, r.experts, r.offsets, r.pair_token, r.pair_weight, col_offsets, act_scale,
                            part.down_scales, out)
        return out

    @staticmethod
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
