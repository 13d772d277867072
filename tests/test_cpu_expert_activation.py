"""gpt-oss's expert activation (`ExpertActivation` swiglu_oai with gate/up/down biases) in the CPU operator, against
the float reference on the dequantized weights (`moe_reference` with the same activation and biases), every format
(int8 per channel and grouped, int4, fp8, mxfp4, nvfp4) and path: decode (1 and 17 tokens; integer and float
kernels for int8/int4) and prefill (300 tokens: each prefill backend this CPU has, plus the AMX ones with their tile
instructions replaced by plain numba, and the AMX instructions where the CPU has them). Sizes off the vector widths
(H = 80, I = 72, so a last partition of 8 rows), random biases, and gate/up values far past the clamp at 7.
"""

from __future__ import annotations

import pytest
import torch
from cpu_features import features

from cpu_experts import prefill_amx, prefill_amx_float, prefill_amx_grouped
from cpu_experts.expert_file import SILU, SWIGLU_OAI, ExpertActivation, ExpertLayerSpec, dequantize_matrix
from cpu_experts.operator import CpuMoE, route
from cpu_experts.packed import PackedLayer
from cpu_experts.prefill import DequantBackend, Prefill, Workspace
from cpu_experts.reference import moe_reference

E, H, I, TOP_K = 8, 80, 72, 2  # noqa: E741 (the shape letters of the project)
GAIN = 0.6  # weight std: gate/up pre-activations of std ~5 on unit inputs, a good share past the clamp at 7
REL_TOL = 1e-5  # float activations: float32 summation order only
# rounded activations (W8A8 int8 steps, bf16 steps) against a reference that rounds the same values: a value within
# float32 error of a rounding boundary may round the other way, one step (1/127 of a row's largest, 2^-8) each
ROUNDED_TOL = 2e-2
PREFILL_FROM = 64  # the operator's token count from which it prefills (below every format's default but bf16's)
FORMATS = [("int8", 0), ("int8", 32), ("int4", 32), ("fp8", 128), ("mxfp4", 32), ("nvfp4", 16)]


def _weights(seed: int, hidden: int = H, inter: int = I):
    gen = torch.Generator().manual_seed(seed)
    ws = [torch.randn(shape, generator=gen) * GAIN for shape in ((E, inter, hidden),) * 2]
    ws.append(torch.randn(E, hidden, inter, generator=gen) * 0.1)
    biases = (torch.randn(E, inter, generator=gen), torch.randn(E, inter, generator=gen),
              torch.randn(E, hidden, generator=gen))
    return ws, biases


def _layer(dtype, group, partitions, seed=0, hidden=H, inter=I):
    """(PackedLayer with gpt-oss's activation and biases, dequantized gate, up, down, biases)."""
    ws, biases = _weights(seed, hidden, inter)
    layer = PackedLayer.from_float(*ws, dtype, group, partitions, activation=SWIGLU_OAI, biases=biases)
    whole = PackedLayer.from_float(*ws, dtype, group, 1)  # one partition: the whole rows to dequantize
    part = whole.partitions[0]
    deq = []
    for role in ("gate", "up", "down"):
        scales = getattr(part, f"{role}_scales")
        ts = getattr(part, f"{role}_tensor_scale")
        weight = torch.from_numpy(getattr(part, role))
        if dtype == "bf16":
            weight = weight.view(torch.bfloat16)
        deq.append(torch.stack([dequantize_matrix(weight[e], None if scales is None else torch.from_numpy(scales[e]),
                                                  role, layer.spec, None if ts is None else torch.tensor(ts[e]))
                                for e in range(E)]))
    return layer, deq, biases


def _routing(num_tokens, seed):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=gen)[:TOP_K] for _ in range(num_tokens)])
    ids[torch.rand(ids.shape, generator=gen) < 0.2] = -1
    return ids, torch.rand(num_tokens, TOP_K, generator=gen)


def _inputs(num_tokens, seed, hidden=H):
    return torch.randn(num_tokens, hidden, generator=torch.Generator().manual_seed(100 + seed))


def _reference(layer, deq, biases, x, ids, w, is_w8a8):
    bounds = [(p.start, p.end) for p in layer.partitions]
    return moe_reference(x, *deq, ids, w, int8_activations=is_w8a8, partitions=bounds,
                         bf16_activations=layer.spec.dtype in ("fp8", "mxfp4", "nvfp4"), activation=SWIGLU_OAI,
                         biases=biases)


def _assert_close(got, want, tol, what):
    err = float((got - want).abs().max())
    assert err <= tol * float(want.abs().max()), f"{what}: error {err:.3e}, max |ref| {float(want.abs().max()):.3e}"


def test_clamp_is_crossed():
    """The inputs exercise both clamps: a good share of gate and up pre-activations lie beyond +-7."""
    (gate, up, _), (gate_b, up_b, _) = _weights(0)
    x = _inputs(17, 0)
    g = torch.einsum("eih,th->tei", gate, x) + gate_b
    u = torch.einsum("eih,th->tei", up, x) + up_b
    assert (g > 7).float().mean() > 0.05 and (u.abs() > 7).float().mean() > 0.1


@pytest.mark.parametrize("partitions", [1, 2])
@pytest.mark.parametrize("dtype,group", FORMATS)
@pytest.mark.parametrize("int8_activations", [True, False])
@pytest.mark.parametrize("is_vnni", [True, False])
def test_matches_reference(dtype, group, partitions, int8_activations, is_vnni):
    """Decode (1 and 17 tokens) and prefill (300 tokens) through `CpuMoE`."""
    if (not int8_activations or is_vnni) and dtype not in ("int8", "int4"):
        pytest.skip("the float formats ignore int8_activations and have no integer kernels")
    layer, deq, biases = _layer(dtype, group, partitions)
    # the integer kernels (their generic form on a CPU without VNNI)
    op = CpuMoE(layer, prefill_min_tokens=PREFILL_FROM, int8_activations=int8_activations,
                features=features(has_vnni=is_vnni))
    if not op.is_w8a8 and is_vnni:
        pytest.skip("float activations have no integer kernels")
    for seed, num_tokens in enumerate([1, 17, 300]):
        x, (ids, w) = _inputs(num_tokens, seed), _routing(num_tokens, seed)
        want = _reference(layer, deq, biases, x, ids, w, op.is_w8a8)
        tol = REL_TOL if dtype in ("int8", "int4") and not op.is_w8a8 else ROUNDED_TOL
        _assert_close(op(x, ids, w), want, tol, f"{dtype} group {group}, {num_tokens} tokens")


@pytest.mark.parametrize("dtype,group", FORMATS + [("bf16", 0)])
def test_dequantize_prefill(dtype, group):
    """The dequantize-and-multiply backend (`DequantBackend`), whatever `kernel_table.select` picks on this CPU."""
    layer, deq, biases = _layer(dtype, group, 2)
    is_float = dtype in ("fp8", "mxfp4", "nvfp4")
    prefill = Prefill(DequantBackend(layer, round_activations=False, bf16_activations=is_float), Workspace())
    x, (ids, w) = _inputs(40, 3), _routing(40, 3)
    want = _reference(layer, deq, biases, x, ids, w, False)
    got = prefill(x, route(ids.numpy(), w.numpy(), E)) + _down_bias(biases[2], ids, w)
    _assert_close(got, want, ROUNDED_TOL if is_float or dtype == "bf16" else REL_TOL, f"{dtype} dequantize prefill")


def _down_bias(bias, ids, w):
    """What `CpuMoE` adds to a prefill backend's output: each pair's weighted down bias."""
    out = torch.zeros(ids.shape[0], bias.shape[1])
    for k in range(ids.shape[1]):
        hit = ids[:, k] >= 0
        out[hit] += w[hit, k, None] * bias[ids[hit, k]]
    return out


@pytest.fixture(scope="module")
def amx_reference_kernels():
    """Each AMX module's kernels with plain-numba tiles, compiled once for the module's tests (a compile is
    seconds; every case of a module has the same argument types)."""
    return {module: module.reference_kernels() for module in (prefill_amx, prefill_amx_grouped, prefill_amx_float)}


@pytest.mark.parametrize("is_amx", [False, True])
@pytest.mark.parametrize("backend,dtype,group", [("amx", "int8", 0), ("grouped", "int4", 32), ("grouped", "int8", 64),
                                                 ("float", "fp8", 128), ("float", "mxfp4", 32),
                                                 ("float", "nvfp4", 16)])
def test_amx_prefill(amx_reference_kernels, backend, dtype, group, is_amx):
    """The AMX grouped GEMMs' epilogues with gpt-oss's activation and biases: on every CPU with the tile
    instructions replaced by plain numba (`reference_kernels`), the AMX instructions where the CPU has them."""
    module, cls, has = {"amx": (prefill_amx, prefill_amx.AmxInt8Backend, prefill_amx.has_amx),
                        "grouped": (prefill_amx_grouped, prefill_amx_grouped.AmxGroupedBackend, prefill_amx.has_amx),
                        "float": (prefill_amx_float, prefill_amx_float.AmxFloatBackend,
                                  prefill_amx_float.has_amx_bf16)}[backend]
    if is_amx and not has():
        pytest.skip("this CPU has no AMX")
    hidden, inter = 256, 192  # the tiles' sizes
    layer, deq, biases = _layer(dtype, group, 3, hidden=hidden, inter=inter)
    op = Prefill(cls(layer, None if is_amx else amx_reference_kernels[module]), Workspace())
    for seed, num_tokens in enumerate([1, 33]):
        x, (ids, w) = _inputs(num_tokens, seed, hidden), _routing(num_tokens, seed)
        want = _reference(layer, deq, biases, x, ids, w, backend != "float")
        got = op(x, route(ids.numpy(), w.numpy(), E)) + _down_bias(biases[2], ids, w)
        _assert_close(got, want, ROUNDED_TOL, f"{backend} {dtype}, {num_tokens} tokens")


def test_spec_metadata_round_trips_and_old_files_read_as_silu():
    spec = ExpertLayerSpec(E, H, I, "mxfp4", 32, "e8m0", SWIGLU_OAI, True)
    assert ExpertLayerSpec.from_metadata(spec.metadata(3)) == spec
    assert {"gate.bias", "up.bias", "down.bias"} <= set(spec.tensor_shapes())
    old = ExpertLayerSpec(E, H, I, "int8", 0).metadata(0)
    assert "activation" not in old and "has_bias" not in old
    plain = ExpertLayerSpec.from_metadata(old)
    assert plain.activation == SILU and not plain.has_bias and plain.is_plain
    with pytest.raises(ValueError, match="activation 'gelu'"):
        ExpertActivation("gelu")
