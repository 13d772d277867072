"""SiLU-and-multiply of a merged gate/up projection.

Data flow: gate_up [T, 2I] (gate = first I columns, up = last I) -> out [T, I] = silu(gate) * up.

Numerics follow `F.silu(gate) * up` on the activation dtype: silu in float32, rounded to the dtype, then the
product in the dtype. The grid is (T, cdiv(I, BLOCK)) with a fixed BLOCK, so any I (odd ones too) works and a
decode step with few tokens still spreads over several programs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gpu_layers.capability import CAPABILITIES, GateCase, capability_of, select
from gpu_layers.reference import silu_and_mul as silu_and_mul_reference  # noqa: F401 (the kernel's reference)

DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}

# Elementwise and bandwidth-bound: 1024 columns over 4 warps is 8 per thread (16-byte bf16 vectors).
CONFIGS = {
    89: {"BLOCK": 1024, "num_warps": 4},
    90: {"BLOCK": 1024, "num_warps": 4},
    120: {"BLOCK": 1024, "num_warps": 4},
}


@triton.jit
def silu_and_mul_kernel(gate_up_ptr, out_ptr, in_row_stride, out_row_stride, intermediate, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < intermediate
    gate = tl.load(gate_up_ptr + row * in_row_stride + cols, mask=mask, other=0.0)
    up = tl.load(gate_up_ptr + row * in_row_stride + intermediate + cols, mask=mask, other=0.0)
    gate_f = gate.to(tl.float32)
    # silu rounded to the dtype, then the product rounded again (float32 math, as the interpreter lacks bf16's).
    silu = (gate_f / (1.0 + tl.exp(-gate_f))).to(gate.dtype).to(tl.float32)
    tl.store(out_ptr + row * out_row_stride + cols, (silu * up.to(tl.float32)).to(gate.dtype), mask=mask)


def silu_and_mul(gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """gate_up [T, 2I] (rows contiguous, any row stride) -> out [T, I] (allocated unless given)."""
    if gate_up.dim() != 2 or gate_up.stride(-1) != 1 or gate_up.shape[1] % 2:
        raise ValueError(f"gate_up must be [T, 2I] with contiguous rows, got shape {tuple(gate_up.shape)} "
                         f"strides {gate_up.stride()}")
    if gate_up.dtype not in DTYPES:
        raise ValueError(f"gate_up dtype {gate_up.dtype} is not one of {list(DTYPES)}")
    num_tokens, intermediate = gate_up.shape[0], gate_up.shape[1] // 2
    if out is None:
        out = torch.empty(num_tokens, intermediate, dtype=gate_up.dtype, device=gate_up.device)
    elif (out.shape != (num_tokens, intermediate) or out.dtype != gate_up.dtype or out.device != gate_up.device
          or out.stride(-1) != 1):
        raise ValueError(f"out must be [{num_tokens}, {intermediate}] {gate_up.dtype} on {gate_up.device} with "
                         f"contiguous rows, got {tuple(out.shape)} {out.dtype} {out.device}")
    if out.numel() == 0:
        return out
    config = select(CONFIGS, capability_of(gate_up.device))
    grid = (num_tokens, triton.cdiv(intermediate, config["BLOCK"]))
    silu_and_mul_kernel[grid](gate_up, out, gate_up.stride(0), out.stride(0), intermediate,
                              BLOCK=config["BLOCK"], num_warps=config["num_warps"])
    return out


def gate_cases() -> list[GateCase]:
    cases = []
    for capability in CAPABILITIES:
        config = select(CONFIGS, capability)
        for dtype in DTYPES.values():
            cases.append(GateCase(
                kernel=silu_and_mul_kernel,
                signature={"gate_up_ptr": f"*{dtype}", "out_ptr": f"*{dtype}", "in_row_stride": "i32",
                           "out_row_stride": "i32", "intermediate": "i32", "BLOCK": "constexpr"},
                constexprs={"BLOCK": config["BLOCK"]},
                capability=capability,
                label=f"silu_and_mul {dtype} BLOCK={config['BLOCK']}",
                num_warps=config["num_warps"],
            ))
    return cases


def bench_cases():
    """DeepSeek-V3's dense MLP (I=18432) and Qwen3-30B-A3B's (I=6144), decode and prefill."""
    cases = []
    for name, num_tokens, intermediate in [("dsv3 decode", 64, 18432), ("dsv3 prefill", 8192, 18432),
                                           ("qwen3-30b prefill", 8192, 6144)]:
        gate_up = torch.randn(num_tokens, 2 * intermediate, device="cuda", dtype=torch.bfloat16)
        bytes_moved = gate_up.numel() * 2 * 3 // 2  # read 2I, write I per token
        cases.append((f"silu_and_mul {name}", lambda g=gate_up: silu_and_mul(g), bytes_moved,
                      5 * num_tokens * intermediate))
    return cases
