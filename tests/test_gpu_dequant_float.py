"""`gpu_layers.dequant`: FP8, MXFP4 and NVFP4 expert weights -> bf16 tables for streamed prefill, against the
kernels' PyTorch references and the CPU experts' format references (`cpu_experts.formats`, the numerics contract:
the dequantized stored weight rounded once to bf16). Every code of e4m3 and e2m1, E8M0 0 and 254, odd K, groups
cut by K's end, the up half of a gate_up table (the gate half must stay untouched)."""

from __future__ import annotations

import pytest
import torch
from gpu_support import DEVICE, poisoned

from cpu_experts import formats
from gpu_layers.dequant import (
    dequantize_fp4,
    dequantize_fp4_reference,
    dequantize_fp8,
    dequantize_fp8_reference,
)

E, N = 3, 5


def same(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Bit-equal bf16, NaN where the other has NaN (torch.equal calls NaN unequal)."""
    return torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num())


def into_up_half(launch, num_cols: int) -> torch.Tensor:
    """Runs `launch(out)` into the up half of a poisoned [E, 2N, K] table; checks the gate half untouched."""
    table = poisoned(E, 2 * N, num_cols, dtype=torch.bfloat16)
    launch(table[:, N:])
    assert table[:, :N].isnan().all()
    return table[:, N:].cpu()


@pytest.mark.parametrize("num_cols,group", [(256, 128), (97, 32), (300, 128)])
def test_fp8_every_code_and_group(num_cols, group):
    g = torch.Generator().manual_seed(num_cols)
    w = torch.randint(0, 256, (E, N, num_cols), generator=g, dtype=torch.uint8)
    w.view(-1)[:256] = torch.arange(256, dtype=torch.uint8)  # every code: subnormals, +-448, -0, the NaNs
    scales = torch.rand(E, N, -(-num_cols // group), generator=g) * 2 + 1e-3
    got = into_up_half(lambda out: dequantize_fp8(w.to(DEVICE), scales.to(DEVICE), group, out), num_cols)
    want = dequantize_fp8_reference(w, scales, group)
    assert same(got, want) and got.isnan().sum() >= 2
    layout = torch.stack([formats.dequantize_fp8(w[e], scales[e], group) for e in range(E)]).to(torch.bfloat16)
    assert same(want, layout)  # the CPU experts' reference, expert by expert


def fp4_codes(num_cols: int, g: torch.Generator) -> torch.Tensor:
    """Packed e2m1 codes, every code in the first row; an odd K's padding nibble set (it must not be read)."""
    w = torch.randint(0, 256, (E, N, -(-num_cols // 2)), generator=g, dtype=torch.uint8)
    w[0, 0, :8] = torch.arange(16, dtype=torch.uint8).view(8, 2)[:, 0] | (torch.arange(16, dtype=torch.uint8)
                                                                           .view(8, 2)[:, 1] << 4)
    if num_cols % 2:
        w[..., -1] |= 0xF0
    return w


@pytest.mark.parametrize("num_cols", [64, 97, 2880 // 8])
def test_mxfp4_every_code_and_the_scale_extremes(num_cols):
    g = torch.Generator().manual_seed(num_cols)
    w = fp4_codes(num_cols, g)
    scales = torch.randint(100, 140, (E, N, -(-num_cols // 32)), generator=g, dtype=torch.uint8)
    scales[0, 1, 0], scales[0, 2, 0] = 0, 254  # 2^-127 (a float32 subnormal) and 2^127
    got = into_up_half(lambda out: dequantize_fp4(w.to(DEVICE), scales.to(DEVICE), num_cols, out=out), num_cols)
    want = dequantize_fp4_reference(w, scales, num_cols)
    assert same(got, want)
    layout = torch.stack([formats.dequantize_mxfp4(w[e], scales[e], num_cols) for e in range(E)]).to(torch.bfloat16)
    assert same(want, layout)
    assert got[0, 2, :4].abs().max() > 1e37  # the 2^127 row is not flushed


@pytest.mark.parametrize("num_cols", [160, 289])  # at least 126 blocks: every scale code
def test_nvfp4_every_code_with_its_block_and_tensor_scales(num_cols):
    g = torch.Generator().manual_seed(num_cols)
    w = fp4_codes(num_cols, g)
    num_scales = E * N * -(-num_cols // 16)
    # every positive e4m3 code but NaN (0x7f), subnormals included, cycled over the blocks
    scales = (torch.randperm(num_scales, generator=g) % 126 + 1).to(torch.uint8).view(E, N, -1)
    tensor_scale = torch.rand(E, generator=g) / 100 + 1e-4
    got = into_up_half(lambda out: dequantize_fp4(w.to(DEVICE), scales.to(DEVICE), num_cols,
                                                  tensor_scale.to(DEVICE), out), num_cols)
    want = dequantize_fp4_reference(w, scales, num_cols, tensor_scale)
    assert same(got, want)
    layout = torch.stack([formats.dequantize_nvfp4(w[e], scales[e], tensor_scale[e], num_cols)
                          for e in range(E)]).to(torch.bfloat16)
    assert same(want, layout)


def test_launchers_name_the_bad_input():
    w = torch.zeros(E, N, 49, dtype=torch.uint8, device=DEVICE)
    with pytest.raises(ValueError, match="scales must be"):
        dequantize_fp4(w, torch.zeros(E, N, 3, dtype=torch.uint8, device=DEVICE), 97)  # MXFP4 wants 4 groups
    with pytest.raises(ValueError, match="w must be"):
        dequantize_fp4(w, torch.zeros(E, N, 4, dtype=torch.uint8, device=DEVICE), 100)  # 100 packs into 50
    with pytest.raises(ValueError, match="tensor_scale must be"):
        dequantize_fp4(w, torch.zeros(E, N, 7, dtype=torch.uint8, device=DEVICE), 97,
                       torch.ones(E + 1, device=DEVICE))
    with pytest.raises(ValueError, match="scales must be"):
        dequantize_fp8(w, torch.ones(E, N, 3, device=DEVICE), 32)  # K 49 in groups of 32: 2 groups
    with pytest.raises(ValueError, match="out must be"):
        dequantize_fp8(w, torch.ones(E, N, 1, device=DEVICE), 64,
                       torch.empty(E, N, 50, dtype=torch.bfloat16, device=DEVICE))
