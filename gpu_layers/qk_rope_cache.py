"""GQA's per-token preparation in one launch: per-head QK RMSNorm (optional), rotary on q and k, and the KV-cache
write of k and v, where the unfused path launches up to six kernels (two norms, rotary on q and on k, two cache
writes).

Data flow: q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, Dv] (last dims contiguous, any token/head strides: views of the
fused QKV product), q_weight / k_weight [D] or None, positions [T] int64, inv_freq [R / 2] float32 ->
q_out [T, Hq, D] (normed, rotated), and for the tokens whose slot >= 0 the normed, rotated k and v stored in
k_cache [blocks, block_size, Hkv, D] / v_cache [blocks, block_size, Hkv, Dv] at slot_mapping[t].

Numerics are the unfused kernels' step for step (`gpu_layers.norm`, `gpu_layers.rotary`, `gpu_layers.kv_cache`):
float32 x * rsqrt(mean(x^2) + eps) cast to the dtype, times the weight rounded, then every rotary product rounded
to the dtype (cos/sin from `rotary._cos_sin`, scaled and rounded). The one difference: the sum of squares is
reduced over another thread layout, so it may associate differently (an output may then move by one rounding). With
is_interleaved the input pairs (2i, 2i + 1) come out as halves, as `gpu_layers.reference.rotary` defines.

One program per (token, head) over Hq + Hkv + Hkv heads (q heads, then k, then v): a head's D <= 256 elements sit
in one warp's registers. A rotated output dim d < R takes its pair's two inputs, loaded again from the source row
(L1-resident), so no register shuffles are needed.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gpu_layers import kv_cache as kv_cache_kernels
from gpu_layers import norm, reference
from gpu_layers import rotary as rotary_kernels
from gpu_layers.capability import CAPABILITIES, GateCase
from gpu_layers.rotary import _cos_sin

DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
HEAD_BLOCKS = (64, 128, 256)  # BLOCK_D = next_power_of_2(max(D, Dv))
NUM_WARPS = 1  # 128 elements of a head: 4 a thread


@triton.jit
def _normed(x_row, cols, weight_ptr, inv_rms, HAS_NORM: tl.constexpr):
    """Elements `cols` of a head row, normed as `gpu_layers.norm` does (x unchanged without a norm)."""
    x = tl.load(x_row + cols)
    if HAS_NORM:
        normed = (x.to(tl.float32) * inv_rms).to(x.dtype).to(tl.float32)
        x = (normed * tl.load(weight_ptr + cols).to(tl.float32)).to(x.dtype)
    return x.to(tl.float32)


@triton.jit
def qk_norm_rope_cache_kernel(
    q_ptr, k_ptr, v_ptr, q_weight_ptr, k_weight_ptr, positions_ptr, inv_freq_ptr, slot_mapping_ptr,
    q_out_ptr, k_cache_ptr, v_cache_ptr,
    q_token_stride, q_head_stride, k_token_stride, k_head_stride, v_token_stride, v_head_stride,
    num_q_heads, num_kv_heads, head_dim, v_head_dim, half_rotary, eps, attention_factor,
    k_slot_stride, v_slot_stride,
    HAS_NORM: tl.constexpr, IS_INTERLEAVED: tl.constexpr, BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    dims = tl.arange(0, BLOCK_D)
    slot = tl.load(slot_mapping_ptr + token)
    if head >= num_q_heads + num_kv_heads:  # a v head: into the cache as it is
        v_head = head - num_q_heads - num_kv_heads
        mask = (dims < v_head_dim) & (slot >= 0)
        v = tl.load(v_ptr + token * v_token_stride + v_head * v_head_stride + dims, mask=mask)
        tl.store(v_cache_ptr + slot * v_slot_stride + v_head * v_head_dim + dims, v, mask=mask)
    else:
        if head < num_q_heads:
            row = q_ptr + token * q_token_stride + head * q_head_stride
            weight_ptr = q_weight_ptr
            out = q_out_ptr + (token * num_q_heads + head) * head_dim
        else:
            row = k_ptr + token * k_token_stride + (head - num_q_heads) * k_head_stride
            weight_ptr = k_weight_ptr
            out = k_cache_ptr + slot * k_slot_stride + (head - num_q_heads) * head_dim
        is_stored = (head < num_q_heads) | (slot >= 0)  # k of a padding row (slot -1) is not cached
        in_head = dims < head_dim
        x = tl.load(row + dims, mask=in_head, other=0.0).to(tl.float32)
        inv_rms = tl.rsqrt(tl.sum(x * x, axis=0) / head_dim + eps)
        # Output dim d < R is half a pair: p = its pair, a / b the pair's first / second input dims.
        rotary_dim = 2 * half_rotary
        is_first = dims < half_rotary
        pair = tl.where(is_first, dims, dims - half_rotary)
        is_rotated = dims < rotary_dim
        if IS_INTERLEAVED:
            a, b = 2 * pair, 2 * pair + 1
        else:
            a, b = pair, pair + half_rotary
        a = tl.where(is_rotated, a, 0)
        b = tl.where(is_rotated, b, 0)
        xa = _normed(row, a, weight_ptr, inv_rms, HAS_NORM)
        xb = _normed(row, b, weight_ptr, inv_rms, HAS_NORM)
        plain = _normed(row, tl.where(in_head, dims, 0), weight_ptr, inv_rms, HAS_NORM)
        dtype = q_ptr.dtype.element_ty
        position = tl.load(positions_ptr + token).to(tl.float32)
        cos, sin = _cos_sin(position * tl.load(inv_freq_ptr + pair, mask=is_rotated, other=0.0))
        cos = (cos * attention_factor).to(dtype).to(tl.float32)
        sin = (sin * attention_factor).to(dtype).to(tl.float32)
        first = (xa * cos).to(dtype).to(tl.float32) - (xb * sin).to(dtype).to(tl.float32)
        second = (xb * cos).to(dtype).to(tl.float32) + (xa * sin).to(dtype).to(tl.float32)
        result = tl.where(is_rotated, tl.where(is_first, first, second), plain)
        tl.store(out + dims, result.to(dtype), mask=in_head & is_stored)


def _check_heads(name: str, x: torch.Tensor, num_tokens: int, dim: int, dtype: torch.dtype) -> None:
    if x.dim() != 3 or x.shape[0] != num_tokens or x.shape[2] != dim or x.stride(-1) != 1 or x.dtype != dtype:
        raise ValueError(f"{name} must be [{num_tokens}, heads, {dim}] {dtype} with a contiguous last dim, got "
                         f"{tuple(x.shape)} {x.dtype} strides {x.stride()}")


def supports(head_dim: int, v_head_dim: int, rotary_dim: int, dtype: torch.dtype) -> bool:
    """Whether the kernel takes these head dims, this rotary dim and dtype."""
    return (dtype in DTYPES and max(head_dim, v_head_dim) <= HEAD_BLOCKS[-1] and 2 <= rotary_dim <= head_dim
            and rotary_dim % 2 == 0)


def qk_norm_rope_cache(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_weight: torch.Tensor | None, k_weight: torch.Tensor | None,
    eps: float, positions: torch.Tensor, inv_freq: torch.Tensor, attention_factor: float, is_interleaved: bool,
    k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """-> q_out [T, Hq, D], with k and v written to the caches (module docstring). q_weight and k_weight: both
    given (per-head QK norm) or both None."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, v_head_dim = v_cache.shape[2], v_cache.shape[3]
    half_rotary = inv_freq.shape[0] if inv_freq.dim() == 1 else 0
    if q.dtype not in DTYPES or not supports(head_dim, v_head_dim, 2 * half_rotary, q.dtype):
        raise ValueError(f"q {tuple(q.shape)} {q.dtype} with rotary dim {2 * half_rotary} and v head dim "
                         f"{v_head_dim} is not supported (dims up to {HEAD_BLOCKS[-1]}, dtypes {list(DTYPES)})")
    _check_heads("q", q, num_tokens, head_dim, q.dtype)
    _check_heads("k", k, num_tokens, head_dim, q.dtype)
    _check_heads("v", v, num_tokens, v_head_dim, q.dtype)
    for name, cache, dim in (("k_cache", k_cache, head_dim), ("v_cache", v_cache, v_head_dim)):
        if cache.dim() != 4 or cache.shape[2:] != (num_kv_heads, dim) or not cache.is_contiguous() or \
                cache.dtype != q.dtype:
            raise ValueError(f"{name} must be a contiguous [blocks, block_size, {num_kv_heads}, {dim}] {q.dtype}, "
                             f"got {tuple(cache.shape)} {cache.dtype}")
    if k.shape[1] != num_kv_heads or v.shape[1] != num_kv_heads:
        raise ValueError(f"k and v must have the caches' {num_kv_heads} heads, got {k.shape[1]} and {v.shape[1]}")
    if (q_weight is None) != (k_weight is None):
        raise ValueError("q_weight and k_weight must be both given or both None")
    for name, weight in (("q_weight", q_weight), ("k_weight", k_weight)):
        if weight is not None and (weight.shape != (head_dim,) or weight.dtype != q.dtype or weight.stride(0) != 1):
            raise ValueError(f"{name} must be contiguous [{head_dim}] {q.dtype}, got {tuple(weight.shape)} "
                             f"{weight.dtype}")
    if inv_freq.dtype != torch.float32 or inv_freq.stride(0) != 1:
        raise ValueError(f"inv_freq must be contiguous float32 [R / 2], got {inv_freq.dtype}")
    for name, index in (("positions", positions), ("slot_mapping", slot_mapping)):
        if index.shape != (num_tokens,) or index.dtype != torch.int64:
            raise ValueError(f"{name} must be int64 [{num_tokens}], got {tuple(index.shape)} {index.dtype}")
    q_out = torch.empty(num_tokens, num_q_heads, head_dim, dtype=q.dtype, device=q.device)
    if num_tokens == 0:
        return q_out
    has_norm = q_weight is not None
    block_d = max(HEAD_BLOCKS[0], triton.next_power_of_2(max(head_dim, v_head_dim)))
    qk_norm_rope_cache_kernel[(num_tokens, num_q_heads + 2 * num_kv_heads)](
        q, k, v, q_weight if has_norm else q, k_weight if has_norm else k, positions.contiguous(), inv_freq,
        slot_mapping.contiguous(), q_out, k_cache, v_cache,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        num_q_heads, num_kv_heads, head_dim, v_head_dim, half_rotary, float(eps), float(attention_factor),
        k_cache.stride(1), v_cache.stride(1),
        HAS_NORM=has_norm, IS_INTERLEAVED=is_interleaved, BLOCK_D=block_d, num_warps=NUM_WARPS,
    )
    return q_out


def qk_norm_rope_cache_unfused(q, k, v, q_weight, k_weight, eps, positions, inv_freq, attention_factor,
                               is_interleaved, k_cache, v_cache, slot_mapping) -> torch.Tensor:
    """The same through the separate kernels (norms, rotary, two cache writes): the fused kernel's bit-exact
    reference."""
    if q_weight is not None:
        q = norm.rms_norm(q.reshape(-1, q.shape[-1]), q_weight, eps).view(q.shape)
        k = norm.rms_norm(k.reshape(-1, k.shape[-1]), k_weight, eps).view(k.shape)
    else:
        q, k = q.clone(), k.clone()
    rotary_kernels.rotary_embedding(positions, q, k, inv_freq, attention_factor, is_interleaved)
    kv_cache_kernels.write_kv_cache(k_cache, k, slot_mapping)
    kv_cache_kernels.write_kv_cache(v_cache, v, slot_mapping)
    return q


def qk_norm_rope_cache_reference(q, k, v, q_weight, k_weight, eps, positions, inv_freq, attention_factor,
                                 is_interleaved, k_cache, v_cache, slot_mapping) -> torch.Tensor:
    """Plain PyTorch (`gpu_layers.reference`); torch's cos/sin, so within an ulp of the kernels, not bit-equal."""
    if q_weight is not None:
        q = reference.rms_norm(q.reshape(-1, q.shape[-1]), q_weight, eps).view(q.shape)
        k = reference.rms_norm(k.reshape(-1, k.shape[-1]), k_weight, eps).view(k.shape)
    else:
        q, k = q.clone(), k.clone()
    reference.rotary(positions, q, k, inv_freq, attention_factor, is_interleaved)
    keep = slot_mapping >= 0
    reference.write_kv_cache(k_cache, k[keep], slot_mapping[keep])
    reference.write_kv_cache(v_cache, v[keep], slot_mapping[keep])
    return q


def gate_cases() -> list[GateCase]:
    cases = []
    for capability in CAPABILITIES:
        for block_d in HEAD_BLOCKS:
            for dtype in DTYPES.values():
                for has_norm in (False, True):
                    for is_interleaved in (False, True):
                        ptr = f"*{dtype}"
                        signature = {
                            "q_ptr": ptr, "k_ptr": ptr, "v_ptr": ptr, "q_weight_ptr": ptr, "k_weight_ptr": ptr,
                            "positions_ptr": "*i64", "inv_freq_ptr": "*fp32", "slot_mapping_ptr": "*i64",
                            "q_out_ptr": ptr, "k_cache_ptr": ptr, "v_cache_ptr": ptr,
                            **{n: "i32" for n in ("q_token_stride", "q_head_stride", "k_token_stride",
                                                  "k_head_stride", "v_token_stride", "v_head_stride", "num_q_heads",
                                                  "num_kv_heads", "head_dim", "v_head_dim", "half_rotary")},
                            "eps": "fp32", "attention_factor": "fp32", "k_slot_stride": "i32",
                            "v_slot_stride": "i32", "HAS_NORM": "constexpr", "IS_INTERLEAVED": "constexpr",
                            "BLOCK_D": "constexpr"}
                        cases.append(GateCase(
                            kernel=qk_norm_rope_cache_kernel, signature=signature,
                            constexprs={"HAS_NORM": has_norm, "IS_INTERLEAVED": is_interleaved, "BLOCK_D": block_d},
                            capability=capability, num_warps=NUM_WARPS,
                            label=f"qk_norm_rope_cache {dtype} BLOCK_D={block_d}{' norm' if has_norm else ''}"
                                  f"{' interleaved' if is_interleaved else ''}"))
    return cases
