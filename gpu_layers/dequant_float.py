"""FP8, MXFP4 and NVFP4 expert weights -> bf16 on the device, for experts streamed from the CPU's memory (the float
formats' side of `gpu_layers.dequant`, same data flow and output: a bf16 [E, N, K] table, possibly a strided view).

The stored bits, as `cpu_experts.formats` keeps them (E experts, N rows, K columns):
- FP8: e4m3fn codes uint8 [E, N, K], float32 scales [E, N, ceil(K / group)] (a checkpoint's 128 x 128 block scale
  repeated over its rows). Element: e4m3 value x scale, in float32, rounded once to bf16.
- MXFP4: two e2m1 codes a byte uint8 [E, N, ceil(K / 2)] (even column in the low nibble), E8M0 scales uint8
  [E, N, ceil(K / 32)] (2^(s - 127)). Element: e2m1 value x 2^(s - 127): exact in float32, rounded to bf16 (exact
  but for exponents past bf16's range).
- NVFP4: the same codes, e4m3 scales uint8 [E, N, ceil(K / 16)], one float32 tensor scale per expert [E]. Element:
  (e2m1 x e4m3 scale, exact) x tensor scale in float32, rounded once to bf16: the CPU reference's order.
So each element is the dequantized stored weight (the formats' float reference) rounded once to bf16, as the int8
and int4 kernels do.

The codes are decoded with integer arithmetic into float32 bit patterns (no lookup table, no exp2 approximation):
e4m3 normal numbers are sign | (exponent + 120) << 23 | mantissa << 20, subnormals mantissa x 2^-9; e2m1 normal
numbers sign | (exponent + 126) << 23 | mantissa << 22, its subnormal 0.5; E8M0 s is s << 23 (s = 0: 2^-127, the
float32 subnormal 0x00400000). e4m3's NaN codes (S.1111.111) and E8M0's 255 decode to NaN.

Pure bandwidth kernels: one program converts BLOCK_R rows x BLOCK_K columns with no shared memory.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gpu_layers.capability import CAPABILITIES, GateCase
from gpu_layers.dequant import BLOCK_K, BLOCK_R, checked_table

MX_GROUP, NV_GROUP = 32, 16


@triton.jit
def _e4m3_to_float(bits):
    """uint8 e4m3fn codes (as int32) -> float32 values, exact."""
    bits = bits.to(tl.uint32)
    sign, exponent, mantissa = (bits >> 7) & 1, (bits >> 3) & 0xF, bits & 7
    normal = ((sign << 31) | ((exponent + 120) << 23) | (mantissa << 20)).to(tl.float32, bitcast=True)
    subnormal = mantissa.to(tl.float32) * 0.001953125  # mantissa x 2^-9
    subnormal = tl.where(sign == 1, -subnormal, subnormal)
    value = tl.where(exponent == 0, subnormal, normal)
    return tl.where((exponent == 15) & (mantissa == 7), float("nan"), value)


@triton.jit
def _e2m1_to_float(code):
    """e2m1 codes 0..15 (as int32; bit 3 the sign) -> float32 values, exact."""
    code = code.to(tl.uint32)
    sign, exponent, mantissa = (code >> 3) & 1, (code >> 1) & 3, code & 1
    normal = ((sign << 31) | ((exponent + 126) << 23) | (mantissa << 22)).to(tl.float32, bitcast=True)
    subnormal = mantissa.to(tl.float32) * 0.5
    subnormal = tl.where(sign == 1, -subnormal, subnormal)
    return tl.where(exponent == 0, subnormal, normal)


@triton.jit
def _e8m0_to_float(bits):
    """uint8 E8M0 exponents (as int32) -> float32 2^(bits - 127), exact; 255 -> NaN."""
    bits = bits.to(tl.uint32)
    value = tl.where(bits == 0, 0x00400000, bits << 23).to(tl.float32, bitcast=True)
    return tl.where(bits == 255, float("nan"), value)


@triton.jit
def _fp4_codes(w, rows, cols, num_bytes, mask):
    """The e2m1 codes of [rows, cols] from packed rows of `num_bytes` (each byte loaded by its two columns' lanes:
    adjacent addresses, one transaction)."""
    packed = tl.load(w + rows[:, None] * num_bytes + (cols // 2)[None, :], mask=mask, other=0)
    return (packed.to(tl.int32) >> ((cols % 2) * 4)[None, :]) & 0xF


@triton.jit
def dequantize_fp8_kernel(
    w, scales, out, num_rows, rows_per_expert, num_cols, num_groups, group, stride_oe, stride_on,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (rows < num_rows)[:, None] & (cols < num_cols)[None, :]
    bits = tl.load(w + rows[:, None] * num_cols + cols[None, :], mask=mask, other=0)
    scale = tl.load(scales + rows[:, None] * num_groups + (cols // group)[None, :], mask=mask, other=0.0)
    value = _e4m3_to_float(bits.to(tl.int32)) * scale
    dst = (rows // rows_per_expert) * stride_oe + (rows % rows_per_expert) * stride_on
    tl.store(out + dst[:, None] + cols[None, :], value.to(tl.bfloat16), mask=mask)


@triton.jit
def dequantize_fp4_kernel(
    w, scales, tensor_scales, out, num_rows, rows_per_expert, num_cols, num_bytes, num_groups, stride_oe, stride_on,
    IS_NVFP4: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """MXFP4 (E8M0 scales a 32 columns) or, IS_NVFP4, NVFP4 (e4m3 scales a 16, times the expert's tensor scale)."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (rows < num_rows)[:, None] & (cols < num_cols)[None, :]
    value = _e2m1_to_float(_fp4_codes(w, rows, cols, num_bytes, mask))
    group = 16 if IS_NVFP4 else 32
    scale_bits = tl.load(scales + rows[:, None] * num_groups + (cols // group)[None, :], mask=mask, other=0)
    expert = rows // rows_per_expert
    if IS_NVFP4:
        tensor_scale = tl.load(tensor_scales + expert, mask=rows < num_rows, other=0.0)
        value = value * _e4m3_to_float(scale_bits.to(tl.int32)) * tensor_scale[:, None]
    else:
        value = value * _e8m0_to_float(scale_bits.to(tl.int32))
    dst = expert * stride_oe + (rows % rows_per_expert) * stride_on
    tl.store(out + dst[:, None] + cols[None, :], value.to(tl.bfloat16), mask=mask)


def _check(name: str, tensor: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    if tuple(tensor.shape) != shape or tensor.dtype != dtype or not tensor.is_contiguous():
        raise ValueError(f"{name} must be contiguous {dtype} {list(shape)}, got {tuple(tensor.shape)} {tensor.dtype}")


def dequantize_fp8(w: torch.Tensor, scales: torch.Tensor, group_size: int, out: torch.Tensor | None = None
                   ) -> torch.Tensor:
    """w e4m3 bits uint8 [E, N, K], scales float32 [E, N, ceil(K / group_size)] -> out bf16 [E, N, K] (unit column
    stride; allocated if None)."""
    if w.dim() != 3 or group_size < 1:
        raise ValueError(f"w must be uint8 [E, N, K] and group_size >= 1, got {tuple(w.shape)}, {group_size}")
    num_experts, rows_per_expert, num_cols = w.shape
    _check("w", w, tuple(w.shape), torch.uint8)
    num_groups = -(-num_cols // group_size)
    _check("scales", scales, (num_experts, rows_per_expert, num_groups), torch.float32)
    out = checked_table(out, tuple(w.shape), w, scales)
    num_rows = num_experts * rows_per_expert
    if num_rows and num_cols:
        grid = (triton.cdiv(num_rows, BLOCK_R), triton.cdiv(num_cols, BLOCK_K))
        dequantize_fp8_kernel[grid](w, scales, out, num_rows, rows_per_expert, num_cols, num_groups, group_size,
                                    out.stride(0), out.stride(1), BLOCK_R=BLOCK_R, BLOCK_K=BLOCK_K)
    return out


def dequantize_fp4(w: torch.Tensor, scales: torch.Tensor, num_cols: int, tensor_scale: torch.Tensor | None = None,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """w packed e2m1 uint8 [E, N, ceil(K / 2)], K = num_cols, with either E8M0 scales uint8 [E, N, ceil(K / 32)]
    (MXFP4, `tensor_scale` None) or e4m3 scales uint8 [E, N, ceil(K / 16)] and `tensor_scale` float32 [E] (NVFP4)
    -> out bf16 [E, N, K] (unit column stride; allocated if None)."""
    if w.dim() != 3:
        raise ValueError(f"w must be packed uint8 [E, N, ceil(K / 2)], got {tuple(w.shape)}")
    num_experts, rows_per_expert, num_bytes = w.shape
    _check("w", w, (num_experts, rows_per_expert, -(-num_cols // 2)), torch.uint8)
    is_nvfp4 = tensor_scale is not None
    num_groups = -(-num_cols // (NV_GROUP if is_nvfp4 else MX_GROUP))
    _check("scales", scales, (num_experts, rows_per_expert, num_groups), torch.uint8)
    if is_nvfp4:
        _check("tensor_scale", tensor_scale, (num_experts,), torch.float32)
    out = checked_table(out, (num_experts, rows_per_expert, num_cols), w, scales)
    num_rows = num_experts * rows_per_expert
    if num_rows and num_cols:
        grid = (triton.cdiv(num_rows, BLOCK_R), triton.cdiv(num_cols, BLOCK_K))
        dequantize_fp4_kernel[grid](w, scales, tensor_scale if is_nvfp4 else scales, out, num_rows, rows_per_expert,
                                    num_cols, num_bytes, num_groups, out.stride(0), out.stride(1),
                                    IS_NVFP4=is_nvfp4, BLOCK_R=BLOCK_R, BLOCK_K=BLOCK_K)
    return out


# ---- references: the same in PyTorch ------------------------------------------------------------------------------

def _expand(scales: torch.Tensor, group: int, num_cols: int) -> torch.Tensor:
    return scales.repeat_interleave(group, dim=2)[..., :num_cols]


def _unpacked(w: torch.Tensor, num_cols: int) -> torch.Tensor:
    """packed uint8 [E, N, ceil(K / 2)] -> e2m1 codes int64 [E, N, K], the low nibble first."""
    return torch.stack((w & 0x0F, w >> 4), dim=-1).flatten(2)[..., :num_cols].long()


E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_fp8_reference(w: torch.Tensor, scales: torch.Tensor, group_size: int) -> torch.Tensor:
    values = w.view(torch.float8_e4m3fn).float()
    return (values * _expand(scales, group_size, w.shape[2])).to(torch.bfloat16)


def dequantize_fp4_reference(w: torch.Tensor, scales: torch.Tensor, num_cols: int,
                             tensor_scale: torch.Tensor | None = None) -> torch.Tensor:
    values = torch.tensor(E2M1, device=w.device)[_unpacked(w, num_cols)]
    if tensor_scale is None:  # E8M0: 2^(s - 127) in float64 is exact, and so is its float32 (0 -> 2^-127)
        exponents = scales.double() - 127
        factors = torch.where(scales == 255, torch.nan, torch.pow(2.0, exponents)).float()
        return (values * _expand(factors, MX_GROUP, num_cols)).to(torch.bfloat16)
    block = _expand(scales.view(torch.float8_e4m3fn).float(), NV_GROUP, num_cols)
    return (values * block * tensor_scale[:, None, None]).to(torch.bfloat16)


def gate_cases() -> list[GateCase]:
    constexprs = {"BLOCK_R": BLOCK_R, "BLOCK_K": BLOCK_K}
    signature = {"w": "*u8", "scales": "*fp32", "out": "*bf16", "num_rows": "i32", "rows_per_expert": "i32",
                 "num_cols": "i32", "num_groups": "i32", "group": "i32", "stride_oe": "i64", "stride_on": "i32"}
    cases = [GateCase(kernel=dequantize_fp8_kernel, signature=signature, constexprs=constexprs,
                      capability=capability, label="dequantize_fp8") for capability in CAPABILITIES]
    signature = {"w": "*u8", "scales": "*u8", "tensor_scales": "*fp32", "out": "*bf16", "num_rows": "i32",
                 "rows_per_expert": "i32", "num_cols": "i32", "num_bytes": "i32", "num_groups": "i32",
                 "stride_oe": "i64", "stride_on": "i32"}
    for is_nvfp4 in (False, True):  # MXFP4's launch passes its scales as tensor_scales (never read): *u8 there
        fp4 = dict(signature, tensor_scales="*fp32" if is_nvfp4 else "*u8")
        cases += [GateCase(kernel=dequantize_fp4_kernel, signature=fp4, constexprs={**constexprs,
                                                                                   "IS_NVFP4": is_nvfp4},
                           capability=capability, label=f"dequantize_fp4 {'nvfp4' if is_nvfp4 else 'mxfp4'}")
                  for capability in CAPABILITIES]
    return cases
