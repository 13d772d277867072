"""The gate and benchmark cases of gpu_layers.linear (read through its gate_cases and bench_cases): the FP8 and
W4A16 GEMM kernels in every regime, output type and bias variant the launchers select, and their timings."""

from __future__ import annotations

import functools

import torch
import triton

from gpu_layers.capability import CAPABILITIES, GateCase
from gpu_layers.linear import (
    DTYPES,
    FP8_CONFIGS,
    MIN_W4A16_BLOCK_K,
    PACK_FACTOR,
    QUANT_CONFIGS,
    REDUCE_CONFIGS,
    W4A16_CONFIGS,
    _fp8_config_key,
    fp8_gemm_kernel,
    fp8_linear,
    fp8_quantize_kernel,
    splitk_reduce_kernel,
    w4a16_gemm_kernel,
    w4a16_linear,
)


def _gate_case(kernel, pointers: dict, ints: tuple, constexprs: dict, cc: int, label: str, config: dict) -> GateCase:
    signature = {**pointers, **dict.fromkeys(ints, "i32"), **dict.fromkeys(constexprs, "constexpr")}
    return GateCase(kernel, signature, constexprs, cc, label, config.get("num_warps", 4), config.get("num_stages", 2))


def _gemm_outputs(dtype: str, regime: str) -> list[tuple[str, bool]]:
    """(c type, has_bias) a GEMM can be launched with: out directly, or float32 partials when decode splits K."""
    return [(dtype, False), (dtype, True)] + ([("fp32", False)] if regime == "decode" else [])


def _fp8_gemm_case(cc: int, dtype: str, regime: str, c_type: str, has_bias: bool, is_block: bool) -> GateCase:
    config = FP8_CONFIGS[cc][_fp8_config_key(regime, is_block)]
    pointers = {"a_ptr": "*fp8e4nv", "a_scale_ptr": "*fp32", "b_ptr": "*fp8e4nv", "b_scale_ptr": "*fp32",
                "bias_ptr": f"*{dtype}", "c_ptr": f"*{c_type}"}
    ints = ("M", "N", "K", "c_row_stride", "c_split_stride", "num_k_groups", "scale_block_n", "scale_block_k",
            "tiles_per_split")
    constexprs = {k: config[k] for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K")}
    constexprs |= {"IS_BLOCK_SCALED": is_block, "HAS_BIAS": has_bias}
    label = f"fp8_gemm {'block' if is_block else 'channel'} {regime} {dtype}->{c_type}{' bias' if has_bias else ''}"
    return _gate_case(fp8_gemm_kernel, pointers, ints, constexprs, cc, label, config)


def _w4a16_gemm_case(cc: int, dtype: str, regime: str, c_type: str, has_bias: bool, block_k: int) -> GateCase:
    config = W4A16_CONFIGS[cc][regime]
    pointers = {"x_ptr": f"*{dtype}", "w_ptr": "*i32", "scale_ptr": f"*{dtype}", "bias_ptr": f"*{dtype}",
                "c_ptr": f"*{c_type}"}
    ints = ("M", "N", "K", "x_row_stride", "c_row_stride", "c_split_stride", "group_size", "num_groups",
            "tiles_per_split")
    constexprs = {"BLOCK_M": config["BLOCK_M"], "BLOCK_N": config["BLOCK_N"], "BLOCK_K": block_k,
                  "HAS_BIAS": has_bias}
    label = f"w4a16_gemm {regime} BLOCK_K={block_k} {dtype}->{c_type}{' bias' if has_bias else ''}"
    return _gate_case(w4a16_gemm_kernel, pointers, ints, constexprs, cc, label, config)


def _w4a16_block_ks(block_k: int) -> list[int]:
    """Every BLOCK_K `_w4a16_block_k` can pick from the config's: it, and its halvings down to the minimum."""
    return [block_k >> i for i in range(block_k.bit_length()) if block_k >> i >= MIN_W4A16_BLOCK_K]


def gate() -> list[GateCase]:
    cases = []
    for cc in CAPABILITIES:
        for dtype in DTYPES.values():
            for block, config in QUANT_CONFIGS[cc].items():
                cases.append(_gate_case(fp8_quantize_kernel, {"x_ptr": f"*{dtype}", "q_ptr": "*fp8e4nv",
                                        "scale_ptr": "*fp32"}, ("K", "x_row_stride", "group_size", "num_groups"),
                                        {"GROUPS": config["GROUPS"], "BLOCK": block}, cc,
                                        f"fp8_quantize {dtype} BLOCK={block}", config))
            for has_bias in (False, True):
                cases.append(_gate_case(splitk_reduce_kernel, {"partial_ptr": "*fp32", "bias_ptr": f"*{dtype}",
                                        "c_ptr": f"*{dtype}"}, ("M", "N", "c_row_stride", "num_splits"),
                                        {"HAS_BIAS": has_bias, "BLOCK_S": REDUCE_CONFIGS[cc]["BLOCK_S"],
                                         "BLOCK_N": REDUCE_CONFIGS[cc]["BLOCK_N"]}, cc,
                                        f"splitk_reduce {dtype}{' bias' if has_bias else ''}", REDUCE_CONFIGS[cc]))
            for regime in ("decode", "prefill"):
                for c_type, has_bias in _gemm_outputs(dtype, regime):
                    cases += [_fp8_gemm_case(cc, dtype, regime, c_type, has_bias, is_block)
                              for is_block in (False, True)]
                    cases += [_w4a16_gemm_case(cc, dtype, regime, c_type, has_bias, block_k)
                              for block_k in _w4a16_block_ks(W4A16_CONFIGS[cc][regime]["BLOCK_K"])]
    return cases


# (K, N): Qwen3-30B-A3B's fused q/k/v projection (32 x 128 + 2 x 4 x 128 outputs), DeepSeek-V3's shared-expert
# fused gate/up projection (2 x 2048 outputs).
BENCH_SHAPES = {"qwen3-30b-a3b qkv": (2048, 4096 + 2 * 512), "deepseek-v3 shared gate_up": (7168, 2 * 2048)}
BENCH_TOKENS = (1, 8, 2048)


def _bench_weights(num_cols: int, num_out: int, device: torch.device) -> dict[str, tuple]:
    """Random weights in the three stored forms: (launcher, weight-side args, bytes they occupy)."""
    fp8 = (torch.randn(num_out, num_cols, device=device) * 0.5).to(torch.float8_e4m3fn)
    channel_scale = torch.rand(num_out, device=device) * 1e-2
    block_scale = torch.rand(triton.cdiv(num_out, 128), triton.cdiv(num_cols, 128), device=device) * 1e-2
    packed = torch.randint(-2**31, 2**31, (num_out, triton.cdiv(num_cols, PACK_FACTOR)), dtype=torch.int32,
                           device=device)
    group_scale = torch.rand(num_out, triton.cdiv(num_cols, 128), device=device).to(torch.bfloat16) * 1e-2
    nbytes = lambda *ts: sum(t.numel() * t.element_size() for t in ts)
    return {
        "fp8 channel": (fp8_linear, (fp8, channel_scale), {}, nbytes(fp8, channel_scale)),
        "fp8 block": (fp8_linear, (fp8, block_scale), {"block_shape": (128, 128)}, nbytes(fp8, block_scale)),
        "w4a16 g128": (w4a16_linear, (packed, group_scale, 128), {}, nbytes(packed, group_scale)),
    }


def bench() -> list[tuple]:
    """(name, run once, bytes moved (weights + activations in and out), flops) for full-size shapes on CUDA."""
    device = torch.device("cuda")
    cases = []
    for shape_name, (num_cols, num_out) in BENCH_SHAPES.items():
        for form, (linear, weights, kwargs, weight_bytes) in _bench_weights(num_cols, num_out, device).items():
            for num_tokens in BENCH_TOKENS:
                x = torch.randn(num_tokens, num_cols, dtype=torch.bfloat16, device=device)
                out = torch.empty(num_tokens, num_out, dtype=torch.bfloat16, device=device)
                run = functools.partial(linear, x, *weights, out=out, **kwargs)
                moved = weight_bytes + 2 * num_tokens * (num_cols + num_out)
                cases.append((f"linear {form} {shape_name} T={num_tokens}", run, moved,
                              2 * num_tokens * num_cols * num_out))
    return cases
