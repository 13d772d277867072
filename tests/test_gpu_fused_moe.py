"""gpu_layers.fused_moe against its plain-PyTorch reference: bf16/fp16 and FP8 (per-channel and 128x128 block
scales) experts, gpt-oss's clamped activation with biases, the align step, ids that are not local, awkward shapes,
and the launcher's argument checks."""

import pytest
import torch
import triton
from gpu_support import DEVICE, IS_INTERPRETED, poisoned

from gpu_layers import fused_moe as fm


def make_experts(num_experts, hidden_size, inter, seed=0):
    """Float32 weights [E, 2I, H], [E, H, I] scaled so that act and the output are O(1). Rows and columns get
    magnitudes a few times apart, so FP8 scales differ from block to block and a mixed-up scale shows."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)

    def weight(rows, cols):
        w = torch.randn(num_experts, rows, cols, generator=gen, device=DEVICE) / cols**0.5
        row_scale = torch.randn(num_experts, rows, 1, generator=gen, device=DEVICE).mul(0.7).exp()
        col_scale = torch.randn(num_experts, 1, cols, generator=gen, device=DEVICE).mul(0.7).exp()
        return w * row_scale * col_scale

    return weight(2 * inter, hidden_size), weight(hidden_size, inter)


def make_routing(num_tokens, top_k, num_experts, num_skipped=0, seed=0):
    """Distinct experts per token (like a router's top-k), normalized weights, `num_skipped` ids set to -1."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.rand(num_tokens, num_experts, generator=gen).argsort(dim=1)[:, :top_k].int()
    weights = torch.rand(num_tokens, top_k, generator=gen) + 0.1
    weights /= weights.sum(dim=1, keepdim=True)
    skipped = torch.randperm(num_tokens * top_k, generator=gen)[:num_skipped]
    ids.view(-1)[skipped] = -1
    return ids.to(DEVICE), weights.to(DEVICE)


def make_hidden(num_tokens, hidden_size, dtype=torch.bfloat16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(num_tokens, hidden_size, generator=gen).to(dtype).to(DEVICE)


def quantized(w_gate_up, w_down, block_shape):
    gate_up, gate_up_scale = fm.quantize_fp8_weights(w_gate_up, block_shape)
    down, down_scale = fm.quantize_fp8_weights(w_down, block_shape)
    return gate_up, down, {"w_gate_up_scale": gate_up_scale, "w_down_scale": down_scale, "block_shape": block_shape}


def relative_error(actual, expected):
    return ((actual.float() - expected.float()).norm() / expected.float().norm()).item()


def run_and_check(hidden, w_gate_up, w_down, ids, weights, quant_args=None, capability=None, **epilogue):
    """The kernels against the reference: relative norm error 5e-3 for 16-bit weights; for FP8 1e-3 under the
    interpreter (the same arithmetic) and 2e-2 on a GPU, where Hopper's fp8 MMA adds 128 products in reduced
    precision and a changed group absmax re-rounds a whole group (the activations' own FP8 noise is ~3e-2)."""
    quant_args = {**(quant_args or {}), **epilogue}  # epilogue: activation and biases, for both
    is_fp8 = w_gate_up.dtype == torch.float8_e4m3fn
    tight = (1e-3 if IS_INTERPRETED else 2e-2) if is_fp8 else 5e-3
    expected = fm.fused_moe_reference(hidden, w_gate_up, w_down, ids, weights, **quant_args)
    out = poisoned(*hidden.shape, dtype=hidden.dtype)
    result = fm.fused_moe(hidden, w_gate_up, w_down, ids, weights, out=out, capability=capability, **quant_args)
    assert result.data_ptr() == out.data_ptr()
    # Elementwise: a pair's output is rounded to hidden's dtype before the K slots are summed, so one rounding
    # step of the largest pair output can remain where the slots cancel; hence atol relative to the largest.
    # FP8: an act element one bf16 step apart (float32 sums in another order) can move its group's absmax and
    # so the float8 rounding of the whole group; a few outputs in ten thousand then differ by more.
    atol = 2e-2 * expected.abs().max().item()
    outside = (out.float() - expected.float()).abs() > atol + 2e-2 * expected.float().abs()
    assert outside.float().mean().item() <= (1e-3 if is_fp8 else 0.0), f"{outside.sum().item()} elements differ"
    assert relative_error(out, expected) < tight
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_tokens, top_k, num_experts, num_skipped", [
    (1, 1, 4, 0), (1, 8, 16, 3), (3, 2, 8, 1), (17, 4, 4, 0), (17, 1, 16, 5), (64, 2, 16, 20), (64, 8, 8, 0),
])
def test_16bit_matches_reference(dtype, num_tokens, top_k, num_experts, num_skipped):
    """H=80, I=48: odd multiples of 16, neither divided by the tiles (BLOCK_N 64/128, BLOCK_K 64)."""
    w_gate_up, w_down = (w.to(dtype) for w in make_experts(num_experts, 80, 48))
    ids, weights = make_routing(num_tokens, top_k, num_experts, num_skipped)
    run_and_check(make_hidden(num_tokens, 80, dtype), w_gate_up, w_down, ids, weights)


@pytest.mark.parametrize("capability", [89, 90, 120])
@pytest.mark.parametrize("num_tokens", [1, 40])
def test_every_config_table(capability, num_tokens):
    """Each capability's decode and prefill tiles (SM90's BLOCK_M 128 too); H=144 leaves a K tail of 16."""
    w_gate_up, w_down = (w.bfloat16() for w in make_experts(4, 144, 112))
    ids, weights = make_routing(num_tokens, 2, 4, num_skipped=num_tokens // 8)
    run_and_check(make_hidden(num_tokens, 144), w_gate_up, w_down, ids, weights, capability=capability)


@pytest.mark.parametrize("top_k", [1, 2])
def test_all_tokens_on_one_expert(top_k):
    """One expert's run spans several row blocks; the other slot, if any, is not local."""
    w_gate_up, w_down = (w.bfloat16() for w in make_experts(8, 80, 48))
    ids = torch.full((64, top_k), -1, dtype=torch.int64, device=DEVICE)
    ids[:, 0] = 5
    weights = torch.rand(64, top_k, device=DEVICE)
    out = run_and_check(make_hidden(64, 80), w_gate_up, w_down, ids, weights)
    assert out.abs().amax() > 0.1


def test_no_local_expert_gives_zeros():
    w_gate_up, w_down = (w.bfloat16() for w in make_experts(4, 80, 48))
    ids = torch.tensor([[-1, -1], [-1, 4], [7, -1]], dtype=torch.int32, device=DEVICE)  # 4, 7: not on this GPU
    weights = torch.full((3, 2), 0.5, device=DEVICE)
    out = fm.fused_moe(make_hidden(3, 80), w_gate_up, w_down, ids, weights, out=poisoned(3, 80, dtype=torch.bfloat16))
    assert torch.equal(out, torch.zeros_like(out))


def test_ids_past_the_table_are_dropped():
    """An id >= E contributes nothing (it is never read), exactly as -1 would."""
    w_gate_up, w_down = (w.bfloat16() for w in make_experts(4, 80, 48))
    ids, weights = make_routing(9, 2, 4)
    bad = ids.clone()
    bad[::2, 1] = 4
    hidden = make_hidden(9, 80)
    expected = fm.fused_moe_reference(hidden, w_gate_up, w_down, torch.where(bad >= 4, -1, bad), weights)
    torch.testing.assert_close(fm.fused_moe(hidden, w_gate_up, w_down, bad, weights), expected, atol=3e-2, rtol=3e-2)


SWIGLU_GAIN = 6.0  # hidden scaled so that a good share of gate/up values lies beyond swiglu_oai's clamp at 7


def make_biases(num_experts, hidden_size, inter, seed=0):
    """float32 gate_up bias [E, 2I] (gate then up) and down bias [E, H], O(1) like the GEMMs' outputs."""
    gen = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(num_experts, 2 * inter, generator=gen) * 2
    return {"w_gate_up_bias": gate_up.to(DEVICE), "w_down_bias": torch.randn(num_experts, hidden_size,
                                                                             generator=gen).to(DEVICE)}


def assert_crosses_clamp(hidden, w_gate_up, biases, ids):
    """Both sides of the clamp are exercised: some pre-activations of the routed pairs lie beyond +-7, most not."""
    token, slot = torch.where(ids >= 0)
    pre = torch.einsum("ph,pnh->pn", hidden[token].float(), w_gate_up[ids[token, slot].long()].float())
    pre += biases["w_gate_up_bias"][ids[token, slot].long()]
    beyond = (pre.abs() > 7).float().mean().item()
    assert 0.05 < beyond < 0.7, beyond


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_tokens, top_k, num_experts, num_skipped", [
    (1, 2, 4, 0), (1, 4, 8, 1), (33, 4, 8, 9), (64, 2, 4, 0),
])
def test_swiglu_oai_with_biases(dtype, num_tokens, top_k, num_experts, num_skipped):
    """gpt-oss's experts: clamped activation, both biases; H=80, I=48 (masked tails); decode and prefill tiles."""
    w_gate_up, w_down = (w.to(dtype) for w in make_experts(num_experts, 80, 48, seed=num_tokens))
    ids, weights = make_routing(num_tokens, top_k, num_experts, num_skipped, seed=num_tokens)
    hidden = (make_hidden(num_tokens, 80, seed=num_tokens).float() * SWIGLU_GAIN).to(dtype)
    biases = make_biases(num_experts, 80, 48, seed=num_tokens)
    assert_crosses_clamp(hidden, w_gate_up, biases, ids)
    run_and_check(hidden, w_gate_up, w_down, ids, weights, activation=fm.SWIGLU_OAI, **biases)


@pytest.mark.parametrize("activation", [fm.SILU, fm.SWIGLU_OAI], ids=["silu", "swiglu_oai"])
@pytest.mark.parametrize("bias_names", [(), ("w_gate_up_bias",), ("w_down_bias",)])
def test_every_epilogue(activation, bias_names):
    """Each activation with no bias or one of the two (the kernels' HAS_BIAS switches are independent)."""
    w_gate_up, w_down = (w.bfloat16() for w in make_experts(8, 80, 48))
    ids, weights = make_routing(17, 2, 8, num_skipped=3)
    biases = {name: bias for name, bias in make_biases(8, 80, 48).items() if name in bias_names}
    gain = SWIGLU_GAIN if activation.kind == "swiglu_oai" else 1.0  # silu's output stays O(1) like the biases
    hidden = (make_hidden(17, 80).float() * gain).bfloat16()
    run_and_check(hidden, w_gate_up, w_down, ids, weights, activation=activation, **biases)


@pytest.mark.parametrize("capability", [89, 90, 120])
def test_swiglu_oai_every_config_table(capability):
    w_gate_up, w_down = (w.bfloat16() for w in make_experts(4, 144, 112))
    ids, weights = make_routing(40, 2, 4, num_skipped=5)
    hidden = (make_hidden(40, 144).float() * SWIGLU_GAIN).bfloat16()
    run_and_check(hidden, w_gate_up, w_down, ids, weights, capability=capability, activation=fm.SWIGLU_OAI,
                  **make_biases(4, 144, 112))


@pytest.mark.parametrize("block_shape", [None, (128, 128)])
def test_swiglu_oai_with_biases_fp8(block_shape):
    """The same epilogue after the FP8 scales; I=192: a scale block holds the last gate rows and the first up
    rows, whose biases come from the two halves of the bias row."""
    w_gate_up, w_down = make_experts(4, 256, 192, seed=5)
    ids, weights = make_routing(9, 2, 4, num_skipped=2, seed=5)
    hidden = (make_hidden(9, 256, seed=5).float() * SWIGLU_GAIN).bfloat16()
    biases = make_biases(4, 256, 192, seed=5)
    gate_up, down, quant_args = quantized(w_gate_up, w_down, block_shape)
    run_and_check(hidden, gate_up, down, ids, weights, quant_args, activation=fm.SWIGLU_OAI, **biases)


def test_activation_spec_is_checked():
    with pytest.raises(ValueError, match="activation kind"):
        fm.Activation("gelu")
    with pytest.raises(ValueError, match="limit"):
        fm.Activation("swiglu_oai", alpha=1.702)


@pytest.mark.parametrize("num_tokens, top_k, num_experts", [(1, 2, 4), (17, 8, 16), (64, 2, 8)])
def test_fp8_per_channel(num_tokens, top_k, num_experts):
    """Per-channel scales [E, N, 1], per-token activation scales; H=80, I=48 (one masked K tile of 128)."""
    w_gate_up, w_down = make_experts(num_experts, 80, 48)
    ids, weights = make_routing(num_tokens, top_k, num_experts, num_skipped=num_tokens // 3)
    hidden = make_hidden(num_tokens, 80)
    gate_up, down, quant_args = quantized(w_gate_up, w_down, None)
    out = run_and_check(hidden, gate_up, down, ids, weights, quant_args)
    unquantized = fm.fused_moe_reference(hidden.float(), w_gate_up, w_down, ids, weights)
    assert relative_error(out, unquantized) < 0.15


@pytest.mark.parametrize("hidden_size, inter, num_tokens, top_k, num_experts", [
    (256, 128, 1, 8, 8), (256, 192, 17, 2, 4), (192, 256, 9, 8, 16), (256, 128, 40, 2, 8),
])
def test_fp8_block_scales(hidden_size, inter, num_tokens, top_k, num_experts):
    """128x128 block scales and per-token per-128-column activation scales. I=192: a scale block holds the
    last gate rows and the first up rows; H=192: a half-full last activation group and scale column."""
    w_gate_up, w_down = make_experts(num_experts, hidden_size, inter, seed=num_tokens)
    ids, weights = make_routing(num_tokens, top_k, num_experts, num_skipped=num_tokens // 4)
    hidden = make_hidden(num_tokens, hidden_size)
    gate_up, down, quant_args = quantized(w_gate_up, w_down, (128, 128))
    out = run_and_check(hidden, gate_up, down, ids, weights, quant_args)
    unquantized = fm.fused_moe_reference(hidden.float(), w_gate_up, w_down, ids, weights)
    assert relative_error(out, unquantized) < 0.15


def test_fp8_block_every_config_table():
    w_gate_up, w_down = make_experts(4, 256, 128)
    gate_up, down, quant_args = quantized(w_gate_up, w_down, (128, 128))
    ids, weights = make_routing(40, 2, 4, num_skipped=5)
    for capability in (89, 90):
        run_and_check(make_hidden(40, 256), gate_up, down, ids, weights, quant_args, capability=capability)


@pytest.mark.parametrize("num_tokens, top_k, num_experts, block_m", [(37, 3, 8, 16), (1, 8, 128, 16), (300, 2, 5, 64)])
def test_align_places_every_local_pair_once(num_tokens, top_k, num_experts, block_m):
    """Every local pair sits once in its expert's run, runs are packed in expert order and padded to block_m,
    used blocks come first. (300 x 2 pairs: several count/scatter programs, more blocks than one tile.)"""
    ids, _ = make_routing(num_tokens, top_k, num_experts, num_skipped=num_tokens * top_k // 4)
    ids[0, 0] = num_experts + 3  # not on this GPU either
    sorted_pair_ids, block_experts = fm.moe_align(ids, num_experts, block_m)
    num_pairs = ids.numel()
    num_rows = triton.cdiv(num_pairs + min(num_experts, num_pairs) * (block_m - 1), block_m) * block_m
    assert sorted_pair_ids.shape == (num_rows,) and block_experts.shape == (num_rows // block_m,)
    flat, placed, block_experts = ids.reshape(-1).cpu(), sorted_pair_ids.cpu(), block_experts.cpu()
    is_local = (flat >= 0) & (flat < num_experts)
    is_pair = placed < num_pairs
    assert sorted(placed[is_pair].tolist()) == torch.nonzero(is_local).flatten().tolist()
    row_experts = block_experts.repeat_interleave(block_m)
    assert torch.equal(flat[placed[is_pair].long()], row_experts[is_pair])  # each pair in its expert's block
    counts = torch.bincount(flat[is_local], minlength=num_experts)
    expected = torch.repeat_interleave(torch.arange(num_experts), (counts + block_m - 1) // block_m)
    num_used = expected.numel()
    assert torch.equal(block_experts[:num_used], expected) and bool((block_experts[num_used:] == -1).all())
    for expert in range(num_experts):  # the run's pairs first, then padding
        run = placed[row_experts == expert]
        assert bool((run[:counts[expert]] < num_pairs).all()) and bool((run[counts[expert]:] == num_pairs).all())


def test_deterministic():
    w_gate_up, w_down = (w.bfloat16() for w in make_experts(8, 80, 48))
    ids, weights = make_routing(33, 8, 8)
    hidden = make_hidden(33, 80)
    first = fm.fused_moe(hidden, w_gate_up, w_down, ids, weights)
    assert torch.equal(first, fm.fused_moe(hidden, w_gate_up, w_down, ids, weights))


def test_zero_tokens():
    w_gate_up, w_down = (w.bfloat16() for w in make_experts(4, 80, 48))
    ids, weights = make_routing(0, 2, 4)
    assert fm.fused_moe(make_hidden(0, 80), w_gate_up, w_down, ids, weights).shape == (0, 80)


def _bad_arguments():
    w_gate_up, w_down = (w.bfloat16() for w in make_experts(4, 32, 48))
    ids, weights = make_routing(3, 2, 4)
    hidden = make_hidden(3, 32)
    fp8_gu, fp8_d, q = quantized(w_gate_up.float(), w_down.float(), None)
    good = dict(hidden=hidden, w_gate_up=w_gate_up, w_down=w_down, topk_ids=ids, topk_weights=weights)
    return [
        ("hidden", dict(good, hidden=hidden.float())),
        ("hidden", dict(good, hidden=hidden.t())),
        ("w_gate_up", dict(good, w_gate_up=w_gate_up[:, :, :16])),
        ("w_down", dict(good, w_down=w_down[:, :, :40])),
        ("w_down", dict(good, w_down=w_down.transpose(1, 2).contiguous().transpose(1, 2))),
        ("topk_ids", dict(good, topk_ids=ids.float())),
        ("topk_weights", dict(good, topk_weights=weights.double())),
        ("w_gate_up", dict(good, w_gate_up=w_gate_up.half(), w_down=w_down.half())),
        ("w_gate_up_scale", dict(good, w_gate_up_scale=q["w_gate_up_scale"])),
        ("w_gate_up_scale", dict(good, w_gate_up=fp8_gu, w_down=fp8_d)),
        ("w_down_scale", dict(good, w_gate_up=fp8_gu, w_down=fp8_d, **dict(q, w_down_scale=q["w_gate_up_scale"]))),
        ("block_shape", dict(good, w_gate_up=fp8_gu, w_down=fp8_d, **dict(q, block_shape=(64, 64)))),
        ("w_gate_up_scale", dict(good, w_gate_up=fp8_gu, w_down=fp8_d, **dict(q, block_shape=(128, 128)))),
        ("hidden", dict(good, hidden=hidden.half(), w_gate_up=fp8_gu, w_down=fp8_d, **q)),
        ("out", dict(good, out=torch.empty(3, 16, dtype=torch.bfloat16, device=DEVICE))),
        ("w_gate_up_bias", dict(good, w_gate_up_bias=torch.zeros(4, 48, device=DEVICE))),
        ("w_gate_up_bias", dict(good, w_gate_up_bias=torch.zeros(4, 96, dtype=torch.bfloat16, device=DEVICE))),
        ("w_down_bias", dict(good, w_down_bias=torch.zeros(32, 4, device=DEVICE).t())),
        ("activation", dict(good, activation="silu")),
    ]


@pytest.mark.parametrize("case", range(19))
def test_bad_arguments_raise(case):
    name, kwargs = _bad_arguments()[case]
    with pytest.raises(ValueError, match=name):
        fm.fused_moe(**kwargs)


def test_gate_cases_cover_every_kernel_and_config():
    cases = fm.gate_cases()
    kernels = {case.kernel for case in cases}
    assert kernels == {fm.moe_gate_up_kernel, fm.moe_down_kernel, fm.moe_sum_kernel, fm.moe_count_kernel,
                       fm.moe_offsets_kernel, fm.moe_scatter_kernel}
    for cc, table in fm.CONFIGS.items():
        for (_, weights), (gate_up, down) in table.items():
            assert gate_up.block_m == down.block_m  # they share the align step's row blocks
            assert weights != "fp8" or gate_up.block_k == down.block_k == 128  # one activation group per K tile
        num_block_ms = len({gate_up.block_m for gate_up, _ in table.values()})
        # 4 dtype variants x 2 regimes; gate_up: 2 activations x bias or not, down: bias or not
        assert sum(case.capability == cc for case in cases) == 4 * 2 * (2 * 2 + 2) + 2 + 2 + num_block_ms
    for case in cases:
        assert list(case.signature) == case.kernel.arg_names


@pytest.mark.skipif(IS_INTERPRETED, reason="needs a GPU")
@pytest.mark.parametrize("num_tokens", [1, 64, 2048])
@pytest.mark.parametrize("variant", ["bf16", "fp8-channel", "fp8-block"])
def test_full_size_qwen3(num_tokens, variant):
    """Qwen3-30B-A3B: H 2048, I 768, 128 experts, top-8 (a tenth of the slots not local)."""
    w_gate_up, w_down = make_experts(128, 2048, 768)
    ids, weights = make_routing(num_tokens, 8, 128, num_skipped=num_tokens * 8 // 10)
    hidden = make_hidden(num_tokens, 2048)
    if variant == "bf16":
        run_and_check(hidden, w_gate_up.bfloat16(), w_down.bfloat16(), ids, weights)
    else:
        gate_up, down, quant_args = quantized(w_gate_up, w_down, (128, 128) if variant == "fp8-block" else None)
        run_and_check(hidden, gate_up, down, ids, weights, quant_args)


@pytest.mark.skipif(IS_INTERPRETED, reason="needs a GPU")
@pytest.mark.parametrize("num_tokens", [1, 256])
def test_full_size_deepseek_v3_fp8_block(num_tokens):
    """DeepSeek-V3 sizes (H 7168, I 2048, top-8) with 32 of its 256 experts on the GPU, the rest -1."""
    w_gate_up, w_down = make_experts(32, 7168, 2048)
    ids, weights = make_routing(num_tokens, 8, 256)
    ids = torch.where(ids < 32, ids, -1)
    gate_up, down, quant_args = quantized(w_gate_up, w_down, (128, 128))
    run_and_check(make_hidden(num_tokens, 7168), gate_up, down, ids, weights, quant_args)
