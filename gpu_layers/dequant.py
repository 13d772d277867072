"""int8 and int4 expert weights -> bf16 on the device, for experts streamed from the CPU's memory.

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
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gpu_layers.capability import CAPABILITIES, GateCase

BLOCK_R, BLOCK_K = 8, 256


@triton.jit
def dequantize_int8_kernel(
    w, scales, out, num_rows, rows_per_expert, num_cols, num_groups, group, stride_oe, stride_on,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    row_ok = rows < num_rows
    mask = row_ok[:, None] & (cols < num_cols)[None, :]
    q = tl.load(w + rows[:, None] * num_cols + cols[None, :], mask=mask, other=0)
    scale = tl.load(scales + rows[:, None] * num_groups + (cols // group)[None, :], mask=mask, other=0.0)
    dst = (rows // rows_per_expert) * stride_oe + (rows % rows_per_expert) * stride_on
    tl.store(out + dst[:, None] + cols[None, :], (q.to(tl.float32) * scale).to(tl.bfloat16), mask=mask)



def checked_table(out: torch.Tensor | None, shape: tuple[int, ...], w: torch.Tensor, scales: torch.Tensor
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
    out = checked_table(out, tuple(w.shape), w, scales)
    num_rows = num_experts * rows_per_expert
    if num_rows == 0 or num_cols == 0:
        return out
    num_groups = scales.shape[2]
    grid = (triton.cdiv(num_rows, BLOCK_R), triton.cdiv(num_cols, BLOCK_K))
    dequantize_int8_kernel[grid](w, scales, out, num_rows, rows_per_expert, num_cols, num_groups,
                                 num_cols // num_groups, out.stride(0), out.stride(1), BLOCK_R=BLOCK_R,
                                 BLOCK_K=BLOCK_K)
    return out


@triton.jit
def dequantize_int4_kernel(
    w, scales, out, num_rows, rows_per_expert, num_cols, num_bytes, num_groups, group, stride_oe, stride_on,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    row_ok = rows < num_rows
    mask = row_ok[:, None] & (cols < num_cols)[None, :]
    # each byte is loaded by its two columns' lanes: adjacent addresses, one transaction
    packed = tl.load(w + rows[:, None] * num_bytes + (cols // 2)[None, :], mask=mask, other=0x88)
    nibble = (packed.to(tl.int32) >> ((cols % 2) * 4)[None, :]) & 0xF
    scale = tl.load(scales + rows[:, None] * num_groups + (cols // group)[None, :], mask=mask, other=0.0)
    dst = (rows // rows_per_expert) * stride_oe + (rows % rows_per_expert) * stride_on
    value = (nibble - 8).to(tl.float32) * scale.to(tl.float32)
    tl.store(out + dst[:, None] + cols[None, :], value.to(tl.bfloat16), mask=mask)


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
    out = checked_table(out, (num_experts, rows_per_expert, num_cols), w, scales)
    num_rows = num_experts * rows_per_expert
    if num_rows == 0 or num_cols == 0:
        return out
    grid = (triton.cdiv(num_rows, BLOCK_R), triton.cdiv(num_cols, BLOCK_K))
    dequantize_int4_kernel[grid](w, scales, out, num_rows, rows_per_expert, num_cols, num_bytes, num_groups,
                                 group_size, out.stride(0), out.stride(1), BLOCK_R=BLOCK_R, BLOCK_K=BLOCK_K)
    return out


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


def gate_cases() -> list[GateCase]:
    constexprs = {"BLOCK_R": BLOCK_R, "BLOCK_K": BLOCK_K}
    signature = {"w": "*i8", "scales": "*fp32", "out": "*bf16", "num_rows": "i32", "rows_per_expert": "i32",
                 "num_cols": "i32", "num_groups": "i32", "group": "i32", "stride_oe": "i64", "stride_on": "i32"}
    cases = [GateCase(kernel=dequantize_int8_kernel, signature=signature, constexprs=constexprs,
                      capability=capability, label="dequantize_int8") for capability in CAPABILITIES]
    for scale_type in ("fp32", "bf16"):  # the expert file's scale_dtype: each compiles its own specialisation
        signature = {"w": "*u8", "scales": f"*{scale_type}", "out": "*bf16", "num_rows": "i32",
                     "rows_per_expert": "i32", "num_cols": "i32", "num_bytes": "i32", "num_groups": "i32",
                     "group": "i32", "stride_oe": "i64", "stride_on": "i32"}
        cases += [GateCase(kernel=dequantize_int4_kernel, signature=signature, constexprs=constexprs,
                           capability=capability, label=f"dequantize_int4 {scale_type} scales")
                  for capability in CAPABILITIES]
    return cases
