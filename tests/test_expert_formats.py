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


@pytest.mark.parametrize("cols", [64, 77, 96])
def test_compressed_tensors_words_are_the_int4_layout(cols):
    """A compressed-tensors `weight_packed` int32 row, read as bytes, is the experts' INT4 row: copying it loses
    nothing, the -8 code included (what `hybrid-convert` does with Kimi-K2's experts)."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    from hybrid.compressed_tensors import int4_bytes

    q = torch.randint(-8, 8, (5, cols), generator=torch.Generator().manual_seed(cols), dtype=torch.int8)
    q[:, 0] = -8
    copied = int4_bytes(pack_to_int32(q, 4), cols)
    assert copied.dtype == torch.uint8 and copied.shape == (5, -(-cols // 2))
    assert torch.equal(unpack_int4(copied, cols), q)
    assert torch.equal(copied[:, : cols // 2], pack_int4(q)[:, : cols // 2])


def test_scale_dtype_in_the_expert_file_spec():
    from cpu_experts.expert_file import ExpertLayerSpec, dequantize_matrix

    spec = ExpertLayerSpec(2, 64, 96, "int4", 32, "bfloat16")
    assert ExpertLayerSpec.from_metadata(spec.metadata(3)) == spec
    assert spec.tensor_shapes()["down.scales"] == ((2, 64, 3), torch.bfloat16)
    old = {k: v for k, v in ExpertLayerSpec(2, 64, 96, "int4", 32).metadata(3).items() if k != "scale_dtype"}
    assert ExpertLayerSpec.from_metadata(old).scale_dtype == "float32"  # files of earlier converters
    for dtype, scale_dtype in (("int8", "bfloat16"), ("int4", "float16")):
        with pytest.raises(ValueError, match="scale dtype"):
            ExpertLayerSpec(2, 64, 96, dtype, 32, scale_dtype)
    q = torch.randint(-8, 8, (64, 96), dtype=torch.int8)
    scales = torch.rand(64, 3).bfloat16()
    want = q.float() * scales.float().repeat_interleave(32, dim=1)
    assert torch.equal(dequantize_matrix(pack_int4(q), scales, "down", spec), want)  # bfloat16 widened exactly


def test_float_formats_round_trip_and_codes():
    """FP8, MXFP4 and NVFP4: quantize -> dequantize stays within each format's step, every code decodes to its
    table value, and E8M0's extremes widen exactly."""
    import pytest
    import torch

    from cpu_experts import formats
    from cpu_experts.expert_file import ExpertLayerSpec

    codes = torch.arange(256, dtype=torch.uint8)
    e4m3 = formats.e4m3_to_float(codes)
    assert e4m3[0x7E] == 448 and e4m3[0x01] == 2.0 ** -9 and e4m3[0x80] == 0 and torch.isnan(e4m3[0x7F])
    assert formats.e2m1_to_float(torch.arange(16)).tolist()[:8] == [0, 0.5, 1, 1.5, 2, 3, 4, 6]
    assert formats.e8m0_to_float(torch.tensor([0, 127, 254], dtype=torch.uint8)).tolist() == \
        [2.0 ** -127, 1.0, 2.0 ** 127]
    with pytest.raises(ValueError, match="255"):
        formats.e8m0_to_float(torch.tensor([255], dtype=torch.uint8))
    w = torch.randn(7, 75)
    q, s = formats.quantize_fp8(w, 128)
    assert (formats.dequantize_fp8(q, s, 128) - w).abs().max() <= w.abs().max() / 16
    packed, s = formats.quantize_mxfp4(w)
    assert packed.shape == (7, 38) and s.shape == (7, 3)
    assert (formats.dequantize_mxfp4(packed, s, 75) - w).abs().max() <= w.abs().max() / 3
    packed, s, ts = formats.quantize_nvfp4(w)
    assert s.shape == (7, 5) and ts.dim() == 0
    assert (formats.dequantize_nvfp4(packed, s, ts, 75) - w).abs().max() <= w.abs().max() / 4
    with pytest.raises(ValueError, match="must be 32"):
        ExpertLayerSpec(4, 64, 64, "mxfp4", 16, "e8m0")
    with pytest.raises(ValueError, match="allowed: e4m3"):
        ExpertLayerSpec(4, 64, 64, "nvfp4", 16, "float32")
