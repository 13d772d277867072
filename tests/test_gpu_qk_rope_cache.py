"""GQA's fused per-token preparation (`gpu_layers.qk_rope_cache`: QK-norm, rotary, KV-cache write in one launch)
against the unfused kernels and the PyTorch reference, on the GPU or under Triton's interpreter: one token and
several, padding rows (slot -1), strided views of one QKV product, NeoX and interleaved pairs, partial rotary, with
and without the norm, a V head dim of its own."""

import pytest
import torch
from gpu_support import DEVICE

from gpu_layers import qk_rope_cache

# (tokens, q heads, kv heads, head dim, v head dim, rotary dim)
SHAPES = [(1, 32, 4, 128, 128, 128), (3, 8, 2, 64, 64, 32), (2, 4, 1, 128, 64, 128), (5, 2, 2, 256, 256, 64)]
ULP = {torch.float32: 2.0**-20, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}


def _inputs(num_tokens, num_q, num_kv, dim, v_dim, rotary_dim, dtype, has_norm):
    torch.manual_seed(num_tokens * 7 + dim)
    widths = [num_q * dim, num_kv * dim, num_kv * v_dim]
    qkv = torch.randn(num_tokens, sum(widths), device=DEVICE).to(dtype)  # q, k and v as views of one product
    q, k, v = qkv.split(widths, dim=-1)
    q, k, v = q.view(num_tokens, num_q, dim), k.view(num_tokens, num_kv, dim), v.view(num_tokens, num_kv, v_dim)
    weights = [(1 + 0.1 * torch.randn(dim, device=DEVICE)).to(dtype) if has_norm else None for _ in range(2)]
    positions = torch.randint(0, 40000, (num_tokens,), device=DEVICE)
    inv_freq = 1.0 / 1e6 ** (torch.arange(0, rotary_dim, 2, device=DEVICE).float() / rotary_dim)
    slots = torch.randperm(64, device=DEVICE)[:num_tokens]
    if num_tokens > 1:
        slots[-1] = -1  # a padding row: nothing cached
    caches = [torch.zeros(4, 16, num_kv, d, device=DEVICE, dtype=dtype) for d in (dim, v_dim)]
    return [q, k, v, *weights, 1e-6, positions, inv_freq, 1.25], caches, slots


@pytest.mark.parametrize(("dtype", "shape"), [(torch.bfloat16, s) for s in SHAPES] + [(torch.float32, SHAPES[1])])
@pytest.mark.parametrize("has_norm", [True, False])
@pytest.mark.parametrize("is_interleaved", [False, True])
def test_fused_preparation_matches_the_unfused_kernels(dtype, shape, has_norm, is_interleaved):
    args, caches, slots = _inputs(*shape, dtype, has_norm)
    results = []
    for fn in (qk_rope_cache.qk_norm_rope_cache, qk_rope_cache.qk_norm_rope_cache_unfused,
               qk_rope_cache.qk_norm_rope_cache_reference):
        k_cache, v_cache = (c.clone() for c in caches)
        q = fn(*args, is_interleaved, k_cache, v_cache, slots)
        results.append((q, k_cache, v_cache))
    fused, unfused, ref = results
    for got, want in zip(fused, unfused, strict=True):  # the same math: at most one rounding apart
        torch.testing.assert_close(got.float(), want.float(), rtol=ULP[dtype], atol=ULP[dtype])
    for got, want in zip(fused, ref, strict=True):  # torch's cos/sin: within the dtype's rounding
        torch.testing.assert_close(got.float(), want.float(), rtol=4 * ULP[dtype], atol=4 * ULP[dtype])
    assert torch.equal(fused[2], unfused[2])  # v is copied as it is
    if shape[0] > 1:  # the padding row's k and v went nowhere: the untouched slots still hold zeros
        assert int((fused[1].flatten(0, 1).abs().sum((1, 2)) > 0).sum()) == shape[0] - 1


def test_rejects_unsupported_shapes():
    args, (k_cache, v_cache), slots = _inputs(1, 4, 2, 128, 128, 128, torch.float32, True)
    with pytest.raises(ValueError, match="q_weight and k_weight"):
        qk_rope_cache.qk_norm_rope_cache(*args[:3], args[3], None, *args[5:], False, k_cache, v_cache, slots)
    with pytest.raises(ValueError, match="slot_mapping"):
        qk_rope_cache.qk_norm_rope_cache(*args, False, k_cache, v_cache, slots.int())
