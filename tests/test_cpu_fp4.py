"""MXFP4 and NVFP4 experts on the CPU (`cpu_experts.kernels_fp4`, the prefill's dequantization) against the float
reference on the dequantized stored weights with bf16-rounded activations (`moe_reference(bf16_activations=True)`).

Layers are built as checkpoints store them: random e2m1 codes (every code in every row), E8M0 scales over a wide
range with zeros (2^-127) among them, e4m3 block scales with subnormals, zero and 448, tensor scales not 1. Shapes:
H = 80, I = 96 (whole and partial 16-byte chunks, an NVFP4 group alone in a row's tail) and H = 33, I = 45 (a half
byte at the end of every gate row, an odd partition whose last byte pairs with no act column); 1 and 3 partitions;
1, 3, 17 and 300 tokens, top-k 1, 2 and 8, -1 ids. E8M0's extreme scales (0 and 254, each with activations that
keep the row's dot a normal float), under a flush-to-zero mode too, on single rows; and through the operator
(decode, dequantizing prefill) in a layer read as DeepSeek-V4 stores it (`tests/stored_experts.py`).

Tolerance: float32 summation order, 1e-5 of the largest output, plus, where the reference's act = silu(gate) * up
lies within summation error of a bf16 rounding boundary, the one bf16 step it may round the other way
(`rounding_slack`): both sides round act to bf16, so such an element may differ by a step after any correct sum.
"""

from __future__ import annotations

import numpy as np
import pytest
import stored_experts
import torch
import torch.nn.functional as F
from numba import njit
from numba.extending import intrinsic

from cpu_experts import formats, kernels_fp4, kernels_fp4_ir
from cpu_experts.expert_file import ALLOWED_SCALES, FIXED_GROUP, ExpertLayerSpec, dequantize_matrix
from cpu_experts.kernel_table import PREFILL_MIN_TOKENS
from cpu_experts.operator import CpuMoE
from cpu_experts.packed import PackedLayer
from cpu_experts.reference import moe_reference

FORMATS = ("mxfp4", "nvfp4")
SHAPES = ((8, 80, 96), (8, 33, 45))  # (E, H, I)
REL_TOL = 1e-5
SUM_ERROR = 32 * 2.0 ** -24  # a float32 dot's error, relative to the sum of its terms' magnitudes (generous)


def stored_layer(fmt: str, num_experts: int, hidden: int, inter: int, partitions: int, seed: int = 0):
    """A layer as a checkpoint stores it, and its dequantized gate, up, down (the reference's weights)."""
    gen = torch.Generator().manual_seed(seed)
    spec = ExpertLayerSpec(num_experts, hidden, inter, fmt, FIXED_GROUP[fmt], ALLOWED_SCALES[fmt][0])
    tensors, deq = {}, []
    for role in ("gate", "up", "down"):
        n, k = spec.matrix_shape(role)
        codes = torch.randint(0, 16, (num_experts, n, k), generator=gen)
        codes[:, :, :16] = torch.arange(16)  # every code, in every row
        groups = -(-k // FIXED_GROUP[fmt])
        if fmt == "mxfp4":  # 2^-9 .. 2^0, and one group in five 2^-127 (its weights subnormal)
            scales = torch.randint(118, 128, (num_experts, n, groups), generator=gen)
            scales[torch.rand(scales.shape, generator=gen) < 0.2] = 0
        else:  # e4m3 0.125 .. 1.875, and among them 0, subnormals (2^-9 .. 7 * 2^-9) and 448
            scales = torch.randint(0x28, 0x40, (num_experts, n, groups), generator=gen)
            special = torch.tensor([0x00, 0x01, 0x05, 0x07, 0x7E])
            pick = torch.rand(scales.shape, generator=gen) < 0.25
            scales[pick] = special[torch.randint(0, 5, (int(pick.sum()),), generator=gen)]
            tensors[f"{role}.tensor_scale"] = torch.rand(num_experts, generator=gen) * 0.01 + 0.003
        tensors[f"{role}.weight"] = torch.stack([formats.pack_fp4(codes[e]) for e in range(num_experts)])
        tensors[f"{role}.scales"] = scales.to(torch.uint8)
        ts = tensors.get(f"{role}.tensor_scale")
        deq.append(torch.stack([dequantize_matrix(tensors[f"{role}.weight"][e], tensors[f"{role}.scales"][e], role,
                                                  spec, None if ts is None else ts[e]) for e in range(num_experts)]))
    return PackedLayer.from_file_tensors(tensors, spec, partitions), deq


@pytest.fixture(scope="module")
def layers():
    cache = {}

    def get(fmt, shape, partitions):
        key = (fmt, shape, partitions)
        if key not in cache:
            cache[key] = stored_layer(fmt, *shape, partitions, seed=len(cache))
        return cache[key]
    return get


def routing(num_experts: int, num_tokens: int, top_k: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(num_tokens)])
    ids[torch.rand(ids.shape, generator=gen) < 0.25] = -1
    if num_tokens > 1:
        ids[1] = -1  # a token with nothing to compute here
    return ids, torch.rand(num_tokens, top_k, generator=gen)


def rounding_slack(x, gate, up, down, ids, weights) -> torch.Tensor:
    """Per output element: what act's bf16 rounding may move it by where the reference's act lies within float32
    summation error of a rounding boundary (the interval act +- error rounds to two bf16 values)."""
    slack = torch.zeros(x.shape, dtype=torch.float64)
    xb = x.bfloat16().float()
    for e in torch.unique(ids[ids >= 0]).tolist():
        tok, k = torch.where(ids == e)
        rows = xb[tok]
        g, u = rows @ gate[e].T, rows @ up[e].T
        g_err = SUM_ERROR * (rows.abs() @ gate[e].abs().T)
        u_err = SUM_ERROR * (rows.abs() @ up[e].abs().T)
        sig = torch.sigmoid(g)
        act = F.silu(g) * u
        err = (sig * (1 + g * (1 - sig))).abs() * g_err * u.abs() + F.silu(g).abs() * u_err + SUM_ERROR * act.abs()
        step = ((act + err).bfloat16().float() - (act - err).bfloat16().float()).double()
        slack.index_add_(0, tok, weights[tok, k, None].double() * (step @ down[e].abs().T.double()))
    return slack


def check(got, want, slack, what, factor=1.0):
    bound = factor * (REL_TOL * max(float(want.abs().max()), 1e-3) + slack)
    excess = ((got.double() - want.double()).abs() - bound).max()
    assert float(excess) <= 0, f"{what}: off by {float(excess):.3e} beyond the bound (max |ref| " \
                               f"{float(want.abs().max()):.3e})"


CASES = [(1, 1), (3, 2), (17, 8), (300, 8)]  # (tokens, top-k)


@pytest.mark.parametrize("partitions", [1, 3])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("fmt", FORMATS)
def test_matches_reference(layers, fmt, shape, partitions):
    layer, (gate, up, down) = layers(fmt, shape, partitions)
    num_experts, hidden, inter = shape
    assert len(layer.partitions) == min(partitions, -(-inter // 32))
    decode = CpuMoE(layer, prefill_min_tokens=10**9)
    prefill = CpuMoE(layer, prefill_min_tokens=1)
    default = CpuMoE(layer)
    assert not default.is_w8a8 and default.prefill_min_tokens == PREFILL_MIN_TOKENS[fmt]
    for seed, (num_tokens, top_k) in enumerate(CASES):
        ids, w = routing(num_experts, num_tokens, top_k, seed)
        x = torch.randn(num_tokens, hidden, generator=torch.Generator().manual_seed(100 + seed))
        want = moe_reference(x, gate, up, down, ids, w, bf16_activations=True)
        slack = rounding_slack(x, gate, up, down, ids, w)
        got_decode, got_prefill = decode(x, ids, w), prefill(x, ids, w)
        what = f"{fmt} H={hidden} I={inter} P={partitions} T={num_tokens} K={top_k}"
        check(got_decode, want, slack, f"decode {what}")
        check(got_prefill, want, slack, f"prefill {what}")
        check(got_decode, got_prefill, slack, f"decode vs prefill {what}", factor=2.0)
        assert torch.equal(default(x, ids, w), got_decode if num_tokens < default.prefill_min_tokens else got_prefill)
        # the activations' dtype does not matter: both paths round them to bf16 first
        assert torch.equal(decode(x.bfloat16(), ids, w), got_decode.bfloat16())


def _split(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x float32 [K] -> the kernels' activations x_even, x_odd [1, ceil(K / 2)] (bf16-rounded)."""
    half = -(-x.shape[0] // 2)
    x_even, x_odd = np.empty((1, half), np.float32), np.empty((1, half), np.float32)
    kernels_fp4.split_bf16(x[None], x_even, x_odd)
    return x_even, x_odd


@njit
def _row_dots(w, s, x_even, x_odd, is_mx):
    """Each row of w [1, N, B] (scale bits s [1, N, G]) . x[0], as the kernels compute it (NVFP4: before the
    tensor scale)."""
    out = np.empty(w.shape[1], dtype=np.float32)
    for n in range(w.shape[1]):
        if is_mx:
            out[n] = kernels_fp4.dot_mxfp4(w, s, 0, n, kernels_fp4.MX_FACTORS, x_even, x_odd, 0)
        else:
            out[n] = kernels_fp4.dot_nvfp4(w, s, 0, n, kernels_fp4.NV_FACTORS, x_even, x_odd, 0)
    return out


def row_dots(packed: torch.Tensor, scales: torch.Tensor, x_even, x_odd, is_mx: bool) -> torch.Tensor:
    return torch.from_numpy(_row_dots(packed[None].numpy(), scales[None].numpy(), x_even, x_odd, is_mx)).double()


def test_e8m0_extremes_on_single_rows():
    """E8M0 scales 0 (2^-127: the dequantized weights are float32 subnormals) and 254 (2^127: codes up to 1.5, more
    would overflow float32), each on a row of its own and mixed with ordinary ones, against activations that keep
    each group's share of the dot a normal float (2^clamp(127 - s, -120, 100)); the same results with denormals
    flushed to zero (a mode some libraries set): the scale is never a subnormal operand, so the groups at 2^-127
    still count."""
    gen = torch.Generator().manual_seed(5)
    cols = 1000  # 31 whole chunks (an odd count) and a partial group of 8 columns in the tail
    num_groups = -(-cols // 32)
    rows = [torch.zeros(num_groups), torch.full((num_groups,), 254),
            torch.tensor([1, 127, 2, 200, 60, 127, 254, 0] * 4)[:num_groups]]
    for flush in (False, True):
        for scale_bits in rows:
            col_scale = scale_bits.long().repeat_interleave(32)[:cols]
            codes = torch.randint(0, 16, (1, cols), generator=gen)
            codes[:, :16] = torch.arange(16)
            codes = torch.where((col_scale == 254) & (codes % 8 > 3), codes & 0b1011, codes)  # |value| <= 1.5
            x_exponent = (127 - col_scale).clamp(-120, 100).double()
            magnitude = (1 + torch.rand(cols, generator=gen)) * torch.sign(torch.randn(cols, generator=gen))
            x = (magnitude * torch.exp2(x_exponent).float()).bfloat16().float()  # normal floats, as DAZ keeps them
            packed, scales = formats.pack_fp4(codes), scale_bits.to(torch.uint8)[None]
            deq = formats.dequantize_mxfp4(packed, scales, cols)[0].double()
            assert bool(torch.isfinite(deq).all())
            want, magnitude = float(deq @ x.double()), float(deq.abs() @ x.abs().double())
            x_even, x_odd = _split(x.numpy())
            assert torch.set_flush_denormal(flush)
            try:
                got = float(row_dots(packed, scales, x_even, x_odd, True)[0])
            finally:
                torch.set_flush_denormal(False)
            assert 1e-30 < magnitude < 1e30 and abs(got - want) <= 1e-6 * magnitude, \
                f"scales {scale_bits[:4].tolist()}.., flush to zero {flush}: {got} vs {want}"


@pytest.fixture(scope="module")
def extreme_layer():
    return stored_experts.extreme_mxfp4_layer(EXTREME_H, EXTREME_I)


EXTREME_H, EXTREME_I = 256, 192
EXTREME_CASES = [(1, 1), (3, 2), (17, 8), (300, 2)]  # 300 at top-2: the small class's subnormal weights are slow


@pytest.mark.parametrize("partitions", [1, 3])
def test_e8m0_extremes_through_the_operator(extreme_layer, partitions):
    """E8M0 scales 254 (2^127, on codes up to 1.5: finite) and 0 (2^-127) beside 250-253 and 1-4 in every row, read
    as DeepSeek-V4 stores MXFP4 experts, in three classes of experts each with tokens sized for it
    (`stored_experts`), through `CpuMoE` on the decode and the dequantizing prefill paths: exact (README: e2m1 value
    x 2^(E8M0 - 127)), each token compared on its own scale."""
    tensors, spec, (gate, up, down) = extreme_layer
    layer = PackedLayer.from_file_tensors(tensors, spec, partitions)
    assert len(layer.partitions) == partitions
    decode, prefill = CpuMoE(layer, prefill_min_tokens=10**9), CpuMoE(layer, prefill_min_tokens=1)
    for seed, (num_tokens, top_k) in enumerate(EXTREME_CASES):
        x, ids, w = stored_experts.class_tokens(num_tokens, EXTREME_H, top_k, seed)
        want = moe_reference(x, gate, up, down, ids, w, bf16_activations=True)
        assert bool(torch.isfinite(want).all())
        scale = stored_experts.per_token_scale(want)
        slack = rounding_slack(x, gate, up, down, ids, w) * scale
        for op, path in ((decode, "decode"), (prefill, "prefill")):
            check(op(x, ids, w).double() * scale, want.double() * scale, slack, f"{path} T={num_tokens} K={top_k}")


def test_nvfp4_block_scales_on_single_rows():
    """Every e4m3 block scale from 0 through the subnormals (2^-9 ..) to 448, each alone on a row, then rows whose
    groups' scales all differ (each group's own scale, the tail's two groups included); the kernel's dot before
    the tensor scale, times it, against the reference's weights (tensor scale applied per element)."""
    gen = torch.Generator().manual_seed(6)
    cols = 220  # 13 whole groups and a partial one: 6 chunks, then 14 bytes (two groups, the second partial)
    num_groups = -(-cols // 16)
    bits = torch.arange(0, 0x7F, dtype=torch.uint8)  # 0x7F is NaN
    mixed = torch.randint(0x28, 0x48, (16, num_groups), generator=gen, dtype=torch.uint8)
    scales = torch.cat([bits[:, None].expand(-1, num_groups), mixed]).contiguous()
    codes = torch.randint(0, 16, (len(scales), cols), generator=gen)
    codes[:, :16] = torch.arange(16)
    packed = formats.pack_fp4(codes)
    tensor_scale = torch.tensor(0.0371)
    x = torch.randn(cols, generator=gen).bfloat16().float()
    deq = formats.dequantize_nvfp4(packed, scales, tensor_scale, cols).double()
    want, magnitude = deq @ x.double(), deq.abs() @ x.abs().double()
    x_even, x_odd = _split(x.numpy())
    got = row_dots(packed, scales, x_even, x_odd, False) * float(tensor_scale)
    assert bool((got[1:] != 0).all()) and got[0] == 0
    assert float(((got - want).abs() / magnitude.clamp(min=1e-30)).max()) <= 1e-6


def test_round_bf16_matches_torch():
    """The kernels' activation rounding is torch's (to nearest, ties to even), including ties, overflow to
    infinity, subnormals and NaN."""
    gen = torch.Generator().manual_seed(7)
    base = torch.randn(4096, generator=gen).bfloat16().float()
    tie = (base.view(torch.int32) + 0x8000).view(torch.float32)  # exactly between two bf16 values
    special = torch.tensor([0.0, -0.0, 1e-40, -3e-39, 3.4e38, -3.4e38, float("inf"), float("-inf"), 1.00390625,
                            1.01171875, 65504.0, 1e-20])
    x = torch.cat([torch.randn(4096, generator=gen) * 100, tie, special, torch.tensor([float("nan")])])
    want = x.bfloat16().float()
    x_even, x_odd = _split(x.numpy())
    got = torch.from_numpy(np.stack([x_even[0], x_odd[0]], axis=1).reshape(-1)[:len(x)].copy())
    assert torch.equal(got[:-1].view(torch.int32), want[:-1].view(torch.int32))
    assert torch.isnan(got[-1])


def _mode_codegen(is_mx, mode):
    def typer(typingctx, w, s, e, n, table, x_even, x_odd, t):
        return (kernels_fp4_ir._signature(1)(w, s, e, n, table, x_even, x_odd, t),
                kernels_fp4_ir._fp4_codegen(kernels_fp4_ir.ONE_ROW, is_mx, mode=mode))
    return intrinsic(typer)


# the decodings this CPU does not compile by default: the generic IR, `pshufb` where AVX-512 takes `vpermps` (an AVX2
# CPU compiles `pshufb` by default and cannot run `vpermps`), and the scaled lookups written lane by lane ("lanes",
# `vpermps`' arithmetic on any CPU)
OTHER_MODES = ["portable", "lanes"] + (["shuffle"] if kernels_fp4_ir.decode_mode() == "permute" else [])
_OTHER = {(mode, is_mx): _mode_codegen(is_mx, mode) for mode in OTHER_MODES for is_mx in (True, False)}


def _other_row_dots(mode):
    mx, nv = _OTHER[mode, True], _OTHER[mode, False]

    @njit
    def row_dots(w, s, x_even, x_odd, is_mx):
        out = np.empty(w.shape[1], dtype=np.float32)
        for n in range(w.shape[1]):
            if is_mx:
                out[n] = mx(w, s, 0, n, kernels_fp4.MX_FACTORS, x_even, x_odd, 0)
            else:
                out[n] = nv(w, s, 0, n, kernels_fp4.NV_FACTORS, x_even, x_odd, 0)
        return out
    return row_dots


def _is_scaled(mode):
    return mode in kernels_fp4_ir.SCALED_MODES


@pytest.mark.parametrize("mode", OTHER_MODES)
@pytest.mark.parametrize("fmt", FORMATS)
def test_every_nibble_decoding_gives_the_same_sums(fmt, mode):
    """Every decoding against this CPU's: bit for bit within a family (the factored ones: generic IR, `pshufb`;
    the scaled ones: `vpermps`, lane by lane), within float32 summation order across them (the products are the
    same, their sums' order is not). Rows mix E8M0 bytes 0 and 1 (the scaled path's exception, checked with
    denormals flushed) with ordinary scales."""
    rng = np.random.default_rng(8)
    num_bytes = 170  # 10 chunks and a tail of 10 bytes
    rows = rng.integers(0, 256, (1, 4, num_bytes), dtype=np.uint8)
    rows[0, :, :16] = np.arange(16) * 17
    is_mx = fmt == "mxfp4"
    scales = rng.integers(100, 111, (1, 4, -(-num_bytes // 16)), dtype=np.uint8) if is_mx else \
        rng.integers(0x28, 0x40, (1, 4, -(-num_bytes // 8)), dtype=np.uint8)
    x_even, x_odd = _split(rng.standard_normal(2 * num_bytes).astype(np.float32))
    if is_mx:  # tiny groups (2^-127, 2^-126), their products brought near the others' by x
        scales[0, :, 1::3] = [0, 1, 0, 1]
        for group in (1, 4, 7, 10):
            x_even[0, 16 * group:16 * group + 16] *= np.float32(2.0**110)
            x_odd[0, 16 * group:16 * group + 16] *= np.float32(2.0**110)
    table = _row_dots(rows, scales, x_even, x_odd, is_mx)
    # the scaled lookups under denormals-are-zero: bytes 0 and 1 must not reach their tables' subnormals
    assert torch.set_flush_denormal(_is_scaled(mode)) or not _is_scaled(mode)
    try:
        other = _other_row_dots(mode)(rows, scales, x_even, x_odd, is_mx)
    finally:
        torch.set_flush_denormal(False)
    assert bool((table != 0).all()) and bool(np.isfinite(table).all())
    if _is_scaled(mode) == _is_scaled(kernels_fp4_ir.decode_mode()):
        assert np.array_equal(table, other)
    else:
        magnitude = _other_row_dots("portable")(rows & 0x77, scales, np.abs(x_even), np.abs(x_odd), is_mx)  # |w| |x|
        assert np.abs(table - other).max() <= 1e-6 * np.abs(magnitude).max()


@pytest.mark.parametrize("fmt", FORMATS)
def test_bench_layers(fmt):
    """`hybrid-bench cpu-moe --dtype mxfp4,nvfp4`: its random layers are valid and give finite outputs."""
    from cpu_experts.bench import random_layer

    layer = random_layer("small", fmt, 0)
    assert layer.spec.group_size == FIXED_GROUP[fmt] and layer.spec.scale_dtype == ALLOWED_SCALES[fmt][0]
    ids = torch.tensor([[0, 5, 9, 31]])
    out = CpuMoE(layer)(torch.randn(1, layer.spec.hidden_size), ids, torch.rand(1, 4))
    assert bool(torch.isfinite(out).all()) and float(out.abs().max()) > 0
