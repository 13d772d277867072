"""Prefill path of the CPU MoE operator: many tokens, so the work is matrix multiplication, not streaming.

The call's (token, slot) pairs, grouped by expert (`operator.Routing`), are laid out as rows of fixed work buffers:
expert u's pairs occupy rows `row_offsets[u]:row_offsets[u + 1]` (for int8, padded to whole tiles of rows so that
every matmul call of a phase has the same shape, see `int8_tile`). Per partition of I:

1. per expert: gate = x_rows @ gate[e].T and up = x_rows @ up[e].T  ([rows_e, H] @ [H, Ip])
2. for all pairs at once: act = silu(gate) * up                      ([R, Ip])
3. per expert: down = act_rows @ down[e].T                           ([rows_e, Ip] @ [Ip, H])
4. for all tokens at once: out[t] += sum_k weight[t, k] * down[row of (t, k)]

Two matmul kinds:
- `Int8Prefill` (int8 experts with one scale per output channel): activations are quantized per row to int8
  (symmetric, dynamic: W8A8, what llama.cpp and KTransformers do for quantized experts), the products run as
  int8 x int8 -> int32 (`torch._int_mm`: oneDNN, VNNI or AMX-INT8 where the CPU has them) and the scales are
  applied in the numba epilogues of steps 2 and 4.
- `DequantPrefill` (int4, grouped int8, bf16, or int8 when asked to keep activations in float): each routed
  expert is dequantized once per call to the activations' dtype (bf16 uses AMX-BF16 where present) by numba
  kernels, then multiplied in PyTorch.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from numba import njit, prange

from cpu_experts import memory
from cpu_experts.kernels import quantize_row, round_rows_int8
from cpu_experts.packed import PackedLayer, PartitionWeights

MIN_TILE, MAX_TILE = 16, 64  # rows per int8 matmul (see `int8_tile`)
FLAGS = dict(parallel=True, fastmath=True, nogil=True, cache=True)


# ---- numba kernels -------------------------------------------------------------------------------------------

@njit(**FLAGS)
def quantize_rows(x, q, scales):
    """x float32 [T, K] -> q int8 [T, K], scales float32 [T]."""
    for t in prange(x.shape[0]):
        scales[t] = quantize_row(x[t], q[t])


@njit(**FLAGS)
def act_int8(gate_acc, up_acc, rows, pair_expert, x_scale, gate_s, up_s, act, act_q, act_scale):
    """Step 2 for int8: act[r] = silu(gate_acc[r] * s) * (up_acc[r] * s') with s = x_scale[r] * channel scale,
    then quantized per row into act_q / act_scale. gate_acc, up_acc int32 [R, Ip]; act float32 scratch [R, Ip]."""
    for p in prange(rows.shape[0]):
        r, e = rows[p], pair_expert[p]
        xs = x_scale[r]
        g_s, u_s = gate_s[e], up_s[e]  # [Ip, 1]
        a = act[r]
        for i in range(a.shape[0]):
            g = np.float32(gate_acc[r, i]) * (xs * g_s[i, 0])
            u = np.float32(up_acc[r, i]) * (xs * u_s[i, 0])
            a[i] = g / (np.float32(1.0) + np.exp(-g)) * u
        act_scale[r] = quantize_row(a, act_q[r])


@njit(**FLAGS)
def combine_int8(down_acc, pair_index, rows, pair_expert, pair_weight, act_scale, down_s, out):
    """Step 4 for int8: out[t] += sum_k w * act_scale * down_scale[h] * down_acc[row]; pair_index [T, K] is each
    slot's pair (-1: none). Parallel over tokens, so no two threads write one row of `out`."""
    for t in prange(pair_index.shape[0]):
        o = out[t]
        for k in range(pair_index.shape[1]):
            p = pair_index[t, k]
            if p < 0:
                continue
            r = rows[p]
            c = pair_weight[p] * act_scale[r]
            d, s = down_acc[r], down_s[pair_expert[p]]  # [H], [H, 1]
            for h in range(o.shape[0]):
                o[h] += c * s[h, 0] * np.float32(d[h])


@njit(**FLAGS)
def dequantize_int8(q, scales, group, out):
    """q int8 [N, K], scales [N, G] -> out float32 [N, K]."""
    cols = q.shape[1]
    for n in prange(q.shape[0]):
        for g in range(scales.shape[1]):
            s = scales[n, g]
            for j in range(g * group, min((g + 1) * group, cols)):
                out[n, j] = np.float32(q[n, j]) * s


@njit(**FLAGS)
def dequantize_int4(packed, scales, group, out):
    """packed uint8 [N, ceil(K / 2)] (even column in the low nibble), scales [N, G] -> out float32 [N, K]."""
    cols = out.shape[1]
    for n in prange(packed.shape[0]):
        for j in range(cols):
            byte = np.int32(packed[n, j >> 1])
            nibble = (byte >> ((j & 1) * 4)) & 15
            out[n, j] = np.float32(nibble - 8) * scales[n, j // group]


# ---- drivers ---------------------------------------------------------------------------------------------------

class RowLayout:
    """Where each pair's row lives in the work buffers (see the module docstring): expert u's rows start at
    `row_offsets[u]`, padded to a multiple of `tile` rows."""

    def __init__(self, routing, num_tokens: int, top_k: int, tile: int = 1):
        counts = np.diff(routing.offsets)
        padded = -(-counts // tile) * tile
        self.tile = tile
        self.row_offsets = np.zeros(len(counts) + 1, dtype=np.int64)
        np.cumsum(padded, out=self.row_offsets[1:])
        self.pair_expert = np.repeat(routing.experts, counts)  # [P]
        first_pair = np.repeat(routing.offsets[:-1], counts)
        self.rows = np.repeat(self.row_offsets[:-1], counts) + np.arange(len(first_pair)) - first_pair  # [P]
        self.num_rows = int(self.row_offsets[-1])
        self.row_token = np.zeros(self.num_rows, dtype=np.int64)  # padding rows read token 0; never read back
        self.row_token[self.rows] = routing.pair_token
        self.pair_index = routing.pair_index.reshape(num_tokens, top_k)

    def blocks(self, experts: list[int]):
        """(expert, first row, end row) per matmul: whole tiles, so every call of the phase has one shape."""
        for u, e in enumerate(experts):
            for r0 in range(int(self.row_offsets[u]), int(self.row_offsets[u + 1]), self.tile):
                yield e, r0, r0 + self.tile


def int8_tile(num_pairs: int, num_experts: int) -> int:
    """Rows per int8 matmul call: about one expert's share of the pairs, a power of two in [16, MAX_TILE]. oneDNN
    reuses its kernel only while the shape stays the same; calls of varying M measured several times slower."""
    share = max(1, num_pairs // max(1, num_experts))
    return min(MAX_TILE, max(MIN_TILE, 1 << (share - 1).bit_length()))


class Workspace:
    """Grow-only scratch buffers, reused across calls and shared by the layers of a model (one call at a time).
    Fresh buffers are page-faulted in by the matmul threads as they first write them, which measured slower than
    the matmuls themselves; these are faulted in once, in huge pages where the kernel allows."""

    def __init__(self):
        self._buffers: dict[str, np.ndarray] = {}

    def array(self, name: str, shape: tuple[int, ...], dtype) -> np.ndarray:
        dtype = np.dtype(dtype)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        buf = self._buffers.get(name)
        if buf is None or buf.nbytes < nbytes:
            buf = memory.empty((max(nbytes, 1) * 5 // 4,), np.uint8)  # headroom: calls vary in size
            buf[::4096] = 0  # fault every page in now
            self._buffers[name] = buf
        return buf[:nbytes].view(dtype).reshape(shape)

    def tensor(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        if dtype == torch.bfloat16:
            return torch.from_numpy(self.array(name, shape, np.uint16)).view(torch.bfloat16)
        return torch.from_numpy(self.array(name, shape, torch.empty((), dtype=dtype).numpy().dtype))


class Int8Prefill:
    """int8 x int8 -> int32 matmuls with the scales applied in numba epilogues (per-channel int8 experts)."""

    def __init__(self, layer: PackedLayer, workspace: Workspace):
        self.layer = layer
        self.ws = workspace
        self.views = [_torch_views(part) for part in layer.partitions]

    def __call__(self, x: np.ndarray, routing, top_k: int) -> np.ndarray:
        ws = self.ws
        lay = RowLayout(routing, x.shape[0], top_k, int8_tile(len(routing.pair_token), len(routing.experts)))
        x_q = ws.array("x_q", x.shape, np.int8)
        x_scale = np.empty(x.shape[0], dtype=np.float32)
        quantize_rows(x, x_q, x_scale)
        rows_q = ws.tensor("rows_q", (lay.num_rows, x.shape[1]), torch.int8)  # [R, H]
        torch.index_select(torch.from_numpy(x_q), 0, torch.from_numpy(lay.row_token), out=rows_q)
        rows_scale = x_scale[lay.row_token]
        out = np.zeros(x.shape, dtype=np.float32)
        experts = routing.experts.tolist()
        for part, (gate, up, down) in zip(self.layer.partitions, self.views, strict=True):
            size = part.size
            gate_acc = ws.tensor("gate_acc", (lay.num_rows, size), torch.int32)
            up_acc = ws.tensor("up_acc", (lay.num_rows, size), torch.int32)
            for e, r0, r1 in lay.blocks(experts):
                torch._int_mm(rows_q[r0:r1], gate[e].t(), out=gate_acc[r0:r1])
                torch._int_mm(rows_q[r0:r1], up[e].t(), out=up_acc[r0:r1])
            act = ws.array("act", (lay.num_rows, size), np.float32)
            act_q = ws.array("act_q", (lay.num_rows, size), np.int8)  # padding rows: whatever is there, unread
            act_scale = np.zeros(lay.num_rows, dtype=np.float32)
            act_int8(gate_acc.numpy(), up_acc.numpy(), lay.rows, lay.pair_expert, rows_scale, part.gate_scales,
                     part.up_scales, act, act_q, act_scale)
            act_t = torch.from_numpy(act_q)
            down_acc = ws.tensor("down_acc", (lay.num_rows, x.shape[1]), torch.int32)
            for e, r0, r1 in lay.blocks(experts):
                torch._int_mm(act_t[r0:r1], down[e].t(), out=down_acc[r0:r1])
            combine_int8(down_acc.numpy(), lay.pair_index, lay.rows, lay.pair_expert, routing.pair_weight,
                         act_scale, part.down_scales, out)
        return out


class DequantPrefill:
    """Each routed expert dequantized once per call, then PyTorch matmuls in the activations' dtype.
    `round_activations`: the matmul inputs are rounded to their per-row int8 grid first (the W8A8 semantics of
    quantized experts, kept in float here)."""

    def __init__(self, layer: PackedLayer, workspace: Workspace, round_activations: bool = False):
        self.layer = layer
        self.spec = layer.spec
        self.ws = workspace
        self.round_activations = round_activations

    def __call__(self, x: torch.Tensor, routing, top_k: int) -> torch.Tensor:
        lay = RowLayout(routing, x.shape[0], top_k)
        x_rows = self._rounded(x[torch.from_numpy(lay.row_token)])  # [R, H]
        rows = torch.from_numpy(lay.rows)
        out = torch.zeros(x.shape, dtype=torch.float32)
        weights = torch.from_numpy(routing.pair_weight)[:, None]
        experts = routing.experts.tolist()
        for part in self.layer.partitions:
            gate = self.ws.tensor("gate", (lay.num_rows, part.size), x.dtype)
            up = self.ws.tensor("up", (lay.num_rows, part.size), x.dtype)
            for u, e in enumerate(experts):
                r0, r1 = int(lay.row_offsets[u]), int(lay.row_offsets[u + 1])
                torch.mm(x_rows[r0:r1], self._weight(part, "gate", e, x.dtype).t(), out=gate[r0:r1])
                torch.mm(x_rows[r0:r1], self._weight(part, "up", e, x.dtype).t(), out=up[r0:r1])
            act = self._rounded(F.silu(gate) * up)  # [R, Ip]
            down = self.ws.tensor("down", (lay.num_rows, x.shape[1]), x.dtype)
            for u, e in enumerate(experts):
                r0, r1 = int(lay.row_offsets[u]), int(lay.row_offsets[u + 1])
                torch.mm(act[r0:r1], self._weight(part, "down", e, x.dtype).t(), out=down[r0:r1])
            out.index_add_(0, torch.from_numpy(routing.pair_token), down[rows].float() * weights)
        return out

    def _rounded(self, rows: torch.Tensor) -> torch.Tensor:
        if not self.round_activations:
            return rows
        rounded = rows.float().contiguous()
        round_rows_int8(rounded.numpy())
        return rounded.to(rows.dtype)

    def _weight(self, part: PartitionWeights, role: str, expert: int, dtype: torch.dtype) -> torch.Tensor:
        """One partition's slice of one expert's projection, dequantized -> [N, K] in `dtype`."""
        weight = getattr(part, role)[expert]
        if self.spec.dtype == "bf16":
            return torch.from_numpy(weight).view(torch.bfloat16).to(dtype)
        scales = getattr(part, f"{role}_scales")[expert]
        cols = self.spec.hidden_size if role != "down" else part.size
        out = self.ws.array("weight", (weight.shape[0], cols), np.float32)
        group = self.spec.group_size or (self.spec.hidden_size if role != "down" else part.size)
        if self.spec.dtype == "int4":
            dequantize_int4(weight, scales, group, out)
        else:
            dequantize_int8(weight, scales, group, out)
        return torch.from_numpy(out).to(dtype)


def _torch_views(part: PartitionWeights) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch.from_numpy(part.gate), torch.from_numpy(part.up), torch.from_numpy(part.down)
