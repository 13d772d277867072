"""Reading weights stored in the compressed-tensors format (what `llm-compressor` writes and vLLM/SGLang load).

Two formats are understood, as `hybrid-convert --gpu-quant` writes them:
- `float-quantized` (FP8, per output channel): `X.weight` float8_e4m3fn [N, K] and `X.weight_scale` [N, 1];
  w = weight * scale. Activations are quantized dynamically per token by the kernel, nothing is stored for them.
- `pack-quantized` (INT4 weights, 16-bit activations, symmetric, per group along K): `X.weight_packed` int32
  [N, ceil(K / 8)] holding eight 4-bit values per word (column 8j+i in bits 4i..4i+3, stored as value + 8),
  `X.weight_scale` [N, ceil(K / group)] and `X.weight_shape` int [2] = (N, K); w = (nibble - 8) * scale.
- `nvfp4-pack-quantized` (NVFP4: e2m1 weights, one float8_e4m3 scale per 16 columns, one float32 global scale):
  `X.weight_packed` uint8 [N, K / 2] (two e2m1 codes a byte, even column in the low nibble), `X.weight_scale`
  float8_e4m3fn [N, K / 16], `X.weight_global_scale` float32 [1]; compressed-tensors dequantizes
  w = e2m1 * (scale / global_scale) (`quantization.lifecycle.forward_helpers._dequantize`). These, and FP8
  `float-quantized` weights of the `group` and `block` strategies, are decoded by `hybrid.stored_matrix`.
The dequantization here is the reference the GPU kernels are tested against and, until they land, the runtime's
path: weights are dequantized on the CPU at load time.

The packed words, read as little-endian bytes, are already the CPU experts' INT4 layout (`cpu_experts.formats`:
byte b holds columns 2b and 2b + 1 in its low and high nibble, value + 8): `int4_bytes` is a copy, which is how
`hybrid-convert` passes a checkpoint's INT4 experts (Kimi-K2) through without rounding them again.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

FORMATS = ("float-quantized", "pack-quantized", "nvfp4-pack-quantized")
AUX_SUFFIXES = ("_packed", "_scale", "_shape", "_zero_point", "_g_idx", "_global_scale")
# activation scales stored beside a module's weight (static or NVFP4 W4A4 activations): kept with the weight's parts,
# never used (activations are quantized dynamically, or not at all, here)
INPUT_SCALES = (".input_scale", ".input_global_scale")
PACK_FACTOR = 8  # 4-bit values per int32


@dataclass(frozen=True)
class Scheme:
    format: str  # one of FORMATS
    group_size: int | None  # pack-quantized: input columns per scale; None: per channel
    ignore: tuple[str, ...] = ()  # modules left in the checkpoint's dtype
    num_bits: int = 4  # pack-quantized: bits per weight (only 4 is read)
    strategy: str | None = None  # float-quantized: "tensor", "channel", "group" or "block"
    block_structure: tuple[int, int] | None = None  # the block strategy's [rows, columns]


def parse(quant: dict, source: str) -> Scheme:
    """The `quantization_config` of a compressed-tensors checkpoint (one config group, weight-only or FP8)."""
    fmt = quant.get("format")
    groups = quant.get("config_groups") or {}
    if fmt not in FORMATS or len(groups) != 1:
        raise ValueError(f"{source}: compressed-tensors format '{fmt}' with {len(groups)} config groups is not "
                         f"supported; supported: one group in {', '.join(FORMATS)}")
    weights = next(iter(groups.values())).get("weights") or {}
    if not weights.get("symmetric", True):
        raise ValueError(f"{source}: asymmetric compressed-tensors weights are not supported")
    num_bits = weights.get("num_bits", 4)
    if fmt == "pack-quantized" and num_bits != 4:
        raise ValueError(f"{source}: pack-quantized weights of {num_bits} bits are not supported; supported: 4 bits")
    if fmt == "nvfp4-pack-quantized" and weights.get("group_size", 16) != 16:
        raise ValueError(f"{source}: nvfp4-pack-quantized weights in groups of {weights.get('group_size')} are not "
                         "supported; NVFP4 groups are 16")
    block = weights.get("block_structure")
    if block is not None and not (isinstance(block, list) and len(block) == 2
                                  and all(isinstance(b, int) and b > 0 for b in block)):
        raise ValueError(f"{source}: weights.block_structure must be two positive integers, got {block!r}")
    return Scheme(fmt, weights.get("group_size"), tuple(quant.get("ignore") or ()), num_bits,
                  weights.get("strategy"), tuple(block) if block else None)


def logical_name(stored: str) -> str:
    """`X.weight_packed` / `X.weight_scale` / `X.input_scale` / ... -> `X.weight`; other names unchanged."""
    for suffix in INPUT_SCALES:
        if stored.endswith(suffix):
            return stored[: -len(suffix)] + ".weight"
    for suffix in AUX_SUFFIXES:
        if stored.endswith(".weight" + suffix):
            return stored[: -len(suffix)]
    return stored


def unpack_int4(packed: torch.Tensor, cols: int) -> torch.Tensor:
    """int32 [N, ceil(K / 8)] -> int8 values in [-8, 7], [N, K]."""
    words = packed.to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(PACK_FACTOR, dtype=torch.int64) * 4
    nibbles = (words.unsqueeze(-1) >> shifts) & 0xF  # [N, K/8, 8]: column 8j + i in bits 4i..4i+3
    return (nibbles.flatten(1)[:, :cols] - 8).to(torch.int8)


def pack_int4(values: torch.Tensor) -> torch.Tensor:
    """int values in [-8, 7], [N, K] -> int32 [N, ceil(K / 8)]; the inverse of `unpack_int4`."""
    rows, cols = values.shape
    padded = torch.nn.functional.pad(values.to(torch.int64) + 8, (0, -cols % PACK_FACTOR), value=8)
    shifts = torch.arange(PACK_FACTOR, dtype=torch.int64) * 4
    words = (padded.view(rows, -1, PACK_FACTOR) << shifts).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def int4_bytes(packed: torch.Tensor, cols: int) -> torch.Tensor:
    """int32 [N, ceil(K / 8)] -> uint8 [N, ceil(K / 2)], the same nibbles in `cpu_experts.formats`' INT4 layout:
    the words' little-endian bytes (word j's byte b holds columns 8j + 2b and 8j + 2b + 1, low nibble first), those
    past column K dropped. A copy of the bits: nothing is unpacked or rounded."""
    if packed.dtype != torch.int32 or packed.dim() != 2:
        raise ValueError(f"packed INT4 must be a 2-D int32 tensor, got {packed.dtype} {tuple(packed.shape)}")
    data = packed.contiguous().view(torch.uint8)
    if sys.byteorder != "little":  # the words' low bits first, whatever the host's order
        data = data.view(packed.shape[0], -1, 4).flip(-1).reshape(packed.shape[0], -1)
    return data[:, : -(-cols // 2)].contiguous()


def dequantize(parts: dict[str, torch.Tensor], name: str, group_size: int | None) -> torch.Tensor:
    """The stored parts of logical weight `name` -> float32 [N, K]; group_size None: per channel."""
    scale = parts.get(name + "_scale")
    if scale is None:
        raise ValueError(f"no '{name}_scale' stored with it")
    if name + "_packed" in parts:
        shape = parts.get(name + "_shape")
        if shape is None or shape.numel() != 2:
            raise ValueError(f"'{name}_shape' is missing or not 2 values")
        rows, cols = (int(d) for d in shape.tolist())
        values = unpack_int4(parts[name + "_packed"], cols)
        if values.shape[0] != rows or rows != scale.shape[0]:
            raise ValueError(f"packed rows {values.shape[0]} / scale rows {scale.shape[0]} do not match shape "
                             f"{(rows, cols)}")
        group = group_size or cols
        if scale.shape[1] != -(-cols // group):
            raise ValueError(f"scale shape {tuple(scale.shape)} does not fit {cols} columns in groups of {group}")
        return values.float() * scale.float().repeat_interleave(group, dim=1)[:, :cols]
    weight = parts.get(name)
    if weight is None:
        raise ValueError("no stored weight")
    if scale.shape not in ((weight.shape[0], 1), (1,), ()):
        raise ValueError(f"scale shape {tuple(scale.shape)} does not fit weight {tuple(weight.shape)}")
    return weight.float() * scale.float().reshape(-1, 1) if scale.dim() == 2 else weight.float() * scale.float()
