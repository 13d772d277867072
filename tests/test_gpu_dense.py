"""The small dense kernels (RMSNorm, SiLU-and-mul, rotary, MoE routing, KV-cache write) against their plain-PyTorch
references: under Triton's interpreter on CPU here, on CUDA on a GPU machine. Awkward shapes on purpose (one
token, odd sizes, strided views, page boundaries, skipped slots); full-size shapes only on a GPU."""

import pytest
import torch
from gpu_support import DEVICE, IS_INTERPRETED, poisoned

from gpu_layers import activation, kv_cache, norm, rotary, routing
from hybrid.config import RopeConfig
from hybrid.layers.rotary import rope_inv_freq

DTYPES = [torch.float32, torch.bfloat16]
# A few rounding flips of the last bit (rsqrt / exp / cos differ in their last float32 bits), nothing more.
TOLERANCE = {torch.float32: {"rtol": 1e-5, "atol": 1e-5}, torch.bfloat16: {"rtol": 1.6e-2, "atol": 1.6e-2}}


def randn(*shape, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, device=DEVICE) * scale).to(dtype)


def rel_error(actual, expected):
    return ((actual.float() - expected.float()).norm() / expected.float().norm()).item()


# --- RMSNorm ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_rows, hidden", [(1, 100), (5, 64), (40, 64), (3, 7168), (4, 129)])
def test_rms_norm(dtype, num_rows, hidden):
    torch.manual_seed(hidden)
    x, weight = randn(num_rows, hidden, dtype=dtype, scale=3.0), randn(hidden, dtype=dtype)
    out = poisoned(num_rows, hidden, dtype=dtype)
    assert norm.rms_norm(x, weight, 1e-6, out=out) is out
    torch.testing.assert_close(out, norm.rms_norm_reference(x, weight, 1e-6), **TOLERANCE[dtype])
    assert rel_error(out, norm.rms_norm_reference(x, weight, 1e-6)) < (1e-6 if dtype == torch.float32 else 4e-3)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_fused_residual(dtype):
    torch.manual_seed(0)
    x, residual, weight = randn(3, 1000, dtype=dtype), randn(3, 1000, dtype=dtype), randn(1000, dtype=dtype)
    ref_residual = residual.clone()
    expected = norm.rms_norm_reference(x, weight, 1e-5, ref_residual)
    out = norm.rms_norm(x, weight, 1e-5, residual, out=poisoned(3, 1000, dtype=dtype))
    assert torch.equal(residual, ref_residual)  # x + residual, rounded to the dtype, written in place
    torch.testing.assert_close(out, expected, **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_per_head_rows_of_a_strided_view(dtype):
    """QK-norm: rows of [T * heads, D] taken from a wider buffer (row stride > D)."""
    torch.manual_seed(1)
    qkv = randn(2 * 5, 3 * 128, dtype=dtype)
    q = qkv[:, :128]  # [T * heads, D], row stride 384
    weight = randn(128, dtype=dtype)
    out = norm.rms_norm(q, weight, 1e-6)
    torch.testing.assert_close(out, norm.rms_norm_reference(q.contiguous(), weight, 1e-6), **TOLERANCE[dtype])


def test_rms_norm_reference_and_argument_checks():
    x, weight = randn(2, 96, dtype=torch.bfloat16), randn(96, dtype=torch.bfloat16)
    exact = x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-6) * weight.double()
    torch.testing.assert_close(norm.rms_norm_reference(x, weight, 1e-6).double(), exact, rtol=2e-2, atol=2e-2)
    with pytest.raises(ValueError, match="weight"):
        norm.rms_norm(x, weight.float(), 1e-6)
    with pytest.raises(ValueError, match="x must be"):
        norm.rms_norm(x.t(), weight, 1e-6)
    with pytest.raises(ValueError, match="residual"):
        norm.rms_norm(x, weight, 1e-6, residual=x[:1])


# --- SiLU and mul --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens, intermediate", [(1, 5), (4, 64), (3, 1000), (2, 2500)])
def test_silu_and_mul(dtype, num_tokens, intermediate):
    torch.manual_seed(intermediate)
    gate_up = randn(num_tokens, 2 * intermediate, dtype=dtype, scale=4.0)
    out = poisoned(num_tokens, intermediate, dtype=dtype)
    activation.silu_and_mul(gate_up, out=out)
    torch.testing.assert_close(out, activation.silu_and_mul_reference(gate_up), **TOLERANCE[dtype])


def test_silu_and_mul_strided_rows_and_argument_checks():
    wide = randn(3, 2 * 48 + 7, dtype=torch.bfloat16)
    gate_up = wide[:, : 2 * 48]
    out = activation.silu_and_mul(gate_up)
    torch.testing.assert_close(out, activation.silu_and_mul_reference(gate_up), **TOLERANCE[torch.bfloat16])
    with pytest.raises(ValueError, match="gate_up"):
        activation.silu_and_mul(wide)  # odd width
    with pytest.raises(ValueError, match="out"):
        activation.silu_and_mul(gate_up, out=out.float())


# --- Rotary --------------------------------------------------------------------------------------------------------

def yarn_inv_freq(rotary_dim: int) -> tuple[torch.Tensor, float]:
    """DeepSeek-V3's YaRN: interpolation ramp between the extrapolated and interpolated frequencies."""
    rope = RopeConfig(theta=10000.0, rotary_dim=rotary_dim, is_interleaved=True, scaling_type="yarn", factor=40.0,
                      original_max_position=4096, mscale=1.0, mscale_all_dim=1.0)
    return rope_inv_freq(rope)


def default_inv_freq(rotary_dim: int, theta: float = 10000.0) -> tuple[torch.Tensor, float]:
    return rope_inv_freq(RopeConfig(theta=theta, rotary_dim=rotary_dim, is_interleaved=False))


ROTARY_CASES = {
    # name: (num_q_heads, num_k_heads, head_dim, inv_freq and attention factor, is_interleaved)
    "qwen3 neox full": (3, 1, 128, default_inv_freq(128, 1e6), False),
    "partial 64 of 128": (5, 2, 128, default_inv_freq(64), False),
    "glm half rotary": (70, 3, 128, default_inv_freq(64), False),  # 70 heads: two head blocks
    "dsv3 yarn interleaved": (7, 1, 64, yarn_inv_freq(64), True),
    "interleaved partial": (2, 2, 96, (default_inv_freq(32)[0], 0.8), True),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(ROTARY_CASES))
def test_rotary(dtype, case):
    num_q, num_k, head_dim, (inv_freq, attention_factor), is_interleaved = ROTARY_CASES[case]
    torch.manual_seed(num_q)
    positions = torch.tensor([0, 1, 17, 4095, 131071, 500000], device=DEVICE)
    q, k = randn(6, num_q, head_dim, dtype=dtype), randn(6, num_k, head_dim, dtype=dtype)
    ref_q, ref_k = q.clone(), k.clone()
    inv_freq = inv_freq.to(DEVICE)
    rotary.rotary_reference(positions, ref_q, ref_k, inv_freq, attention_factor, is_interleaved)
    rotary.rotary_embedding(positions, q, k, inv_freq, attention_factor, is_interleaved)
    rotary_dim = 2 * inv_freq.shape[0]
    for ours, ref in ((q, ref_q), (k, ref_k)):
        assert torch.equal(ours[..., rotary_dim:], ref[..., rotary_dim:])  # dims past R untouched
        torch.testing.assert_close(ours, ref, **TOLERANCE[dtype])
        assert rel_error(ours, ref) < (1e-6 if dtype == torch.float32 else 4e-3)


@pytest.mark.parametrize("is_interleaved", [False, True])
def test_rotary_reference_rotates_pairs_as_complex_numbers(is_interleaved):
    """Each pair (i, i + R/2), or (2i, 2i+1) when interleaved, turns by position * inv_freq[i] like a complex number
    (scaled by the YaRN factor); the results come out as halves, the dims past R unchanged."""
    inv_freq, attention_factor = yarn_inv_freq(32)
    positions = torch.tensor([3, 0, 70000])
    q, k = torch.randn(3, 4, 48), torch.randn(3, 2, 48)
    expected = []
    for x in (q, k):
        rot = x[..., :32].double()
        x1, x2 = (rot[..., 0::2], rot[..., 1::2]) if is_interleaved else (rot[..., :16], rot[..., 16:])
        # angles in float32, as every implementation computes them (at 70000 their rounding shows)
        angle = (positions[:, None, None].float() * inv_freq).double()  # [T, 1, R/2]
        turned = torch.complex(x1, x2) * torch.polar(torch.full_like(angle, attention_factor), angle)
        expected.append(torch.cat((turned.real, turned.imag, x[..., 32:].double()), dim=-1))
    rotary.rotary_reference(positions, q, k, inv_freq, attention_factor, is_interleaved)
    for got, want in zip((q, k), expected, strict=True):
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_on_strided_views_single_token(dtype):
    """MLA's q_rope is the tail of each head of q [T, H, 192]; k_rope a [T, 1, 64] slice of the latent."""
    torch.manual_seed(2)
    q_full, latent = randn(1, 4, 192, dtype=dtype), randn(1, 1, 576, dtype=dtype)
    q, k = q_full[..., 128:], latent[..., 512:]
    ref_full, ref_latent = q_full.clone(), latent.clone()
    inv_freq, attention_factor = yarn_inv_freq(64)
    inv_freq, positions = inv_freq.to(DEVICE), torch.tensor([12345], device=DEVICE)
    rotary.rotary_reference(positions, ref_full[..., 128:], ref_latent[..., 512:], inv_freq, attention_factor, True)
    rotary.rotary_embedding(positions, q, k, inv_freq, attention_factor, True)
    assert torch.equal(q_full[..., :128], ref_full[..., :128]) and torch.equal(latent[..., :512], ref_latent[..., :512])
    torch.testing.assert_close(q_full, ref_full, **TOLERANCE[dtype])
    torch.testing.assert_close(latent, ref_latent, **TOLERANCE[dtype])


# --- Routing -------------------------------------------------------------------------------------------------------

def distinct_logits(num_tokens, num_experts, dtype=torch.float32):
    """Per token a permutation of evenly spaced values, exact in bf16: no ties among scores or group sums."""
    ranks = torch.stack([torch.randperm(num_experts) for _ in range(num_tokens)]).float()
    return (ranks * (8.0 / num_experts) - 4.0).to(dtype).to(DEVICE)


def assert_same_routing(weights, ids, ref_weights, ref_ids):
    """Same id set per token, and the weights matched by id (the order within a token may differ)."""
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    ids, ref_ids = ids.long(), ref_ids.long()
    assert torch.equal(ids.sort(dim=1).values, ref_ids.sort(dim=1).values)
    order, ref_order = ids.argsort(dim=1), ref_ids.argsort(dim=1)
    torch.testing.assert_close(weights.gather(1, order), ref_weights.gather(1, ref_order), rtol=1e-5, atol=1e-6)


def routing_out(num_tokens, top_k):
    return poisoned(num_tokens, top_k), torch.full((num_tokens, top_k), -1, dtype=torch.int32, device=DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens, num_experts, top_k, renormalize",
                         [(1, 8, 2, True), (5, 128, 8, True), (3, 128, 8, False), (2, 60, 4, True)])
def test_softmax_topk(dtype, num_tokens, num_experts, top_k, renormalize):
    torch.manual_seed(num_experts)
    logits = distinct_logits(num_tokens, num_experts, dtype)
    weights, ids = routing.softmax_topk(logits, top_k, renormalize, out=routing_out(num_tokens, top_k))
    assert_same_routing(weights, ids, *routing.softmax_topk_reference(logits, top_k, renormalize))


GROUPED_CASES = {
    # name: (num_experts, has_bias, top_k, num_groups, topk_group, scoring, group_score, renormalize, scale)
    "dsv3": (256, True, 8, 8, 4, "sigmoid", "top2_sum", True, 2.5),
    "glm45 one group": (160, True, 8, 1, 1, "sigmoid", "top2_sum", True, 1.0),
    "dsv2 max": (64, False, 6, 8, 3, "softmax", "max", False, 16.0),
    "no groups": (32, True, 4, 1, 1, "sigmoid", "none", False, 1.0),
    "softmax top2_sum": (48, False, 3, 4, 2, "softmax", "top2_sum", True, 1.0),
}


@pytest.mark.parametrize("case", list(GROUPED_CASES))
@pytest.mark.parametrize("num_tokens", [1, 6])
def test_grouped_topk(case, num_tokens):
    num_experts, has_bias, *args = GROUPED_CASES[case]
    torch.manual_seed(num_experts + num_tokens)
    logits = distinct_logits(num_tokens, num_experts) + randn(num_tokens, num_experts, scale=1e-3)
    bias = randn(num_experts, scale=0.5) if has_bias else None
    weights, ids = routing.grouped_topk(logits, bias, *args, out=routing_out(num_tokens, args[0]))
    assert_same_routing(weights, ids, *routing.grouped_topk_reference(logits, bias, *args))


def test_routing_ties_go_to_the_lowest_expert():
    """Four experts tie for the top-3 (positive scores; then negative choices, a bias below the sigmoid's 0.5): the
    lowest three win, whatever the reduction's lane order; weights are the tied experts' scores."""
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.5, 3.0, -2.0, 3.0, 0.0]], device=DEVICE)
    weights, ids = routing.softmax_topk(logits, 3, False, out=routing_out(1, 3))
    assert sorted(ids[0].tolist()) == [1, 2, 4]
    torch.testing.assert_close(weights, torch.softmax(logits, -1)[:, [1, 2, 4]], rtol=1e-6, atol=0)
    bias = torch.tensor([-2.0, -1.5, -1.5, -3.0, -1.5, -2.0, -4.0, -1.5], device=DEVICE)
    weights, ids = routing.grouped_topk(torch.zeros(1, 8, device=DEVICE), bias, 3, 1, 1, "sigmoid", "none", False,
                                        1.0, out=routing_out(1, 3))
    assert sorted(ids[0].tolist()) == [1, 2, 4] and torch.equal(weights, torch.full_like(weights, 0.5))


def test_routing_argument_checks():
    logits = distinct_logits(2, 16)
    with pytest.raises(ValueError, match="top_k"):
        routing.softmax_topk(logits, 17, True)
    with pytest.raises(ValueError, match="logits must be float32"):
        routing.grouped_topk(logits.bfloat16(), None, 2, 4, 2, "sigmoid", "max", True, 1.0)
    with pytest.raises(ValueError, match="num_groups"):
        routing.grouped_topk(logits, None, 2, 3, 2, "sigmoid", "max", True, 1.0)
    with pytest.raises(ValueError, match="correction_bias"):
        routing.grouped_topk(logits, torch.zeros(15, device=DEVICE), 2, 4, 2, "sigmoid", "max", True, 1.0)


# --- KV-cache write ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_heads, dim", [(1, 576), (3, 576), (2, 128), (3, 64), (1, 80)])
def test_write_kv_cache(dtype, num_heads, dim):
    torch.manual_seed(dim)
    cache = poisoned(5, 4, num_heads, dim, dtype=dtype)  # block_size 4: slots 3|4 and 15|16 cross pages
    qkv = randn(7, 3 * num_heads, dim, dtype=dtype)
    values = qkv[:, num_heads : 2 * num_heads]  # strided along tokens, as k inside a fused qkv
    slots = torch.tensor([3, 4, 15, -1, 16, 0, 19], device=DEVICE)
    expected = cache.clone()
    kv_cache.write_kv_cache_reference(expected, values, slots)
    kv_cache.write_kv_cache(cache, values, slots)
    torch.testing.assert_close(cache, expected, rtol=0, atol=0, equal_nan=True)
    assert cache.view(-1, num_heads, dim)[slots[slots >= 0]].isfinite().all()
    assert cache.isnan().sum() == (20 - 6) * num_heads * dim  # the -1 slot wrote nothing


def test_write_kv_cache_argument_checks():
    cache = poisoned(2, 4, 1, 64)
    with pytest.raises(ValueError, match="values"):
        kv_cache.write_kv_cache(cache, randn(3, 1, 64, dtype=torch.bfloat16), torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="slot_mapping"):
        kv_cache.write_kv_cache(cache, randn(3, 1, 64), torch.zeros(3, dtype=torch.int32, device=DEVICE))


# --- Full-size shapes (GPU only) -----------------------------------------------------------------------------------

needs_gpu = pytest.mark.skipif(IS_INTERPRETED, reason="needs a GPU")


@needs_gpu
@pytest.mark.parametrize("hidden", [7168, 5120, 4096, 2048])
def test_full_size_rms_norm_and_silu(hidden):
    x, residual, weight = (randn(4096, hidden, dtype=torch.bfloat16), randn(4096, hidden, dtype=torch.bfloat16),
                           randn(hidden, dtype=torch.bfloat16))
    ref_residual = residual.clone()
    expected = norm.rms_norm_reference(x, weight, 1e-6, ref_residual)
    out = norm.rms_norm(x, weight, 1e-6, residual)
    assert torch.equal(residual, ref_residual)
    assert rel_error(out, expected) < 4e-3
    gate_up = randn(2048, 2 * 18432, dtype=torch.bfloat16, scale=3.0)
    assert rel_error(activation.silu_and_mul(gate_up), activation.silu_and_mul_reference(gate_up)) < 4e-3


@needs_gpu
def test_full_size_rotary_routing_and_cache():
    positions = torch.randint(0, 160000, (4096,), device=DEVICE)
    inv_freq, factor = yarn_inv_freq(64)
    q, k = randn(4096, 128, 64, dtype=torch.bfloat16), randn(4096, 1, 64, dtype=torch.bfloat16)
    ref_q, ref_k = q.clone(), k.clone()
    rotary.rotary_reference(positions, ref_q, ref_k, inv_freq.to(DEVICE), factor, True)
    rotary.rotary_embedding(positions, q, k, inv_freq.to(DEVICE), factor, True)
    assert rel_error(q, ref_q) < 4e-3 and rel_error(k, ref_k) < 4e-3

    logits, bias = distinct_logits(4096, 256) + randn(4096, 256, scale=1e-3), randn(256, scale=0.5)
    args = (8, 8, 4, "sigmoid", "top2_sum", True, 2.5)
    expected = routing.grouped_topk_reference(logits, bias, *args)
    assert_same_routing(*routing.grouped_topk(logits, bias, *args), *expected)
    qwen = distinct_logits(4096, 128, torch.bfloat16)
    assert_same_routing(*routing.softmax_topk(qwen, 8, True), *routing.softmax_topk_reference(qwen, 8, True))

    cache = poisoned(512, 64, 1, 576, dtype=torch.bfloat16)
    latents = randn(4096, 1, 576, dtype=torch.bfloat16)
    slots = torch.randperm(512 * 64, device=DEVICE)[:4096]
    slots[::7] = -1
    expected = cache.clone()
    kv_cache.write_kv_cache_reference(expected, latents, slots)
    kv_cache.write_kv_cache(cache, latents, slots)
    torch.testing.assert_close(cache, expected, rtol=0, atol=0, equal_nan=True)
