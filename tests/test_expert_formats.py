"""INT8 / INT4 expert weight formats: round trips within half a quantization step, awkward shapes, packing."""

import pytest
import torch

from cpu_experts.formats import (
    dequantize_int4,
    dequantize_int8,
    pack_int4,
    quantize_int4,
    quantize_int8,
    unpack_int4,
)


@pytest.mark.parametrize("shape,group", [((5, 7), None), ((3, 128), 32), ((4, 300), 128), ((1, 1), None)])
def test_int8_round_trip_within_half_step(shape, group):
    w = torch.randn(*shape) * torch.logspace(-3, 1, shape[0])[:, None]  # rows of very different magnitude
    q, scales = quantize_int8(w, group)
    assert q.dtype == torch.int8 and q.shape == w.shape
    assert scales.shape == (shape[0], -(-shape[1] // (group or shape[1])))
    step = scales.repeat_interleave(group or shape[1], dim=1)[:, : shape[1]]
    err = (dequantize_int8(q, scales, group) - w).abs()
    assert (err <= step / 2 + 1e-7).all()
    assert q.abs().max() == 127  # the largest value of a group uses the full range


@pytest.mark.parametrize("shape,group", [((6, 129), 128), ((2, 64), 32), ((3, 5), 4)])
def test_int4_round_trip_and_layout(shape, group):
    w = torch.randn(*shape)
    packed, scales = quantize_int4(w, group)
    assert packed.dtype == torch.uint8 and packed.shape == (shape[0], -(-shape[1] // 2))
    deq = dequantize_int4(packed, scales, group, shape[1])
    step = scales.repeat_interleave(group, dim=1)[:, : shape[1]]
    assert ((deq - w).abs() <= step / 2 + 1e-7).all()
    rel = (deq - w).norm() / w.norm()
    assert 0.01 < rel < 0.15  # 4 bits: lossy, but not garbage


def test_int4_packing_is_exact_and_low_nibble_first():
    q = torch.tensor([[-8, 7, 0, -1, 3]], dtype=torch.int8)
    packed = pack_int4(q)
    assert packed.tolist() == [[0 | (15 << 4), 8 | (7 << 4), 11 | (8 << 4)]]
    assert torch.equal(unpack_int4(packed, 5), q)


def test_all_zero_groups_stay_zero():
    w = torch.zeros(2, 8)
    w[1, 4:] = 1.0
    q, scales = quantize_int8(w, 4)
    assert torch.equal(dequantize_int8(q, scales, 4), w) and torch.isfinite(scales).all()
    packed, s4 = quantize_int4(w, 4)
    assert torch.equal(dequantize_int4(packed, s4, 4, 8), w)
