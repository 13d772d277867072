"""The fused router (`gpu_layers.routing.router_topk`: the router's GEMV and its top-k in one launch, for decode-sized
steps) against the unfused path, on the GPU or under Triton's interpreter. Inputs are small multiples of powers of
two, so every logit is exact in float32 whatever the order of its sums: the fused kernel must then pick the experts
of the GEMV followed by the top-k kernel (same tie-breaking) and their weights to a few float32 ulps (on the H200
the two kernels' softmax and renormalisation round differently by an ulp), for softmax top-k (Qwen), grouped sigmoid
top-k with a correction bias and a scale (DeepSeek-V3), logits rounded to bf16 or kept float32, one token and up to
MAX_FUSED_TOKENS, odd expert counts across the programs' chunks; and it leaves its counter at 0, so a replay (a CUDA
graph) gives the same result."""

import pytest
import torch
from gpu_support import DEVICE

from gpu_layers import routing

# (experts, top_k, groups, topk_group, scoring, group_score, renormalize, scale, bias)
ROUTERS = {
    "qwen3": (128, 8, 1, 1, "softmax", "none", True, 1.0, False),
    "deepseek_v3": (256, 8, 8, 4, "sigmoid", "top2_sum", True, 2.5, True),
    "odd": (60, 4, 1, 1, "softmax", "none", False, 1.0, False),
    "glm_max_groups": (64, 6, 4, 2, "sigmoid", "max", True, 1.5, True),
    "mixtral": (8, 2, 1, 1, "softmax", "none", True, 1.0, False),  # fewer experts than the smallest BLOCK_E
}


def _exact(*shape, scale, generator):
    """Integers in [-8, 8] times `scale`: products and their sums are exact in float32 (and in bf16 inputs)."""
    return torch.randint(-8, 9, shape, generator=generator).float() * scale


CASES = [  # (router, tokens, dtype, is_float32_logits): each router once, the other axes on the cheap ones
    ("qwen3", 1, torch.bfloat16, False), ("deepseek_v3", 1, torch.bfloat16, True),
    ("deepseek_v3", 2, torch.float32, True), ("odd", 3, torch.bfloat16, False),
    ("odd", 2, torch.float32, True), ("glm_max_groups", 3, torch.bfloat16, False),
    ("mixtral", routing.MAX_FUSED_TOKENS, torch.float16, False),  # the most tokens on the fewest programs (4)
]


@pytest.mark.parametrize(("router", "num_tokens", "dtype", "is_float32_logits"), CASES)
def test_router_topk_matches_the_gemv_then_the_topk_kernel(router, num_tokens, dtype, is_float32_logits):
    num_experts, top_k, groups, topk_group, scoring, group_score, renorm, scale, has_bias = ROUTERS[router]
    gen = torch.Generator().manual_seed(num_tokens * 1000 + num_experts)
    hidden = 2048 + 320  # two column steps of 2048, the second partial
    x = _exact(num_tokens, hidden, scale=2**-3, generator=gen).to(dtype).to(DEVICE)
    weight = _exact(num_experts, hidden, scale=2**-6, generator=gen).to(dtype).to(DEVICE)
    bias = (_exact(num_experts, scale=2**-5, generator=gen).to(DEVICE)) if has_bias else None
    counter = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    args = (top_k, groups, topk_group, scoring, group_score, renorm, scale, is_float32_logits)
    weights, ids = routing.router_topk(x, weight, bias, counter, *args)
    logits = x.float() @ weight.float().T  # exact
    if not is_float32_logits and dtype != torch.float32:
        logits = logits.to(dtype).float()
    want_weights, want_ids = routing.grouped_topk(logits.contiguous(), bias, top_k, groups, topk_group, scoring,
                                                  group_score, renorm, scale)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_weights, rtol=1e-6, atol=0)
    assert int(counter[0]) == 0  # reset by the last program: the launch can be replayed
    again = routing.router_topk(x, weight, bias, counter, *args)
    assert torch.equal(again[0], weights) and torch.equal(again[1], ids)
    ref_weights, ref_ids = routing.router_topk_reference(x, weight, bias, counter, *args)  # PyTorch, sorted top-k
    torch.testing.assert_close(weights.sort(dim=1).values, ref_weights.to(weights.device).sort(dim=1).values)


def test_router_topk_rejects_prefill_sized_steps_and_bad_counters():
    x = torch.zeros(routing.MAX_FUSED_TOKENS + 1, 64, device=DEVICE)
    weight = torch.zeros(16, 64, device=DEVICE)
    counter = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="tokens"):
        routing.router_topk(x, weight, None, counter, 2, 1, 1, "softmax", "none", True, 1.0, True)
    with pytest.raises(ValueError, match="counter"):
        routing.router_topk(x[:1], weight, None, counter.long(), 2, 1, 1, "softmax", "none", True, 1.0, True)
