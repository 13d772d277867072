"""The gate and benchmark cases of gpu_layers.delta_net (read through its gate_cases and bench_cases): every kernel
config the launchers can select, and Qwen3-Next-like prefill (8K tokens) and decode (batch 1-64)."""

from __future__ import annotations

import functools

import torch
import triton

from gpu_layers import delta_net_chunked
from gpu_layers.capability import GateCase
from gpu_layers.delta_net import (
    CONV_CONFIGS,
    PREFILL_CONFIGS,
    SUPPORTED_DTYPES,
    SUPPORTED_HEAD_DIMS,
    SUPPORTED_KERNEL_SIZES,
    causal_conv1d_decode_kernel,
    causal_conv1d_prefill,
    causal_conv1d_prefill_kernel,
    causal_conv1d_state_kernel,
    conv_config,
    decode_config,
    gated_delta_rule_decode,
    gated_delta_rule_decode_kernel,
    gated_delta_rule_prefill_kernel,
    gated_delta_rule_prefill_sequential,
    prefill_config,
)


def _gate_case(kernel, dtype_name: str, constexprs: dict, capability: int, label: str, num_warps: int,
               num_stages: int = 1) -> GateCase:
    """Argument types follow the naming: metadata pointers are int32 (has_initial_state bool), state_pool, g and
    beta float32, other pointers the data dtype; scale is fp32, other plain arguments i32."""

    def arg_type(name: str) -> str:
        if name in constexprs:
            return "constexpr"
        if name in ("cu_seqlens_ptr", "state_slots_ptr", "chunk_offsets_ptr"):
            return "*i32"
        if name == "has_initial_state_ptr":
            return "*i1"
        if name in ("state_pool_ptr", "g_ptr", "beta_ptr", "gates_ptr", "scratch_ptr"):
            return "*fp32"
        if name.endswith("_ptr"):
            return f"*{dtype_name}"
        return "fp32" if name == "scale" else "i32"

    signature = {name: arg_type(name) for name in kernel.arg_names}
    return GateCase(kernel, signature, constexprs, capability, label, num_warps, num_stages)


def gate() -> list[GateCase]:
    """Every (kernel, dtype, head dims, kernel size, bias) config of each capability's tables."""
    cases = []
    for capability in PREFILL_CONFIGS:
        for dtype, name in SUPPORTED_DTYPES.items():
            for k_dim in SUPPORTED_HEAD_DIMS:
                for v_dim in SUPPORTED_HEAD_DIMS:
                    dims = f"Dk={k_dim} Dv={v_dim}"
                    block_v, num_warps, num_stages = prefill_config(capability, v_dim, dtype)
                    constexprs = {"K_DIM": k_dim, "V_DIM": v_dim, "BLOCK_V": block_v}
                    cases.append(_gate_case(gated_delta_rule_prefill_kernel, name, constexprs, capability,
                                            f"gdn_prefill {name} {dims} BLOCK_V={block_v}", num_warps, num_stages))
                    block_v, num_warps = decode_config(capability, v_dim, dtype)
                    cases.append(_gate_case(gated_delta_rule_decode_kernel, name,
                                            {"K_DIM": k_dim, "V_DIM": v_dim, "BLOCK_V": block_v}, capability,
                                            f"gdn_decode {name} {dims} BLOCK_V={block_v}", num_warps))
            cases += _conv_cases(capability, name)
    return cases


def _conv_cases(capability: int, name: str) -> list[GateCase]:
    block_t, block_c, num_warps, state_block_c = conv_config(capability)
    cases = []
    for kernel_size in SUPPORTED_KERNEL_SIZES:
        state_pad = triton.next_power_of_2(kernel_size - 1)
        cases.append(_gate_case(causal_conv1d_state_kernel, name,
                                {"KERNEL_SIZE": kernel_size, "STATE_PAD": state_pad, "BLOCK_C": state_block_c},
                                capability, f"conv1d_state {name} K={kernel_size}", 4))
        for has_bias in (False, True):
            tag = f"{name} K={kernel_size}{' bias' if has_bias else ''}"
            cases.append(_gate_case(causal_conv1d_prefill_kernel, name,
                                    {"KERNEL_SIZE": kernel_size, "HAS_BIAS": has_bias, "BLOCK_T": block_t,
                                     "BLOCK_C": block_c}, capability, f"conv1d_prefill {tag}", num_warps))
            cases.append(_gate_case(causal_conv1d_decode_kernel, name,
                                    {"KERNEL_SIZE": kernel_size, "STATE_PAD": state_pad, "HAS_BIAS": has_bias,
                                     "BLOCK_C": state_block_c}, capability, f"conv1d_decode {tag}", 4))
    return cases


def gate_chunked() -> list[GateCase]:
    """Every (kernel, dtype, head dims) config of gpu_layers.delta_net_chunked's tables."""
    cases = []
    for capability in delta_net_chunked.CONFIGS:
        for dtype, name in SUPPORTED_DTYPES.items():
            precision = delta_net_chunked.dot_precision(dtype)
            for k_dim in SUPPORTED_HEAD_DIMS:
                for v_dim in SUPPORTED_HEAD_DIMS:
                    configs = delta_net_chunked.chunk_configs(capability, k_dim, v_dim, dtype)
                    if configs is None:
                        continue
                    (block_k, num_warps, num_stages), (block_v, state_warps, state_stages) = configs
                    dims = f"Dk={k_dim} Dv={v_dim}"
                    constexprs = {"K_DIM": k_dim, "V_DIM": v_dim, "DOT_PRECISION": precision}
                    cases.append(_gate_case(delta_net_chunked.gated_delta_rule_chunk_prepare_kernel, name,
                                            {**constexprs, "BLOCK_K": block_k}, capability,
                                            f"gdn_chunk_prepare {name} {dims} BLOCK_K={block_k}", num_warps,
                                            num_stages))
                    cases.append(_gate_case(delta_net_chunked.gated_delta_rule_chunk_state_kernel, name,
                                            {**constexprs, "BLOCK_V": block_v}, capability,
                                            f"gdn_chunk_state {name} {dims} BLOCK_V={block_v}", state_warps,
                                            state_stages))
    return cases


assert set(CONV_CONFIGS) == set(PREFILL_CONFIGS), "every capability has conv and delta-rule configs"

# Qwen3-Next-80B's GDN: 16 k heads, 32 v heads, 128 x 128 state, conv over q, k, v (2 * 16 * 128 + 32 * 128).
NUM_K_HEADS, NUM_V_HEADS, HEAD_DIM = 16, 32, 128
CONV_DIM = 2 * NUM_K_HEADS * HEAD_DIM + NUM_V_HEADS * HEAD_DIM


def _inputs(num_tokens: int, device):
    q, k = (torch.randn(num_tokens, NUM_K_HEADS, HEAD_DIM, dtype=torch.bfloat16, device=device) for _ in range(2))
    v = torch.randn(num_tokens, NUM_V_HEADS, HEAD_DIM, dtype=torch.bfloat16, device=device)
    g = -torch.rand(num_tokens, NUM_V_HEADS, device=device)
    beta = torch.rand(num_tokens, NUM_V_HEADS, device=device)
    return q, k, v, g, beta


def bench() -> list[tuple]:
    """Prefill of one 8K sequence (flops: the recurrent form's, 6 Dk Dv per token and v head; baseline: the
    token-sequential kernel) and decode at batch 1-64 (bytes: each sequence's state read and written, plus q, k, v,
    out); the conv at both."""
    device = torch.device("cuda")
    scale = HEAD_DIM**-0.5
    cases = []
    num_tokens = 8192
    q, k, v, g, beta = _inputs(num_tokens, device)
    pool = torch.zeros(64, NUM_V_HEADS, HEAD_DIM, HEAD_DIM, device=device)
    cu_seqlens = torch.tensor([0, num_tokens], dtype=torch.int32, device=device)
    slots = torch.zeros(1, dtype=torch.int32, device=device)
    initial = torch.ones(1, dtype=torch.bool, device=device)
    flops = 6 * num_tokens * NUM_V_HEADS * HEAD_DIM * HEAD_DIM
    num_bytes = 2 * (q.numel() + k.numel() + 2 * v.numel())
    args = (q, k, v, g, beta, cu_seqlens, pool, slots, initial, scale)
    # The chunked kernels with SM120's configs, whatever this device's tables say (Hopper's have none at Dk = 128),
    # against the token-sequential kernel.
    prepare_cfg, state_cfg = delta_net_chunked.CONFIGS[120][(HEAD_DIM, HEAD_DIM, 2)]
    chunked = functools.partial(delta_net_chunked.chunked_prefill, *args, torch.empty_like(v),
                                NUM_V_HEADS // NUM_K_HEADS, 120, prepare_cfg, state_cfg)
    cases.append((f"delta_net.gdn_prefill T={num_tokens} chunked", chunked, num_bytes, flops,
                  functools.partial(gated_delta_rule_prefill_sequential, *args)))
    for batch in (1, 8, 32, 64):
        q, k, v, g, beta = _inputs(batch, device)
        rows = torch.arange(batch, dtype=torch.int32, device=device)
        state_bytes = 2 * batch * NUM_V_HEADS * HEAD_DIM * HEAD_DIM * 4
        cases.append((f"delta_net.gdn_decode B={batch}",
                      functools.partial(gated_delta_rule_decode, q, k, v, g, beta, pool, rows, scale,
                                        out=torch.empty_like(v)),
                      state_bytes + 2 * (q.numel() + k.numel() + 2 * v.numel()), 4 * state_bytes // 8))
    conv_pool = torch.zeros(64, CONV_DIM, 3, dtype=torch.bfloat16, device=device)
    weight = torch.randn(CONV_DIM, 4, dtype=torch.bfloat16, device=device)
    x = torch.randn(num_tokens, CONV_DIM, dtype=torch.bfloat16, device=device)
    cases.append((f"delta_net.conv1d_prefill T={num_tokens}",
                  functools.partial(causal_conv1d_prefill, x, weight, None, cu_seqlens, conv_pool, slots, initial,
                                    num_tokens), 2 * x.numel() * 2, 8 * x.numel()))
    return cases


def tune(num_tokens: int = 8192, prepare_cfgs=((16, 8, 1), (64, 8, 1), (32, 4, 1)),
         state_cfgs=((16, 8, 2), (32, 8, 1), (32, 8, 2), (64, 8, 1), (16, 4, 1))) -> list[str]:
    """The chunked prefill at the bench's shapes under SM120's configs and variants of one kernel's (device runs,
    to choose the tables' entries; variants are not gate-checked): one line per config, microseconds of both
    launches."""
    import triton.testing

    from gpu_layers.capability import capability_of

    device = torch.device("cuda")
    q, k, v, g, beta = _inputs(num_tokens, device)
    pool = torch.zeros(1, NUM_V_HEADS, HEAD_DIM, HEAD_DIM, device=device)
    cu_seqlens = torch.tensor([0, num_tokens], dtype=torch.int32, device=device)
    slots = torch.zeros(1, dtype=torch.int32, device=device)
    initial = torch.ones(1, dtype=torch.bool, device=device)
    out = torch.empty_like(v)
    capability = capability_of(device)
    default = delta_net_chunked.CONFIGS[120][(HEAD_DIM, HEAD_DIM, 2)]
    configs = [default] + [(p, default[1]) for p in prepare_cfgs] + [(default[0], s) for s in state_cfgs]
    lines = []
    for prepare_cfg, state_cfg in configs:
        def run(prepare_cfg=prepare_cfg, state_cfg=state_cfg):
            delta_net_chunked.chunked_prefill(q, k, v, g, beta, cu_seqlens, pool, slots, initial, HEAD_DIM**-0.5,
                                              out, NUM_V_HEADS // NUM_K_HEADS, capability, prepare_cfg, state_cfg)
        us = triton.testing.do_bench(run, warmup=25, rep=200, return_mode="median") * 1e3
        flops = 6 * num_tokens * NUM_V_HEADS * HEAD_DIM * HEAD_DIM
        lines.append(f"prepare {prepare_cfg} state {state_cfg}: {us:.1f} us, {flops / us / 1e6:.1f} TFLOP/s")
    return lines
