"""gpu_layers.linear against its plain-PyTorch references: FP8 linear with per-channel and 128x128 block scales,
W4A16 linear with groups of 32 and 128 and per-channel scales, both regimes (decode with and without split-K,
prefill), bias, strided x and out, awkward shapes, the launchers' argument checks, and the gate case list."""

import pytest
import torch
import triton
from gpu_support import DEVICE, IS_INTERPRETED, poisoned

from gpu_layers import linear
from gpu_layers.capability import CAPABILITIES
from hybrid.compressed_tensors import pack_int4


def make_x(num_tokens, num_cols, dtype, seed=0, row_stride=None):
    """Activations [T, K] with rows of different magnitudes, optionally a view with a wider row stride."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    wide = torch.randn(num_tokens, row_stride or num_cols, generator=gen, device=DEVICE)
    wide *= torch.logspace(-2, 2, num_tokens, device=DEVICE)[:, None]
    return wide.to(dtype)[:, :num_cols]


def make_fp8_weight(num_out, num_cols, block_shape=None, seed=1):
    """FP8 weight [N, K] and its float32 scales ([N, 1] per channel or per block), quantized from randn / sqrt(K)."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    w = torch.randn(num_out, num_cols, generator=gen, device=DEVICE) / num_cols**0.5
    w *= torch.logspace(-1, 1, num_cols, device=DEVICE)  # column blocks of different magnitudes
    if block_shape is None:
        scale = w.abs().amax(dim=1, keepdim=True) / 448.0
        return (w / scale).to(torch.float8_e4m3fn), scale
    rows, cols = block_shape
    scale = torch.zeros(triton.cdiv(num_out, rows), triton.cdiv(num_cols, cols), device=DEVICE)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            scale[i, j] = w[i * rows:(i + 1) * rows, j * cols:(j + 1) * cols].abs().max() / 448.0
    full = scale.repeat_interleave(rows, 0)[:num_out].repeat_interleave(cols, 1)[:, :num_cols]
    return (w / full).to(torch.float8_e4m3fn), scale


def make_w4a16_weight(num_out, num_cols, group_size, dtype, seed=2):
    """Packed int4 weight [N, K / 8] (every value -8..7 present) and scales [N, ceil(K / group)] in `dtype`."""
    gen = torch.Generator().manual_seed(seed)
    values = torch.randint(-8, 8, (num_out, num_cols), generator=gen)
    num_groups = triton.cdiv(num_cols, group_size or num_cols)
    scale = (torch.rand(num_out, num_groups, generator=gen) + 0.5) / (8 * num_cols**0.5)
    return pack_int4(values).to(DEVICE), scale.to(dtype).to(DEVICE)


def relative_error(actual, expected):
    return ((actual.float() - expected.float()).norm() / expected.float().norm()).item()


def check_linear(out, expected):
    """Kernel vs reference that computed the same products: equal up to float32 summation order and one
    rounding to the activation dtype. Rows differ in magnitude by 10^4, so the tolerance is per row."""
    assert not out.isnan().any(), "unwritten output elements"
    row_scale = expected.float().abs().amax(dim=1, keepdim=True).clamp_min(1e-6)
    torch.testing.assert_close(out.float() / row_scale, expected.float() / row_scale, rtol=0, atol=1e-2)


# ------------------------------------------------------------------------------------------------------- FP8


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("group_size", [None, 128, 256])
def test_fp8_quantize_is_bit_exact(dtype, group_size):
    x = make_x(5, 320, dtype, row_stride=352)
    x[1] = 0  # an all-zero row still gets a positive scale and zero codes
    x[2, :7] = 3e4 if dtype == torch.float16 else 1e30  # one group dominated by a huge value
    q, scale = linear.fp8_quantize(x, group_size)
    q_ref, scale_ref = linear.fp8_quantize_reference(x, group_size)
    assert torch.equal(scale, scale_ref)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


@pytest.mark.parametrize("group_size", [None, 128])
def test_fp8_quantize_long_rows(group_size):
    """K = 8400: per token, longer than the largest BLOCK (the kernel loops over the rest of the row, twice);
    in 128-column groups, 66 groups over several programs, the last one partial."""
    x = make_x(2, 8400, torch.bfloat16)
    x[1, -1] = 500.0  # the row's maximum in its last, partial block
    q, scale = linear.fp8_quantize(x, group_size)
    q_ref, scale_ref = linear.fp8_quantize_reference(x, group_size)
    assert torch.equal(scale, scale_ref)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


@pytest.mark.parametrize("num_tokens", [1, 5, 33])
@pytest.mark.parametrize("num_out, num_cols", [(72, 208), (200, 1024)])
@pytest.mark.parametrize("has_bias", [False, True])
def test_fp8_linear_per_channel(num_tokens, num_out, num_cols, has_bias):
    dtype = torch.bfloat16
    x = make_x(num_tokens, num_cols, dtype)
    weight, scale = make_fp8_weight(num_out, num_cols)
    bias = torch.randn(num_out, device=DEVICE).to(dtype) if has_bias else None
    out = linear.fp8_linear(x, weight, scale, bias=bias)
    expected = linear.fp8_linear_reference(x, weight, scale, bias=bias)
    check_linear(out, expected)
    plain = x.float() @ (weight.float() * scale).T + (bias.float() if has_bias else 0)
    assert relative_error(out, plain) < 0.05  # only the activations' e4m3 rounding separates them


@pytest.mark.parametrize("num_tokens", [1, 5, 33])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fp8_linear_block_scales_partial_blocks(num_tokens, dtype):
    num_out, num_cols = 200, 320  # last blocks: 72 rows, 64 columns
    x = make_x(num_tokens, num_cols, dtype, row_stride=336)
    x[:, 128:256] *= 30  # a column group whose activation scale differs from its neighbours'
    weight, scale = make_fp8_weight(num_out, num_cols, (128, 128))
    bias = torch.randn(num_out, device=DEVICE).to(dtype)
    wide_out = poisoned(num_tokens, num_out + 24, dtype=dtype)
    out = linear.fp8_linear(x, weight, scale, block_shape=(128, 128), bias=bias, out=wide_out[:, 8:8 + num_out])
    expected = linear.fp8_linear_reference(x, weight, scale, block_shape=(128, 128), bias=bias)
    check_linear(out, expected)
    assert wide_out[:, :8].isnan().all() and wide_out[:, 8 + num_out:].isnan().all(), "wrote outside out"
    plain = x.float() @ linear.dequantize_fp8_block(weight, scale, (128, 128)).T + bias.float()
    assert relative_error(out, plain) < 0.05


def test_fp8_linear_scale_forms_agree():
    """[N, 1] and [N] per-channel scales, in bfloat16 (as compressed-tensors stores them) or float32."""
    x = make_x(3, 208, torch.bfloat16)
    weight, scale = make_fp8_weight(72, 208)
    expected = linear.fp8_linear_reference(x, weight, scale)
    for form in (scale, scale.reshape(-1), scale.to(torch.bfloat16)):
        reference = linear.fp8_linear_reference(x, weight, form)
        check_linear(linear.fp8_linear(x, weight, form), reference)
    check_linear(linear.fp8_linear(x, weight, scale.reshape(-1)), expected)


# ----------------------------------------------------------------------------------------------------- W4A16


@pytest.mark.parametrize("num_tokens", [1, 5, 33])
@pytest.mark.parametrize("num_out, num_cols, group_size", [(72, 160, 32), (200, 384, 128), (200, 224, None)])
@pytest.mark.parametrize("has_bias", [False, True])
def test_w4a16_linear(num_tokens, num_out, num_cols, group_size, has_bias):
    dtype = torch.bfloat16
    x = make_x(num_tokens, num_cols, dtype, row_stride=num_cols + 8)
    packed, scale = make_w4a16_weight(num_out, num_cols, group_size, dtype)
    bias = torch.randn(num_out, device=DEVICE).to(dtype) if has_bias else None
    out = linear.w4a16_linear(x, packed, scale, group_size, bias=bias, out=poisoned(num_tokens, num_out, dtype=dtype))
    expected = linear.w4a16_linear_reference(x, packed, scale, group_size, bias=bias)
    check_linear(out, expected)
    # Against float32 weights: only the weights' rounding to bfloat16 separates them.
    values = linear.unpack_int4(packed.cpu(), num_cols).to(DEVICE).float()
    w = values * scale.float().repeat_interleave(group_size or num_cols, dim=1)[:, :num_cols]
    plain = x.float() @ w.T + (bias.float() if has_bias else 0)
    assert relative_error(out, plain) < 0.01


@pytest.mark.parametrize("num_tokens", [1, 33])
def test_w4a16_linear_fp16(num_tokens):
    x = make_x(num_tokens, 256, torch.float16)
    packed, scale = make_w4a16_weight(72, 256, 128, torch.float16)
    check_linear(linear.w4a16_linear(x, packed, scale, 128), linear.w4a16_linear_reference(x, packed, scale, 128))


# ------------------------------------------------------------------------------------------ shared machinery


def test_decode_splits_k_only_when_useful(monkeypatch):
    monkeypatch.setattr(linear, "num_sms", lambda device: 4)
    assert linear._tiles_per_split(2, 8, DEVICE, "decode") == 2  # 4 splits: 8 programs for 4 SMs
    assert linear._tiles_per_split(2, 3, DEVICE, "decode") == 3  # too few K tiles to split
    assert linear._tiles_per_split(64, 8, DEVICE, "decode") == 8  # enough output tiles already
    assert linear._tiles_per_split(2, 8, DEVICE, "prefill") == 8


def test_splitk_path_is_taken_and_matches(monkeypatch):
    """T = 1, K = 1024: the launcher splits K and reduces; the result equals the unsplit one."""
    calls, reduce = [], linear.splitk_reduce_kernel

    class Spy:
        def __getitem__(self, grid):
            calls.append(grid)
            return reduce[grid]

    monkeypatch.setattr(linear, "splitk_reduce_kernel", Spy())
    x = make_x(1, 1024, torch.bfloat16)
    weight, scale = make_fp8_weight(72, 1024)
    bias = torch.randn(72, device=DEVICE).to(torch.bfloat16)
    check_linear(linear.fp8_linear(x, weight, scale, bias=bias), linear.fp8_linear_reference(x, weight, scale,
                                                                                              bias=bias))
    if IS_INTERPRETED:  # a GPU with many SMs splits too, but how often depends on it
        assert calls, "the decode launch did not split K"


def test_empty_batch():
    x = torch.empty(0, 208, dtype=torch.bfloat16, device=DEVICE)
    weight, scale = make_fp8_weight(72, 208)
    assert linear.fp8_linear(x, weight, scale).shape == (0, 72)
    packed, w_scale = make_w4a16_weight(72, 224, 32, torch.bfloat16)
    assert linear.w4a16_linear(x.new_empty(0, 224), packed, w_scale, 32).shape == (0, 72)


def test_argument_checks():
    x = make_x(2, 256, torch.bfloat16)
    weight, scale = make_fp8_weight(72, 256)
    packed, w_scale = make_w4a16_weight(72, 256, 128, torch.bfloat16)
    cases = [
        (lambda: linear.fp8_linear(x.float(), weight, scale), "x dtype"),
        (lambda: linear.fp8_linear(x.t(), weight, scale), "x must be"),
        (lambda: linear.fp8_linear(x[:, :200], weight[:, :200].contiguous(), scale), "multiple of 16"),
        (lambda: linear.fp8_linear(x, weight.float(), scale), "weight must be"),
        (lambda: linear.fp8_linear(x, weight[:, :128], scale), "weight must be"),
        (lambda: linear.fp8_linear(x, weight, scale[:70]), "weight_scale must be"),
        (lambda: linear.fp8_linear(x, weight, scale, block_shape=(128, 128)), "weight_scale must be"),
        (lambda: linear.fp8_linear(x, weight, scale, block_shape=(128, 96)), "block_shape"),
        (lambda: linear.fp8_linear(x, weight, scale, bias=torch.zeros(72, device=DEVICE)), "bias must be"),
        (lambda: linear.fp8_linear(x, weight, scale, out=poisoned(2, 71, dtype=torch.bfloat16)), "out must be"),
        (lambda: linear.w4a16_linear(x, packed, w_scale.float(), 128), "weight_scale must be"),
        (lambda: linear.w4a16_linear(x, packed[:, :16], w_scale, 128), "weight_packed must be"),
        (lambda: linear.w4a16_linear(x, packed.view(torch.float32), w_scale, 128), "weight_packed must be"),
        (lambda: linear.w4a16_linear(x, packed, w_scale.repeat(1, 8), 16), "group_size 16"),
        (lambda: linear.w4a16_linear(make_x(2, 256, torch.bfloat16, row_stride=260), packed, w_scale, 128),
         "row stride"),
    ]
    for call, message in cases:
        with pytest.raises(ValueError, match=message):
            call()


def test_gate_cases_cover_every_kernel_and_capability():
    cases = linear.gate_cases()
    kernels = {linear.fp8_quantize_kernel, linear.fp8_gemm_kernel, linear.w4a16_gemm_kernel,
               linear.splitk_reduce_kernel}
    assert {(case.kernel, case.capability) for case in cases} == {(k, cc) for k in kernels for cc in CAPABILITIES}
    assert len({(case.label, case.capability) for case in cases}) == len(cases)
    for case in cases:
        assert set(case.signature) == set(case.kernel.arg_names), case.label


# --------------------------------------------------------------------------------------------- full size (GPU)


@pytest.mark.skipif(IS_INTERPRETED, reason="needs a GPU")
@pytest.mark.parametrize("num_tokens", [1, 8, 300])
@pytest.mark.parametrize("block_shape", [None, (128, 128)])
def test_fp8_linear_deepseek_v3_shared_expert(num_tokens, block_shape):
    num_out, num_cols = 2 * 2048, 7168
    x = make_x(num_tokens, num_cols, torch.bfloat16)
    weight, scale = make_fp8_weight(num_out, num_cols, block_shape)
    out = linear.fp8_linear(x, weight, scale, block_shape=block_shape)
    check_linear(out, linear.fp8_linear_reference(x, weight, scale, block_shape=block_shape))


@pytest.mark.skipif(IS_INTERPRETED, reason="needs a GPU")
@pytest.mark.parametrize("num_tokens", [1, 8, 300])
@pytest.mark.parametrize("group_size", [32, 128])
def test_w4a16_linear_qwen3_qkv(num_tokens, group_size):
    num_out, num_cols = 4096 + 2 * 512, 2048
    x = make_x(num_tokens, num_cols, torch.bfloat16)
    packed, scale = make_w4a16_weight(num_out, num_cols, group_size, torch.bfloat16)
    bias = torch.randn(num_out, device=DEVICE).to(torch.bfloat16)
    out = linear.w4a16_linear(x, packed, scale, group_size, bias=bias)
    check_linear(out, linear.w4a16_linear_reference(x, packed, scale, group_size, bias=bias))


@pytest.mark.skipif(IS_INTERPRETED, reason="needs a GPU")
def test_bench_cases_run():
    for name, run, moved, flops in linear.bench_cases():
        run()
        assert moved > 0 and flops > 0, name
    torch.cuda.synchronize()
