"""The on-disk layout of one MoE layer's routed experts (`experts/layer-NNN.safetensors`), shared by the
converter that writes it and the runtime that reads it. `docs/format.md` is the user-facing description.

Canonical and NUMA-agnostic: all E experts of the layer stacked along the first dimension, in the model's own
order, with projections named by role whatever the checkpoint called them (Mixtral's w1/w3/w2 become
gate/up/down). The runtime slices the intermediate dimension I per NUMA node at load time (rows of gate/up,
columns of down); slice boundaries are multiples of the group size, so every slice owns whole scale groups.

Tensors (E experts, H hidden, I intermediate, G = ceil(K / group_size) scale groups along the input K):
    gate.weight [E, I, H]   up.weight [E, I, H]   down.weight [E, H, I]
    gate.scales [E, I, G_H] up.scales [E, I, G_H] down.scales [E, H, G_I]   (`scale_dtype`; absent for bf16)
`weight` is int8 (int8), packed uint8 with K/2 columns (int4, mxfp4, nvfp4: see `cpu_experts.formats`), uint8
e4m3 bits (fp8) or bfloat16 (bf16). NVFP4 adds `{role}.tensor_scale` [E] float32 (one per expert's projection);
MXFP4 scales are E8M0 and NVFP4's e4m3, both as uint8 bits.
A layer whose experts carry biases (`has_bias`: gpt-oss) adds gate.bias, up.bias [E, I] and down.bias [E, H], float32;
the activation between the projections is the metadata's `activation` (`ExpertActivation`; absent: silu, the files
written before it existed).
Scales are float32, or bfloat16 for int4 experts copied from a checkpoint that stores them so (Kimi-K2's
compressed-tensors INT4): kept as stored, since at group 32 float32 scales would add 11% to the bytes a decode
step reads; the int4 kernels widen them (exactly) in registers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cpu_experts import formats

EXPERT_DTYPES = ("int8", "int4", "bf16", "fp8", "mxfp4", "nvfp4")
# e8m0 and e4m3 scales are stored as their bits (uint8), like the float formats' weights
SCALE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "e8m0": torch.uint8, "e4m3": torch.uint8}
# per expert dtype: the scale dtypes it allows (the first is the quantizer's) and the group size it requires (None:
# any group; the FP4 formats fix theirs)
ALLOWED_SCALES = {"int8": ("float32",), "int4": ("float32", "bfloat16"), "fp8": ("float32",), "mxfp4": ("e8m0",),
                  "nvfp4": ("e4m3",), "bf16": ("float32",)}
FIXED_GROUP = {"mxfp4": 32, "nvfp4": 16}
PACKED_FP4 = ("int4", "mxfp4", "nvfp4")  # two columns a byte along K
ROLES = ("gate", "up", "down")
FORMAT_NAME = "hybrid-experts"
FORMAT_VERSION = "1"


ACTIVATION_KINDS = ("silu", "swiglu_oai")


@dataclass(frozen=True)
class ExpertActivation:
    """The function between an expert's gate/up and down projections (after the gate/up biases, if any):
    silu: silu(gate) * up. swiglu_oai (gpt-oss): g = min(gate, limit), u = clamp(up, -limit, limit),
    (u + 1) * g * sigmoid(alpha * g)."""
    kind: str = "silu"
    alpha: float = 1.0
    limit: float = 0.0

    def __post_init__(self):
        if self.kind not in ACTIVATION_KINDS:
            raise ValueError(f"expert activation '{self.kind}' is not one of {', '.join(ACTIVATION_KINDS)}")
        if self.kind == "swiglu_oai" and not (self.alpha > 0 and self.limit > 0):
            raise ValueError(f"swiglu_oai needs alpha > 0 and limit > 0, got {self.alpha}, {self.limit}")

    @property
    def is_silu(self) -> bool:
        return self.kind == "silu"

    def metadata(self) -> dict[str, str]:
        if self.is_silu:
            return {}
        return {"activation": self.kind, "activation_alpha": repr(self.alpha), "activation_limit": repr(self.limit)}

    @classmethod
    def from_metadata(cls, metadata: dict[str, str]) -> ExpertActivation:
        kind = metadata.get("activation", "silu")
        if kind == "silu":
            return SILU
        return cls(kind, float(metadata["activation_alpha"]), float(metadata["activation_limit"]))


SILU = ExpertActivation()
SWIGLU_OAI = ExpertActivation("swiglu_oai", 1.702, 7.0)  # gpt-oss's constants (transformers' modeling_gpt_oss)


@dataclass(frozen=True)
class ExpertLayerSpec:
    num_experts: int
    hidden_size: int
    intermediate_size: int
    dtype: str  # one of EXPERT_DTYPES
    group_size: int  # scale group along K; 0 = one scale per output row (per channel)
    scale_dtype: str = "float32"  # one of ALLOWED_SCALES[dtype] (bfloat16 int4 scales: copied from a checkpoint)
    activation: ExpertActivation = SILU
    has_bias: bool = False  # gate.bias, up.bias [E, I] and down.bias [E, H] (float32)

    @property
    def is_plain(self) -> bool:
        """silu without biases: the kernels' original epilogue, compiled without the bias loads."""
        return self.activation.is_silu and not self.has_bias

    def __post_init__(self):
        if self.dtype not in EXPERT_DTYPES:
            raise ValueError(f"expert dtype '{self.dtype}' is not one of {', '.join(EXPERT_DTYPES)}")
        grouped = self.dtype in ("int4", "fp8", "mxfp4", "nvfp4")
        if self.group_size < 0 or (grouped and self.group_size == 0) or \
                self.group_size != FIXED_GROUP.get(self.dtype, self.group_size):
            raise ValueError(f"group size {self.group_size} is invalid for {self.dtype} experts"
                             + (f" (it must be {FIXED_GROUP[self.dtype]})" if self.dtype in FIXED_GROUP else ""))
        if self.scale_dtype not in ALLOWED_SCALES[self.dtype]:
            raise ValueError(f"scale dtype '{self.scale_dtype}' is invalid for {self.dtype} experts (allowed: "
                             f"{', '.join(ALLOWED_SCALES[self.dtype])})")

    def matrix_shape(self, role: str) -> tuple[int, int]:
        """(N, K) of one expert's projection: output rows, input columns."""
        h, i = self.hidden_size, self.intermediate_size
        return (h, i) if role == "down" else (i, h)

    def group(self, cols: int) -> int:
        return self.group_size or cols

    def tensor_shapes(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Tensor name -> (shape, dtype), in file order."""
        e = self.num_experts
        shapes = {}
        for role in ROLES:
            n, k = self.matrix_shape(role)
            if self.dtype == "bf16":
                shapes[f"{role}.weight"] = ((e, n, k), torch.bfloat16)
            elif self.dtype == "int8":
                shapes[f"{role}.weight"] = ((e, n, k), torch.int8)
            elif self.dtype == "fp8":
                shapes[f"{role}.weight"] = ((e, n, k), torch.uint8)
            else:
                shapes[f"{role}.weight"] = ((e, n, -(-k // 2)), torch.uint8)
            if self.dtype != "bf16":
                shapes[f"{role}.scales"] = ((e, n, -(-k // self.group(k))), SCALE_DTYPES[self.scale_dtype])
            if self.dtype == "nvfp4":
                shapes[f"{role}.tensor_scale"] = ((e,), torch.float32)
        if self.has_bias:
            for role in ROLES:
                shapes[f"{role}.bias"] = ((e, self.matrix_shape(role)[0]), torch.float32)
        return shapes

    def metadata(self, layer: int) -> dict[str, str]:
        return {"format": FORMAT_NAME, "format_version": FORMAT_VERSION, "layer": str(layer),
                "num_experts": str(self.num_experts), "hidden_size": str(self.hidden_size),
                "intermediate_size": str(self.intermediate_size), "dtype": self.dtype,
                "group_size": str(self.group_size), "scale_dtype": self.scale_dtype,
                **({"has_bias": "1"} if self.has_bias else {}), **self.activation.metadata()}

    @classmethod
    def from_metadata(cls, metadata: dict[str, str]) -> ExpertLayerSpec:
        if metadata.get("format") != FORMAT_NAME or metadata.get("format_version") != FORMAT_VERSION:
            raise ValueError(f"not a {FORMAT_NAME} v{FORMAT_VERSION} file (metadata {metadata})")
        return cls(int(metadata["num_experts"]), int(metadata["hidden_size"]), int(metadata["intermediate_size"]),
                   metadata["dtype"], int(metadata["group_size"]), metadata.get("scale_dtype", "float32"),
                   ExpertActivation.from_metadata(metadata), metadata.get("has_bias") == "1")


def quantize_matrix(w: torch.Tensor, spec: ExpertLayerSpec) -> dict[str, torch.Tensor]:
    """One expert's projection w [N, K] -> {'weight': ..., 'scales': ...} in the file's dtype (float32 scales: the
    quantizer's own; a bfloat16 `scale_dtype` is only ever copied from a source, never computed)."""
    if spec.scale_dtype != ALLOWED_SCALES[spec.dtype][0]:
        raise ValueError(f"quantizing to {spec.scale_dtype} scales is not supported (they are copied from a source)")
    if spec.dtype == "bf16":
        return {"weight": w.to(torch.bfloat16)}
    group = spec.group(w.shape[1])
    if spec.dtype == "nvfp4":
        q, scales, tensor_scale = formats.quantize_nvfp4(w)
        return {"weight": q, "scales": scales, "tensor_scale": tensor_scale}
    quantize = {"int8": formats.quantize_int8, "int4": formats.quantize_int4, "fp8": formats.quantize_fp8,
                "mxfp4": lambda w, _group: formats.quantize_mxfp4(w)}[spec.dtype]
    q, scales = quantize(w, group)
    return {"weight": q, "scales": scales}


def dequantize_matrix(weight: torch.Tensor, scales: torch.Tensor | None, role: str, spec: ExpertLayerSpec,
                      tensor_scale: torch.Tensor | None = None) -> torch.Tensor:
    """The reference dequantization of one expert's projection -> float32 [N, K] (`tensor_scale`: NVFP4's)."""
    _, k = spec.matrix_shape(role)
    if spec.dtype == "bf16":
        return weight.float()
    group = spec.group(k)
    if spec.dtype == "int8":
        return formats.dequantize_int8(weight, scales, group)
    if spec.dtype == "fp8":
        return formats.dequantize_fp8(weight, scales, group)
    if spec.dtype == "mxfp4":
        return formats.dequantize_mxfp4(weight, scales, k)
    if spec.dtype == "nvfp4":
        return formats.dequantize_nvfp4(weight, scales, tensor_scale, k)
    return formats.dequantize_int4(weight, scales, group, k)
