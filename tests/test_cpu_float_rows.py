"""The float formats' decode loop bodies over work ranges (`gate_up_rows_<fmt>`, `down_rows_<fmt>`, what a decode
pool calls), on shapes that take every path: the unrolled common group and the looped other groups, groups the
vector loop cannot take (the scalar tail), partial last groups, ranges that are not a multiple of the four rows a
down call takes and that cross from one routed expert to the next. Against a float64 reference on the decoded
weights; and each output the same, bit for bit, whichever range split computed it (a row's dot must not depend on
the rows it shares a call with, or a pool's split would change results).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cpu_experts import formats, kernels_fp4, kernels_fp8

E4M3_CODES = np.array([c for c in range(256) if c not in (0x7F, 0xFF)], dtype=np.uint8)
REL_TOL = 1e-5  # of sum |w x|: float32 summation order


def _bf16(values: np.ndarray) -> np.ndarray:
    return torch.from_numpy(values.astype(np.float32)).bfloat16().float().numpy()


def _fp8_rows(rng, num_experts, rows, cols, group):
    codes = E4M3_CODES[rng.integers(0, len(E4M3_CODES), (num_experts, rows, cols))]
    scales = rng.uniform(0.5, 2, (num_experts, rows, -(-cols // group))).astype(np.float32)
    values = formats.e4m3_to_float(torch.from_numpy(codes)).double().numpy()
    return codes, scales, values * np.repeat(scales, group, axis=2)[:, :, :cols]


def _routing(num_experts):
    """Experts 2 and 0 routed, three pairs: (expert 2: tokens 0, 1), (expert 0: token 1)."""
    return (np.array([2, 0]), np.array([0, 2, 3]), np.array([0, 1, 1]), np.array([0.5, -0.25, 1.5], np.float32))


# groups: 128 (unrolled), 32 and 64 (looped), 48 (scalar tail only); columns with and without a partial group
FP8_SHAPES = [(128, 256 + 40), (128, 256), (32, 96 + 20), (64, 128), (48, 100)]


@pytest.mark.parametrize("group,cols", FP8_SHAPES)
def test_fp8_down_rows(group, cols):
    rng = np.random.default_rng(group + cols)
    num_hidden = 23  # five four-row calls and three single rows in one range
    codes, scales, weights = _fp8_rows(rng, 3, num_hidden, cols, group)
    experts, offsets, pair_token, pair_weight = _routing(3)
    act = _bf16(rng.standard_normal((3, cols + 5)))  # wider than the rows: a pool's scratch
    want = np.zeros((2, num_hidden))
    magnitude = np.zeros((2, num_hidden))
    for u, e in enumerate(experts):
        for p in range(offsets[u], offsets[u + 1]):
            want[pair_token[p]] += pair_weight[p] * (weights[e] @ act[p, :cols])
            magnitude[pair_token[p]] += abs(pair_weight[p]) * (np.abs(weights[e]) @ np.abs(act[p, :cols]))
    whole = np.zeros((2, num_hidden), np.float32)
    kernels_fp8.down_rows_fp8(0, num_hidden, experts, offsets, pair_token, pair_weight, codes, scales, act, group,
                              whole)
    assert float((np.abs(whole - want) - REL_TOL * magnitude).max()) <= 0
    split = np.zeros_like(whole)
    for lo, hi in ((0, 3), (3, 4), (4, 13), (13, num_hidden)):
        kernels_fp8.down_rows_fp8(lo, hi, experts, offsets, pair_token, pair_weight, codes, scales, act, group,
                                  split)
    assert np.array_equal(whole, split)


def _silu_mul_bf16(g, v):
    return _bf16(g / (1 + np.exp(-g)) * v)


@pytest.mark.parametrize("group,cols", FP8_SHAPES)
def test_fp8_gate_up_rows(group, cols):
    rng = np.random.default_rng(2 * group + cols)
    rows = 7
    (gate, gate_s, wg), (up, up_s, wu) = (_fp8_rows(rng, 3, rows, cols, group) for _ in range(2))
    experts, offsets, pair_token, _ = _routing(3)
    x = _bf16(rng.standard_normal((2, cols)) * 0.05)
    num_items = len(experts) * rows
    whole = np.full((3, rows), np.nan, np.float32)
    kernels_fp8.gate_up_rows_fp8(0, num_items, experts, offsets, pair_token, gate, gate_s, up, up_s, x, group,
                                 None, whole)
    for u, e in enumerate(experts):
        for p in range(offsets[u], offsets[u + 1]):
            g, v = wg[e] @ x[pair_token[p]], wu[e] @ x[pair_token[p]]
            want = g / (1 + np.exp(-g)) * v
            # one bf16 step: act is rounded to bf16 after float32 sums that may sit either side of a midpoint
            assert np.all(np.abs(whole[p] - want) <= np.abs(want) * 2.0 ** -8 + 1e-6), (p, whole[p], want)
    split = np.full_like(whole, np.nan)
    for lo, hi in ((0, 5), (5, 9), (9, num_items)):  # 5..9 crosses from the first routed expert to the second
        kernels_fp8.gate_up_rows_fp8(lo, hi, experts, offsets, pair_token, gate, gate_s, up, up_s, x, group, None,
                                     split)
    assert np.array_equal(whole, split)


# ---- MXFP4 / NVFP4 ---------------------------------------------------------------------------------------------

def _fp4_rows(rng, fmt, num_experts, rows, cols):
    """Packed codes, scale bits and (NVFP4) tensor scales, with the weights they decode to (float64)."""
    codes = torch.from_numpy(rng.integers(0, 16, (num_experts, rows, cols)))
    packed = torch.stack([formats.pack_fp4(codes[e]) for e in range(num_experts)])
    group = kernels_fp4.MX_GROUP if fmt == "mxfp4" else kernels_fp4.NV_GROUP
    lo, hi = (120, 130) if fmt == "mxfp4" else (0x28, 0x40)
    scales = torch.from_numpy(rng.integers(lo, hi, (num_experts, rows, -(-cols // group)), dtype=np.uint8))
    tensor_scale = torch.from_numpy(rng.uniform(0.5, 2, num_experts).astype(np.float32))
    if fmt == "mxfp4":
        weights = [formats.dequantize_mxfp4(packed[e], scales[e], cols) for e in range(num_experts)]
    else:
        weights = [formats.dequantize_nvfp4(packed[e], scales[e], tensor_scale[e], cols) for e in range(num_experts)]
    return packed.numpy(), scales.numpy(), tensor_scale.numpy(), torch.stack(weights).double().numpy()


def _split(x):
    half = -(-x.shape[1] // 2)
    x_even, x_odd = np.empty((x.shape[0], half), np.float32), np.empty((x.shape[0], half), np.float32)
    kernels_fp4.split_bf16(x, x_even, x_odd)
    return x_even, x_odd


def _down_fp4(fmt, lo, hi, routing, down, down_s, down_ts, a_even, a_odd, out):
    experts, offsets, pair_token, pair_weight = routing
    if fmt == "mxfp4":
        kernels_fp4.down_rows_mxfp4(lo, hi, experts, offsets, pair_token, pair_weight, down, down_s, a_even, a_odd,
                                    out)
    else:
        kernels_fp4.down_rows_nvfp4(lo, hi, experts, offsets, pair_token, pair_weight, down, down_s, down_ts,
                                    a_even, a_odd, out)


FP4_COLS = [256, 96 + 20, 45]  # whole chunks; a partial chunk; an odd count (a half byte)


@pytest.mark.parametrize("cols", FP4_COLS)
@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_fp4_down_rows(fmt, cols):
    rng = np.random.default_rng(cols)
    num_hidden = 23
    down, down_s, down_ts, weights = _fp4_rows(rng, fmt, 3, num_hidden, cols)
    routing = _routing(3)
    experts, offsets, pair_token, pair_weight = routing
    act = _bf16(rng.standard_normal((3, cols)))
    a_even, a_odd = _split(act)
    want, magnitude = np.zeros((2, num_hidden)), np.zeros((2, num_hidden))
    for u, e in enumerate(experts):
        for p in range(offsets[u], offsets[u + 1]):
            want[pair_token[p]] += pair_weight[p] * (weights[e] @ act[p])
            magnitude[pair_token[p]] += abs(pair_weight[p]) * (np.abs(weights[e]) @ np.abs(act[p]))
    whole = np.zeros((2, num_hidden), np.float32)
    _down_fp4(fmt, 0, num_hidden, routing, down, down_s, down_ts, a_even, a_odd, whole)
    assert float((np.abs(whole - want) - REL_TOL * magnitude).max()) <= 0
    split = np.zeros_like(whole)
    for lo, hi in ((0, 3), (3, 4), (4, 13), (13, num_hidden)):
        _down_fp4(fmt, lo, hi, routing, down, down_s, down_ts, a_even, a_odd, split)
    assert np.array_equal(whole, split)


@pytest.mark.parametrize("cols", FP4_COLS)
@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_fp4_gate_up_rows(fmt, cols):
    rng = np.random.default_rng(2 * cols + 1)
    rows = 7  # odd: the last column's act_odd is zeroed
    (gate, gate_s, gate_ts, wg), (up, up_s, up_ts, wu) = (_fp4_rows(rng, fmt, 3, rows, cols) for _ in range(2))
    experts, offsets, pair_token, _ = _routing(3)
    x = _bf16(rng.standard_normal((2, cols)) * 0.1)
    x_even, x_odd = _split(x)
    num_items = len(experts) * rows

    def run(lo, hi, act_even, act_odd):
        if fmt == "mxfp4":
            kernels_fp4.gate_up_rows_mxfp4(lo, hi, experts, offsets, pair_token, gate, gate_s, up, up_s, x_even,
                                           x_odd, None, act_even, act_odd)
        else:
            kernels_fp4.gate_up_rows_nvfp4(lo, hi, experts, offsets, pair_token, gate, gate_s, gate_ts, up, up_s,
                                           up_ts, x_even, x_odd, None, act_even, act_odd)

    whole = [np.full((3, (rows + 1) // 2), np.nan, np.float32) for _ in range(2)]
    run(0, num_items, *whole)
    act = np.stack(whole, axis=2).reshape(3, -1)
    assert np.all(act[:, rows] == 0)  # past the odd partition's last column
    for u, e in enumerate(experts):
        for p in range(offsets[u], offsets[u + 1]):
            g, v = wg[e] @ x[pair_token[p]], wu[e] @ x[pair_token[p]]
            want = g / (1 + np.exp(-g)) * v
            assert np.all(np.abs(act[p, :rows] - want) <= np.abs(want) * 2.0 ** -8 + 1e-6), (p, act[p], want)
    split = [np.full_like(whole[0], np.nan) for _ in range(2)]
    for lo, hi in ((0, 5), (5, 9), (9, num_items)):
        run(lo, hi, *split)
    assert all(np.array_equal(a, b) for a, b in zip(whole, split, strict=True))
