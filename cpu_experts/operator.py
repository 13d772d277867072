"""`CpuMoE`: the routed experts of one MoE layer on the CPU.

forward(hidden [T, H], topk_ids [T, K], topk_weights [T, K]) -> [T, H] = sum_k w[t, k] * expert_{id[t, k]}(h[t]),
expert(x) = down(silu(gate x) * up x); an id of -1 is skipped (the expert runs elsewhere, e.g. on the GPU). A layer
whose spec says so (gpt-oss) adds biases and computes another activation: expert(x) = down(act(gate x + b_g,
up x + b_u)) + b_d (`ExpertActivation`; every kernel through `kernels.activation`, the down bias weighted like
the matmul and added once per call, after the partitions' sums: `kernels.add_down_bias`).

Per call, the (token, slot) pairs are grouped by expert (`route`), then each partition of I computes its partial
output and the partials are summed. Two paths, chosen per call by token count:
- decode (few tokens): the numba kernels stream each routed expert's quantized rows once, dequantizing in
  registers (`cpu_experts.kernels`; the float formats', on bf16 activations, in `FLOAT_DECODE`:
  `cpu_experts.kernels_fp8`, `kernels_fp4`);
- prefill (many tokens, `prefill_min_tokens` or more, and bf16 experts at any count): matmuls grouped by expert,
  one driver (`cpu_experts.prefill.Prefill`) over a GEMM backend. Per-channel int8 experts multiply int8 x int8:
  our AMX grouped GEMM where the CPU has AMX (`cpu_experts.prefill_amx`), else oneDNN per expert
  (`cpu_experts.prefill_int8`); int4 and grouped int8 on AMX: `cpu_experts.prefill_amx_grouped`. The float formats
  multiply bf16 x bf16 on AMX-BF16 (`cpu_experts.prefill_amx_float`). Other experts are each dequantized once per
  call and multiplied by PyTorch (`prefill.DequantBackend`). Which backend a layer takes is decided once, in
  `select_prefill`.
The float formats (FP8) compute on bfloat16 activations whatever `int8_activations` says: each matmul's input is
rounded to bf16 on both paths, products and sums in float32 (the format's published contract).
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
from cpu_experts.packed import PackedLayer
from cpu_experts.prefill import DequantBackend, Prefill, Workspace
from cpu_experts.prefill_int8 import OneDnnInt8Backend

# Token counts from which the prefill path runs, per expert dtype, where the two paths measured even on the
# 16-core Xeon (docs/benchmarks.md); int4 prefill dequantizes every routed expert, so its decode kernels win longer.
# The float formats' prefill dequantizes every routed expert to float32: on the 2-core AVX-512 development machine
# the paths measured even at ~700 tokens on qwen3-30b-a3b (fp8 at 512: decode 383 ms, prefill 472 ms) and ~160-200
# on `hybrid-bench cpu-moe`'s "small".
PREFILL_MIN_TOKENS = {"int8": 64, "int4": 512, "bf16": 0, "fp8": 512, "mxfp4": 512, "nvfp4": 512}
# On AMX (`cpu_experts.prefill_amx`, `prefill_amx_grouped`): from here the grouped GEMM beats the decode kernels.
# The float formats' (`prefill_amx_float`, AMX-BF16): a first guess, not yet measured on the Xeon (issue 19).
AMX_PREFILL_MIN_TOKENS = {"int8": 8, "int4": 32, "fp8": 32, "mxfp4": 32, "nvfp4": 32}
# The float formats' decode kernels (bf16 activations, never W8A8), one partition a call: (x, routing, part, spec,
# epilogue, out), x already rounded to bf16.
FLOAT_DECODE = {"fp8": kernels_fp8.decode_partition_fp8, "mxfp4": kernels_fp4.decode_partition_mxfp4,
                "nvfp4": kernels_fp4.decode_partition_nvfp4}


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
    formats' contract, `cpu_experts.kernels_fp4`). `workspace`: scratch buffers, shareable by all layers of a model."""

    def __init__(self, layer: PackedLayer, prefill_min_tokens: int | None = None,
                 int8_activations: bool = True, workspace: Workspace | None = None):
        self.layer = layer
        self.spec = layer.spec
        self.is_w8a8 = self.spec.dtype not in ("bf16", *FLOAT_DECODE) and int8_activations
        workspace = workspace or Workspace()
        # a tensor-parallel rank whose slice of I is empty (`packed.rank_slice`) has no matmuls to choose for
        self.prefill, is_amx = select_prefill(layer, workspace, self.is_w8a8) if layer.partitions else (None, False)
        if prefill_min_tokens is None:
            prefill_min_tokens = (AMX_PREFILL_MIN_TOKENS if is_amx else PREFILL_MIN_TOKENS)[self.spec.dtype]
        self.prefill_min_tokens = prefill_min_tokens
        self.is_vnni = self.is_w8a8 and kernels_vnni.has_vnni()  # integer decode kernels (same results)
        self.epilogues = kernels.epilogues(layer)  # per partition (`kernels.activation`)

    def __call__(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        self._check(hidden, topk_ids, topk_weights)
        routing = route(topk_ids.cpu().numpy(), topk_weights.detach().float().cpu().numpy(), self.spec.num_experts)
        if not self.layer.partitions:  # an empty rank slice: nothing here but the down bias (rank 0 has a slice)
            zeros = torch.zeros(hidden.shape[0], self.spec.hidden_size)
            return self._with_bias(zeros, routing).to(hidden.dtype)
        if self.spec.dtype != "bf16" and hidden.shape[0] < self.prefill_min_tokens:
            decode = self._decode_float if self.spec.dtype in FLOAT_DECODE else \
                self._decode_vnni if self.is_vnni else self._decode
            return self._with_bias(torch.from_numpy(decode(_float32(hidden), routing)), routing).to(hidden.dtype)
        return self._with_bias(self.prefill(hidden, routing), routing).to(hidden.dtype)

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

    def _decode(self, x: np.ndarray, routing: Routing) -> np.ndarray:
        """The numba streaming kernels, partition by partition; x float32 [T, H] -> [T, H]."""
        out = np.zeros_like(x)
        r = routing
        num_pairs = len(r.pair_token)
        group_h = self.spec.group(self.spec.hidden_size)
        if self.is_w8a8:
            x = x.copy()
            kernels.round_rows_int8(x)
        if self.spec.dtype == "int4":
            x_parts = _split_int4(x, group_h)  # after rounding: the int4 kernels see the rounded rows
        for part, epilogue in zip(self.layer.partitions, self.epilogues, strict=True):
            group_i = self.spec.group_size or part.size
            act = np.empty((num_pairs, part.size), dtype=np.float32)
            if self.spec.dtype == "int8":
                kernels.gate_up_int8(x, r.experts, r.offsets, r.pair_token, part.gate, part.gate_scales, part.up,
                                     part.up_scales, group_h, epilogue, act)
                if self.is_w8a8:
                    kernels.round_rows_int8(act)
                kernels.down_int8(act, r.experts, r.offsets, r.pair_token, r.pair_weight, part.down,
                                  part.down_scales, group_i, out)
                continue
            kernels.gate_up_int4(*x_parts, r.experts, r.offsets, r.pair_token, part.gate, part.gate_scales, part.up,
                                 part.up_scales, group_h, epilogue, act)
            if self.is_w8a8:
                kernels.round_rows_int8(act)
            kernels.down_int4(*_split_int4(act, group_i), r.experts, r.offsets, r.pair_token, r.pair_weight,
                              part.down, part.down_scales, group_i, out)
        return out

    def _decode_vnni(self, x: np.ndarray, routing: Routing) -> np.ndarray:
        """The integer (VNNI) streaming kernels on int8 activations; x float32 [T, H] -> [T, H]."""
        out = np.zeros_like(x)
        r = routing
        decode = kernels_vnni.decode_int8 if self.spec.dtype == "int8" else kernels_vnni_int4.decode_int4
        group_h = self.spec.group(self.spec.hidden_size)
        for part, epilogue in zip(self.layer.partitions, self.epilogues, strict=True):
            decode(x, r.experts, r.offsets, r.pair_token, r.pair_weight, part.gate, part.gate_scales, part.up,
                   part.up_scales, part.down, part.down_scales, group_h, self.spec.group_size or part.size, epilogue,
                   out)
        return out

    def _decode_float(self, x: np.ndarray, routing: Routing) -> np.ndarray:
        """The float formats' decode kernels (`FLOAT_DECODE`), partition by partition, on x rounded to bf16 once;
        x float32 [T, H] -> [T, H]."""
        out = np.zeros_like(x)
        x = torch.from_numpy(x).bfloat16().float().numpy()
        decode = FLOAT_DECODE[self.spec.dtype]
        for part, epilogue in zip(self.layer.partitions, self.epilogues, strict=True):
            decode(x, routing, part, self.spec, epilogue, out)
        return out


def select_prefill(layer: PackedLayer, workspace: Workspace, is_w8a8: bool) -> tuple[Prefill, bool]:
    """The matmul backend of a layer's many-token calls, chosen here alone from its format and this CPU's features:
    (the prefill driver over it, is_amx). W8A8 int8/int4: our AMX grouped GEMMs (`prefill_amx`,
    `prefill_amx_grouped`) where the CPU has AMX-INT8, else oneDNN for per-channel int8 (`prefill_int8`); the float
    formats: the AMX-BF16 grouped GEMM (`prefill_amx_float`); everything else, and layers whose sizes the tiles do
    not fit: each routed expert dequantized and multiplied by PyTorch (`DequantBackend`, on the formats' activation
    grid)."""
    spec = layer.spec
    is_float = spec.dtype in FLOAT_DECODE
    is_amx_int8 = is_w8a8 and prefill_amx.has_amx()
    if is_float and prefill_amx_float.has_amx_bf16() and prefill_amx_float.is_supported(layer):
        backend = prefill_amx_float.AmxFloatBackend(layer)
    elif is_amx_int8 and prefill_amx.is_supported(layer):
        backend = prefill_amx.AmxInt8Backend(layer)
    elif is_amx_int8 and prefill_amx_grouped.is_supported(layer):
        backend = prefill_amx_grouped.AmxGroupedBackend(layer)
    elif is_w8a8 and spec.dtype == "int8" and spec.group_size == 0:
        backend = OneDnnInt8Backend(layer)
    else:
        backend = DequantBackend(layer, round_activations=is_w8a8, bf16_activations=is_float)
    return Prefill(backend, workspace), backend.is_amx


def _float32(hidden: torch.Tensor) -> np.ndarray:
    return hidden.detach().float().contiguous().numpy()


def _split_int4(x: np.ndarray, group: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    half = -(-x.shape[1] // 2)
    x_even = np.empty((x.shape[0], half), dtype=np.float32)
    x_odd = np.empty((x.shape[0], half), dtype=np.float32)
    x_sum = np.empty((x.shape[0], -(-x.shape[1] // group)), dtype=np.float32)
    kernels.split_int4(x, group, x_even, x_odd, x_sum)
    return x_even, x_odd, x_sum
