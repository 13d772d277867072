"""Rotary position embedding applied in place to q and k: NeoX halves or interleaved pairs, partial rotary.

Data flow: q [T, Hq, D], k [T, Hk, D] (last dim contiguous, any token/head strides), positions [T] int64,
inv_freq [R / 2] float32, attention_factor -> q and k rotated in place on their first R dims (dims past R are
untouched). cos/sin = cos/sin(position * inv_freq) * attention_factor, computed in the kernel: linear scaling and
YaRN arrive through inv_freq and attention_factor (hybrid/layers/rotary.py `rope_inv_freq`), and there is no
table to outgrow.

The convention is `gpu_layers.reference.rotary`'s: with is_interleaved, the input pairs (2i, 2i+1) come
out as halves (evens then odds); q and k get the same permutation, so attention is unchanged. cos/sin are cast to
the activation dtype and each product is rounded there, as in the reference.

One program rotates a [BLOCK_H heads, BLOCK_HALF] tile of one token; cos/sin are computed once per program.
cos/sin use an explicit float64 reduction to [-pi/4, pi/4] and a float32 polynomial (~1 ulp): libdevice's cosf
needs a local-memory stack frame for huge arguments (its Payne-Hanek path), which the SM120 gate forbids, and
the hardware's approximate cos is inaccurate outside [-pi, pi] (positions reach 10^5 and more).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gpu_layers.capability import CAPABILITIES, GateCase, capability_of, select
from gpu_layers.reference import rotary as rotary_reference  # noqa: F401 (the kernel's reference)

DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
HALF_BLOCKS = (16, 32, 64, 128)  # BLOCK_HALF = next_power_of_2(R / 2): rotary dims up to 256

# TILE elements per program (BLOCK_H = TILE // BLOCK_HALF heads): 2048 over 4 warps is 16 pairs per thread.
CONFIGS = {
    89: {"TILE": 2048, "num_warps": 4},
    90: {"TILE": 2048, "num_warps": 4},
    120: {"TILE": 2048, "num_warps": 4},
}


@triton.jit
def _cos_sin(angle):
    """cos and sin of float32 angles >= 0 of any size, to ~1 ulp, without local memory."""
    wide = angle.to(tl.float64)
    quadrant = tl.floor(wide * 0.6366197723675814 + 0.5)  # nearest multiple of pi/2
    # pi/2 as two float32-exact parts: the reduction in float64 stays exact to ~1e-9 for 10^6 radians.
    r = (wide - quadrant * 1.5707963705062866 - quadrant * -4.371139000186243e-08).to(tl.float32)
    z = r * r
    sin_r = r + r * z * (-1.6666654611e-1 + z * (8.3321608736e-3 + z * -1.9515295891e-4))
    cos_r = 1.0 - 0.5 * z + z * z * (4.166664568298827e-2 + z * (-1.388731625493765e-3 + z * 2.443315711809948e-5))
    q = quadrant.to(tl.int32) & 3
    cos = tl.where(q == 0, cos_r, tl.where(q == 1, -sin_r, tl.where(q == 2, -cos_r, sin_r)))
    sin = tl.where(q == 0, sin_r, tl.where(q == 1, cos_r, tl.where(q == 2, -sin_r, -cos_r)))
    return cos, sin


@triton.jit
def rotary_kernel(
    x_ptr, positions_ptr, inv_freq_ptr, token_stride, head_stride, num_heads, half_rotary, attention_factor,
    IS_INTERLEAVED: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    pairs = tl.arange(0, BLOCK_HALF)
    pair_mask = pairs < half_rotary
    position = tl.load(positions_ptr + token).to(tl.float32)
    inv_freq = tl.load(inv_freq_ptr + pairs, mask=pair_mask, other=0.0)
    cos, sin = _cos_sin(position * inv_freq)
    # Every product and sum is rounded to the activation dtype, as the reference computes in that dtype (the math
    # itself is float32: the interpreter has no bfloat16 arithmetic, and GPUs widen it anyway).
    dtype = x_ptr.dtype.element_ty
    cos = (cos * attention_factor).to(dtype).to(tl.float32)[None, :]
    sin = (sin * attention_factor).to(dtype).to(tl.float32)[None, :]

    base = x_ptr + token * token_stride + heads[:, None].to(tl.int64) * head_stride
    mask = (heads < num_heads)[:, None] & pair_mask[None, :]
    if IS_INTERLEAVED:
        # One contiguous [BLOCK_H, R] load (vectorised), then the pairs split into evens and odds.
        dims = tl.arange(0, 2 * BLOCK_HALF)
        dims_mask = (heads < num_heads)[:, None] & (dims < 2 * half_rotary)[None, :]
        rot = tl.load(base + dims[None, :], mask=dims_mask, other=0.0).to(tl.float32)
        x1, x2 = tl.split(tl.reshape(rot, [BLOCK_H, BLOCK_HALF, 2]))
    else:
        x1 = tl.load(base + pairs[None, :], mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(base + half_rotary + pairs[None, :], mask=mask, other=0.0).to(tl.float32)
    out1 = (x1 * cos).to(dtype).to(tl.float32) - (x2 * sin).to(dtype).to(tl.float32)
    out2 = (x2 * cos).to(dtype).to(tl.float32) + (x1 * sin).to(dtype).to(tl.float32)
    # In place: with interleaved input, a thread writes elements another thread read; all reads finish first.
    tl.debug_barrier()
    tl.store(base + pairs[None, :], out1.to(dtype), mask=mask)
    tl.store(base + half_rotary + pairs[None, :], out2.to(dtype), mask=mask)


def _check_heads(name: str, x: torch.Tensor, like: torch.Tensor, rotary_dim: int) -> None:
    if x.dim() != 3 or x.stride(-1) != 1:
        raise ValueError(f"{name} must be [T, heads, D] with a contiguous last dim, got {tuple(x.shape)} "
                         f"strides {x.stride()}")
    if x.shape[0] != like.shape[0] or x.dtype != like.dtype or x.device != like.device:
        raise ValueError(f"{name} must match q's tokens, dtype and device, got {tuple(x.shape)} {x.dtype} "
                         f"{x.device}")
    if x.shape[2] < rotary_dim:
        raise ValueError(f"{name} head dim {x.shape[2]} is smaller than the rotary dim {rotary_dim}")


def rotary_embedding(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, inv_freq: torch.Tensor, attention_factor: float,
    is_interleaved: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotates q [T, Hq, D] and k [T, Hk, D] in place (see the module docstring); returns them."""
    if inv_freq.dim() != 1 or inv_freq.dtype != torch.float32 or inv_freq.stride(0) != 1:
        raise ValueError(f"inv_freq must be contiguous float32 [R / 2], got {tuple(inv_freq.shape)} {inv_freq.dtype}")
    half_rotary = inv_freq.shape[0]
    if q.dtype not in DTYPES:
        raise ValueError(f"q dtype {q.dtype} is not one of {list(DTYPES)}")
    _check_heads("q", q, q, 2 * half_rotary)
    _check_heads("k", k, q, 2 * half_rotary)
    if positions.shape != (q.shape[0],) or positions.dtype != torch.int64 or positions.device != q.device:
        raise ValueError(f"positions must be int64 [{q.shape[0]}] on {q.device}, got {tuple(positions.shape)} "
                         f"{positions.dtype} {positions.device}")
    if inv_freq.device != q.device:
        raise ValueError(f"inv_freq is on {inv_freq.device}, q on {q.device}")
    block_half = max(HALF_BLOCKS[0], triton.next_power_of_2(half_rotary))
    if block_half > HALF_BLOCKS[-1]:
        raise ValueError(f"inv_freq length {half_rotary} exceeds {HALF_BLOCKS[-1]}")
    if q.shape[0] == 0:
        return q, k
    config = select(CONFIGS, capability_of(q.device))
    block_heads = config["TILE"] // block_half
    positions = positions.contiguous()
    for x in (q, k):
        grid = (x.shape[0], triton.cdiv(x.shape[1], block_heads))
        rotary_kernel[grid](
            x, positions, inv_freq, x.stride(0), x.stride(1), x.shape[1], half_rotary, float(attention_factor),
            IS_INTERLEAVED=is_interleaved, BLOCK_H=block_heads, BLOCK_HALF=block_half,
            num_warps=config["num_warps"],
        )
    return q, k


def gate_cases() -> list[GateCase]:
    cases = []
    for capability in CAPABILITIES:
        config = select(CONFIGS, capability)
        for block_half in HALF_BLOCKS:
            for dtype in DTYPES.values():
                for is_interleaved in (False, True):
                    block_heads = config["TILE"] // block_half
                    cases.append(GateCase(
                        kernel=rotary_kernel,
                        signature={"x_ptr": f"*{dtype}", "positions_ptr": "*i64", "inv_freq_ptr": "*fp32",
                                   "token_stride": "i32", "head_stride": "i32", "num_heads": "i32",
                                   "half_rotary": "i32", "attention_factor": "fp32", "IS_INTERLEAVED": "constexpr",
                                   "BLOCK_H": "constexpr", "BLOCK_HALF": "constexpr"},
                        constexprs={"IS_INTERLEAVED": is_interleaved, "BLOCK_H": block_heads,
                                    "BLOCK_HALF": block_half},
                        capability=capability,
                        label=f"rotary {dtype} BLOCK_HALF={block_half}{' interleaved' if is_interleaved else ''}",
                        num_warps=config["num_warps"],
                    ))
    return cases


def bench_cases():
    """DeepSeek-V3 (128 heads, rope 64 interleaved, k 1 head) and Qwen3-30B-A3B (32 q / 4 kv heads, D 128)."""
    cases = []
    for name, num_tokens, num_q, num_k, dim, rotary_dim, interleaved in [
        ("dsv3 prefill", 8192, 128, 1, 64, 64, True), ("dsv3 decode", 64, 128, 1, 64, 64, True),
        ("qwen3-30b prefill", 8192, 32, 4, 128, 128, False),
    ]:
        q = torch.randn(num_tokens, num_q, dim, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(num_tokens, num_k, dim, device="cuda", dtype=torch.bfloat16)
        positions = torch.arange(num_tokens, device="cuda")
        inv_freq = 1.0 / 10000 ** (torch.arange(0, rotary_dim, 2, device="cuda").float() / rotary_dim)
        elements = num_tokens * (num_q + num_k) * rotary_dim
        cases.append((f"rotary {name}", lambda q=q, k=k, p=positions, f=inv_freq, i=interleaved: rotary_embedding(
            p, q, k, f, 1.0, i), 2 * 2 * elements, 3 * elements))
    return cases
