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

from cpu_experts import formats, kernels_fp8

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
                                 whole)
    for u, e in enumerate(experts):
        for p in range(offsets[u], offsets[u + 1]):
            g, v = wg[e] @ x[pair_token[p]], wu[e] @ x[pair_token[p]]
            want = g / (1 + np.exp(-g)) * v
            # one bf16 step: act is rounded to bf16 after float32 sums that may sit either side of a midpoint
            assert np.all(np.abs(whole[p] - want) <= np.abs(want) * 2.0 ** -8 + 1e-6), (p, whole[p], want)
    split = np.full_like(whole, np.nan)
    for lo, hi in ((0, 5), (5, 9), (9, num_items)):  # 5..9 crosses from the first routed expert to the second
        kernels_fp8.gate_up_rows_fp8(lo, hi, experts, offsets, pair_token, gate, gate_s, up, up_s, x, group, split)
    assert np.array_equal(whole, split)
