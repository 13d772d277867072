"""The gate and benchmark cases of gpu_layers.w8a8_moe (read through its gate_cases and bench_cases): every
(kernel, weight format, epilogue, BLOCK_K, config) w8a8_moe can launch for each capability, and Qwen3-30B-A3B's
routed experts in int8 (per row) and int4 (group 32) against bf16 fused_moe on the same weights."""

from __future__ import annotations

import torch

from gpu_layers.capability import GateCase
from gpu_layers.fused_moe import SUM_BLOCK_H, fused_moe, moe_sum_kernel
from gpu_layers.fused_moe_cases import _GATE_UP_EPILOGUES
from gpu_layers.w8a8_moe import (
    BLOCK_KS,
    CONFIGS,
    NO_FMA,
    QUANTIZE_BLOCK,
    quantize_rows,
    quantize_rows_kernel,
    w8a8_down_kernel,
    w8a8_gate_up_kernel,
    w8a8_moe,
)

_WEIGHTS = {  # variant -> (codes type, scales type, IS_INT4)
    "int8": ("*i8", "*fp32", False),
    "int4 fp32 scales": ("*u8", "*fp32", True),
    "int4 bf16 scales": ("*u8", "*bf16", True),
}
_DOWN_EPILOGUES = {"no-bias": {"HAS_BIAS": False}, "bias": {"HAS_BIAS": True}}


def gate() -> list[GateCase]:
    cases = []
    for cc, (gate_up, down) in CONFIGS.items():
        for variant, (codes, scales, is_int4) in _WEIGHTS.items():
            kernels = (
                (w8a8_gate_up_kernel, gate_up, {"x_q": "*i8", "x_scale": "*fp32", "gate": codes, "gate_scale": scales,
                                                 "up": codes, "up_scale": scales, "act": "*fp32"}, _GATE_UP_EPILOGUES),
                (w8a8_down_kernel, down, {"a_q": "*i8", "a_scale": "*fp32", "w": codes, "w_scale": scales,
                                          "topk_weights": "*fp32", "y": "*fp32"}, _DOWN_EPILOGUES),
            )
            for kernel, tiles, pointers, epilogues in kernels:
                names = kernel.arg_names
                types = {"bias": "*fp32", "sorted_pair_ids": "*i32", "block_expert_ids": "*i32", **pointers}
                types.update({name: "constexpr" if name.isupper() else "i32" for name in names if name not in types})
                for block_k in (k for k in BLOCK_KS if k <= tiles.block_k):
                    constexprs = {"IS_INT4": is_int4, "BLOCK_M": tiles.block_m, "BLOCK_N": tiles.block_n,
                                  "BLOCK_K": block_k}
                    for epilogue_name, epilogue in epilogues.items():
                        cases.append(GateCase(
                            kernel, {name: types[name] for name in names}, {**constexprs, **epilogue}, cc,
                            f"{kernel.fn.__name__} {variant} {epilogue_name} BLOCK_K={block_k} {tiles}",
                            tiles.num_warps, tiles.num_stages, dict(NO_FMA)))
        for dtype in ("fp32", "bf16", "fp16"):
            signature = {"x": f"*{dtype}", "q": "*i8", "scale": "*fp32", "num_cols": "i32", "stride_x": "i32",
                         "stride_q": "i32", "BLOCK": "constexpr"}
            cases.append(GateCase(quantize_rows_kernel, signature, {"BLOCK": QUANTIZE_BLOCK}, cc,
                                  f"quantize_rows_kernel {dtype}", extra=dict(NO_FMA)))
        signature = {"y": "*fp32", "topk_ids": "*i32", "out": "*fp32", "hidden_size": "i32", "top_k": "i32",
                     "num_experts": "i32", "stride_ot": "i32", "BLOCK_H": "constexpr"}
        cases.append(GateCase(moe_sum_kernel, signature, {"BLOCK_H": SUM_BLOCK_H[cc]}, cc,
                              f"moe_sum_kernel fp32 BLOCK_H={SUM_BLOCK_H[cc]}", extra=dict(NO_FMA)))
    return cases


def _int4_pack(codes: torch.Tensor) -> torch.Tensor:
    """int8 codes -8..7 [E, N, K] -> packed uint8 [E, N, K / 2] (even column in the low nibble)."""
    nibbles = (codes + 8).to(torch.uint8)
    return nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)


def bench():
    """Qwen3-30B-A3B routed experts (H 2048, I 768, 128 experts, top-8) at T in {512, 2048} (the streamed prefill's
    sizes): int8 per row and int4 group 32 through w8a8_moe (the hidden rows' quantization included), bf16 through
    fused_moe as the baseline. (name, run once, bytes moved, flops, baseline). CUDA only."""
    hidden_size, inter, num_experts, top_k = 2048, 768, 128, 8
    gen = torch.Generator(device="cuda").manual_seed(0)

    def codes(rows, cols, low, high):
        return torch.randint(low, high, (num_experts, rows, cols), device="cuda", generator=gen, dtype=torch.int8)

    def scales(rows, groups):
        return torch.rand(num_experts, rows, groups, device="cuda", generator=gen) * 1e-3

    int8 = dict(gate=(codes(inter, hidden_size, -127, 128), scales(inter, 1)),
                up=(codes(inter, hidden_size, -127, 128), scales(inter, 1)),
                down=(codes(hidden_size, inter, -127, 128), scales(hidden_size, 1)), group_size=0)
    int4 = dict(gate=(_int4_pack(codes(inter, hidden_size, -8, 8)), scales(inter, hidden_size // 32)),
                up=(_int4_pack(codes(inter, hidden_size, -8, 8)), scales(inter, hidden_size // 32)),
                down=(_int4_pack(codes(hidden_size, inter, -8, 8)), scales(hidden_size, inter // 32)), group_size=32)
    w_gate_up = torch.randn(num_experts, 2 * inter, hidden_size, device="cuda", generator=gen).mul_(0.02).bfloat16()
    w_down = torch.randn(num_experts, hidden_size, inter, device="cuda", generator=gen).mul_(0.02).bfloat16()
    cases = []
    for num_tokens in (512, 2048):
        hidden = torch.randn(num_tokens, hidden_size, device="cuda", generator=gen).bfloat16()
        scores = torch.rand(num_tokens, num_experts, device="cuda", generator=gen)
        topk_weights, topk_ids = scores.topk(top_k, dim=1)
        topk_weights = (topk_weights / topk_weights.sum(1, keepdim=True)).contiguous()
        num_hit = torch.unique(topk_ids).numel()
        num_pairs = num_tokens * top_k
        flops = 2 * num_pairs * 3 * inter * hidden_size

        def baseline(hidden=hidden, ids=topk_ids, weights=topk_weights):
            fused_moe(hidden, w_gate_up, w_down, ids, weights)

        for variant, weights in (("int8", int8), ("int4 g32", int4)):
            weight_bytes = num_hit * sum(weights[r][0][0].numel() + 4 * weights[r][1][0].numel()
                                         for r in ("gate", "up", "down"))
            activation_bytes = num_tokens * hidden_size * 3 + num_pairs * inter * 9 + num_pairs * hidden_size * 8

            def run(hidden=hidden, ids=topk_ids, topk=topk_weights, weights=weights):
                w8a8_moe(*quantize_rows(hidden), topk_ids=ids, topk_weights=topk, **weights)

            cases.append((f"w8a8_moe qwen3-30b-a3b {variant} T={num_tokens}", run, weight_bytes + activation_bytes,
                          flops, baseline))
    return cases
