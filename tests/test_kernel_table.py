"""`kernel_table.select`: the one place a layer's CPU kernels are chosen, from its format and the CPU's features;
what the operator and the decode pool then run follows from it alone."""

from __future__ import annotations

import pytest
import torch

from cpu_experts import prefill, prefill_int8
from cpu_experts.decode_pool import supports
from cpu_experts.kernel_table import (
    AMX_PREFILL_MIN_TOKENS,
    DECODE,
    POOL_DECODE,
    PREFILL_MIN_TOKENS,
    CpuFeatures,
    select,
)
from cpu_experts.operator import DECODE_KERNELS, CpuMoE
from cpu_experts.packed import PackedLayer

E, H, I = 4, 128, 192  # noqa: E741 (the shape letters of the project); multiples of the tiles
PLAIN = CpuFeatures(has_vnni=False, has_amx_int8=False, has_amx_bf16=False)
VNNI = CpuFeatures(has_vnni=True, has_amx_int8=False, has_amx_bf16=False)
AMX = CpuFeatures(has_vnni=True, has_amx_int8=True, has_amx_bf16=True)


def layer(dtype: str, group: int = 0, partitions: int = 1) -> PackedLayer:
    gen = torch.Generator().manual_seed(0)
    ws = [torch.randn(shape, generator=gen) * 0.1 for shape in ((E, I, H), (E, I, H), (E, H, I))]
    return PackedLayer.from_float(*ws, dtype, group, partitions)


# (dtype, group, int8_activations, features) -> (activations, decode, prefill)
CASES = [
    (("int8", 0, True, PLAIN), ("int8", "int8", "onednn-int8")),
    (("int8", 0, True, VNNI), ("int8", "int8-vnni", "onednn-int8")),
    (("int8", 0, True, AMX), ("int8", "int8-vnni", "amx-int8")),
    (("int8", 32, True, VNNI), ("int8", "int8-vnni", "dequant")),
    (("int8", 32, True, AMX), ("int8", "int8-vnni", "amx-int8-grouped")),
    (("int8", 0, False, AMX), ("float", "int8", "dequant")),
    (("int4", 32, True, PLAIN), ("int8", "int4", "dequant")),
    (("int4", 32, True, AMX), ("int8", "int4-vnni", "amx-int8-grouped")),
    (("int4", 32, False, VNNI), ("float", "int4", "dequant")),
    (("fp8", 32, True, VNNI), ("bf16", "fp8", "dequant")),
    (("fp8", 32, False, AMX), ("bf16", "fp8", "amx-bf16")),
    (("mxfp4", 32, True, AMX), ("bf16", "mxfp4", "amx-bf16")),
    (("nvfp4", 16, True, PLAIN), ("bf16", "nvfp4", "dequant")),
    (("bf16", 0, True, AMX), ("float", None, "dequant")),
]


@pytest.mark.parametrize("case,want", CASES, ids=[f"{c[0]}-g{c[1]}-{c[2]}-{i}" for i, (c, _) in enumerate(CASES)])
def test_select(case, want):
    dtype, group, int8_activations, features = case
    kernels = select(layer(dtype, group), features, int8_activations)
    assert (kernels.activations, kernels.decode, kernels.prefill) == want
    is_amx = kernels.prefill.startswith("amx")
    assert kernels.prefill_min_tokens == (AMX_PREFILL_MIN_TOKENS if is_amx else PREFILL_MIN_TOKENS)[dtype]
    assert kernels.is_w8a8 == (want[0] == "int8")
    assert kernels.is_pool_decode == (want[1] in POOL_DECODE)
    assert select(layer(dtype, group), features, int8_activations, prefill_min_tokens=5).prefill_min_tokens == 5


def test_every_decode_kernel_has_its_driver_entry():
    assert set(DECODE_KERNELS) == set(DECODE) and set(POOL_DECODE) <= set(DECODE)


@pytest.mark.parametrize("features", [PLAIN, VNNI])
def test_the_operator_and_the_pool_follow_the_table(features):
    """Without AMX (every machine can build these): the operator's prefill backend and the pool's verdict follow
    `select`; an empty tensor-parallel slice has no matmuls and no pool."""
    for dtype, group in (("int8", 0), ("int4", 32), ("fp8", 32), ("bf16", 0)):
        op = CpuMoE(layer(dtype, group), features=features)
        want = {"onednn-int8": prefill_int8.OneDnnInt8Backend, "dequant": prefill.DequantBackend}[op.kernels.prefill]
        assert type(op.prefill.backend) is want, (dtype, op.kernels)
        assert supports(op) == op.kernels.is_pool_decode
    empty = PackedLayer.from_float(*(torch.zeros(shape) for shape in ((E, I, H), (E, I, H), (E, H, I))), "int8", 0, 1,
                                   rank=199, num_ranks=200)
    assert not empty.partitions and not supports(CpuMoE(empty, features=features))
