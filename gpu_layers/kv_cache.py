"""Scatter of new keys/values (or MLA latents) into a paged cache.

Data flow: values [T, heads, dim] (last dim contiguous, any token/head strides), slot_mapping [T] int64 ->
cache [num_blocks, block_size, heads, dim] (contiguous) with cache.view(-1, heads, dim)[slot_mapping[t]] =
values[t]. A slot < 0 skips its token: padded CUDA-graph batches write nothing for their padding.

One program copies BLOCK_H heads of one token, dim elements each (BLOCK_D = next_power_of_2(dim): 576 for MLA's
latent + rope key rounds up to 1024, 128 for GQA). Offsets are int64: a large cache passes 2^31 elements.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gpu_layers import reference
from gpu_layers.capability import CAPABILITIES, GateCase, capability_of, select

DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}

# BLOCK_D -> (BLOCK_H heads per program, num_warps): a 1024-element tile, 8 per thread (16-byte bf16 vectors), so
# GQA's short 128-wide rows do not each launch a one-warp program.
_CONFIG_BY_BLOCK = {32: (32, 4), 64: (16, 4), 128: (8, 4), 256: (4, 4), 512: (2, 4), 1024: (1, 4)}
CONFIGS = {89: _CONFIG_BY_BLOCK, 90: _CONFIG_BY_BLOCK, 120: _CONFIG_BY_BLOCK}


@triton.jit
def write_kv_cache_kernel(
    cache_ptr, values_ptr, slot_mapping_ptr, slot_stride, cache_head_stride, token_stride, head_stride, num_heads,
    dim, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    heads = (tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)).to(tl.int64)[:, None]
    cols = tl.arange(0, BLOCK_D)[None, :]
    slot = tl.load(slot_mapping_ptr + token)
    mask = (heads < num_heads) & (cols < dim) & (slot >= 0)
    rows = tl.load(values_ptr + token * token_stride + heads * head_stride + cols, mask=mask)
    tl.store(cache_ptr + slot * slot_stride + heads * cache_head_stride + cols, rows, mask=mask)


def write_kv_cache_reference(cache: torch.Tensor, values: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """reference.write_kv_cache for the tokens whose slot is >= 0."""
    keep = slot_mapping >= 0
    reference.write_kv_cache(cache, values[keep], slot_mapping[keep])


def write_kv_cache(cache: torch.Tensor, values: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Stores values [T, heads, dim] into cache [num_blocks, block_size, heads, dim] at flat slots [T] (< 0: skip)."""
    if cache.dim() != 4 or not cache.is_contiguous():
        raise ValueError(f"cache must be a contiguous [num_blocks, block_size, heads, dim], got {tuple(cache.shape)}")
    if cache.dtype not in DTYPES:
        raise ValueError(f"cache dtype {cache.dtype} is not one of {list(DTYPES)}")
    num_heads, dim = cache.shape[2], cache.shape[3]
    if values.dim() != 3 or values.shape[1:] != (num_heads, dim) or values.stride(-1) != 1:
        raise ValueError(f"values must be [T, {num_heads}, {dim}] with a contiguous last dim, got "
                         f"{tuple(values.shape)} strides {values.stride()}")
    if values.dtype != cache.dtype or values.device != cache.device:
        raise ValueError(f"values must be {cache.dtype} on {cache.device}, got {values.dtype} on {values.device}")
    if slot_mapping.shape != (values.shape[0],) or slot_mapping.dtype != torch.int64:
        raise ValueError(f"slot_mapping must be int64 [{values.shape[0]}], got {tuple(slot_mapping.shape)} "
                         f"{slot_mapping.dtype}")
    if slot_mapping.device != cache.device:
        raise ValueError(f"slot_mapping is on {slot_mapping.device}, cache on {cache.device}")
    block_d = max(min(_CONFIG_BY_BLOCK), triton.next_power_of_2(dim))
    if block_d > max(_CONFIG_BY_BLOCK):
        raise ValueError(f"cache dim {dim} exceeds {max(_CONFIG_BY_BLOCK)}")
    if values.shape[0] == 0 or num_heads == 0:
        return
    block_heads, num_warps = select(CONFIGS, capability_of(cache.device))[block_d]
    write_kv_cache_kernel[(values.shape[0], triton.cdiv(num_heads, block_heads))](
        cache, values, slot_mapping.contiguous(), cache.stride(1), cache.stride(2), values.stride(0), values.stride(1),
        num_heads, dim, BLOCK_H=block_heads, BLOCK_D=block_d, num_warps=num_warps,
    )


def gate_cases() -> list[GateCase]:
    cases = []
    for capability in CAPABILITIES:
        for block_d, (block_heads, num_warps) in select(CONFIGS, capability).items():
            for dtype in DTYPES.values():
                cases.append(GateCase(
                    kernel=write_kv_cache_kernel,
                    signature={"cache_ptr": f"*{dtype}", "values_ptr": f"*{dtype}", "slot_mapping_ptr": "*i64",
                               "slot_stride": "i32", "cache_head_stride": "i32", "token_stride": "i32",
                               "head_stride": "i32", "num_heads": "i32", "dim": "i32", "BLOCK_H": "constexpr",
                               "BLOCK_D": "constexpr"},
                    constexprs={"BLOCK_H": block_heads, "BLOCK_D": block_d},
                    capability=capability,
                    label=f"write_kv_cache {dtype} BLOCK_H={block_heads} BLOCK_D={block_d}",
                    num_warps=num_warps,
                ))
    return cases


def bench_cases():
    """DeepSeek-V3's MLA latent (1 head x 576) and Qwen3-30B-A3B's keys (4 heads x 128), decode and prefill."""
    cases = []
    for name, num_tokens, num_heads, dim in [("dsv3 mla decode", 64, 1, 576), ("dsv3 mla prefill", 8192, 1, 576),
                                             ("qwen3-30b k prefill", 8192, 4, 128)]:
        cache = torch.zeros(4096, 16, num_heads, dim, device="cuda", dtype=torch.bfloat16)
        values = torch.randn(num_tokens, num_heads, dim, device="cuda", dtype=torch.bfloat16)
        slots = torch.randperm(cache.shape[0] * cache.shape[1], device="cuda")[:num_tokens]
        cases.append((f"write_kv_cache {name}", lambda c=cache, v=values, s=slots: write_kv_cache(c, v, s),
                      2 * values.numel() * 2, 0))
    return cases
