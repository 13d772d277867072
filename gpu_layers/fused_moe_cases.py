"""The gate and benchmark cases of gpu_layers.fused_moe (read through its gate_cases and bench_cases): every
(kernel, dtype variant, epilogue, config) fused_moe can launch for each capability, and Qwen3-30B-A3B's routed
experts in bf16 and FP8 at several token counts."""

from __future__ import annotations

import torch

from gpu_layers.capability import GateCase
from gpu_layers.fused_moe import (
    ALIGN_BLOCK,
    ALIGN_TILE,
    CONFIGS,
    FP8_BLOCKWISE,
    FP8_CHANNEL,
    NO_QUANT,
    SUM_BLOCK_H,
    fused_moe,
    moe_count_kernel,
    moe_down_kernel,
    moe_gate_up_kernel,
    moe_offsets_kernel,
    moe_scatter_kernel,
    moe_sum_kernel,
)
from gpu_layers.fused_moe_reference import SILU, SWIGLU_OAI, quantize_fp8_weights

_GATE_DTYPES = {  # variant -> (activation type, weight type, QUANT, CONFIGS weights key)
    "bf16": ("*bf16", "*bf16", NO_QUANT, "16bit"),
    "fp16": ("*fp16", "*fp16", NO_QUANT, "16bit"),
    "fp8-channel": ("*bf16", "*fp8e4nv", FP8_CHANNEL, "fp8"),
    "fp8-block": ("*bf16", "*fp8e4nv", FP8_BLOCKWISE, "fp8"),
}


_GATE_UP_EPILOGUES = {  # every activation, with and without the bias
    f"{activation.kind}{'+bias' if has_bias else ''}": {"HAS_BIAS": has_bias, **activation.constexprs()}
    for activation in (SILU, SWIGLU_OAI) for has_bias in (False, True)
}
_DOWN_EPILOGUES = {"no-bias": {"HAS_BIAS": False}, "bias": {"HAS_BIAS": True}}


def gate() -> list[GateCase]:
    """Every (kernel, dtype variant, config) fused_moe can launch, for each capability in CONFIGS."""
    ints = dict.fromkeys(("num_pairs", "top_k", "hidden_size", "inter", "stride_ht", "stride_we", "stride_wn",
                          "stride_se", "stride_sn"), "i32")
    cases = []
    for cc, table in CONFIGS.items():
        for (regime, weights), (gate_up, down) in table.items():
            for variant, (act_type, w_type, quant, key) in _GATE_DTYPES.items():
                if key != weights:
                    continue
                pointers = {"w": w_type, "w_scale": "*fp32", "a_scale": "*fp32", "bias": "*fp32",
                            "sorted_pair_ids": "*i32", "block_expert_ids": "*i32"}
                kernels = (
                    (moe_gate_up_kernel, gate_up, {"hidden": act_type, **pointers, "act": act_type},
                     _GATE_UP_EPILOGUES),
                    (moe_down_kernel, down, {"act": act_type, **pointers, "topk_weights": "*fp32", "y": act_type},
                     _DOWN_EPILOGUES),
                )
                for kernel, tiles, signature, epilogues in kernels:
                    names = kernel.arg_names
                    types = {**signature, **ints, **{name: "constexpr" for name in names if name.isupper()}}
                    constexprs = {"QUANT": quant, "BLOCK_M": tiles.block_m, "BLOCK_N": tiles.block_n,
                                  "BLOCK_K": tiles.block_k}
                    for epilogue_name, epilogue in epilogues.items():
                        cases.append(GateCase(
                            kernel, {name: types[name] for name in names}, {**constexprs, **epilogue}, cc,
                            f"{kernel.fn.__name__} {variant} {epilogue_name} {regime} {tiles}", tiles.num_warps,
                            tiles.num_stages))
        cases += _align_gate_cases(cc, sorted({gate_up.block_m for gate_up, _ in table.values()}))
        for dtype in ("bf16", "fp16"):
            signature = {"y": f"*{dtype}", "topk_ids": "*i32", "out": f"*{dtype}", "hidden_size": "i32", "top_k": "i32",
                         "num_experts": "i32", "stride_ot": "i32", "BLOCK_H": "constexpr"}
            cases.append(GateCase(moe_sum_kernel, signature, {"BLOCK_H": SUM_BLOCK_H[cc]}, cc,
                                  f"moe_sum_kernel {dtype} BLOCK_H={SUM_BLOCK_H[cc]}"))
    return cases


def _align_gate_cases(cc: int, block_ms: list[int]) -> list[GateCase]:
    pairs = {"topk_ids": "*i32", "num_pairs": "i32", "num_experts": "i32", "BLOCK": "constexpr"}
    block = {"BLOCK": ALIGN_BLOCK[cc]}
    cases = [
        GateCase(moe_count_kernel, {"topk_ids": "*i32", "counts": "*i32", **pairs}, block, cc, f"moe_count {block}"),
        GateCase(moe_scatter_kernel, {"topk_ids": "*i32", "cursor": "*i32", "sorted_pair_ids": "*i32", **pairs},
                 block, cc, f"moe_scatter {block}"),
    ]
    signature = {name: "*i32" for name in ("counts", "cursor", "block_expert_ids", "sorted_pair_ids")}
    signature.update({name: "i32" for name in ("num_experts", "num_pairs", "num_rows")})
    signature.update(BLOCK_M="constexpr", BLOCK="constexpr")
    for block_m in block_ms:
        constexprs = {"BLOCK_M": block_m, "BLOCK": ALIGN_TILE}
        cases.append(GateCase(moe_offsets_kernel, signature, constexprs, cc, f"moe_offsets {constexprs}"))
    return cases


def bench():
    """Qwen3-30B-A3B routed experts (H 2048, I 768, 128 local experts, top-8) at T in {1, 8, 64, 512, 2048},
    bf16 and FP8 with 128x128 block scales: (name, run once, bytes moved, flops). Bytes count the hit experts'
    weights (and scales) plus hidden, act, y and out traffic. CUDA only."""
    hidden_size, inter, num_experts, top_k = 2048, 768, 128, 8
    gen = torch.Generator(device="cuda").manual_seed(0)
    w_gate_up = torch.randn(num_experts, 2 * inter, hidden_size, device="cuda", generator=gen).mul_(0.02)
    w_down = torch.randn(num_experts, hidden_size, inter, device="cuda", generator=gen).mul_(0.02)
    gu8, gu_scale = quantize_fp8_weights(w_gate_up, (128, 128))
    d8, d_scale = quantize_fp8_weights(w_down, (128, 128))
    variants = {
        "bf16": (w_gate_up.bfloat16(), w_down.bfloat16(), {}),
        "fp8-block": (gu8, d8, {"w_gate_up_scale": gu_scale, "w_down_scale": d_scale, "block_shape": (128, 128)}),
    }
    del w_gate_up, w_down
    cases = []
    for num_tokens in (1, 8, 64, 512, 2048):
        hidden = torch.randn(num_tokens, hidden_size, device="cuda", generator=gen).bfloat16()
        scores = torch.rand(num_tokens, num_experts, device="cuda", generator=gen)
        topk_weights, topk_ids = scores.topk(top_k, dim=1)
        topk_weights = (topk_weights / topk_weights.sum(1, keepdim=True)).contiguous()
        num_hit = torch.unique(topk_ids).numel()
        num_pairs = num_tokens * top_k
        out = torch.empty_like(hidden)
        for variant, (gate_up, down, quant_args) in variants.items():
            weight_bytes = num_hit * (gate_up[0].numel() + down[0].numel()) * gate_up.element_size()
            if quant_args:
                weight_bytes += num_hit * (gu_scale[0].numel() + d_scale[0].numel()) * 4
            activation_bytes = 2 * (2 * num_tokens * hidden_size + 2 * num_pairs * inter + 2 * num_pairs * hidden_size)
            flops = 2 * num_pairs * 3 * inter * hidden_size

            def run(hidden=hidden, gate_up=gate_up, down=down, ids=topk_ids, weights=topk_weights, out=out,
                    quant_args=quant_args):
                fused_moe(hidden, gate_up, down, ids, weights, out=out, **quant_args)

            cases.append((f"fused_moe qwen3-30b-a3b {variant} T={num_tokens}", run,
                          weight_bytes + activation_bytes, flops))
    return cases
