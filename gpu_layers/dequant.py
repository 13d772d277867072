"""int8 weights with float32 scales -> bf16 on the device, for experts streamed from the CPU's memory.

Data flow: w int8 [E, N, K] (contiguous, as the CPU experts store it), scales float32 [E, N, G] (one per row and
group of K // G columns; G = 1: per row) -> out bf16 [E, N, K], which may be a strided view (rows n of expert e at
out + e * stride_oe + n * stride_on), so gate and up land side by side in one [E, 2I, H] table without a copy.
Each element is w * scale rounded once to bf16: what the CPU operator's float path multiplies by.

A pure bandwidth kernel (1 byte read, 2 written per element): one program converts BLOCK_R rows x BLOCK_K columns
with no shared memory.
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


def dequantize_int8(w: torch.Tensor, scales: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """w int8 [E, N, K], scales float32 [E, N, G] -> out bf16 [E, N, K] (unit column stride; allocated if None)."""
    if w.dim() != 3 or w.dtype != torch.int8 or not w.is_contiguous():
        raise ValueError(f"w must be contiguous int8 [E, N, K], got {tuple(w.shape)} {w.dtype}")
    num_experts, rows_per_expert, num_cols = w.shape
    if scales.dim() != 3 or scales.shape[:2] != w.shape[:2] or scales.dtype != torch.float32 \
            or not scales.is_contiguous() or num_cols % scales.shape[2]:
        raise ValueError(f"scales must be contiguous float32 [E, N, G] = [{num_experts}, {rows_per_expert}, G] with G "
                         f"dividing K={num_cols}, got {tuple(scales.shape)} {scales.dtype}")
    if out is None:
        out = torch.empty(w.shape, dtype=torch.bfloat16, device=w.device)
    if out.shape != w.shape or out.dtype != torch.bfloat16 or out.stride(2) != 1:
        raise ValueError(f"out must be bf16 {tuple(w.shape)} with unit column stride, got {tuple(out.shape)} "
                         f"{out.dtype} strides {out.stride()}")
    for name, tensor in (("scales", scales), ("out", out)):
        if tensor.device != w.device:
            raise ValueError(f"{name} is on {tensor.device}, w on {w.device}")
    num_rows = num_experts * rows_per_expert
    if num_rows == 0 or num_cols == 0:
        return out
    num_groups = scales.shape[2]
    grid = (triton.cdiv(num_rows, BLOCK_R), triton.cdiv(num_cols, BLOCK_K))
    dequantize_int8_kernel[grid](w, scales, out, num_rows, rows_per_expert, num_cols, num_groups,
                                 num_cols // num_groups, out.stride(0), out.stride(1), BLOCK_R=BLOCK_R,
                                 BLOCK_K=BLOCK_K)
    return out


def dequantize_int8_reference(w: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The same in PyTorch: every group of K // G columns times its scale, rounded once to bf16."""
    num_experts, rows, cols = w.shape
    groups = scales.shape[2]
    grouped = w.float().view(num_experts, rows, groups, cols // groups) * scales[..., None]  # [E, N, G, K/G]
    return grouped.view(num_experts, rows, cols).to(torch.bfloat16)


def gate_cases() -> list[GateCase]:
    signature = {"w": "*i8", "scales": "*fp32", "out": "*bf16", "num_rows": "i32", "rows_per_expert": "i32",
                 "num_cols": "i32", "num_groups": "i32", "group": "i32", "stride_oe": "i64", "stride_on": "i32"}
    return [GateCase(kernel=dequantize_int8_kernel, signature=signature,
                     constexprs={"BLOCK_R": BLOCK_R, "BLOCK_K": BLOCK_K}, capability=capability,
                     label="dequantize_int8") for capability in CAPABILITIES]
