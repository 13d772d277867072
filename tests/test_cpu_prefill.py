"""The one prefill driver (`cpu_experts.prefill.Prefill`) and its backends, through `CpuMoE`.

`kernel_table.select` names a layer's GEMM backend (tests/test_kernel_table.py); `operator.make_prefill` builds
the driver over it: each `kernel_table.PREFILL` key's backend is pinned here. Then one prefill call through every
backend, built by `CpuMoE` for a CPU with the features that select it, the AMX ones on their tile reference
(`reference_kernels`: this machine has no AMX), against the PyTorch reference on the dequantized weights
(`cpu_experts.reference`) on the backend's activation grid. A fake backend pins the driver's sequence: activations
once, gate_up then down per partition in order, one zeroed float32 output, the column layout of the routing.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cpu_experts import prefill_amx, prefill_amx_float, prefill_amx_grouped
from cpu_experts.expert_file import dequantize_matrix
from cpu_experts.kernel_table import PREFILL, CpuFeatures, ExpertKernels
from cpu_experts.operator import CpuMoE, make_prefill, route
from cpu_experts.packed import PackedLayer
from cpu_experts.prefill import COLUMN_TILE, DequantBackend, Prefill, Workspace
from cpu_experts.prefill_int8 import OneDnnInt8Backend
from cpu_experts.reference import moe_reference

E, H, I, PARTITIONS = 8, 256, 192, 3  # noqa: E741 (the shape letters of the project); I: 3 x 64, the tiles' sizes
FLOAT_FORMATS = ("fp8", "mxfp4", "nvfp4")
BACKENDS = {"amx-int8": prefill_amx.AmxInt8Backend, "amx-int8-grouped": prefill_amx_grouped.AmxGroupedBackend,
            "amx-bf16": prefill_amx_float.AmxFloatBackend, "onednn-int8": OneDnnInt8Backend,
            "dequant": DequantBackend}
# rounded activations (W8A8 int8 steps, bf16 steps; bf16 hidden rows, bf16 matmuls of the dequantizing backend,
# the output rounded to bf16) against a reference that rounds the same values: a value within float32 error of a
# rounding boundary may round the other way (`test_cpu_moe`, `test_cpu_expert_activation`); a wrong expert, scale,
# partition or pair costs O(1)
ROUNDED_TOL = 2e-2


@pytest.fixture(scope="module")
def layers():
    """(dtype, group) -> (PackedLayer in PARTITIONS partitions, its dequantized gate, up, down)."""
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(shape, generator=gen) * 0.1 for shape in ((E, I, H), (E, I, H), (E, H, I))]
    cache = {}

    def get(dtype, group):
        if (dtype, group) not in cache:
            layer = PackedLayer.from_float(*weights, dtype, group, PARTITIONS)
            cache[dtype, group] = layer, _dequantized(PackedLayer.from_float(*weights, dtype, group, 1))
        return cache[dtype, group]
    return get


def _dequantized(whole: PackedLayer) -> list[torch.Tensor]:
    """gate, up [E, I, H] and down [E, H, I] of a one-partition layer (`expert_file.dequantize_matrix`)."""
    part, deq = whole.partitions[0], []
    for role in ("gate", "up", "down"):
        weight = torch.from_numpy(getattr(part, role))
        if whole.spec.dtype == "bf16":
            weight = weight.view(torch.bfloat16)
        scales, ts = getattr(part, f"{role}_scales"), getattr(part, f"{role}_tensor_scale")
        deq.append(torch.stack([dequantize_matrix(weight[e], None if scales is None else torch.from_numpy(scales[e]),
                                                  role, whole.spec, None if ts is None else torch.tensor(ts[e]))
                                for e in range(E)]))
    return deq


@pytest.mark.parametrize("key,dtype,group,activations", [
    ("amx-int8", "int8", 0, "int8"), ("amx-int8-grouped", "int4", 32, "int8"), ("amx-bf16", "nvfp4", 16, "bf16"),
    ("onednn-int8", "int8", 0, "int8"), ("dequant", "int8", 64, "int8"), ("dequant", "fp8", 128, "bf16"),
    ("dequant", "bf16", 0, "float")])
def test_make_prefill(layers, monkeypatch, key, dtype, group, activations):
    """Each `kernel_table.PREFILL` key builds the driver over its backend, the dequantizing one on the key's
    activation grid."""
    monkeypatch.setattr(prefill_amx_float, "has_amx_bf16", lambda: True)  # the backend's own check of the CPU
    assert set(BACKENDS) == set(PREFILL)
    layer, _ = layers(dtype, group)
    built = make_prefill(ExpertKernels(activations, None, key, 1), layer, Workspace())
    assert type(built) is Prefill and type(built.backend) is BACKENDS[key]
    if key == "dequant":
        assert (built.backend.round_activations, built.backend.bf16_activations) == (activations == "int8",
                                                                                    activations == "bf16")


@pytest.fixture(scope="module")
def tile_references():
    """Each AMX backend's kernels with plain-numba tiles, compiled once for the module."""
    return {cls: module.reference_kernels() for module, cls in
            ((prefill_amx, prefill_amx.AmxInt8Backend), (prefill_amx_grouped, prefill_amx_grouped.AmxGroupedBackend),
             (prefill_amx_float, prefill_amx_float.AmxFloatBackend))}


# (dtype, group, int8_activations, AMX-INT8, AMX-BF16, the backend that runs)
CALLS = [("int8", 0, True, True, False, prefill_amx.AmxInt8Backend),
         ("int4", 32, True, True, False, prefill_amx_grouped.AmxGroupedBackend),
         ("fp8", 128, True, False, True, prefill_amx_float.AmxFloatBackend),
         ("int8", 0, True, False, False, OneDnnInt8Backend),
         ("int8", 64, True, False, False, DequantBackend),
         ("int4", 128, False, False, False, DequantBackend),
         ("nvfp4", 16, True, False, False, DequantBackend),
         ("bf16", 0, True, False, False, DequantBackend)]


@pytest.mark.parametrize("dtype,group,int8_activations,is_amx_int8,is_amx_bf16,backend", CALLS,
                         ids=[f"{b[-1].__name__}-{b[0]}" for b in CALLS])
def test_every_backend_one_call(layers, tile_references, monkeypatch, dtype, group, int8_activations, is_amx_int8,
                                is_amx_bf16, backend):
    """One 70-token top-4 call (-1 slots, a token with none, one expert with a single pair) through `CpuMoE`'s
    prefill in 3 partitions, on bf16 hidden rows as the model gives them, against the reference."""
    monkeypatch.setattr(prefill_amx_float, "has_amx_bf16", lambda: is_amx_bf16)  # the backend's own check
    layer, (gate, up, down) = layers(dtype, group)
    features = CpuFeatures(has_vnni=False, has_amx_int8=is_amx_int8, has_amx_bf16=is_amx_bf16)
    op = CpuMoE(layer, prefill_min_tokens=1, int8_activations=int8_activations, features=features)
    assert type(op.prefill.backend) is backend
    if backend in tile_references:
        op.prefill.backend.gate_up_kernel, op.prefill.backend.down_kernel = tile_references[backend]
    gen = torch.Generator().manual_seed(3)
    num_tokens = 70
    ids = torch.stack([torch.randperm(E - 1, generator=gen)[:4] for _ in range(num_tokens)])
    ids[torch.rand(ids.shape, generator=gen) < 0.25] = -1
    ids[0], ids[1, 0] = -1, E - 1  # token 0: nothing here; expert E - 1: one pair
    w = torch.rand(ids.shape, generator=gen)
    x = torch.randn(num_tokens, H, generator=gen).bfloat16()
    bounds = [(p.start, p.end) for p in layer.partitions]
    is_float = dtype in FLOAT_FORMATS
    want = moe_reference(x.float(), gate, up, down, ids, w, int8_activations=op.is_w8a8, partitions=bounds,
                         bf16_activations=is_float)
    got = op(x, ids, w)
    assert got.dtype == torch.bfloat16 and got.shape == x.shape
    err = float((got.float() - want).abs().max())
    assert err <= ROUNDED_TOL * float(want.abs().max()), f"{backend.__name__} {dtype}: error {err:.3e}"


class _Recording:
    """A backend that records what the driver hands it: gate_up's act is its partition's start."""

    uses_columns = True

    def __init__(self, layer):
        self.layer = layer
        self.calls = []

    def activations(self, hidden, call):
        self.calls.append(("activations", hidden.shape, call))
        return "x"

    def gate_up(self, call, part, epilogue, x):
        assert x == "x"
        self.calls.append(("gate_up", part.start))
        return part.start

    def down(self, call, part, act, out):
        assert out.dtype == np.float32 and not out.any(), "out is zeroed once, before the first partition"
        self.calls.append(("down", part.start, act))


def test_driver_sequence(layers):
    layer, _ = layers("int8", 0)
    backend = _Recording(layer)
    ids = torch.tensor([[0, 3], [3, -1], [3, 0], [-1, -1]])
    routing = route(ids.numpy(), torch.ones(4, 2).numpy(), E)
    out = Prefill(backend, Workspace())(torch.zeros(4, H, dtype=torch.bfloat16), routing)
    assert out.shape == (4, H) and out.dtype == torch.float32
    (name, shape, call), *rest = backend.calls
    assert name == "activations" and shape == (4, H) and call.routing is routing
    starts = [p.start for p in layer.partitions]
    assert len(starts) == PARTITIONS and rest == [step for s in starts for step in (("gate_up", s), ("down", s, s))]
    assert np.array_equal(call.col_offsets, [0, COLUMN_TILE, 2 * COLUMN_TILE]) and call.num_cols == 2 * COLUMN_TILE
    assert np.array_equal(call.pair_rows, np.arange(5))
