"""Which CPU kernels run a layer's routed experts: decided here alone, once per layer, from the layer's format and
the CPU's features (`select`). The operator (`cpu_experts.operator.CpuMoE`) and the decode pool
(`cpu_experts.decode_pool`) only look the answer up.

Two drivers run what this table names:
- decode (few tokens): per partition, one item kernel streams each routed expert's rows once. The decode pool's
  pinned threads run it for the engine's decode steps, graph and eager alike (`DecodePool.call`); `CpuMoE` runs
  the same loop bodies through numba's parallel loops elsewhere (a CPU device, tests, `hybrid-bench cpu-moe`).
  The pool serves the kernels of `POOL_DECODE`; the generic float forms of int8/int4 (a CPU without VNNI, or
  float activations) run on `CpuMoE` only.
- prefill (many tokens): one GEMM backend a layer (`PREFILL`), behind the operator's prefill driver.

Activations (each format's numerics contract, README "Expert formats"): "int8" rounds every matmul input row to
its per-row absmax int8 grid (W8A8: int8/int4 experts with `int8_activations`), "bf16" rounds it to bf16 (FP8,
MXFP4, NVFP4: the published contract), "float" keeps it (bf16 experts, int8/int4 without `int8_activations`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from cpu_experts import kernels_vnni, prefill_amx, prefill_amx_float, prefill_amx_grouped
from cpu_experts.packed import PackedLayer

FLOAT_FORMATS = ("fp8", "mxfp4", "nvfp4")
# decode kernels (`CpuMoE`'s table of item kernels); None: the format has none (bf16: prefill at every count)
DECODE = ("int8-vnni", "int4-vnni", "int8", "int4", *FLOAT_FORMATS)
POOL_DECODE = ("int8-vnni", "int4-vnni", *FLOAT_FORMATS)  # the decode pool's compiled layers
# prefill GEMM backends: AMX-INT8 (per-channel int8; grouped int8/int4), AMX-BF16 (the float formats), oneDNN
# int8 x int8 (per-channel int8 without AMX), and the generic one (each expert dequantized, PyTorch matmuls)
PREFILL = ("amx-int8", "amx-int8-grouped", "amx-bf16", "onednn-int8", "dequant")

# Token counts from which the prefill path runs, per expert dtype, where the two paths measured even on the
# 16-core Xeon (docs/benchmarks.md); int4 prefill dequantizes every routed expert, so its decode kernels win longer.
# The float formats' generic prefill dequantizes every routed expert to float32: on the 2-core AVX-512 development
# machine the paths measured even at ~700 tokens on qwen3-30b-a3b (fp8 at 512: decode 383 ms, prefill 472 ms) and
# ~160-200 on `hybrid-bench cpu-moe`'s "small".
PREFILL_MIN_TOKENS = {"int8": 64, "int4": 512, "bf16": 0, "fp8": 512, "mxfp4": 512, "nvfp4": 512}
# On AMX (`prefill_amx`, `prefill_amx_grouped`): from here the grouped GEMM beats the decode kernels. The float
# formats' (`prefill_amx_float`, AMX-BF16): a first guess, not yet measured on the Xeon (issue 19).
AMX_PREFILL_MIN_TOKENS = {"int8": 8, "int4": 32, "fp8": 32, "mxfp4": 32, "nvfp4": 32}


@dataclass(frozen=True)
class CpuFeatures:
    """What the kernels may use. `has_vnni` may be claimed on any CPU (the integer kernels then compile to their
    generic form: tests cover both forms anywhere); the AMX flags only where the CPU has them (`detect`)."""
    has_vnni: bool
    has_amx_int8: bool
    has_amx_bf16: bool

    @staticmethod
    @functools.cache
    def detect() -> CpuFeatures:
        return CpuFeatures(has_vnni=kernels_vnni.has_vnni(), has_amx_int8=prefill_amx.has_amx(),
                           has_amx_bf16=prefill_amx_float.has_amx_bf16())


@dataclass(frozen=True)
class ExpertKernels:
    """One layer's choice: `decode` (a `DECODE` key, None for bf16), `prefill` (a `PREFILL` key), the token count
    from which a call takes the prefill backend, and the matmul inputs' grid (`activations`)."""
    activations: str  # "int8" | "bf16" | "float"
    decode: str | None
    prefill: str
    prefill_min_tokens: int

    @property
    def is_w8a8(self) -> bool:
        return self.activations == "int8"

    @property
    def is_pool_decode(self) -> bool:
        """Whether the decode pool can serve this layer's decode steps."""
        return self.decode in POOL_DECODE


def select(layer: PackedLayer, features: CpuFeatures, int8_activations: bool = True,
           prefill_min_tokens: int | None = None) -> ExpertKernels:
    """The kernels of `layer`'s calls on a CPU with `features`. `prefill_min_tokens` None: the measured default
    (`AMX_PREFILL_MIN_TOKENS` with an AMX backend, else `PREFILL_MIN_TOKENS`)."""
    dtype = layer.spec.dtype
    if dtype in FLOAT_FORMATS:
        activations = "bf16"
    elif dtype in ("int8", "int4") and int8_activations:
        activations = "int8"
    else:
        activations = "float"
    if dtype == "bf16":
        decode = None
    elif dtype in FLOAT_FORMATS:
        decode = dtype
    else:
        decode = f"{dtype}-vnni" if activations == "int8" and features.has_vnni else dtype
    prefill = _prefill(layer, features, activations)
    if prefill_min_tokens is None:
        prefill_min_tokens = (AMX_PREFILL_MIN_TOKENS if prefill.startswith("amx") else PREFILL_MIN_TOKENS)[dtype]
    return ExpertKernels(activations, decode, prefill, prefill_min_tokens)


def _prefill(layer: PackedLayer, features: CpuFeatures, activations: str) -> str:
    """The GEMM backend: AMX where the CPU has it and the layer's sizes fit the tiles, else oneDNN for per-channel
    W8A8 int8, else the generic one (on the format's activation grid). A tensor-parallel rank with an empty slice
    of I (`packed.rank_slice`) has no matmuls: "dequant", never called."""
    spec = layer.spec
    if not layer.partitions:
        return "dequant"
    if activations == "bf16" and features.has_amx_bf16 and prefill_amx_float.is_supported(layer):
        return "amx-bf16"
    if activations == "int8" and features.has_amx_int8:
        if prefill_amx.is_supported(layer):
            return "amx-int8"
        if prefill_amx_grouped.is_supported(layer):
            return "amx-int8-grouped"
    if activations == "int8" and spec.dtype == "int8" and spec.group_size == 0:
        return "onednn-int8"
    return "dequant"
