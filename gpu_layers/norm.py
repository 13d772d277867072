"""RMSNorm, optionally fused with the residual add, one row per program.

Data flow: x [T, H] (or [T * heads, D] rows for the per-head QK-norm), weight [H], eps -> out [T, H] in x's dtype.
With residual [T, H]: residual <- x + residual in place, rounded to the activation dtype as vLLM's
fused_add_rms_norm does, and out = norm(residual), computed from the rounded sum.

Numerics follow hybrid/layers/norm.py step for step: float32 x * rsqrt(mean(x^2) + eps), cast to x's dtype, THEN
times weight in that dtype. Whole rows sit in registers (BLOCK = next_power_of_2(H), 64 .. 8192), so a row is
read once and the kernel is bandwidth-bound; a program takes ROWS rows (more for short rows) and num_warps grows
with the tile to keep ~8-16 elements per thread.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gpu_layers.capability import CAPABILITIES, GateCase, capability_of, select
from gpu_layers.reference import rms_norm as rms_norm_reference  # noqa: F401 (the kernel's reference)

MIN_BLOCK, MAX_BLOCK = 64, 8192
DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}

# BLOCK -> (ROWS per program, num_warps): ~2-4K elements a program, so QK-norm's many short rows (D=128) do not
# launch a one-warp program each, and a 7168-wide row gets 16 warps. Row kernels use no shared memory beyond the
# reduction scratch, so the three targets share one table; it is keyed by capability so a target can be tuned alone.
_CONFIG_BY_BLOCK = {64: (32, 4), 128: (16, 4), 256: (8, 4), 512: (4, 4), 1024: (2, 4), 2048: (2, 8), 4096: (1, 8),
                    8192: (1, 16)}
CONFIGS = {89: _CONFIG_BY_BLOCK, 90: _CONFIG_BY_BLOCK, 120: _CONFIG_BY_BLOCK}


@triton.jit
def rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr,
    x_row_stride, residual_row_stride, out_row_stride, num_rows, H, eps,
    HAS_RESIDUAL: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr,
):
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)[:, None]
    cols = tl.arange(0, BLOCK)[None, :]
    mask = (rows < num_rows) & (cols < H)
    x = tl.load(x_ptr + rows * x_row_stride + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        # The sum is rounded to the activation dtype before it is stored and before it is normed.
        x = (x.to(tl.float32) + tl.load(residual_ptr + rows * residual_row_stride + cols, mask=mask, other=0.0)
             .to(tl.float32)).to(x.dtype)
        tl.store(residual_ptr + rows * residual_row_stride + cols, x, mask=mask)
    xf = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(xf * xf, axis=1) / H + eps)[:, None]
    # Cast, then the weight product rounded to the dtype (float32 math: the interpreter has no bf16 arithmetic).
    normed = (xf * inv_rms).to(x.dtype).to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=cols < H, other=0.0).to(tl.float32)
    tl.store(out_ptr + rows * out_row_stride + cols, (normed * weight).to(x.dtype), mask=mask)


def block_for(hidden: int) -> int:
    return max(MIN_BLOCK, triton.next_power_of_2(hidden))


def _check_rows(name: str, tensor: torch.Tensor, x: torch.Tensor) -> None:
    if tensor.shape != x.shape or tensor.dtype != x.dtype or tensor.stride(-1) != 1 or tensor.device != x.device:
        raise ValueError(f"{name} must be {tuple(x.shape)} {x.dtype} on {x.device} with contiguous rows, got "
                         f"{tuple(tensor.shape)} {tensor.dtype} on {tensor.device} strides {tensor.stride()}")


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [T, H] (rows contiguous, any row stride), weight [H] -> out [T, H] (allocated unless given; a static
    buffer suits CUDA graphs); see the module docstring."""
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"x must be [T, H] with contiguous rows, got shape {tuple(x.shape)} strides {x.stride()}")
    num_rows, hidden = x.shape
    if x.dtype not in DTYPES:
        raise ValueError(f"x dtype {x.dtype} is not one of {list(DTYPES)}")
    if weight.shape != (hidden,) or weight.dtype != x.dtype or weight.stride(-1) != 1 or weight.device != x.device:
        raise ValueError(f"weight must be contiguous [{hidden}] {x.dtype} on {x.device}, got {tuple(weight.shape)} "
                         f"{weight.dtype} on {weight.device}")
    if hidden > MAX_BLOCK:
        raise ValueError(f"x hidden size {hidden} exceeds {MAX_BLOCK}")
    if residual is not None:
        _check_rows("residual", residual, x)
    if out is None:
        out = torch.empty(num_rows, hidden, dtype=x.dtype, device=x.device)
    _check_rows("out", out, x)
    if num_rows == 0:
        return out
    block = block_for(hidden)
    rows, num_warps = select(CONFIGS, capability_of(x.device))[block]
    has_residual = residual is not None
    rms_norm_kernel[(triton.cdiv(num_rows, rows),)](
        x, residual if has_residual else x, weight, out,
        x.stride(0), residual.stride(0) if has_residual else 0, out.stride(0), num_rows, hidden, eps,
        HAS_RESIDUAL=has_residual, ROWS=rows, BLOCK=block, num_warps=num_warps,
    )
    return out


def gate_cases() -> list[GateCase]:
    cases = []
    for capability in CAPABILITIES:
        for block, (rows, num_warps) in select(CONFIGS, capability).items():
            for dtype in DTYPES.values():
                for has_residual in (False, True):
                    ptr = f"*{dtype}"
                    cases.append(GateCase(
                        kernel=rms_norm_kernel,
                        signature={"x_ptr": ptr, "residual_ptr": ptr, "weight_ptr": ptr, "out_ptr": ptr,
                                   "x_row_stride": "i32", "residual_row_stride": "i32", "out_row_stride": "i32",
                                   "num_rows": "i32", "H": "i32", "eps": "fp32", "HAS_RESIDUAL": "constexpr",
                                   "ROWS": "constexpr", "BLOCK": "constexpr"},
                        constexprs={"HAS_RESIDUAL": has_residual, "ROWS": rows, "BLOCK": block},
                        capability=capability,
                        label=f"rms_norm {dtype} ROWS={rows} BLOCK={block}{' +residual' if has_residual else ''}",
                        num_warps=num_warps,
                    ))
    return cases


def bench_cases():
    """Decode and prefill shapes of DeepSeek-V3 (H=7168), Qwen3-30B-A3B (H=2048) and its QK-norm (D=128)."""
    cases = []
    for name, num_rows, hidden in [("dsv3 decode", 64, 7168), ("dsv3 prefill", 8192, 7168),
                                   ("qwen3-30b prefill", 8192, 2048), ("qwen3 qk-norm", 8192 * 32, 128)]:
        x = torch.randn(num_rows, hidden, device="cuda", dtype=torch.bfloat16)
        residual = torch.randn_like(x)
        weight = torch.randn(hidden, device="cuda", dtype=torch.bfloat16)
        bytes_moved = 2 * x.numel() * x.element_size()
        cases.append((f"rms_norm {name}", lambda x=x, w=weight: rms_norm(x, w, 1e-6), bytes_moved, 4 * x.numel()))
        cases.append((f"rms_norm+residual {name}", lambda x=x, w=weight, r=residual: rms_norm(x, w, 1e-6, r),
                      2 * bytes_moved, 5 * x.numel()))
    return cases
