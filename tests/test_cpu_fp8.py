"""FP8 (e4m3) experts on the CPU against the float reference on their dequantized weights with bf16-rounded
activations (`moe_reference(..., bf16_activations=True)`), on both paths of `CpuMoE`.

Awkward cases: 1, 3, 17 and 300 tokens (300 on the prefill path), top-k 1, 2 and 8, -1 ids; H = 80 (a last half
group of 32) and I = 96 in 1 or 3 partitions; weights holding every e4m3 code but NaN, or only the subnormals and
zeros, with group scales from 2^-68 to 2^64; every code decoded exactly one at a time, also with the calling
thread flushing denormals (the decoding must not rely on denormal arithmetic). Layers read as checkpoints store
them (`tests/stored_experts.py`): odd H and I (33 x 45 in groups of 32; 200 x 301 and 72 x 136 in 128 x 128 blocks,
DeepSeek's float32 `weight_scale_inv` and DeepSeek-V4's E8M0 `.scale`, partial last blocks), and E8M0 blocks at 254
(2^127) and 0 (2^-127).

Tolerance: float32 summation order (REL_TOL of the output's largest element), plus, per output element, what
rounding act = silu(gate) * up to bf16 can add: an element of act within float32 error of a bf16 rounding midpoint
may round either way on either side (`act_flip_bound`; about one act element in ten thousand does, moving its
token's outputs by up to 3e-4 of the largest here, which a plain 1e-5 would not pass).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import stored_experts
import torch

from cpu_experts import bench, formats, kernels_fp8, prefill
from cpu_experts.expert_file import ROLES, ExpertLayerSpec, dequantize_matrix, quantize_matrix
from cpu_experts.operator import CpuMoE
from cpu_experts.packed import PackedLayer
from cpu_experts.reference import moe_reference

E, H, I, GROUP = 8, 80, 96, 32  # noqa: E741 (the shape letters of the project)
REL_TOL = 1e-5
# float32 steps of sum |w x| that a gate or up sum of H = 80 terms may be off by, in `act_flip_bound`: the kernels and
# torch measured at most 1.2 on these weights (one pass over 20 tokens x every row)
SUM_ERR = 4
EVERY_CODE = torch.cat([torch.arange(0x00, 0x7F), torch.arange(0x80, 0xFF)]).to(torch.uint8)  # all but the NaNs
SUBNORMAL_CODES = torch.cat([torch.arange(0x00, 0x08), torch.arange(0x80, 0x88)]).to(torch.uint8)


def quantized_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    spec = ExpertLayerSpec(E, H, I, "fp8", GROUP)
    tensors: dict[str, torch.Tensor] = {}
    for role in ROLES:
        w = torch.randn(E, *spec.matrix_shape(role), generator=gen) * 0.1
        parts = [quantize_matrix(w[e], spec) for e in range(E)]
        tensors[f"{role}.weight"] = torch.stack([p["weight"] for p in parts])
        tensors[f"{role}.scales"] = torch.stack([p["scales"] for p in parts])
    return tensors


def stored_tensors(codes: torch.Tensor, exponents: tuple[int, int], seed: int) -> dict[str, torch.Tensor]:
    """e4m3 bits drawn from `codes` (each of them present in every projection) and power-of-two group scales with
    exponents drawn from [lo, hi], written as a checkpoint would hold them."""
    gen = torch.Generator().manual_seed(seed)
    spec = ExpertLayerSpec(E, H, I, "fp8", GROUP)
    tensors = {}
    for role in ROLES:
        n, k = spec.matrix_shape(role)
        bits = codes[torch.randint(len(codes), (E, n, k), generator=gen)]
        bits.view(-1)[:len(codes)] = codes
        tensors[f"{role}.weight"] = bits
        lo, hi = exponents
        tensors[f"{role}.scales"] = 2.0 ** torch.randint(lo, hi + 1, (E, n, -(-k // GROUP)), generator=gen).float()
    return tensors


def dequantized(tensors: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    spec = ExpertLayerSpec(E, H, I, "fp8", GROUP)
    return [torch.stack([dequantize_matrix(tensors[f"{role}.weight"][e], tensors[f"{role}.scales"][e], role, spec)
                         for e in range(E)]) for role in ROLES]


def layer_of(tensors: dict[str, torch.Tensor], partitions: int) -> PackedLayer:
    return PackedLayer.from_file_tensors(tensors, ExpertLayerSpec(E, H, I, "fp8", GROUP), partitions)


def routing(num_tokens: int, top_k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random distinct experts per token, about a third of the slots -1, the first token's all -1."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=gen)[:top_k] for _ in range(num_tokens)])
    ids[torch.rand(ids.shape, generator=gen) < 0.3] = -1
    ids[0] = -1
    return ids, torch.rand(num_tokens, top_k, generator=gen)


def act_flip_bound(x, gate, up, down, ids, weights) -> torch.Tensor:
    """[T, H]: the most that act's bf16 rounding can move each output element beyond float32 summation order.
    act = silu(g) * v is computed in float32 on both sides, each within `err` of its exact value (the sums over H,
    silu and the product); where that window holds a bf16 rounding midpoint, the two sides may round one bf16 step
    apart, which the down projection carries to every output column. The sums' error is taken as SUM_ERR float32
    steps of sum |w x|: the worst case, H + 2 of them, would put a midpoint in most pairs' window and hide a wrong
    rounding mode."""
    xb = x.bfloat16().double()
    eps = 2.0 ** -24
    bound = torch.zeros(x.shape, dtype=torch.float64)
    for expert in torch.unique(ids[ids >= 0]).tolist():  # each expert's pairs at once (gathering per slot was slow)
        tok, k = torch.where(ids == expert)
        rows = xb[tok]
        wg, wu, wd = gate[expert].double(), up[expert].double(), down[expert].double()  # [I, H], [I, H], [H, I]
        g, v = rows @ wg.T, rows @ wu.T  # [pairs, I]
        g_err = SUM_ERR * eps * (rows.abs() @ wg.abs().T)
        v_err = SUM_ERR * eps * (rows.abs() @ wu.abs().T)
        silu = g * torch.sigmoid(g)
        act = silu * v
        err = 1.1 * g_err * v.abs() + silu.abs() * v_err + 8 * eps * act.abs()  # |silu'| < 1.1
        step = 2.0 ** (torch.floor(torch.log2(act.abs().clamp(min=1e-300))) - 7)  # bf16's spacing at act
        to_midpoint = ((act / step) - torch.floor(act / step) - 0.5).abs() * step
        flips = to_midpoint <= err
        bound.index_add_(0, tok, weights[tok, k, None].double() * ((flips * step) @ wd.abs().T))
    return bound


def assert_close(got: torch.Tensor, want: torch.Tensor, bound: torch.Tensor, what: str) -> None:
    allowed = REL_TOL * float(want.abs().max()) + bound
    excess = (got.double() - want.double()).abs() - allowed
    assert float(excess.max()) <= 0, f"{what}: error {float((got - want).abs().max()):.3e}, max |ref| " \
                                     f"{float(want.abs().max()):.3e}"


@pytest.fixture(scope="module")
def quantized():
    tensors = quantized_tensors()
    return tensors, dequantized(tensors)


# ---- decoding, exactly -------------------------------------------------------------------------------------------

def _decoded_one_at_a_time(codes: np.ndarray, group: int) -> tuple[np.ndarray, ...]:
    """Each code's value through the decode kernels' row dots (a one-hot activation; two rows and one) and the
    prefill's dequantization, scale 1."""
    cols = codes.shape[0]
    scales = np.ones(-(-cols // group), dtype=np.float32)
    x = np.zeros(cols, dtype=np.float32)
    single, pair = np.empty(cols, np.float32), np.empty(cols, np.float32)
    reversed_codes = codes[::-1].copy()
    for j in range(cols):
        x[:] = 0
        x[j] = 1
        single[j] = kernels_fp8.dot_fp8(codes, scales, x, group)
        a, b = kernels_fp8.dot2_fp8(codes, scales, reversed_codes, scales, x, group)
        assert b == kernels_fp8.dot_fp8(reversed_codes, scales, x, group)
        pair[j] = a
    dequantized_rows = np.empty((1, cols), np.float32)
    prefill.dequantize_fp8(codes[None], scales[None], group, dequantized_rows)
    return single, pair, dequantized_rows[0]


@pytest.mark.parametrize("group", [128, 16])  # the vector loop's whole groups; a group the scalar tail takes
def test_every_code_decodes_exactly(group):
    codes = EVERY_CODE.repeat(2)[:256].numpy()  # 256 columns: two whole groups of 128 and a tail
    want = formats.e4m3_to_float(torch.from_numpy(codes)).numpy()
    for got in _decoded_one_at_a_time(codes, group):
        mismatched = np.flatnonzero(got != want)
        assert mismatched.size == 0, [(hex(codes[j]), got[j], want[j]) for j in mismatched[:5]]


def test_decoding_ignores_flush_to_zero():
    """A library that sets flush-to-zero / denormals-are-zero on the thread (torch.set_flush_denormal) must not change
    the subnormal codes' values (0x01..0x07 are 2^-9 .. 7 * 2^-9, normal float32 numbers)."""
    codes = np.concatenate([SUBNORMAL_CODES.numpy(), EVERY_CODE.numpy()[:48]])  # 64: two blocks of 32
    want = formats.e4m3_to_float(torch.from_numpy(codes)).numpy()
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU has no flush-to-zero mode")
    try:
        assert float(torch.tensor([1e-40]) * 1.0) == 0  # the mode is on in this thread
        single, pair, _ = _decoded_one_at_a_time(codes, 32)
    finally:
        torch.set_flush_denormal(False)
    assert np.array_equal(single, want) and np.array_equal(pair, want), (single[:16], want[:16])


def test_round_bf16_matches_torch():
    gen = torch.Generator().manual_seed(0)
    values = torch.randn(4096, generator=gen) * 2.0 ** torch.randint(-60, 60, (4096,), generator=gen)
    bf16 = values.bfloat16().float()
    ties = torch.cat([bf16 + 2.0 ** (torch.floor(torch.log2(bf16.abs())) - 8) * s for s in (1, -1)])
    special = torch.tensor([0.0, -0.0, 1e-40, -1e-40, 3.3895e38, 3.4e38, float("inf"), -float("inf"), float("nan")])
    x = torch.cat([values, ties, special]).numpy()
    got = np.empty_like(x)
    _round_all(x, got)
    assert np.array_equal(got, torch.from_numpy(x).bfloat16().float().numpy(), equal_nan=True)


def _round_all(x, out):
    for j in range(x.shape[0]):
        out[j] = kernels_fp8.round_bf16(x[j])


# ---- the operator ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("partitions", [1, 3])
def test_matches_reference(quantized, partitions):
    tensors, (gate, up, down) = quantized
    layer = layer_of(tensors, partitions)
    assert len(layer.partitions) == partitions
    op = CpuMoE(layer, prefill_min_tokens=100)  # 300 tokens prefill; int8_activations (True) is ignored
    for seed, (num_tokens, top_k) in enumerate([(1, 1), (1, 8), (3, 2), (17, 8), (300, 2), (300, 8)]):
        ids, w = routing(num_tokens, top_k, seed)
        x = torch.randn(num_tokens, H, generator=torch.Generator().manual_seed(100 + seed))
        want = moe_reference(x, gate, up, down, ids, w, bf16_activations=True)
        bound = act_flip_bound(x, gate, up, down, ids, w)
        assert_close(op(x, ids, w), want, bound, f"T={num_tokens} K={top_k}")


CODE_SETS = {"every": EVERY_CODE, "subnormal": SUBNORMAL_CODES}
SCALES = {"tiny": (-68, -60), "large": (56, 64), "mixed": (-12, 12)}


@pytest.mark.parametrize("codes", sorted(CODE_SETS))
@pytest.mark.parametrize("scales", sorted(SCALES))
def test_stored_codes_and_extreme_scales(codes, scales):
    """Every code in the weights (or only the smallest ones) and group scales far from 1, on both paths; the
    activations sized so that gate and up stay near 1 (silu's interesting range)."""
    tensors = stored_tensors(CODE_SETS[codes], SCALES[scales], seed=len(codes) + len(scales))
    gate, up, down = dequantized(tensors)
    layer = layer_of(tensors, 3)
    ids, w = routing(17, 4, 5)
    values = formats.e4m3_to_float(CODE_SETS[codes])
    x_scale = 2.0 ** -round(math.log2(float(values.pow(2).mean().sqrt()) * H ** 0.5) + sum(SCALES[scales]) / 2)
    x = torch.randn(17, H, generator=torch.Generator().manual_seed(3)) * x_scale
    want = moe_reference(x, gate, up, down, ids, w, bf16_activations=True)
    assert torch.isfinite(want).all() and float(want.abs().max()) > 0
    bound = act_flip_bound(x, gate, up, down, ids, w)
    for threshold in (10**9, 1):  # decode, prefill
        assert_close(CpuMoE(layer, prefill_min_tokens=threshold)(x, ids, w), want, bound, f"threshold {threshold}")


@pytest.mark.parametrize("partitions", [1, 3])
def test_decode_matches_prefill(quantized, partitions):
    """A token's result does not depend on the path it took beyond float32 order."""
    tensors, (gate, up, down) = quantized
    layer = layer_of(tensors, partitions)
    ids, w = routing(300, 8, 11)
    x = torch.randn(300, H, generator=torch.Generator().manual_seed(11))
    decoded = CpuMoE(layer, prefill_min_tokens=10**9)(x, ids, w)
    prefilled = CpuMoE(layer, prefill_min_tokens=1)(x, ids, w)
    assert_close(decoded, prefilled, act_flip_bound(x, gate, up, down, ids, w), "decode vs prefill")


def test_activations_are_bf16_whatever_int8_activations_says(quantized):
    tensors, _ = quantized
    layer = layer_of(tensors, 1)
    ids, w = routing(17, 8, 2)
    x = torch.randn(17, H, generator=torch.Generator().manual_seed(2))
    for threshold in (None, 10**9, 1):  # the dtype's own (decode at 17 tokens), decode, prefill
        w8a8, float_ = (CpuMoE(layer, prefill_min_tokens=threshold, int8_activations=flag) for flag in (True, False))
        assert not w8a8.is_w8a8 and w8a8.kernels.decode == "fp8"
        assert isinstance(w8a8.prefill.backend, prefill.DequantBackend)
        assert torch.equal(w8a8(x, ids, w), float_(x, ids, w))


def test_bfloat16_hidden_computes_in_float32(quantized):
    """bf16 hidden rows give the float32 computation's result rounded once at the end, on both paths (prefill
    does not multiply in bf16: e4m3 values times float32 scales do not fit in bf16)."""
    tensors, _ = quantized
    layer = layer_of(tensors, 1)
    ids, w = routing(17, 8, 4)
    x = torch.randn(17, H, generator=torch.Generator().manual_seed(4)).bfloat16()
    for threshold in (10**9, 1):
        op = CpuMoE(layer, prefill_min_tokens=threshold)
        got = op(x, ids, w)
        assert got.dtype == torch.bfloat16
        assert torch.equal(got, op(x.float(), ids, w).bfloat16())


# ---- odd shapes and E8M0 extremes, read as checkpoints store them (`tests/stored_experts.py`) ---------------------

ODD_SHAPES = {  # name: (H, I, group, how stored)
    "file-33x45": (33, 45, 32, None),  # the expert file's layout: a last group of 1 column (H) and 13 (I)
    "deepseek-200x301": (200, 301, 128, "weight_scale_inv"),  # last blocks of 72 x 45, I in 3 partitions
    "v4-72x136": (72, 136, 128, "scale"),  # E8M0 blocks: a partial block in every projection, 8 columns of I
}


def odd_layer(name: str, partitions: int):
    """A layer of ODD_SHAPES[name] (every e4m3 code but NaN) and its reference gate, up, down."""
    hidden, inter, group, scale_part = ODD_SHAPES[name]
    gen = torch.Generator().manual_seed(hidden)
    codes = stored_experts.random_fp8_codes(gen)
    if scale_part is None:
        spec = ExpertLayerSpec(E, hidden, inter, "fp8", group)
        tensors = {}
        for role in ROLES:
            n, k = spec.matrix_shape(role)
            tensors[f"{role}.weight"] = torch.stack([codes(role, e, (n, k)) for e in range(E)])
            tensors[f"{role}.scales"] = torch.rand(E, n, -(-k // group), generator=gen) * 2e-3 + 1e-3
        reference = [torch.stack([dequantize_matrix(tensors[f"{role}.weight"][e], tensors[f"{role}.scales"][e], role,
                                                    spec) for e in range(E)]) for role in ROLES]
        return PackedLayer.from_file_tensors(tensors, spec, partitions), reference

    def scales(role, e, shape):
        if scale_part == "scale":
            return torch.randint(115, 121, shape, generator=gen).to(torch.uint8)  # 2^-12 .. 2^-6
        return torch.rand(shape, generator=gen) * 2e-3 + 1e-3
    tensors, spec, reference = stored_experts.block_fp8_layer(E, hidden, inter, codes, scales, scale_part)
    return PackedLayer.from_file_tensors(tensors, spec, partitions), reference


@pytest.mark.parametrize("partitions", [1, 3])
@pytest.mark.parametrize("shape", sorted(ODD_SHAPES))
def test_odd_sizes_match_reference(shape, partitions):
    """Odd H and I, with partial last scale groups (group 32) and partial last 128 x 128 blocks as DeepSeek and
    DeepSeek-V4 store them (read by `hybrid.stored_matrix`; the reference expands the blocks itself), on the decode
    and the dequantizing prefill paths (the AMX-BF16 prefill refuses sizes off its tiles:
    tests/test_cpu_prefill_amx_float.py)."""
    layer, (gate, up, down) = odd_layer(shape, partitions)
    hidden, inter, group, _ = ODD_SHAPES[shape]
    assert len(layer.partitions) == min(partitions, -(-inter // max(group, 32)))
    decode, prefill_ = CpuMoE(layer, prefill_min_tokens=10**9), CpuMoE(layer, prefill_min_tokens=1)
    assert isinstance(prefill_.prefill.backend, prefill.DequantBackend)
    for seed, (num_tokens, top_k) in enumerate([(1, 1), (3, 2), (17, 8), (300, 2)]):
        ids, w = routing(num_tokens, top_k, seed)
        x = torch.randn(num_tokens, hidden, generator=torch.Generator().manual_seed(200 + seed))
        want = moe_reference(x, gate, up, down, ids, w, bf16_activations=True)
        bound = act_flip_bound(x, gate, up, down, ids, w)
        for op, path in ((decode, "decode"), (prefill_, "prefill")):
            assert_close(op(x, ids, w), want, bound, f"{path} {shape} P={partitions} T={num_tokens} K={top_k}")


EXTREME_H, EXTREME_I = 256, 384  # 2 x 3 blocks: 3 partitions of one block


@pytest.fixture(scope="module")
def extreme_layer():
    return stored_experts.extreme_fp8_layer(EXTREME_H, EXTREME_I)


@pytest.mark.parametrize("partitions", [1, 3])
def test_e8m0_extremes_through_the_operator(extreme_layer, partitions):
    """DeepSeek-V4's E8M0 `.scale` blocks at 254 (2^127, on codes below 2: finite) and 0 (2^-127) beside 250-253 and
    1-4, in three classes of experts each with tokens sized for it (`stored_experts`), on the decode and the
    dequantizing prefill paths: the stored values exactly (README: FP8's code x its float32 group scale), each token
    compared on its own scale."""
    tensors, spec, (gate, up, down) = extreme_layer
    layer = PackedLayer.from_file_tensors(tensors, spec, partitions)
    assert len(layer.partitions) == partitions
    for seed, (num_tokens, top_k) in enumerate([(1, 1), (3, 2), (17, 8), (300, 2)]):
        x, ids, w = stored_experts.class_tokens(num_tokens, EXTREME_H, top_k, seed)
        want = moe_reference(x, gate, up, down, ids, w, bf16_activations=True)
        assert bool(torch.isfinite(want).all())
        scale = stored_experts.per_token_scale(want)
        bound = act_flip_bound(x, gate, up, down, ids, w) * scale
        for threshold, path in ((10**9, "decode"), (1, "prefill")):
            got = CpuMoE(layer, prefill_min_tokens=threshold)(x, ids, w)
            assert_close(got.double() * scale, want.double() * scale, bound, f"{path} T={num_tokens} K={top_k}")


def test_bench_takes_fp8():
    """`hybrid-bench cpu-moe --dtype fp8`: its random layers (every byte, NaN codes included: speed only) run."""
    layer = bench.random_layer("small", "fp8", 0)
    assert layer.spec.group_size == bench.GROUPS["fp8"] == 128
    _, hidden, _, top_k = bench.SHAPES["small"]
    ids = torch.arange(top_k)[None]
    assert CpuMoE(layer)(torch.ones(1, hidden), ids, torch.ones(1, top_k)).shape == (1, hidden)
