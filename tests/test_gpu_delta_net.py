"""gpu_layers.delta_net (Gated DeltaNet conv1d, chunked prefill, recurrent decode) against
gpu_layers.delta_net_reference, and the references against transformers' Qwen3-Next functions.

Outputs start as NaN (an unwritten element fails); state slots no sequence names are NaN too (a kernel that
writes a wrong slot, or reads one it should not, fails). The chunked prefill works in chunks of 64 tokens made of
blocks of 16: lengths sit on both sides of both boundaries, and sequences resume mid-chunk."""

import pytest
import torch
import torch.nn.functional as F
from gpu_support import DEVICE, poisoned
from transformers.models.qwen3_next import modeling_qwen3_next as hf

from gpu_layers import delta_net
from gpu_layers import delta_net_reference as ref

RAGGED = [1, 5, 64, 65, 130]
BOUNDARIES = [2, 15, 16, 17, 31, 33, 47, 48, 49, 63, 127, 128, 129]  # around every block of 16 and chunk of 64
NUM_SLOTS = 8


def make_inputs(lens, num_k_heads=1, num_v_heads=2, head_dim=64, dtype=torch.float32, seed=0, is_slow=False):
    """Packed q, k [T, Hk, D], v [T, Hv, D], g, beta [T, Hv] float32 as the model makes them, and cu_seqlens.
    `is_slow`: keys close to one another (cosine about 0.9), beta near 1 and gates near 0, the hard case of the
    chunk's triangular solve (its power series has terms like 1.9^63)."""
    gen = torch.Generator().manual_seed(seed)
    num_tokens = sum(lens)
    q, k = (torch.randn(num_tokens, num_k_heads, head_dim, generator=gen) for _ in range(2))
    v = torch.randn(num_tokens, num_v_heads, head_dim, generator=gen)
    a = torch.randn(num_tokens, num_v_heads, generator=gen)
    g = -torch.rand(num_v_heads, generator=gen).mul(4).exp() * F.softplus(a + 1.0)
    beta = torch.randn(num_tokens, num_v_heads, generator=gen).sigmoid()
    if is_slow:
        k = torch.randn(1, num_k_heads, head_dim, generator=gen) * 2 + k * 0.6
        g, beta = g * 0.002, beta * 0.1 + 0.9
    cu_seqlens = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    return ([x.to(DEVICE, dtype) for x in (q, k, v)] + [x.to(DEVICE) for x in (g, beta)] +
            [cu_seqlens.to(DEVICE)])


def make_state_pool(num_v_heads, head_dim, slots, seed=1):
    """NaN everywhere but the named slots, which hold a random state."""
    gen = torch.Generator().manual_seed(seed)
    pool = torch.full((NUM_SLOTS, num_v_heads, head_dim, head_dim), float("nan"))
    for slot in slots:
        pool[slot] = torch.randn(num_v_heads, head_dim, head_dim, generator=gen) * 0.1
    return pool.to(DEVICE)


def int32(values):
    return torch.tensor(values, dtype=torch.int32, device=DEVICE)


def check(out, expected, dtype, what="output"):
    assert not out.isnan().any(), f"unwritten or NaN {what}"
    if dtype == torch.float32:
        torch.testing.assert_close(out.float(), expected.float(), atol=2e-4, rtol=2e-4, msg=what)
    else:
        error = (out.float() - expected.float()).norm() / expected.float().norm()
        assert error < 2e-2, f"{what}: relative error {error:.2e}"


def run_prefill(lens, slots, has_initial, dtype=torch.float32, num_k_heads=1, num_v_heads=2, head_dim=64, seed=0,
                is_slow=False, prefill=delta_net.gated_delta_rule_prefill):
    """The kernel and the reference over the same inputs and pools; compares outputs and the named slots."""
    q, k, v, g, beta, cu_seqlens = make_inputs(lens, num_k_heads, num_v_heads, head_dim, dtype, seed, is_slow)
    pool = make_state_pool(num_v_heads, head_dim, slots)
    expected_pool = pool.clone()
    slots_t, initial_t = int32(slots), torch.tensor(has_initial, device=DEVICE)
    scale = head_dim**-0.5
    out = prefill(q, k, v, g, beta, cu_seqlens, pool, slots_t, initial_t, scale, out=poisoned(*v.shape, dtype=dtype))
    expected = ref.gated_delta_rule_prefill(q, k, v, g, beta, cu_seqlens, expected_pool, slots_t, initial_t, scale)
    check(out, expected, dtype)
    check(pool[slots], expected_pool[slots], dtype, "final state")  # bf16 inputs: bf16 dots read the state
    return out, pool


# ------------------------------------------------------------------------------------------- delta rule


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_ragged_batch(dtype):
    run_prefill(RAGGED, [3, 0, 6, 1, 5], [True, False, True, False, True], dtype)


def test_prefill_chunk_boundaries():
    """Every length around the blocks of 16 and chunks of 64, fresh and resumed, in one ragged batch (slots reused
    across two halves)."""
    half = len(BOUNDARIES) // 2
    for lens in (BOUNDARIES[:half], BOUNDARIES[half:]):
        run_prefill(lens, list(range(len(lens))), [i % 2 == 0 for i in range(len(lens))], num_v_heads=1, seed=len(lens))


def test_prefill_gqa_heads_and_dims():
    """Dk = Dv = 128 (the served shape) runs chunked in bf16; float32 there takes the token-sequential kernel."""
    run_prefill([70, 9], [2, 4], [True, True], torch.bfloat16, num_k_heads=2, num_v_heads=4, head_dim=128)


def test_prefill_long_sequence_and_slow_decay():
    """2K tokens (32 chunks of state carried in float32) and a chunk of near-parallel keys with gates near 0."""
    run_prefill([2048], [1], [True], num_v_heads=1, seed=11)
    run_prefill([100, 64], [0, 7], [False, True], is_slow=True, seed=12)


def test_sequential_baseline():
    """The token-by-token kernel the benchmark compares the chunked one with."""
    run_prefill([1, 70], [3, 0], [True, False], prefill=delta_net.gated_delta_rule_prefill_sequential)


@pytest.mark.parametrize("first", [1, 10, 63, 64, 100])
def test_state_carried_across_calls_equals_one_call(first):
    """Two calls (first tokens, then the rest, resuming) put the second call's chunk boundaries at a different
    offset of the sequence; the result must equal one call over the whole sequence."""
    total = first + 70
    q, k, v, g, beta, _ = make_inputs([total], seed=3)
    pool = make_state_pool(2, 64, [])
    slot, scale = int32([5]), 64**-0.5
    whole = delta_net.gated_delta_rule_prefill(q, k, v, g, beta, int32([0, total]), pool, slot,
                                               torch.tensor([False], device=DEVICE), scale)
    whole_state = pool[5].clone()
    parts = []
    for lo, hi, resume in ((0, first, False), (first, total, True)):
        parts.append(delta_net.gated_delta_rule_prefill(q[lo:hi], k[lo:hi], v[lo:hi], g[lo:hi], beta[lo:hi],
                                                        int32([0, hi - lo]), pool, slot,
                                                        torch.tensor([resume], device=DEVICE), scale))
    check(torch.cat(parts), whole, torch.float32)
    check(pool[5], whole_state, torch.float32, "final state")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_with_padding_rows(dtype):
    slots = [4, -1, 0, 7]
    q, k, v, g, beta, _ = make_inputs([1] * len(slots), num_k_heads=2, num_v_heads=4, dtype=dtype, seed=5)
    pool = make_state_pool(4, 64, [s for s in slots if s >= 0])
    expected_pool = pool.clone()
    scale = 64**-0.5
    out = delta_net.gated_delta_rule_decode(q, k, v, g, beta, pool, int32(slots), scale,
                                            out=poisoned(*v.shape, dtype=dtype))
    expected = ref.gated_delta_rule_decode(q, k, v, g, beta, expected_pool, int32(slots), scale)
    check(out, expected, dtype)
    assert (out[1] == 0).all(), "a padding row's output is zero"
    for slot in (1, 2, 3, 5, 6):  # unnamed slots stay NaN: nothing was written there
        assert pool[slot].isnan().all()
    check(pool[[4, 0, 7]], expected_pool[[4, 0, 7]], torch.float32, "state")


def test_decode_continues_prefill():
    """Prefill of n tokens then one decode step equals prefill of n + 1 tokens."""
    q, k, v, g, beta, _ = make_inputs([66], seed=7)
    scale = 64**-0.5
    pool = make_state_pool(2, 64, [])
    no = torch.tensor([False], device=DEVICE)
    whole = delta_net.gated_delta_rule_prefill(q, k, v, g, beta, int32([0, 66]), pool, int32([2]), no, scale)
    delta_net.gated_delta_rule_prefill(q[:65], k[:65], v[:65], g[:65], beta[:65], int32([0, 65]), pool,
                                       int32([1]), no, scale)
    last = delta_net.gated_delta_rule_decode(q[65:], k[65:], v[65:], g[65:], beta[65:], pool, int32([1]), scale)
    check(last, whole[65:], torch.float32)
    check(pool[1], pool[2], torch.float32, "state")


# ------------------------------------------------------------------------------------------- conv1d


def make_conv(lens, num_channels=40, dtype=torch.float32, has_bias=True, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(lens), num_channels, generator=gen).to(DEVICE, dtype)
    weight = torch.randn(num_channels, 4, generator=gen).to(DEVICE, dtype)
    bias = torch.randn(num_channels, generator=gen).to(DEVICE, dtype) if has_bias else None
    pool = torch.full((NUM_SLOTS, num_channels, 3), float("nan"))
    pool[:] = torch.randn(NUM_SLOTS, num_channels, 3, generator=gen)
    return x, weight, bias, pool.to(DEVICE, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("has_bias", [True, False])
def test_conv_prefill_ragged_batch(dtype, has_bias):
    lens = [1, 2, 5, 17, 40]
    slots, has_initial = [3, 0, 6, 1, 5], [True, False, True, True, False]
    x, weight, bias, pool = make_conv(lens, dtype=dtype, has_bias=has_bias)
    expected_pool = pool.clone()
    cu_seqlens = int32([0, *torch.tensor(lens).cumsum(0).tolist()])
    args = (cu_seqlens, pool, int32(slots), torch.tensor(has_initial, device=DEVICE))
    out = delta_net.causal_conv1d_prefill(x, weight, bias, *args, out=poisoned(*x.shape, dtype=dtype))
    expected = ref.causal_conv1d_prefill(x, weight, bias, cu_seqlens, expected_pool, *args[2:])
    check(out, expected, dtype)
    torch.testing.assert_close(pool, expected_pool)  # the named slots updated, the others untouched


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_conv_decode_with_padding_rows(dtype):
    slots = [2, -1, 7]
    x, weight, bias, pool = make_conv([1, 1, 1], dtype=dtype, seed=4)
    expected_pool = pool.clone()
    out = delta_net.causal_conv1d_decode(x, weight, bias, pool, int32(slots), out=poisoned(*x.shape, dtype=dtype))
    expected = ref.causal_conv1d_decode(x, weight, bias, expected_pool, int32(slots))
    check(out, expected, dtype)
    assert (out[1] == 0).all()
    torch.testing.assert_close(pool, expected_pool)


def test_conv_state_carried_across_calls():
    """Prefill 2 tokens (shorter than the state), then 3, then decode one, equals one prefill of 6."""
    x, weight, bias, pool = make_conv([6], seed=6)
    whole = delta_net.causal_conv1d_prefill(x, weight, bias, int32([0, 6]), pool, int32([0]),
                                            torch.tensor([False], device=DEVICE))
    parts = []
    for lo, hi, resume in ((0, 2, False), (2, 5, True)):
        parts.append(delta_net.causal_conv1d_prefill(x[lo:hi], weight, bias, int32([0, hi - lo]), pool, int32([1]),
                                                     torch.tensor([resume], device=DEVICE)))
    parts.append(delta_net.causal_conv1d_decode(x[5:], weight, bias, pool, int32([1])))
    check(torch.cat(parts), whole, torch.float32)
    check(pool[1], pool[0], torch.float32, "conv state")


# ------------------------------------------------------------------------------------------- references


def _hf_layout(q, k, v, g, beta, num_v_heads):
    """Our packed single sequence -> transformers' [1, L, H, D] with q/k repeated to the v heads."""
    group = num_v_heads // q.shape[1]
    return [x.float().cpu()[None] for x in (q.repeat_interleave(group, 1), k.repeat_interleave(group, 1), v, g, beta)]


@pytest.mark.parametrize("length", [70, 2048])
def test_reference_matches_transformers_delta_rule(length):
    """Our token-by-token reference, resuming from a state, against transformers' chunked and recurrent forms
    (float32; 2K tokens at small heads runs in about a second)."""
    head_dim = 16 if length > 1000 else 32
    q, k, v, g, beta, cu_seqlens = (x.cpu() for x in make_inputs([length], 1, 2, head_dim, seed=9))
    pool = make_state_pool(2, head_dim, [3]).cpu()
    initial = pool[3].clone()
    out = ref.gated_delta_rule_prefill(q, k, v, g, beta, cu_seqlens, pool, torch.tensor([3], dtype=torch.int32),
                                       torch.tensor([True]), head_dim**-0.5)
    inputs = _hf_layout(q, k, v, g, beta, 2)
    for fn in (hf.torch_chunk_gated_delta_rule, hf.torch_recurrent_gated_delta_rule):
        hf_out, hf_state = fn(*inputs[:3], g=inputs[3], beta=inputs[4], initial_state=initial[None].clone(),
                              output_final_state=True, use_qk_l2norm_in_kernel=True)
        torch.testing.assert_close(out, hf_out[0], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(pool[3], hf_state[0], atol=1e-4, rtol=1e-4)


def test_reference_matches_transformers_conv():
    x, weight, bias, pool = (t if t is None else t.cpu() for t in make_conv([9], seed=2))
    pool[0] = 0
    out = ref.causal_conv1d_prefill(x[:8], weight, bias, torch.tensor([0, 8], dtype=torch.int32), pool,
                                    torch.tensor([0], dtype=torch.int32), torch.tensor([False]))
    hf_out = hf.causal_conv1d_fn(x[:8].T[None], weight, bias, activation="silu")
    torch.testing.assert_close(out, hf_out[0].T)
    hf_state = torch.zeros(1, 40, 3)
    hf.causal_conv1d_update(x[:8].T[None].contiguous(), hf_state, weight, bias, activation="silu")
    torch.testing.assert_close(pool[0], hf_state[0])
    step = ref.causal_conv1d_decode(x[8:], weight, bias, pool, torch.tensor([0], dtype=torch.int32))
    hf_step = hf.causal_conv1d_update(x[8:].T[None].contiguous(), hf_state, weight, bias, activation="silu")
    torch.testing.assert_close(step, hf_step[0].T)
    torch.testing.assert_close(pool[0], hf_state[0])
