"""One weight matrix as a checkpoint stores it quantized, decoded into the CPU experts' terms (`cpu_experts.formats`:
weight codes, per-row group scales, NVFP4's tensor scale) without touching a value, and dequantized from there.

A matrix `X.weight` [N, K] is stored as parts named by their suffix after `X.` (`Checkpoint.read_parts`). Layouts
(`identify` tells them apart from the headers alone):
- `deepseek-fp8`: `weight` float8_e4m3fn + `weight_scale_inv` float32 [ceil(N / bn), ceil(K / bk)]
  (`quantization_config.weight_block_size` [bn, bk]): the block scale is repeated over its bn rows, group bk.
- `e8m0-fp8` (DeepSeek-V4): `weight` float8_e4m3fn + `scale` E8M0 (2^(s - 127)) in the same blocks, widened to
  float32 exactly.
- `e8m0-mxfp4` (DeepSeek-V4's routed experts): `weight` int8 [N, K / 2] holding two e2m1 codes a byte + `scale`
  E8M0 [N, K / 32]: MXFP4 as stored.
- `ct-fp8` (compressed-tensors `float-quantized`): `weight` float8_e4m3fn + `weight_scale` by the scheme's strategy:
  tensor ([] or [1]) and channel ([N, 1]) become the same value repeated over groups of FP8_CHANNEL_GROUP (one
  layout for the kernels, the same products), group [N, K / g] is kept, block as DeepSeek's.
- `ct-int4` (`pack-quantized`): `weight_packed` int32 + `weight_scale` + `weight_shape`: the words' bytes are the
  CPU experts' INT4 layout (`compressed_tensors.int4_bytes`); bfloat16 scales stay bfloat16.
- `ct-nvfp4` (`nvfp4-pack-quantized`): `weight_packed` uint8 [N, K / 2] + `weight_scale` float8_e4m3fn [N, K / 16] +
  `weight_global_scale` float32 [1]. compressed-tensors computes e2m1 * (scale / global_scale); the tensor scale
  here is float32(1 / global_scale), so a value is e2m1 * scale * tensor_scale: the kernels' one extra multiply,
  within one float32 rounding (relative 6e-8) of compressed-tensors' own quotient.
- `modelopt-nvfp4` (NVIDIA ModelOpt): `weight` uint8 [N, K / 2] + `weight_scale` float8_e4m3fn [N, K / 16] +
  `weight_scale_2` float32 scalar (the tensor scale, as stored); `input_scale` is ignored.
Activation scales stored beside a weight (`input_scale`, `input_global_scale`) are never read.

Codes that stand for NaN (FP8 weight codes 0x7F / 0xFF, e4m3 scales likewise, E8M0 255) and NaN or infinite float
scales are reported through the caller's `check`, which refuses them (the runtime) or lets `--allow-nonfinite`
copy them (the converter).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from cpu_experts import formats
from hybrid import compressed_tensors
from hybrid.safetensors_io import TensorInfo

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
# The float8 codes of NaN and inf have every exponent bit set; as int8 the positive ones are the largest codes.
FP8_NONFINITE_MASK = {torch.float8_e4m3fn: 0x7F, torch.float8_e5m2: 0x7C}
FP8_CHANNEL_GROUP = 128  # per-channel and per-tensor FP8 scales, repeated over groups of this many columns
IGNORED_PARTS = ("input_scale", "input_global_scale")
E8M0_DTYPES = (torch.float8_e8m0fnu, torch.uint8)
PACKED_BYTES = (torch.uint8, torch.int8)

Check = Callable[[str, torch.Tensor], object]  # (part suffix, tensor as stored or widened) -> raises if non-finite


class PartError(ValueError):
    """A stored part that does not fit its layout: `part` (the suffix) and what is wrong with it."""

    def __init__(self, part: str, detail: str):
        super().__init__(f"'{part}' {detail}")
        self.part, self.detail = part, detail


@dataclass(frozen=True)
class Layout:
    name: str  # see the module docstring
    dtype: str  # the expert file's dtype: fp8, mxfp4, nvfp4, int4
    group_size: int  # columns per scale, as the expert file holds them
    scale_dtype: str  # the expert file's scale dtype
    block_rows: int = 1  # rows one stored scale covers (block scales), repeated on decoding

    @property
    def describe(self) -> str:
        return f"{self.dtype} ({self.name}, group {self.group_size}, {self.scale_dtype} scales)"


@dataclass
class StoredMatrix:
    layout: Layout
    shape: tuple[int, int]  # [N, K]
    weight: torch.Tensor  # uint8 codes (FP8 bits, packed e2m1 or INT4 bytes)
    scales: torch.Tensor  # [N, ceil(K / group)]: float32, bfloat16 (int4), E8M0 or e4m3 bits (uint8)
    tensor_scale: torch.Tensor | None = None  # NVFP4: float32 []

    def dequantize(self) -> torch.Tensor:
        """float32 [N, K], the reference dequantization of the CPU experts' formats."""
        cols, group = self.shape[1], self.layout.group_size
        dtype = self.layout.dtype
        if dtype == "fp8":
            return formats.dequantize_fp8(self.weight, self.scales, group)
        if dtype == "mxfp4":
            return formats.dequantize_mxfp4(self.weight, self.scales, cols)
        if dtype == "nvfp4":
            return formats.dequantize_nvfp4(self.weight, self.scales, self.tensor_scale, cols)
        return formats.dequantize_int4(self.weight, self.scales, group, cols)


def is_finite(tensor: torch.Tensor) -> bool:
    """No NaN and no inf, in one pass over `tensor` that allocates nothing (aminmax propagates NaN; float8 has no
    arithmetic on the CPU, so its codes are compared as integers)."""
    if not tensor.is_floating_point() or tensor.numel() == 0:
        return True
    if tensor.dtype == torch.float8_e8m0fnu:
        return not bool((tensor.view(torch.uint8) == formats.E8M0_NAN).any())
    if tensor.dtype in FP8_DTYPES:
        mask = FP8_NONFINITE_MASK[tensor.dtype]
        codes = tensor.view(torch.int8)
        return int(codes.max()) < mask and int(codes.view(torch.uint8).max()) < 0x80 | mask
    low, high = torch.aminmax(tensor)
    return bool(torch.isfinite(low)) and bool(torch.isfinite(high))


def identify(infos: dict[str, TensorInfo], fp8_block: tuple[int, int] | None,
             scheme: compressed_tensors.Scheme | None, is_modelopt: bool = False) -> Layout | None:
    """The layout of a matrix's stored parts (suffix -> header), or None when it is none of the module
    docstring's (a plain float tensor, or a form the CPU experts cannot hold as stored)."""
    keys = set(infos) - set(IGNORED_PARTS)
    weight = infos.get("weight")
    if weight is not None and weight.dtype == torch.float8_e4m3fn and fp8_block is not None:
        if keys == {"weight", "weight_scale_inv"}:
            return Layout("deepseek-fp8", "fp8", fp8_block[1], "float32", fp8_block[0])
        if keys == {"weight", "scale"} and infos["scale"].dtype in E8M0_DTYPES:
            return Layout("e8m0-fp8", "fp8", fp8_block[1], "float32", fp8_block[0])
    if keys == {"weight", "scale"} and weight.dtype in PACKED_BYTES and infos["scale"].dtype in E8M0_DTYPES \
            and fp8_block is not None:
        return Layout("e8m0-mxfp4", "mxfp4", 32, "e8m0")
    if is_modelopt and keys == {"weight", "weight_scale", "weight_scale_2"} and weight.dtype == torch.uint8:
        return Layout("modelopt-nvfp4", "nvfp4", 16, "e4m3")
    if scheme is None:
        return None
    if scheme.format == "float-quantized" and keys == {"weight", "weight_scale"} \
            and weight.dtype == torch.float8_e4m3fn:
        return _ct_fp8_layout(scheme)
    if scheme.format == "pack-quantized" and keys == {"weight_packed", "weight_scale", "weight_shape"} \
            and scheme.group_size:
        scale_dtype = "bfloat16" if infos["weight_scale"].dtype == torch.bfloat16 else "float32"
        return Layout("ct-int4", "int4", scheme.group_size, scale_dtype)
    if scheme.format == "nvfp4-pack-quantized" and \
            keys - {"weight_shape"} == {"weight_packed", "weight_scale", "weight_global_scale"}:
        return Layout("ct-nvfp4", "nvfp4", 16, "e4m3")
    return None


def _ct_fp8_layout(scheme: compressed_tensors.Scheme) -> Layout | None:
    strategy = scheme.strategy or "channel"
    if strategy in ("tensor", "channel"):
        return Layout("ct-fp8", "fp8", FP8_CHANNEL_GROUP, "float32")
    if strategy == "group" and scheme.group_size:
        return Layout("ct-fp8", "fp8", scheme.group_size, "float32")
    if strategy == "block" and scheme.block_structure:
        return Layout("ct-fp8", "fp8", scheme.block_structure[1], "float32", scheme.block_structure[0])
    return None


def decode(parts: dict[str, torch.Tensor], layout: Layout, shape: tuple[int, int] | None = None,
           check: Check | None = None) -> StoredMatrix:
    """The stored parts (suffix -> tensor, as read) of one matrix in `layout` -> its codes and scales, bits kept.
    `shape`: the [N, K] the model expects (None: taken from the parts). Raises `PartError` naming the part at
    fault; `check(suffix, tensor)` sees every part that could hold NaN or inf, before anything is converted."""
    decoder = {"fp8": _decode_fp8, "mxfp4": _decode_mxfp4, "nvfp4": _decode_nvfp4, "int4": _decode_int4}
    return decoder[layout.dtype](parts, layout, shape, check or (lambda suffix, tensor: None))


def _expect(part: str, tensor: torch.Tensor, shape: tuple[int, ...], dtypes: tuple[torch.dtype, ...]) -> None:
    if tuple(tensor.shape) != tuple(shape) or tensor.dtype not in dtypes:
        wanted = "/".join(str(d).removeprefix("torch.") for d in dtypes)
        raise PartError(part, f"is {str(tensor.dtype).removeprefix('torch.')} {tuple(tensor.shape)}, expected "
                              f"{wanted} {tuple(shape)}")


def _matrix_shape(part: str, weight: torch.Tensor, shape: tuple[int, int] | None,
                  cols_per_element: int) -> tuple[int, int]:
    if weight.dim() != 2:
        raise PartError(part, f"is {weight.dim()}-D {tuple(weight.shape)}, expected a matrix")
    return shape or (weight.shape[0], weight.shape[1] * cols_per_element)


def _per_row(scales: torch.Tensor, rows: int, block_rows: int) -> torch.Tensor:
    """Block scales [ceil(N / bn), G] -> one row of scales per weight row [N, G] (the same values)."""
    return scales.repeat_interleave(block_rows, dim=0)[:rows].contiguous() if block_rows > 1 else scales.contiguous()


def _e8m0_bits(scale: torch.Tensor) -> torch.Tensor:
    return scale.view(torch.uint8) if scale.dtype == torch.float8_e8m0fnu else scale


def _decode_fp8(parts, layout: Layout, shape, check: Check) -> StoredMatrix:
    weight = parts["weight"]
    rows, cols = _matrix_shape("weight", weight, shape, 1)
    _expect("weight", weight, (rows, cols), (torch.float8_e4m3fn,))
    check("weight", weight)
    groups = -(-cols // layout.group_size)
    if layout.name == "ct-fp8" and layout.block_rows == 1 and parts["weight_scale"].numel() in (1, rows) \
            and tuple(parts["weight_scale"].shape) in ((), (1,), (rows, 1)):
        scale = parts["weight_scale"]  # per tensor or per channel: one value per row, over every group
        check("weight_scale", scale)
        scales = scale.float().reshape(-1, 1).expand(rows, groups).contiguous()
    else:
        part = {"deepseek-fp8": "weight_scale_inv", "e8m0-fp8": "scale"}.get(layout.name, "weight_scale")
        scale = parts[part]
        blocks = (-(-rows // layout.block_rows), groups)
        if layout.name == "e8m0-fp8":
            _expect(part, scale, blocks, (torch.float8_e8m0fnu, torch.uint8))
            scale = _e8m0_bits(scale).view(torch.float8_e8m0fnu)
        else:
            _expect(part, scale, blocks, (torch.float32, torch.bfloat16, torch.float16))
        check(part, scale)
        scales = _per_row(scale.float(), rows, layout.block_rows)  # E8M0 and 16-bit floats widen exactly
    return StoredMatrix(layout, (rows, cols), weight.view(torch.uint8).contiguous(), scales)


def _decode_mxfp4(parts, layout: Layout, shape, check: Check) -> StoredMatrix:
    weight, scale = parts["weight"], parts["scale"]
    rows, cols = _matrix_shape("weight", weight, shape, 2)
    _expect("weight", weight, (rows, -(-cols // 2)), PACKED_BYTES)
    _expect("scale", scale, (rows, -(-cols // 32)), E8M0_DTYPES)
    check("scale", _e8m0_bits(scale).view(torch.float8_e8m0fnu))
    return StoredMatrix(layout, (rows, cols), weight.view(torch.uint8).contiguous(), _e8m0_bits(scale).contiguous())


def _decode_nvfp4(parts, layout: Layout, shape, check: Check) -> StoredMatrix:
    is_ct = layout.name == "ct-nvfp4"
    packed_part, tensor_part = ("weight_packed", "weight_global_scale") if is_ct else ("weight", "weight_scale_2")
    weight, scale, tensor = parts[packed_part], parts["weight_scale"], parts[tensor_part]
    rows, cols = _matrix_shape(packed_part, weight, shape, 2)
    if is_ct and "weight_shape" in parts and [int(d) for d in parts["weight_shape"].tolist()] != [rows, cols]:
        raise PartError("weight_shape", f"is {parts['weight_shape'].tolist()}, expected {[rows, cols]}")
    _expect(packed_part, weight, (rows, -(-cols // 2)), (torch.uint8,))
    _expect("weight_scale", scale, (rows, -(-cols // 16)), (torch.float8_e4m3fn,))
    if tensor.numel() != 1 or not tensor.is_floating_point():
        raise PartError(tensor_part, f"is {tensor.dtype} {tuple(tensor.shape)}, expected one float32 value")
    check("weight_scale", scale)
    check(tensor_part, tensor)
    tensor_scale = tensor.float().reshape(())
    if is_ct:
        tensor_scale = (1.0 / tensor_scale).float()  # compressed-tensors divides by the global scale
        check(tensor_part, tensor_scale)  # a zero global scale is an infinite tensor scale
    return StoredMatrix(layout, (rows, cols), weight.contiguous(), scale.view(torch.uint8).contiguous(), tensor_scale)


def _decode_int4(parts, layout: Layout, shape, check: Check) -> StoredMatrix:
    packed, scale, stored_shape = parts["weight_packed"], parts["weight_scale"], parts["weight_shape"]
    if stored_shape.numel() != 2:
        raise PartError("weight_shape", f"is {stored_shape.tolist()}, expected 2 values")
    rows, cols = shape or tuple(int(d) for d in stored_shape.tolist())
    if tuple(int(d) for d in stored_shape.tolist()) != (rows, cols):
        raise PartError("weight_shape", f"is {stored_shape.tolist()}, expected {[rows, cols]}")
    _expect("weight_packed", packed, (rows, -(-cols // 8)), (torch.int32,))
    groups = -(-cols // layout.group_size)
    if tuple(scale.shape) != (rows, groups) or not scale.is_floating_point():
        raise PartError("weight_scale", f"is {scale.dtype} {tuple(scale.shape)}, expected float {(rows, groups)} "
                                        f"(groups of {layout.group_size})")
    check("weight_scale", scale)
    scales = scale if layout.scale_dtype == "bfloat16" else scale.float()
    return StoredMatrix(layout, (rows, cols), compressed_tensors.int4_bytes(packed, cols), scales.contiguous())
