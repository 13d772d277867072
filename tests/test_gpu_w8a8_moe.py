"""gpu_layers.w8a8_moe against its PyTorch reference and the CPU experts' rounding: the per-row int8 codes and
scales bit for bit `cpu_experts.kernels.quantize_row`'s, the whole MoE bit for bit the reference's (exact int32
sums per group, the same float32 operations in the same order) for int8 per row and grouped, int4 with float32
and bfloat16 scales, gpt-oss's activation with biases, T = 1, odd counts per expert, experts with no tokens, H
and I not multiples of the tiles; and the launcher's argument checks."""

import numpy as np
import pytest
import torch
from gpu_support import DEVICE, equal_but_rare_flips

from cpu_experts.kernels import quantize_row
from gpu_layers.fused_moe import SWIGLU_OAI
from gpu_layers.w8a8_moe import quantize_rows, quantize_rows_reference, w8a8_moe, w8a8_moe_reference
from gpu_layers.w8a8_moe_cases import _int4_pack


def cpu_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The CPU experts' rounding, row by row (the numba function every CPU path calls)."""
    rows = x.float().numpy()
    codes = np.empty(rows.shape, dtype=np.int8)
    scales = np.array([quantize_row(row, q) for row, q in zip(rows, codes, strict=True)], dtype=np.float32)
    return torch.from_numpy(codes), torch.from_numpy(scales)


def awkward_rows(seed: int = 0) -> torch.Tensor:
    """Rows with exact ties of the rounding (x * inv = k + 0.5), an all-zero row, one nonzero element, a negative
    absmax, tiny and huge magnitudes, 100 columns (not a multiple of any block)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(8, 100, generator=g)
    x[0] = torch.arange(100) - 49.5  # absmax 49.5: 127 / 49.5 * (k + .5) hits many near-ties
    x[1] = (torch.arange(100) % 255 - 127) / 2  # absmax 63.5: inv = 2, x * inv = k exactly, halves at k +- .5
    x[1, 0] = 127.0 / 2 + 0.25
    x[2] = 0
    x[3] = 0
    x[3, 7] = -3e-5
    x[4] *= 1e-30
    x[5] *= 1e30
    x[6, 50] = -1000.0
    return x


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_rows_are_the_cpu_experts_codes_and_scales(dtype):
    x = awkward_rows().to(dtype)
    want = cpu_rows(x)
    got = quantize_rows(x.to(DEVICE))
    assert torch.equal(got[0].cpu(), want[0]) and torch.equal(got[1].cpu(), want[1])
    assert all(torch.equal(a, b) for a, b in zip(quantize_rows_reference(x), want, strict=True))
    assert got[0].abs().max() == 127 and got[1][2] == 0 and (got[0][2] == 0).all()


def make_layer(num_experts, hidden_size, inter, is_int4, group_size, scale_dtype=torch.float32, seed=0):
    """Random codes over the format's whole range (int4's -8 included) and scales that keep act and out O(1)."""
    g = torch.Generator().manual_seed(seed)
    low, high = (-8, 8) if is_int4 else (-127, 128)

    def projection(rows, cols):
        codes = torch.randint(low, high, (num_experts, rows, cols), generator=g, dtype=torch.int8)
        groups = -(-cols // (group_size or cols))
        scales = (torch.rand(num_experts, rows, groups, generator=g) + 0.5) / (high * cols**0.5)
        return (_int4_pack(codes) if is_int4 else codes).to(DEVICE), scales.to(scale_dtype).to(DEVICE)

    return projection(inter, hidden_size), projection(inter, hidden_size), projection(hidden_size, inter)


def make_routing(num_tokens, top_k, num_experts, seed=0):
    """Distinct experts per token, a skipped slot (-1) and an id past the local experts (computed elsewhere)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.rand(num_tokens, num_experts, generator=g).argsort(dim=1)[:, :top_k].int()
    if num_tokens > 3:
        ids[1, 0], ids[2, top_k - 1] = -1, num_experts + 3
    return ids.to(DEVICE), (torch.rand(num_tokens, top_k, generator=g) + 0.1).to(DEVICE)


def check(num_tokens, hidden_size, inter, is_int4=False, group_size=0, scale_dtype=torch.float32, num_experts=5,
          top_k=2, epilogue="saturated", seed=0):
    """The kernels against the reference; returns the output. `epilogue` "saturated": silu with a gate bias of 40,
    whose sigmoid is exactly 1 in float32 on every implementation of exp, so the output must equal the reference
    bit for bit (the int32 sums per group, their scales and order, both roundings to int8). "silu" and "gpt-oss"
    (swiglu_oai with random biases): exp may differ by an ulp from PyTorch's, which moves an act row's scale (and
    at most a code) by as much, so they are held to 1e-6 of the output's norm."""
    layer = make_layer(num_experts, hidden_size, inter, is_int4, group_size, scale_dtype, seed)
    ids, weights = make_routing(num_tokens, top_k, num_experts, seed)
    hidden = torch.randn(num_tokens, hidden_size, generator=torch.Generator().manual_seed(seed)).to(DEVICE)
    g = torch.Generator().manual_seed(seed + 1)
    extra = {}
    if epilogue == "gpt-oss":
        extra = dict(activation=SWIGLU_OAI, w_gate_up_bias=torch.randn(num_experts, 2 * inter, generator=g),
                     w_down_bias=torch.randn(num_experts, hidden_size, generator=g))
    elif epilogue == "saturated":
        extra = dict(w_gate_up_bias=torch.cat([torch.full((num_experts, inter), 40.0),
                                               torch.randn(num_experts, inter, generator=g)], dim=1))
    got = w8a8_moe(*quantize_rows(hidden), *layer, ids, weights, group_size=group_size,
                   **{k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in extra.items()})
    want = w8a8_moe_reference(hidden.cpu(), *[tuple(t.cpu() for t in p) for p in layer], ids.cpu(), weights.cpu(),
                              group_size, **extra)
    assert got.dtype == torch.float32 and want.abs().max() > 0.1
    if epilogue == "saturated":
        assert torch.equal(got.cpu(), want), float((got.cpu() - want).abs().max())
    else:
        assert equal_but_rare_flips(got.cpu(), want, exact=1e-6)
    return got


@pytest.mark.parametrize("is_int4,group_size,scale_dtype", [
    (False, 0, torch.float32), (False, 32, torch.float32), (True, 32, torch.float32), (True, 64, torch.bfloat16),
    (True, 0, torch.float32)])
def test_w8a8_moe_equals_its_reference(is_int4, group_size, scale_dtype):
    """H 80 and I 48: neither a multiple of the tiles, the last group short (80 = 2 x 32 + 16); 13 tokens over 5
    experts: odd counts per expert."""
    check(13, 80 if group_size != 64 else 128, 48 if group_size != 64 else 64, is_int4, group_size, scale_dtype)


@pytest.mark.parametrize("is_int4", [False, True])
@pytest.mark.parametrize("epilogue", ["silu", "gpt-oss"])
def test_the_layers_activation_and_biases(is_int4, epilogue):
    check(11, 64, 32, is_int4, 32 if is_int4 else 0, epilogue=epilogue, seed=3)


def test_one_token_and_experts_with_no_tokens():
    """T = 1, top-2 of 9 experts: seven experts get no row; their blocks must contribute nothing."""
    check(1, 64, 32, num_experts=9, seed=5)


def test_a_skipped_slot_and_a_foreign_id_contribute_nothing():
    out = check(6, 64, 32, seed=7)
    ids, _ = make_routing(6, 2, 5, seed=7)
    assert ids[1, 0] == -1 and ids[2, 1] == 8 and out.abs().sum() > 0


def test_the_launcher_names_bad_arguments():
    layer = make_layer(3, 64, 32, False, 0)
    x_q, x_scale = quantize_rows(torch.randn(4, 64).to(DEVICE))
    ids, weights = make_routing(4, 2, 3)
    with pytest.raises(ValueError, match="x_q must be int8"):
        w8a8_moe(x_q.float(), x_scale, *layer, ids, weights)
    with pytest.raises(ValueError, match="x_scale must be"):
        w8a8_moe(x_q, x_scale[:3], *layer, ids, weights)
    with pytest.raises(ValueError, match="group_size must be 0"):
        w8a8_moe(x_q, x_scale, *layer, ids, weights, group_size=48)
    with pytest.raises(ValueError, match="down codes must be"):
        w8a8_moe(x_q, x_scale, layer[0], layer[1], (layer[2][0][:, :32], layer[2][1]), ids, weights)
    with pytest.raises(ValueError, match="up scales must be"):
        w8a8_moe(x_q, x_scale, layer[0], (layer[1][0], layer[1][1].bfloat16()), layer[2], ids, weights)
    with pytest.raises(ValueError, match="topk_weights must be"):
        w8a8_moe(x_q, x_scale, *layer, ids, weights.double())
    with pytest.raises(ValueError, match="w_down_bias must be"):
        w8a8_moe(x_q, x_scale, *layer, ids, weights, w_down_bias=torch.zeros(3, 32, device=DEVICE))
    with pytest.raises(ValueError, match="x must be"):
        quantize_rows(torch.zeros(4, 64, dtype=torch.int32, device=DEVICE))
