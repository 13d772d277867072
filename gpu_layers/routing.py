"""MoE routing: softmax top-k (Qwen, Mixtral) and grouped top-k (DeepSeek-V3, GLM-4.5), one token per program.

Data flow: logits [T, E] -> weights float32 [T, K], ids int32 [T, K]. The semantics are gpu_layers/reference.py's
`softmax_topk` and `grouped_topk` (the test oracles, reused here as the references): score (softmax or sigmoid),
optionally keep the best `topk_group` of `num_groups` groups (group score: max or sum of the top two, taken on
score + correction bias), pick the top-k experts by score + bias, weight them by the unbiased score, optionally
renormalise, then scale. Both launchers run the same kernel; softmax_topk is grouped routing with softmax scoring,
no bias, no groups and scale 1.

A token's E <= 512 experts sit in one warp's registers (two past 256; BLOCK_E = next_power_of_2(E)), so the argmax
passes are (mostly) warp shuffles. Ties go to the lowest expert index (the order of ids in a row is
the selection order; callers must not rely on it). Flags are ints (the interpreter takes no bool arguments) and
runtime ints that are often 1 are not specialised, so the compiled variants are exactly the ones the gate checks.
Loops over runtime counts are `while` loops: Triton 3.6's interpreter cannot take range() of a kernel argument
under NumPy >= 2.4 (it converts a 1-element array with int()).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gpu_layers import reference
from gpu_layers.capability import CAPABILITIES, GateCase, capability_of, select

DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
MIN_BLOCK_E, MAX_BLOCK_E = 16, 512
MAX_TOP_K = 16  # BLOCK_K: the widest top-k a model uses is 10 (Qwen3-Next)
GROUP_SCORES = {"none": 0, "max": 1, "top2_sum": 2}
MAX_FUSED_TOKENS = 16  # router_topk (GEMV and top-k in one launch) serves decode-sized steps up to here
# router_topk's smallest BLOCK_E: at 16 (fp16) its select spilled on sm_90 (stack 80 B); 16 experts or fewer are
# selected from 32 lanes, the rest -inf
MIN_FUSED_BLOCK_E = 32
# router_topk: BLOCK_EC experts per program, BLOCK_H columns a step: 2 x 2048 weights (32 a thread over 4 warps), so
# a Qwen3 router (128 x 2048) is 64 programs of one load each (the column loop is a while loop, which Triton does
# not pipeline: few, wide steps), DeepSeek-V3's (256 x 7168) 128 programs of four.
_ROUTER_CONFIG = {"BLOCK_EC": 2, "BLOCK_H": 2048, "num_warps": 4}
ROUTER_CONFIGS = {89: _ROUTER_CONFIG, 90: _ROUTER_CONFIG, 120: _ROUTER_CONFIG}

# BLOCK_E -> num_warps: one warp up to 256 experts (8 per thread), two beyond.
_WARPS_BY_BLOCK = {16: 1, 32: 1, 64: 1, 128: 1, 256: 1, 512: 2}
CONFIGS = {89: _WARPS_BY_BLOCK, 90: _WARPS_BY_BLOCK, 120: _WARPS_BY_BLOCK}


@triton.jit
def _best(values, experts, BLOCK_E: tl.constexpr):
    """(The maximum of `values`, the lowest index holding it.)"""
    best = tl.max(values, axis=0)
    return best, tl.min(tl.where(values == best, experts, BLOCK_E), axis=0)


@triton.jit
def _argmax(values, experts, BLOCK_E: tl.constexpr):
    """The lowest index holding the maximum of `values`."""
    return _best(values, experts, BLOCK_E)[1]


@triton.jit
def _allowed_groups(choice, experts, num_experts, num_groups, topk_group, group_score, BLOCK_E: tl.constexpr):
    """Mask [BLOCK_E] of the experts inside the best `topk_group` groups (group score 1: max, 2: top-2 sum)."""
    group_size = num_experts // num_groups
    group_of = experts // group_size
    group_value = tl.full([BLOCK_E], float("-inf"), tl.float32)  # each expert holds its group's score
    g = 0
    while g < num_groups:  # while, not range(): see the module docstring
        members = tl.where(group_of == g, choice, float("-inf"))
        value = tl.max(members, axis=0)
        if group_score == 2:
            first = _argmax(members, experts, BLOCK_E)
            value += tl.max(tl.where(experts == first, float("-inf"), members), axis=0)
        group_value = tl.where(group_of == g, value, group_value)
        g += 1
    allowed = experts < 0
    num_chosen = 0
    while num_chosen < topk_group:
        chosen = group_of == _argmax(group_value, experts, BLOCK_E) // group_size
        allowed = allowed | chosen
        group_value = tl.where(chosen, float("-inf"), group_value)
        num_chosen += 1
    return allowed


@triton.jit
def _select_topk(logits, bias_ptr, experts, num_experts, top_k, num_groups, topk_group, group_score, is_sigmoid,
                 has_bias, renormalize, scaling_factor, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    """One token's float32 logits [BLOCK_E] (-inf past num_experts) -> (weights [BLOCK_K], ids [BLOCK_K])."""
    is_expert = experts < num_experts
    if is_sigmoid:
        scores = tl.sigmoid(logits)
    else:
        exp = tl.exp(logits - tl.max(logits, axis=0))
        scores = exp / tl.sum(exp, axis=0)
    choice = scores
    if has_bias:
        choice += tl.load(bias_ptr + experts, mask=is_expert, other=0.0)
    choice = tl.where(is_expert, choice, float("-inf"))
    if group_score != 0:
        allowed = _allowed_groups(choice, experts, num_experts, num_groups, topk_group, group_score, BLOCK_E)
        choice = tl.where(allowed, choice, float("-inf"))

    slots = tl.arange(0, BLOCK_K)
    top_weights = tl.zeros([BLOCK_K], tl.float32)
    top_ids = tl.zeros([BLOCK_K], tl.int32)
    k = 0
    while k < top_k:
        weight, best = _best(choice, experts, BLOCK_E)  # without a bias the choice is the score: no third reduction
        if has_bias:
            weight = tl.sum(tl.where(experts == best, scores, 0.0), axis=0)
        top_weights = tl.where(slots == k, weight, top_weights)
        top_ids = tl.where(slots == k, best, top_ids)
        choice = tl.where(experts == best, float("-inf"), choice)
        k += 1
    if renormalize:
        top_weights = top_weights / (tl.sum(top_weights, axis=0) + 1e-20)
    return top_weights * scaling_factor, top_ids


@triton.jit(do_not_specialize=["top_k", "num_groups", "topk_group", "group_score", "is_sigmoid", "has_bias",
                            "renormalize"])
def topk_routing_kernel(
    logits_ptr, bias_ptr, weights_ptr, ids_ptr, logits_row_stride, num_experts, top_k,
    num_groups, topk_group, group_score, is_sigmoid, has_bias, renormalize, scaling_factor,
    BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    experts = tl.arange(0, BLOCK_E)
    logits = tl.load(logits_ptr + token * logits_row_stride + experts, mask=experts < num_experts,
                     other=float("-inf"))
    top_weights, top_ids = _select_topk(logits.to(tl.float32), bias_ptr, experts, num_experts, top_k, num_groups,
                                        topk_group, group_score, is_sigmoid, has_bias, renormalize, scaling_factor,
                                        BLOCK_E, BLOCK_K)
    slots = tl.arange(0, BLOCK_K)
    tl.store(weights_ptr + token * top_k + slots, top_weights, mask=slots < top_k)
    tl.store(ids_ptr + token * top_k + slots, top_ids, mask=slots < top_k)


@triton.jit(do_not_specialize=["top_k", "num_groups", "topk_group", "group_score", "is_sigmoid", "has_bias",
                            "renormalize", "round_logits"])
def router_topk_kernel(
    x_ptr, w_ptr, bias_ptr, logits_ptr, counter_ptr, weights_ptr, ids_ptr,
    x_row_stride, num_tokens, hidden_size, num_experts, top_k, num_groups, topk_group, group_score, is_sigmoid,
    has_bias, renormalize, scaling_factor, round_logits,
    BLOCK_EC: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Program p: the logits of experts [p * BLOCK_EC, (p + 1) * BLOCK_EC) for every token (float32 sums, rounded
    to x's dtype when round_logits, as a GEMM in that dtype rounds its output) into logits [T, E]; the last program
    to finish (a counter it then resets, so the kernel can be replayed) selects every token's top-k from them."""
    chunk = tl.program_id(0)
    experts_c = chunk * BLOCK_EC + tl.arange(0, BLOCK_EC)
    is_expert_c = experts_c < num_experts
    w_rows = w_ptr + experts_c[:, None].to(tl.int64) * hidden_size
    token = 0
    while token < num_tokens:  # while, not range(): see the module docstring
        x_row = x_ptr + token * x_row_stride
        acc = tl.zeros([BLOCK_EC], tl.float32)
        h = 0
        while h < hidden_size:
            cols = h + tl.arange(0, BLOCK_H)
            x = tl.load(x_row + cols, mask=cols < hidden_size, other=0.0).to(tl.float32)
            w = tl.load(w_rows + cols[None, :], mask=is_expert_c[:, None] & (cols < hidden_size)[None, :], other=0.0)
            acc += tl.sum(w.to(tl.float32) * x[None, :], axis=1)
            h += BLOCK_H
        if round_logits:
            acc = acc.to(x_ptr.dtype.element_ty).to(tl.float32)
        tl.store(logits_ptr + token * num_experts + experts_c, acc, mask=is_expert_c)
        token += 1
    # Every thread's logits are stored before the one release below; the last program's acquire then sees them all.
    tl.debug_barrier()
    done = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
    if done == tl.num_programs(0) - 1:
        experts = tl.arange(0, BLOCK_E)
        slots = tl.arange(0, BLOCK_K)
        token = 0
        while token < num_tokens:
            logits = tl.load(logits_ptr + token * num_experts + experts, mask=experts < num_experts,
                             other=float("-inf"), cache_modifier=".cg")
            top_weights, top_ids = _select_topk(logits, bias_ptr, experts, num_experts, top_k, num_groups,
                                                topk_group, group_score, is_sigmoid, has_bias, renormalize,
                                                scaling_factor, BLOCK_E, BLOCK_K)
            tl.store(weights_ptr + token * top_k + slots, top_weights, mask=slots < top_k)
            tl.store(ids_ptr + token * top_k + slots, top_ids, mask=slots < top_k)
            token += 1
        tl.atomic_xchg(counter_ptr, 0, sem="relaxed", scope="gpu")


softmax_topk_reference = reference.softmax_topk
grouped_topk_reference = reference.grouped_topk


def _route(logits, bias, top_k, num_groups, topk_group, group_score, is_sigmoid, renormalize, scaling_factor, out):
    if logits.dim() != 2 or logits.stride(-1) != 1:
        raise ValueError(f"logits must be [T, E] with contiguous rows, got {tuple(logits.shape)} {logits.stride()}")
    num_tokens, num_experts = logits.shape
    block_e = max(MIN_BLOCK_E, triton.next_power_of_2(num_experts))
    if block_e > MAX_BLOCK_E:
        raise ValueError(f"logits has {num_experts} experts, more than {MAX_BLOCK_E}")
    if not 1 <= top_k <= min(MAX_TOP_K, num_experts):
        raise ValueError(f"top_k {top_k} must be in [1, min({MAX_TOP_K}, {num_experts})]")
    if out is None:
        out = (torch.empty(num_tokens, top_k, dtype=torch.float32, device=logits.device),
               torch.empty(num_tokens, top_k, dtype=torch.int32, device=logits.device))
    weights, ids = out
    for name, tensor, dtype in (("weights", weights, torch.float32), ("ids", ids, torch.int32)):
        if tensor.shape != (num_tokens, top_k) or tensor.dtype != dtype or not tensor.is_contiguous():
            raise ValueError(f"out {name} must be contiguous {dtype} [{num_tokens}, {top_k}], got "
                             f"{tuple(tensor.shape)} {tensor.dtype}")
        if tensor.device != logits.device:
            raise ValueError(f"out {name} is on {tensor.device}, logits on {logits.device}")
    if num_tokens == 0:
        return weights, ids
    num_warps = select(CONFIGS, capability_of(logits.device))[block_e]
    topk_routing_kernel[(num_tokens,)](
        logits, weights if bias is None else bias, weights, ids, logits.stride(0), num_experts, top_k,
        num_groups, topk_group, group_score, int(is_sigmoid), int(bias is not None), int(renormalize),
        float(scaling_factor),
        BLOCK_E=block_e, BLOCK_K=MAX_TOP_K, num_warps=num_warps,
    )
    return weights, ids


def softmax_topk(
    logits: torch.Tensor, top_k: int, renormalize: bool, out: tuple[torch.Tensor, torch.Tensor] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] (bf16, fp16 or fp32) -> float32 weights [T, K], int32 ids [T, K] (into `out` if given)."""
    if logits.dtype not in DTYPES:
        raise ValueError(f"logits dtype {logits.dtype} is not one of {list(DTYPES)}")
    return _route(logits, None, top_k, 1, 1, GROUP_SCORES["none"], False, renormalize, 1.0, out)


def grouped_topk(
    logits: torch.Tensor, correction_bias: torch.Tensor | None, top_k: int, num_groups: int, topk_group: int,
    scoring: str, group_score: str, renormalize: bool, scaling_factor: float,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 logits [T, E], correction_bias float32 [E] or None -> float32 weights [T, K], int32 ids [T, K]
    (into `out` if given)."""
    if logits.dtype != torch.float32:
        raise ValueError(f"logits must be float32, got {logits.dtype}")
    num_groups, topk_group = _check_grouping(logits.shape[-1], logits.device, correction_bias, top_k, num_groups,
                                             topk_group, scoring, group_score)
    return _route(logits, correction_bias, top_k, num_groups, topk_group, GROUP_SCORES[group_score],
                  scoring == "sigmoid", renormalize, scaling_factor, out)


def _check_grouping(num_experts, device, correction_bias, top_k, num_groups, topk_group, scoring, group_score):
    """The grouped router's arguments checked; -> (num_groups, topk_group), both 1 without groups."""
    if correction_bias is not None and (correction_bias.shape != (num_experts,) or correction_bias.dtype !=
                                        torch.float32 or correction_bias.stride(0) != 1):
        raise ValueError(f"correction_bias must be contiguous float32 [{num_experts}], got "
                         f"{tuple(correction_bias.shape)} {correction_bias.dtype}")
    if correction_bias is not None and correction_bias.device != device:
        raise ValueError(f"correction_bias is on {correction_bias.device}, logits on {device}")
    if scoring not in ("sigmoid", "softmax"):
        raise ValueError(f"scoring must be 'sigmoid' or 'softmax', got {scoring!r}")
    if group_score not in GROUP_SCORES:
        raise ValueError(f"group_score must be one of {list(GROUP_SCORES)}, got {group_score!r}")
    if group_score == "none":
        return 1, 1
    if num_groups < 1 or num_experts % num_groups or not 1 <= topk_group <= num_groups:
        raise ValueError(f"num_groups {num_groups} / topk_group {topk_group} do not fit {num_experts} experts")
    if top_k > topk_group * (num_experts // num_groups):
        raise ValueError(f"top_k {top_k} exceeds the {topk_group} groups' experts")
    return num_groups, topk_group


def router_topk(
    x: torch.Tensor, weight: torch.Tensor, correction_bias: torch.Tensor | None, counter: torch.Tensor, top_k: int,
    num_groups: int, topk_group: int, scoring: str, group_score: str, renormalize: bool, scaling_factor: float,
    is_float32_logits: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The router's GEMV and its top-k in one launch, for decode-sized T (<= MAX_FUSED_TOKENS): x [T, H] (rows
    contiguous), weight [E, H] (x's dtype) -> float32 weights [T, K], int32 ids [T, K], as `router_topk_reference`.
    `is_float32_logits`: the logits stay float32 (a router run in float32), else they are rounded to x's dtype.
    `counter`: int32 [1] device memory holding 0 (the kernel leaves it 0), one per call site that may run
    concurrently with another."""
    if x.dim() != 2 or x.stride(-1) != 1 or x.dtype not in DTYPES:
        raise ValueError(f"x must be [T, H] with contiguous rows in one of {list(DTYPES)}, got {tuple(x.shape)} "
                         f"{x.dtype}")
    num_tokens, hidden_size = x.shape
    if not 0 <= num_tokens <= MAX_FUSED_TOKENS:
        raise ValueError(f"x has {num_tokens} tokens, more than the fused router's {MAX_FUSED_TOKENS}")
    if weight.dim() != 2 or weight.shape[1] != hidden_size or weight.dtype != x.dtype or not weight.is_contiguous():
        raise ValueError(f"weight must be contiguous [E, {hidden_size}] {x.dtype}, got {tuple(weight.shape)} "
                         f"{weight.dtype}")
    num_experts = weight.shape[0]
    block_e = max(MIN_FUSED_BLOCK_E, triton.next_power_of_2(num_experts))
    if block_e > MAX_BLOCK_E or not 1 <= top_k <= min(MAX_TOP_K, num_experts):
        raise ValueError(f"{num_experts} experts (at most {MAX_BLOCK_E}) with top_k {top_k} (1..{MAX_TOP_K})")
    if counter.shape != (1,) or counter.dtype != torch.int32 or counter.device != x.device:
        raise ValueError(f"counter must be int32 [1] on {x.device}, got {tuple(counter.shape)} {counter.dtype} on "
                         f"{counter.device}")
    num_groups, topk_group = _check_grouping(num_experts, x.device, correction_bias, top_k, num_groups, topk_group,
                                             scoring, group_score)
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=x.device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int32, device=x.device)
    if num_tokens == 0:
        return weights, ids
    logits = torch.empty(num_tokens, num_experts, dtype=torch.float32, device=x.device)
    config = select(ROUTER_CONFIGS, capability_of(x.device))
    router_topk_kernel[(triton.cdiv(num_experts, config["BLOCK_EC"]),)](
        x, weight, weights if correction_bias is None else correction_bias, logits, counter, weights, ids,
        x.stride(0), num_tokens, hidden_size, num_experts, top_k, num_groups, topk_group, GROUP_SCORES[group_score],
        int(scoring == "sigmoid"), int(correction_bias is not None), int(renormalize), float(scaling_factor),
        int(not is_float32_logits and x.dtype != torch.float32),
        BLOCK_EC=config["BLOCK_EC"], BLOCK_H=config["BLOCK_H"], BLOCK_E=block_e, BLOCK_K=MAX_TOP_K,
        num_warps=config["num_warps"],
    )
    return weights, ids


def router_topk_reference(x, weight, correction_bias, counter, top_k, num_groups, topk_group, scoring, group_score,
                          renormalize, scaling_factor, is_float32_logits):
    """The unfused path: the GEMV (float32 sums, rounded to x's dtype unless is_float32_logits), then
    `reference.grouped_topk` (softmax top-k is its no-group, no-bias case)."""
    logits = x.float() @ weight.float().T  # [T, E]
    if not is_float32_logits:
        logits = logits.to(x.dtype).float()
    return reference.grouped_topk(logits, correction_bias, top_k, num_groups, topk_group, scoring, group_score,
                                  renormalize, scaling_factor)


def gate_cases() -> list[GateCase]:
    cases = []
    for capability in CAPABILITIES:
        for block_e, num_warps in select(CONFIGS, capability).items():
            for dtype in DTYPES.values():
                cases.append(GateCase(
                    kernel=topk_routing_kernel,
                    signature={"logits_ptr": f"*{dtype}", "bias_ptr": "*fp32", "weights_ptr": "*fp32",
                               "ids_ptr": "*i32", "logits_row_stride": "i32", "num_experts": "i32", "top_k": "i32",
                               "num_groups": "i32", "topk_group": "i32", "group_score": "i32", "is_sigmoid": "i32",
                               "has_bias": "i32", "renormalize": "i32", "scaling_factor": "fp32",
                               "BLOCK_E": "constexpr", "BLOCK_K": "constexpr"},
                    constexprs={"BLOCK_E": block_e, "BLOCK_K": MAX_TOP_K},
                    capability=capability,
                    label=f"topk_routing {dtype} BLOCK_E={block_e}",
                    num_warps=num_warps,
                ))
                if block_e < MIN_FUSED_BLOCK_E:
                    continue
                config = select(ROUTER_CONFIGS, capability)
                cases.append(GateCase(
                    kernel=router_topk_kernel,
                    signature={"x_ptr": f"*{dtype}", "w_ptr": f"*{dtype}", "bias_ptr": "*fp32", "logits_ptr": "*fp32",
                               "counter_ptr": "*i32", "weights_ptr": "*fp32", "ids_ptr": "*i32",
                               **{n: "i32" for n in ("x_row_stride", "num_tokens", "hidden_size", "num_experts",
                                                     "top_k", "num_groups", "topk_group", "group_score",
                                                     "is_sigmoid", "has_bias", "renormalize")},
                               "scaling_factor": "fp32", "round_logits": "i32", "BLOCK_EC": "constexpr",
                               "BLOCK_H": "constexpr", "BLOCK_E": "constexpr", "BLOCK_K": "constexpr"},
                    constexprs={"BLOCK_EC": config["BLOCK_EC"], "BLOCK_H": config["BLOCK_H"], "BLOCK_E": block_e,
                                "BLOCK_K": MAX_TOP_K},
                    capability=capability,
                    label=f"router_topk {dtype} BLOCK_E={block_e}",
                    num_warps=config["num_warps"],
                ))
    return cases


def bench_cases():
    """DeepSeek-V3 (256 experts, 8 groups, top-8 sigmoid + bias) and Qwen3-30B-A3B (128 experts, softmax top-8)."""
    cases = []
    for name, num_tokens in [("decode", 64), ("prefill", 8192)]:
        logits = torch.randn(num_tokens, 256, device="cuda")
        bias = torch.randn(256, device="cuda") * 0.1
        cases.append((f"grouped_topk dsv3 {name}", lambda x=logits, b=bias: grouped_topk(
            x, b, 8, 8, 4, "sigmoid", "top2_sum", True, 2.5), logits.numel() * 4, 40 * logits.numel()))
        qwen = torch.randn(num_tokens, 128, device="cuda", dtype=torch.bfloat16)
        cases.append((f"softmax_topk qwen3-30b {name}", lambda x=qwen: softmax_topk(x, 8, True),
                      qwen.numel() * 2, 30 * qwen.numel()))
    return cases
