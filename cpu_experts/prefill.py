"""Prefill path of the CPU MoE operator: many tokens, so the work is matrix multiplication, not streaming.

Per-channel int8 experts with int8 activations (W8A8) take `cpu_experts.prefill_amx` (AMX) or `prefill_int8`.
The rest (int4, grouped int8, bf16, FP8, MXFP4, NVFP4, or int8 with float activations) takes `DequantPrefill`
here: each routed expert is dequantized once per call to the activations' dtype by numba kernels (bf16 uses
AMX-BF16 where present), then multiplied in PyTorch. The float formats keep their decode kernels' contract
(`cpu_experts.kernels_fp8`, `kernels_fp4`): float32 weights and matmuls on activations rounded to bf16 (an e4m3
value times a float32 scale has more bits than bf16 holds). The call's (token, slot) pairs, grouped by expert
(`operator.Routing`), are rows of work buffers in that order: expert u's pairs are rows
`offsets[u]:offsets[u + 1]`. Per partition of I:

1. per expert: gate = x_rows @ gate[e].T and up = x_rows @ up[e].T  ([rows_e, H] @ [H, Ip])
2. for all pairs at once: act = silu(gate) * up                      ([R, Ip]; other activations and biases:
   `kernels.activation_rows`, in float32)
3. per expert: down = act_rows @ down[e].T                           ([rows_e, Ip] @ [Ip, H])
4. for all pairs at once: out[t] += weight * down[row of the pair]

`Workspace` holds the scratch buffers of both prefill paths.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from numba import njit, prange

from cpu_experts import kernels_fp4, memory
from cpu_experts.kernels import activation_rows, epilogues, round_rows_int8, scale_value
from cpu_experts.kernels_fp8 import FLOAT16_BIAS, e4m3_over_256
from cpu_experts.packed import PackedLayer, PartitionWeights

FLAGS = dict(parallel=True, fastmath=True, nogil=True, cache=True)
EXACT_FLAGS = dict(parallel=True, nogil=True, cache=True)  # products in the written order


# ---- numba kernels -------------------------------------------------------------------------------------------

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
    """packed uint8 [N, ceil(K / 2)] (even column in the low nibble), scales [N, G] (float32, or bfloat16 bits as
    uint16) -> out float32 [N, K]."""
    cols = out.shape[1]
    for n in prange(packed.shape[0]):
        for j in range(cols):
            byte = np.int32(packed[n, j >> 1])
            nibble = (byte >> ((j & 1) * 4)) & 15
            out[n, j] = np.float32(nibble - 8) * scale_value(scales[n, j // group])


@njit(**EXACT_FLAGS)
def dequantize_fp8(q, scales, group, out):
    """q uint8 [N, K] e4m3 bits, scales float32 [N, G] -> out float32 [N, K] (value x scale, rounded once: the
    reference's `formats.dequantize_fp8`). Not fastmath: reassociated, (value / 256) * 256 * scale became
    (value / 256) * (256 * scale), infinite for an E8M0 scale of 2^127 (DeepSeek-V4's `.scale` 254)."""
    cols = q.shape[1]
    for n in prange(q.shape[0]):
        for g in range(scales.shape[1]):
            s = scales[n, g]
            for j in range(g * group, min((g + 1) * group, cols)):
                out[n, j] = e4m3_over_256(q[n, j]) * FLOAT16_BIAS * s


# ---- drivers ---------------------------------------------------------------------------------------------------

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


class DequantPrefill:
    """Each routed expert dequantized once per call, then PyTorch matmuls in the activations' dtype.
    `round_activations`: the matmul inputs are rounded to their per-row int8 grid first (the W8A8 semantics of
    quantized experts, kept in float here). `bf16_activations`: rounded to bf16 instead, the matmuls in float32
    whatever the activations' dtype (the float formats' contract)."""

    def __init__(self, layer: PackedLayer, workspace: Workspace, round_activations: bool = False,
                 bf16_activations: bool = False):
        self.layer = layer
        self.spec = layer.spec
        self.ws = workspace
        self.round_activations = round_activations
        self.bf16_activations = bf16_activations
        self.epilogues = epilogues(layer)

    def __call__(self, x: torch.Tensor, routing) -> torch.Tensor:
        if self.bf16_activations:
            x = x.float()
        pair_token = torch.from_numpy(routing.pair_token)
        num_pairs = len(routing.pair_token)
        x_rows = self._rounded(x[pair_token])  # [P, H]
        out = torch.zeros(x.shape, dtype=torch.float32)
        weights = torch.from_numpy(routing.pair_weight)[:, None]
        experts, bounds = routing.experts.tolist(), routing.offsets.tolist()
        for part, epilogue in zip(self.layer.partitions, self.epilogues, strict=True):
            gate = self.ws.tensor("gate", (num_pairs, part.size), x.dtype)
            up = self.ws.tensor("up", (num_pairs, part.size), x.dtype)
            for u, e in enumerate(experts):
                r0, r1 = bounds[u], bounds[u + 1]
                torch.mm(x_rows[r0:r1], self._weight(part, "gate", e, x.dtype).t(), out=gate[r0:r1])
                torch.mm(x_rows[r0:r1], self._weight(part, "up", e, x.dtype).t(), out=up[r0:r1])
            act = self._rounded(self._activation(gate, up, routing, epilogue))  # [P, Ip]
            down = self.ws.tensor("down", (num_pairs, x.shape[1]), x.dtype)
            for u, e in enumerate(experts):
                r0, r1 = bounds[u], bounds[u + 1]
                torch.mm(act[r0:r1], self._weight(part, "down", e, x.dtype).t(), out=down[r0:r1])
            out.index_add_(0, pair_token, down.float() * weights)
        return out

    def _activation(self, gate: torch.Tensor, up: torch.Tensor, routing, epilogue) -> torch.Tensor:
        if epilogue is None:
            return F.silu(gate) * up
        act = torch.empty(gate.shape, dtype=torch.float32)
        activation_rows(gate.float().numpy(), up.float().numpy(), routing.experts, routing.offsets, epilogue,
                        act.numpy())
        return act.to(gate.dtype)

    def _rounded(self, rows: torch.Tensor) -> torch.Tensor:
        if self.bf16_activations:
            return rows.to(torch.bfloat16).float()
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
        if self.spec.dtype in ("mxfp4", "nvfp4"):
            tensor_scale = getattr(part, f"{role}_tensor_scale")
            kernels_fp4.dequantize_fp4(weight, scales, self.spec.dtype == "mxfp4",
                                       np.float32(1.0 if tensor_scale is None else tensor_scale[expert]), out)
        elif self.spec.dtype == "int4":
            dequantize_int4(weight, scales, group, out)
        elif self.spec.dtype == "fp8":
            dequantize_fp8(weight, scales, group, out)
        else:
            dequantize_int8(weight, scales, group, out)
        return torch.from_numpy(out).to(dtype)


def _torch_views(part: PartitionWeights) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch.from_numpy(part.gate), torch.from_numpy(part.up), torch.from_numpy(part.down)
