"""Prefill path of the CPU MoE operator: many tokens, so the work is matrix multiplication, not streaming.

One driver, `Prefill`, runs every prefill call; a backend per GEMM family (`PrefillBackend`) provides only what
differs between them: how the activations are prepared, the gate/up call (producing act) and the down call
(accumulating into the output). `kernel_table.select` names a layer's backend from its format and the CPU's
features (a `kernel_table.PREFILL` key), `operator.make_prefill` builds it:
- `prefill_amx.AmxInt8Backend`: per-channel int8 x int8 (W8A8) on AMX-INT8;
- `prefill_amx_grouped.AmxGroupedBackend`: int4 and grouped int8, W8A8 on AMX-INT8;
- `prefill_amx_float.AmxFloatBackend`: FP8, MXFP4, NVFP4 as bf16 x bf16 on AMX-BF16;
- `prefill_int8.OneDnnInt8Backend`: per-channel int8 W8A8 through oneDNN (`torch._int_mm`), CPUs without AMX;
- `DequantBackend` (here): everything else (int4 and grouped int8 without AMX, bf16, the float formats without
  AMX-BF16 or off its tiles, int8 with float activations).

The call's (token, slot) pairs, grouped by expert (`operator.Routing`), are its units of work: expert u's pairs are
`offsets[u]:offsets[u + 1]`. The column backends (all but `DequantBackend`) lay them out as columns, expert u's
padded to a multiple of COLUMN_TILE from `col_offsets[u]` (`PrefillCall`). Per call:

1. the hidden rows prepared once (`activations`: int8 rows and scales, bf16 pairs, or float rows), packed
2. per partition of I: gate_up: act = silu(gate x) * (up x)  ([pairs, Ip]; other activations and biases:
   `kernels.activation`)
3.                     down: out[t] += weight * down act    (act prepared as the hidden rows were)

`DequantBackend`: each routed expert dequantized once per call to the activations' dtype by numba kernels, then
multiplied in PyTorch, the pairs as rows of work buffers in routing order. The float formats keep their decode
kernels' contract (`cpu_experts.kernels_fp8`, `kernels_fp4`): float32 weights and matmuls on activations rounded to
bf16 (an e4m3 value times a float32 scale has more bits than bf16 holds). Per partition of I:

1. per expert: gate = x_rows @ gate[e].T and up = x_rows @ up[e].T  ([rows_e, H] @ [H, Ip])
2. for all pairs at once: act = silu(gate) * up                      ([P, Ip], float32 for other activations)
3. per expert: down = act_rows @ down[e].T                           ([rows_e, Ip] @ [Ip, H])
4. for all pairs at once: out[t] += weight * down[row of the pair]

`Workspace` holds the scratch buffers of every backend.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Protocol

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
COLUMN_TILE = 16  # the column backends' pairs of an expert are padded to a multiple of this (`PrefillCall`)


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


# ---- the driver --------------------------------------------------------------------------------------------------

class Workspace:
    """Grow-only scratch buffers, reused across calls and shared by the layers of a model (one call at a time).
    Fresh buffers are page-faulted in by the matmul threads as they first write them, which measured slower than
    the matmuls themselves; these are faulted in once, in huge pages where the kernel allows."""

    def __init__(self):
        self._buffers: dict[str, np.ndarray] = {}

    def array(self, name: str, shape: tuple[int, ...], dtype) -> np.ndarray:
        dtype = np.dtype(dtype)
        nbytes = math.prod(map(int, shape)) * dtype.itemsize  # (np.prod: ~10 us a call, a few calls a partition)
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


@dataclass(frozen=True)
class PrefillCall:
    """One call's routing and what every backend step reads of it. `col_offsets` [U + 1]: expert u's columns start
    at `col_offsets[u]`, its pairs padded to a multiple of COLUMN_TILE (`num_cols` in all), for the backends whose
    `uses_columns` says so (else None, 0); `pair_rows` [P]: 0 .. P - 1, the act row of each pair."""
    routing: Any  # operator.Routing (experts, offsets, pair_token, pair_weight)
    workspace: Workspace
    col_offsets: np.ndarray | None
    num_cols: int
    pair_rows: np.ndarray | None

    @classmethod
    def of(cls, routing, workspace: Workspace, uses_columns: bool) -> PrefillCall:
        if not uses_columns:
            return cls(routing, workspace, None, 0, None)
        col_offsets = np.zeros(len(routing.experts) + 1, dtype=np.int64)
        np.cumsum(-(-np.diff(routing.offsets) // COLUMN_TILE) * COLUMN_TILE, out=col_offsets[1:])
        pair_rows = np.arange(len(routing.pair_token), dtype=np.int64)
        return cls(routing, workspace, col_offsets, int(col_offsets[-1]), pair_rows)


class PrefillBackend(Protocol):
    """What differs between the GEMM families; `Prefill` runs the rest. `uses_columns`: lays the pairs out as
    `PrefillCall`'s columns."""
    layer: PackedLayer
    uses_columns: bool

    def activations(self, hidden: torch.Tensor, call: PrefillCall) -> Any:
        """hidden [T, H] -> gate_up's operand (and any per-call state of the backend), once per call."""

    def gate_up(self, call: PrefillCall, part: PartitionWeights, epilogue, x: Any) -> Any:
        """act = activation(gate x, up x) of one partition, in the form `down` takes."""

    def down(self, call: PrefillCall, part: PartitionWeights, act: Any, out: np.ndarray) -> None:
        """out[t] += weight * (down act) for every pair of one partition; out float32 [T, H]."""


class Prefill:
    """The prefill of the module docstring: one call's sequence over any `PrefillBackend`. hidden [T, H] (any float
    dtype) -> float32 [T, H], without the down bias (`CpuMoE` adds it)."""

    def __init__(self, backend: PrefillBackend, workspace: Workspace):
        self.backend = backend
        self.layer = backend.layer
        self.workspace = workspace
        self.epilogues = epilogues(self.layer)

    def __call__(self, hidden: torch.Tensor, routing) -> torch.Tensor:
        backend = self.backend
        call = PrefillCall.of(routing, self.workspace, backend.uses_columns)
        x = backend.activations(hidden, call)
        out = np.zeros((hidden.shape[0], self.layer.spec.hidden_size), dtype=np.float32)
        for part, epilogue in zip(self.layer.partitions, self.epilogues, strict=True):
            act = backend.gate_up(call, part, epilogue, x)
            backend.down(call, part, act, out)
        return torch.from_numpy(out)


def float32_rows(hidden: torch.Tensor) -> np.ndarray:
    """hidden [T, H] as the C-contiguous float32 array the numba backends take."""
    return hidden.detach().float().contiguous().numpy()


# ---- the dequantize-and-multiply backend ------------------------------------------------------------------------

class DequantBackend:
    """Each routed expert dequantized once per call, then PyTorch matmuls in the activations' dtype (bf16 or
    float32 as given, float32 otherwise). `round_activations`: the matmul inputs are rounded to their per-row int8
    grid first (the W8A8 semantics of quantized experts, kept in float here). `bf16_activations`: rounded to bf16
    instead, the matmuls in float32 whatever the activations' dtype (the float formats' contract)."""

    uses_columns = False

    def __init__(self, layer: PackedLayer, round_activations: bool = False, bf16_activations: bool = False):
        self.layer = layer
        self.spec = layer.spec
        self.round_activations = round_activations
        self.bf16_activations = bf16_activations

    def activations(self, hidden: torch.Tensor, call: PrefillCall) -> torch.Tensor:
        """The pairs' rows x[pair_token], rounded to the activation grid: [P, H]."""
        dtype = hidden.dtype if hidden.dtype in (torch.bfloat16, torch.float32) else torch.float32
        x = hidden.detach().to(dtype)
        if self.bf16_activations:
            x = x.float()
        return self._rounded(x[torch.from_numpy(call.routing.pair_token)])

    def gate_up(self, call: PrefillCall, part: PartitionWeights, epilogue, x_rows: torch.Tensor) -> torch.Tensor:
        num_pairs, dtype, ws = x_rows.shape[0], x_rows.dtype, call.workspace
        gate = ws.tensor("gate", (num_pairs, part.size), dtype)
        up = ws.tensor("up", (num_pairs, part.size), dtype)
        bounds = call.routing.offsets.tolist()
        for u, e in enumerate(call.routing.experts.tolist()):
            r0, r1 = bounds[u], bounds[u + 1]
            torch.mm(x_rows[r0:r1], self._weight(ws, part, "gate", e, dtype).t(), out=gate[r0:r1])
            torch.mm(x_rows[r0:r1], self._weight(ws, part, "up", e, dtype).t(), out=up[r0:r1])
        return self._rounded(self._activation(gate, up, call.routing, epilogue))  # [P, Ip]

    def down(self, call: PrefillCall, part: PartitionWeights, act: torch.Tensor, out: np.ndarray) -> None:
        r, ws = call.routing, call.workspace
        down = ws.tensor("down", (act.shape[0], out.shape[1]), act.dtype)
        bounds = r.offsets.tolist()
        for u, e in enumerate(r.experts.tolist()):
            r0, r1 = bounds[u], bounds[u + 1]
            torch.mm(act[r0:r1], self._weight(ws, part, "down", e, act.dtype).t(), out=down[r0:r1])
        weighted = down.float() * torch.from_numpy(r.pair_weight)[:, None]
        torch.from_numpy(out).index_add_(0, torch.from_numpy(r.pair_token), weighted)

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

    def _weight(self, ws: Workspace, part: PartitionWeights, role: str, expert: int, dtype: torch.dtype
                ) -> torch.Tensor:
        """One partition's slice of one expert's projection, dequantized -> [N, K] in `dtype`."""
        weight = getattr(part, role)[expert]
        if self.spec.dtype == "bf16":
            return torch.from_numpy(weight).view(torch.bfloat16).to(dtype)
        scales = getattr(part, f"{role}_scales")[expert]
        cols = self.spec.hidden_size if role != "down" else part.size
        out = ws.array("weight", (weight.shape[0], cols), np.float32)
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
