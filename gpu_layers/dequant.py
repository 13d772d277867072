"""Expert weights in every CPU format -> bf16 on the device, for experts streamed from the CPU's memory.

Data flow: w int8 [E, N, K] (contiguous, as the CPU experts store it), scales float32 [E, N, G] (one per row and
group of K // G columns; G = 1: per row) -> out bf16 [E, N, K], which may be a strided view (rows n of expert e at
out + e * stride_oe + n * stride_on), so gate and up land side by side in one [E, 2I, H] table without a copy.
Each element is w * scale rounded once to bf16: what the CPU operator's float path multiplies by.

int4 (`dequantize_int4`): packed uint8 [E, N, ceil(K / 2)] as `cpu_experts.formats` stores it (two codes a byte
along K, the even column in the low nibble, value = nibble - 8, so -8..7; for odd K the last byte's high nibble is
padding), scales float32 or bfloat16 [E, N, ceil(K / group_size)] (a bfloat16 scale widens exactly), same out.
Each element is (nibble - 8) * scale in float32 rounded once to bf16: the CPU's int4 kernels factor the scale out
of each group's float32 dot product, so this is the weight they compute with (exact in float32 for bfloat16
scales; a float32 scale's product is the one the PyTorch reference forms too).

Pure bandwidth kernels (int8: 1 byte read, 2 written per element; int4: half a byte read): one program converts
BLOCK_R rows x BLOCK_K columns with no shared memory.

FP8, MXFP4 and NVFP4 (`dequantize_fp8`, `dequantize_fp4`: the float formats as `cpu_experts.formats` stores them):
- FP8: e4m3fn codes uint8 [E, N, K], float32 scales [E, N, ceil(K / group)] (a checkpoint's 128 x 128 block scale
  repeated over its rows). Element: e4m3 value x scale, in float32, rounded once to bf16.
- MXFP4: two e2m1 codes a byte uint8 [E, N, ceil(K / 2)] (even column in the low nibble), E8M0 scales uint8
  [E, N, ceil(K / 32)] (2^(s - 127)). Element: e2m1 value x 2^(s - 127): exact in float32, rounded to bf16 (exact
  but for exponents past bf16's range).
- NVFP4: the same codes, e4m3 scales uint8 [E, N, ceil(K / 16)], one float32 tensor scale per expert [E]. Element:
  (e2m1 x e4m3 scale, exact) x tensor scale in float32, rounded once to bf16: the CPU reference's order.
Codes are decoded with integer arithmetic into float32 bit patterns (no lookup table, no exp2 approximation):
e4m3 normal numbers are sign | (exponent + 120) << 23 | mantissa << 20, subnormals mantissa x 2^-9; e2m1 normal
numbers sign | (exponent + 126) << 23 | mantissa << 22, its subnormal 0.5; E8M0 s is s << 23 (s = 0: 2^-127, the
float32 subnormal 0x00400000). e4m3's NaN codes (S.1111.111) and E8M0's 255 decode to NaN.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gpu_layers.capability import CAPABILITIES, GateCase

BLOCK_R, BLOCK_K = 8, 256
INT4, MXFP4, NVFP4 = 0, 1, 2  # the nibble kernel's FORMAT
MX_GROUP, NV_GROUP = 32, 16


@triton.jit
def _tile(num_rows, num_cols, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    """The program's BLOCK_R flattened (expert, row) rows x BLOCK_K columns and their in-bounds mask."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    return rows, cols, (rows < num_rows)[:, None] & (cols < num_cols)[None, :]


@triton.jit
def _store_table(out, rows, cols, mask, value, rows_per_expert, stride_oe, stride_on):
    """value [BLOCK_R, BLOCK_K] float32 -> bf16 at rows n of expert e: out + e * stride_oe + n * stride_on."""
    dst = (rows // rows_per_expert) * stride_oe + (rows % rows_per_expert) * stride_on
    tl.store(out + dst[:, None] + cols[None, :], value.to(tl.bfloat16), mask=mask)


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
def dequantize_bytes_kernel(
    w, scales, out, num_rows, rows_per_expert, num_cols, num_groups, group, stride_oe, stride_on,
    IS_FP8: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """One code a byte: int8, or (IS_FP8) e4m3 bits; float32 scales a `group` columns."""
    rows, cols, mask = _tile(num_rows, num_cols, BLOCK_R, BLOCK_K)
    q = tl.load(w + rows[:, None] * num_cols + cols[None, :], mask=mask, other=0)
    scale = tl.load(scales + rows[:, None] * num_groups + (cols // group)[None, :], mask=mask, other=0.0)
    value = _e4m3_to_float(q.to(tl.int32)) if IS_FP8 else q.to(tl.float32)
    _store_table(out, rows, cols, mask, value * scale, rows_per_expert, stride_oe, stride_on)


@triton.jit
def dequantize_nibbles_kernel(
    w, scales, tensor_scales, out, num_rows, rows_per_expert, num_cols, num_bytes, num_groups, group, stride_oe,
    stride_on, FORMAT: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Two codes a byte (the even column in the low nibble): INT4 (nibble - 8, float32 or bfloat16 scales a `group`
    columns), MXFP4 (e2m1 x E8M0 a 32) or NVFP4 (e2m1 x e4m3 a 16, times the expert's tensor scale)."""
    rows, cols, mask = _tile(num_rows, num_cols, BLOCK_R, BLOCK_K)
    # each byte is loaded by its two columns' lanes: adjacent addresses, one transaction
    packed = tl.load(w + rows[:, None] * num_bytes + (cols // 2)[None, :], mask=mask, other=0)
    code = (packed.to(tl.int32) >> ((cols % 2) * 4)[None, :]) & 0xF
    scale = tl.load(scales + rows[:, None] * num_groups + (cols // group)[None, :], mask=mask, other=0)
    if FORMAT == 0:  # INT4
        value = (code - 8).to(tl.float32) * scale.to(tl.float32)
    elif FORMAT == 1:  # MXFP4
        value = _e2m1_to_float(code) * _e8m0_to_float(scale.to(tl.int32))
    else:  # NVFP4: the block product is exact, then one rounding for the tensor scale
        tensor_scale = tl.load(tensor_scales + rows // rows_per_expert, mask=rows < num_rows, other=0.0)
        value = _e2m1_to_float(code) * _e4m3_to_float(scale.to(tl.int32)) * tensor_scale[:, None]
    _store_table(out, rows, cols, mask, value, rows_per_expert, stride_oe, stride_on)


def _checked_table(out: torch.Tensor | None, shape: tuple[int, ...], w: torch.Tensor, scales: torch.Tensor
                   ) -> torch.Tensor:
    """The launchers' bf16 output [E, N, K] (allocated if None), checked: unit column stride, w's device."""
    if out is None:
        out = torch.empty(shape, dtype=torch.bfloat16, device=w.device)
    if tuple(out.shape) != shape or out.dtype != torch.bfloat16 or out.stride(2) != 1:
        raise ValueError(f"out must be bf16 {shape} with unit column stride, got {tuple(out.shape)} "
                         f"{out.dtype} strides {out.stride()}")
    for name, tensor in (("scales", scales), ("out", out)):
        if tensor.device != w.device:
            raise ValueError(f"{name} is on {tensor.device}, w on {w.device}")
    return out


def dequantize_int8(w: torch.Tensor, scales: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """w int8 [E, N, K], scales float32 [E, N, G] -> out bf16 [E, N, K] (unit column stride; allocated if None)."""
    if w.dim() != 3 or w.dtype != torch.int8 or not w.is_contiguous():
        raise ValueError(f"w must be contiguous int8 [E, N, K], got {tuple(w.shape)} {w.dtype}")
    num_experts, rows_per_expert, num_cols = w.shape
    if scales.dim() != 3 or scales.shape[:2] != w.shape[:2] or scales.dtype != torch.float32 \
            or not scales.is_contiguous() or num_cols % scales.shape[2]:
        raise ValueError(f"scales must be contiguous float32 [E, N, G] = [{num_experts}, {rows_per_expert}, G] with G "
                         f"dividing K={num_cols}, got {tuple(scales.shape)} {scales.dtype}")
    out = _checked_table(out, tuple(w.shape), w, scales)
    num_rows = num_experts * rows_per_expert
    if num_rows == 0 or num_cols == 0:
        return out
    num_groups = scales.shape[2]
    grid = (triton.cdiv(num_rows, BLOCK_R), triton.cdiv(num_cols, BLOCK_K))
    dequantize_bytes_kernel[grid](w, scales, out, num_rows, rows_per_expert, num_cols, num_groups,
                                  num_cols // num_groups, out.stride(0), out.stride(1), IS_FP8=False, BLOCK_R=BLOCK_R,
                                  BLOCK_K=BLOCK_K)
    return out


def dequantize_int4(w: torch.Tensor, scales: torch.Tensor, group_size: int, num_cols: int,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """w packed uint8 [E, N, ceil(K / 2)], scales float32/bfloat16 [E, N, ceil(K / group_size)], K = num_cols ->
    out bf16 [E, N, K] (unit column stride; allocated if None)."""
    if w.dim() != 3 or w.dtype != torch.uint8 or not w.is_contiguous():
        raise ValueError(f"w must be contiguous packed uint8 [E, N, ceil(K / 2)], got {tuple(w.shape)} {w.dtype}")
    num_experts, rows_per_expert, num_bytes = w.shape
    if num_bytes != -(-num_cols // 2):
        raise ValueError(f"w has {num_bytes} bytes a row, K={num_cols} packs into {-(-num_cols // 2)}")
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1 (K={num_cols} for one scale a row), got {group_size}")
    num_groups = -(-num_cols // group_size)
    if scales.dim() != 3 or scales.shape != (num_experts, rows_per_expert, num_groups) \
            or scales.dtype not in (torch.float32, torch.bfloat16) or not scales.is_contiguous():
        raise ValueError(f"scales must be contiguous float32 or bfloat16 [E, N, ceil(K / group_size)] = "
                         f"[{num_experts}, {rows_per_expert}, {num_groups}], got {tuple(scales.shape)} {scales.dtype}")
    out = _checked_table(out, (num_experts, rows_per_expert, num_cols), w, scales)
    num_rows = num_experts * rows_per_expert
    if num_rows == 0 or num_cols == 0:
        return out
    grid = (triton.cdiv(num_rows, BLOCK_R), triton.cdiv(num_cols, BLOCK_K))
    dequantize_nibbles_kernel[grid](w, scales, scales, out, num_rows, rows_per_expert, num_cols, num_bytes,
                                    num_groups, group_size, out.stride(0), out.stride(1), FORMAT=INT4,
                                    BLOCK_R=BLOCK_R, BLOCK_K=BLOCK_K)
    return out


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
    out = _checked_table(out, tuple(w.shape), w, scales)
    num_rows = num_experts * rows_per_expert
    if num_rows and num_cols:
        grid = (triton.cdiv(num_rows, BLOCK_R), triton.cdiv(num_cols, BLOCK_K))
        dequantize_bytes_kernel[grid](w, scales, out, num_rows, rows_per_expert, num_cols, num_groups, group_size,
                                      out.stride(0), out.stride(1), IS_FP8=True, BLOCK_R=BLOCK_R, BLOCK_K=BLOCK_K)
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
    out = _checked_table(out, (num_experts, rows_per_expert, num_cols), w, scales)
    num_rows = num_experts * rows_per_expert
    if num_rows and num_cols:
        grid = (triton.cdiv(num_rows, BLOCK_R), triton.cdiv(num_cols, BLOCK_K))
        group = NV_GROUP if is_nvfp4 else MX_GROUP
        dequantize_nibbles_kernel[grid](w, scales, tensor_scale if is_nvfp4 else scales, out, num_rows,
                                        rows_per_expert, num_cols, num_bytes, num_groups, group, out.stride(0),
                                        out.stride(1), FORMAT=NVFP4 if is_nvfp4 else MXFP4, BLOCK_R=BLOCK_R,
                                        BLOCK_K=BLOCK_K)
    return out


# ---- references: the same in PyTorch ------------------------------------------------------------------------------

def dequantize_int8_reference(w: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The same in PyTorch: every group of K // G columns times its scale, rounded once to bf16."""
    num_experts, rows, cols = w.shape
    groups = scales.shape[2]
    grouped = w.float().view(num_experts, rows, groups, cols // groups) * scales[..., None]  # [E, N, G, K/G]
    return grouped.view(num_experts, rows, cols).to(torch.bfloat16)


def dequantize_int4_reference(w: torch.Tensor, scales: torch.Tensor, group_size: int, num_cols: int) -> torch.Tensor:
    """The same in PyTorch: the nibbles unpacked (low first) minus 8, times their group's scale widened to float32,
    rounded once to bf16."""
    codes = torch.stack((w & 0x0F, w >> 4), dim=-1).flatten(2)[..., :num_cols].float() - 8  # [E, N, K]
    expanded = scales.float().repeat_interleave(group_size, dim=2)[..., :num_cols]
    return (codes * expanded).to(torch.bfloat16)


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
    """Each format's specialisation: int8 and FP8 bytes, int4 with float32 or bfloat16 scales (the expert file's
    scale_dtype), MXFP4 and NVFP4 (int4 and MXFP4 pass their scales as the unread tensor_scales)."""
    constexprs = {"BLOCK_R": BLOCK_R, "BLOCK_K": BLOCK_K}
    shape = {"out": "*bf16", "num_rows": "i32", "rows_per_expert": "i32", "num_cols": "i32"}
    strides = {"num_groups": "i32", "group": "i32", "stride_oe": "i64", "stride_on": "i32"}
    cases = []
    for label, w, is_fp8 in (("dequantize_int8", "*i8", False), ("dequantize_fp8", "*u8", True)):
        signature = {"w": w, "scales": "*fp32", **shape, **strides}
        cases += [GateCase(kernel=dequantize_bytes_kernel, signature=signature,
                           constexprs={**constexprs, "IS_FP8": is_fp8}, capability=capability, label=label)
                  for capability in CAPABILITIES]
    for label, scales, tensor_scales, fmt in (("int4 fp32 scales", "*fp32", "*fp32", INT4),
                                              ("int4 bf16 scales", "*bf16", "*bf16", INT4),
                                              ("mxfp4", "*u8", "*u8", MXFP4), ("nvfp4", "*u8", "*fp32", NVFP4)):
        signature = {"w": "*u8", "scales": scales, "tensor_scales": tensor_scales, **shape, "num_bytes": "i32",
                     **strides}
        cases += [GateCase(kernel=dequantize_nibbles_kernel, signature=signature,
                           constexprs={**constexprs, "FORMAT": fmt}, capability=capability,
                           label=f"dequantize_{label}") for capability in CAPABILITIES]
    return cases
