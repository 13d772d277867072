"""`CpuMoE`: the routed experts of one MoE layer on the CPU.

forward(hidden [T, H], topk_ids [T, K], topk_weights [T, K]) -> [T, H] = sum_k w[t, k] * expert_{id[t, k]}(h[t]),
expert(x) = down(silu(gate x) * up x); an id of -1 is skipped (the expert runs elsewhere, e.g. on the GPU). A layer
whose spec says so (gpt-oss) adds biases and computes another activation: expert(x) = down(act(gate x + b_g,
up x + b_u)) + b_d (`ExpertActivation`; every kernel through `kernels.activation`, the down bias weighted like
the matmul and added once per call, after the partitions' sums: `kernels.add_down_bias`).

Per call, the (token, slot) pairs are grouped by expert (`route`), then each partition of I computes its partial
output and the partials are summed. Which kernels a layer runs is decided once, when it is built, by
`cpu_experts.kernel_table.select` from its format and the CPU's features (`self.kernels`). Two drivers, chosen per
call by token count:
- decode (few tokens, below `prefill_min_tokens`): `decode` prepares the rows once for the layer's item kernel
  (`DECODE_KERNELS`: int8 rows for the VNNI kernels to quantize, rounded rows for their float forms, bf16 rows for
  the float formats), then runs it partition by partition; each streams every routed expert's rows once,
  dequantizing in registers. In the engine the decode pool's pinned threads run the same loop bodies
  (`cpu_experts.decode_pool`), for graph and eager decode steps;
- prefill (many tokens, and bf16 experts at any count): one driver (`cpu_experts.prefill.Prefill`: activations
  prepared once, per partition gate_up -> act -> down into one output) over the layer's GEMM backend
  (`make_prefill`): AMX-INT8 (`prefill_amx`, `prefill_amx_grouped`), AMX-BF16 for the float formats
  (`prefill_amx_float`), oneDNN for per-channel int8 (`prefill_int8`), else each routed expert dequantized and
  multiplied by PyTorch (`prefill.DequantBackend`).
The float formats compute on bfloat16 activations whatever `int8_activations` says: each matmul's input is rounded
to bf16 on both paths, products and sums in float32 (the format's published contract).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from numba import njit

from cpu_experts import (
    kernels,
    kernels_fp4,
    kernels_fp8,
    kernels_vnni,
    kernels_vnni_int4,
    prefill_amx,
    prefill_amx_float,
    prefill_amx_grouped,
)
from cpu_experts.kernel_table import CpuFeatures, ExpertKernels, select
from cpu_experts.packed import PackedLayer
from cpu_experts.prefill import DequantBackend, Prefill, Workspace
from cpu_experts.prefill_int8 import OneDnnInt8Backend


@dataclass(frozen=True)
class Routing:
    """The call's (token, slot) pairs grouped by expert; `offsets[u]:offsets[u + 1]` are expert `experts[u]`'s."""
    experts: np.ndarray  # [U] int64
    offsets: np.ndarray  # [U + 1] int64
    pair_token: np.ndarray  # [P] int64
    pair_weight: np.ndarray  # [P] float32


def route(topk_ids: np.ndarray, topk_weights: np.ndarray, num_experts: int) -> Routing:
    flat = np.ascontiguousarray(topk_ids.reshape(-1), dtype=np.int64)
    weights = np.ascontiguousarray(topk_weights.reshape(-1), dtype=np.float32)
    *arrays, bad = _route(flat, weights, topk_ids.shape[1], num_experts)
    if bad >= 0:
        raise ValueError(f"topk_ids holds expert {flat[bad]}, outside [-1, {num_experts})")
    return Routing(*arrays)


@njit(cache=True)
def _route(flat, weights, top_k, num_experts):
    """A counting sort, stable by (expert, token), in one compiled call: per-call work that numpy's unique and
    argsort did in tens of microseconds, a noticeable share of a small-expert decode call. Returns the Routing
    arrays and the index of the first id outside [-1, num_experts), or -1."""
    counts = np.zeros(num_experts, dtype=np.int64)
    num_pairs = 0
    for j in range(flat.size):
        e = flat[j]
        if e < -1 or e >= num_experts:
            empty = np.empty(0, dtype=np.int64)
            return empty, np.zeros(1, dtype=np.int64), empty, np.empty(0, dtype=np.float32), j
        if e >= 0:
            counts[e] += 1
            num_pairs += 1
    experts = np.flatnonzero(counts)
    offsets = np.zeros(experts.size + 1, dtype=np.int64)
    for u in range(experts.size):
        offsets[u + 1] = offsets[u] + counts[experts[u]]
        counts[experts[u]] = offsets[u]  # from here on: the expert's next free pair
    pair_token = np.empty(num_pairs, dtype=np.int64)
    pair_weight = np.empty(num_pairs, dtype=np.float32)
    for j in range(flat.size):
        e = flat[j]
        if e < 0:
            continue
        p = counts[e]
        counts[e] = p + 1
        pair_token[p] = j // top_k
        pair_weight[p] = weights[j]
    return experts, offsets, pair_token, pair_weight, -1


class CpuMoE:
    """`int8_activations` (int8 and int4 experts): every matmul input row is rounded to int8 with its own absmax
    scale (W8A8), on both paths, so a token gets the same result whether it is decoded or prefilled; per-channel
    int8 experts then prefill as int8 x int8 (`cpu_experts.prefill_int8`). False keeps activations in float, exact to
    the converted weights, prefill slower. MXFP4 and NVFP4 experts ignore it: their inputs are rounded to bf16 (the
    formats' contract, `cpu_experts.kernels_fp4`). `workspace`: scratch buffers, shareable by all layers of a model.
    `features`: what the kernels may use (`kernel_table.CpuFeatures`; None: this CPU's), the kernels chosen once,
    here, by `kernel_table.select` (`self.kernels`)."""

    def __init__(self, layer: PackedLayer, prefill_min_tokens: int | None = None,
                 int8_activations: bool = True, workspace: Workspace | None = None,
                 features: CpuFeatures | None = None):
        self.layer = layer
        self.spec = layer.spec
        self.kernels = select(layer, features or CpuFeatures.detect(), int8_activations, prefill_min_tokens)
        self.prefill = make_prefill(self.kernels, layer, workspace or Workspace())
        self.epilogues = kernels.epilogues(layer)  # per partition (`kernels.activation`)

    @property
    def is_w8a8(self) -> bool:
        return self.kernels.is_w8a8

    @property
    def prefill_min_tokens(self) -> int:
        return self.kernels.prefill_min_tokens

    def __call__(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        self._check(hidden, topk_ids, topk_weights)
        routing = route(topk_ids.cpu().numpy(), topk_weights.detach().float().cpu().numpy(), self.spec.num_experts)
        if not self.layer.partitions:  # an empty rank slice: nothing here but the down bias (rank 0 has a slice)
            zeros = torch.zeros(hidden.shape[0], self.spec.hidden_size)
            return self._with_bias(zeros, routing).to(hidden.dtype)
        if self.kernels.decode is not None and hidden.shape[0] < self.prefill_min_tokens:
            out = torch.from_numpy(self.decode(_float32(hidden), routing))
            return self._with_bias(out, routing).to(hidden.dtype)
        return self._with_bias(self.prefill(hidden, routing), routing).to(hidden.dtype)

    def decode(self, x: np.ndarray, routing: Routing) -> np.ndarray:
        """The decode driver: x float32 [T, H] prepared once for the layer's kernel (`DECODE_KERNELS`), then its
        item kernel partition by partition, each adding its share into out [T, H]."""
        prepare, partition = DECODE_KERNELS[self.kernels.decode]
        out = np.zeros_like(x)
        inputs = prepare(x, self.spec, self.is_w8a8)
        for part, epilogue in zip(self.layer.partitions, self.epilogues, strict=True):
            partition(inputs, routing, part, self.spec, epilogue, self.is_w8a8, out)
        return out

    def _with_bias(self, out: torch.Tensor, routing: Routing) -> torch.Tensor:
        """out + each pair's weighted down bias (layers with biases; out float32 from every path but bf16's)."""
        if self.layer.down_bias is None:
            return out
        r = routing
        as_float = out.float().contiguous()
        kernels.add_down_bias_all(r.experts, r.offsets, r.pair_token, r.pair_weight, self.layer.down_bias,
                                  as_float.numpy())
        return as_float

    def _check(self, hidden, topk_ids, topk_weights) -> None:
        if hidden.dim() != 2 or hidden.shape[1] != self.spec.hidden_size:
            raise ValueError(f"hidden must be [T, {self.spec.hidden_size}], got {tuple(hidden.shape)}")
        if topk_ids.dim() != 2 or topk_ids.shape[0] != hidden.shape[0] or topk_ids.shape != topk_weights.shape:
            raise ValueError(f"topk_ids {tuple(topk_ids.shape)} and topk_weights {tuple(topk_weights.shape)} must "
                             f"both be [T={hidden.shape[0]}, K]")
        if topk_ids.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"topk_ids must be int32 or int64, got {topk_ids.dtype}")


# ---- the decode kernels: (prepare x once a call, one partition's item kernel) per `kernel_table.DECODE` key ------

def _as_given(x: np.ndarray, spec, is_w8a8: bool) -> tuple:
    return (x,)  # the integer kernels quantize their rows themselves


def _rounded_rows(x: np.ndarray, spec, is_w8a8: bool) -> tuple:
    if is_w8a8:
        x = x.copy()
        kernels.round_rows_int8(x)
    return (x,)


def _rounded_int4(x: np.ndarray, spec, is_w8a8: bool) -> tuple:
    (x,) = _rounded_rows(x, spec, is_w8a8)
    return _split_int4(x, spec.group(spec.hidden_size))  # after rounding: the int4 kernels see the rounded rows


def _bf16_rows(x: np.ndarray, spec, is_w8a8: bool) -> tuple:
    return (torch.from_numpy(x).bfloat16().float().numpy(),)


def _int8_partition(inputs, r, part, spec, epilogue, is_w8a8, out) -> None:
    """The float kernels (a CPU without VNNI, or float activations); act rounded to int8 rows for W8A8."""
    act = np.empty((len(r.pair_token), part.size), dtype=np.float32)
    kernels.gate_up_int8(*inputs, r.experts, r.offsets, r.pair_token, part.gate, part.gate_scales, part.up,
                         part.up_scales, spec.group(spec.hidden_size), epilogue, act)
    if is_w8a8:
        kernels.round_rows_int8(act)
    kernels.down_int8(act, r.experts, r.offsets, r.pair_token, r.pair_weight, part.down, part.down_scales,
                      spec.group_size or part.size, out)


def _int4_partition(inputs, r, part, spec, epilogue, is_w8a8, out) -> None:
    group_i = spec.group_size or part.size
    act = np.empty((len(r.pair_token), part.size), dtype=np.float32)
    kernels.gate_up_int4(*inputs, r.experts, r.offsets, r.pair_token, part.gate, part.gate_scales, part.up,
                         part.up_scales, spec.group(spec.hidden_size), epilogue, act)
    if is_w8a8:
        kernels.round_rows_int8(act)
    kernels.down_int4(*_split_int4(act, group_i), r.experts, r.offsets, r.pair_token, r.pair_weight, part.down,
                      part.down_scales, group_i, out)


def _vnni_partition(decode):
    """The integer (VNNI) kernels on int8 activations: gate/up, act and down in one call."""
    def partition(inputs, r, part, spec, epilogue, is_w8a8, out) -> None:
        decode(*inputs, r.experts, r.offsets, r.pair_token, r.pair_weight, part.gate, part.gate_scales, part.up,
               part.up_scales, part.down, part.down_scales, spec.group(spec.hidden_size),
               spec.group_size or part.size, epilogue, out)
    return partition


def _float_partition(decode):
    """The float formats' kernels (`kernels_fp8`, `kernels_fp4`), on bf16 activations, never W8A8."""
    def partition(inputs, r, part, spec, epilogue, is_w8a8, out) -> None:
        decode(*inputs, r, part, spec, epilogue, out)
    return partition


DECODE_KERNELS = {
    "int8-vnni": (_as_given, _vnni_partition(kernels_vnni.decode_int8)),
    "int4-vnni": (_as_given, _vnni_partition(kernels_vnni_int4.decode_int4)),
    "int8": (_rounded_rows, _int8_partition),
    "int4": (_rounded_int4, _int4_partition),
    "fp8": (_bf16_rows, _float_partition(kernels_fp8.decode_partition_fp8)),
    "mxfp4": (_bf16_rows, _float_partition(kernels_fp4.decode_partition_mxfp4)),
    "nvfp4": (_bf16_rows, _float_partition(kernels_fp4.decode_partition_nvfp4)),
}


def make_prefill(kernels: ExpertKernels, layer: PackedLayer, workspace: Workspace) -> Prefill:
    """The layer's prefill: the one driver over its GEMM backend (`kernels.prefill`, a `kernel_table.PREFILL` key
    chosen by `select`)."""
    if kernels.prefill == "amx-bf16":
        backend = prefill_amx_float.AmxFloatBackend(layer)
    elif kernels.prefill == "amx-int8":
        backend = prefill_amx.AmxInt8Backend(layer)
    elif kernels.prefill == "amx-int8-grouped":
        backend = prefill_amx_grouped.AmxGroupedBackend(layer)
    elif kernels.prefill == "onednn-int8":
        backend = OneDnnInt8Backend(layer)
    else:
        backend = DequantBackend(layer, round_activations=kernels.is_w8a8,
                                 bf16_activations=kernels.activations == "bf16")
    return Prefill(backend, workspace)


def _float32(hidden: torch.Tensor) -> np.ndarray:
    return hidden.detach().float().contiguous().numpy()


def _split_int4(x: np.ndarray, group: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    half = -(-x.shape[1] // 2)
    x_even = np.empty((x.shape[0], half), dtype=np.float32)
    x_odd = np.empty((x.shape[0], half), dtype=np.float32)
    x_sum = np.empty((x.shape[0], -(-x.shape[1] // group)), dtype=np.float32)
    kernels.split_int4(x, group, x_even, x_odd, x_sum)
    return x_even, x_odd, x_sum
