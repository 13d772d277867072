"""The AMX-BF16 prefill of the float formats (`cpu_experts.prefill_amx_float`) against the float reference on the
dequantized stored weights with bf16-rounded activations (`moe_reference(..., bf16_activations=True)`).

On CPUs without AMX-BF16 (this one) the tile instructions are replaced by their plain-numba reference
(`reference_kernels`): the weight conversion to bf16, the activations' pair packing, the group scales, the folded
FP4 scales and the epilogues are what these tests check; with AMX-BF16 the real kernels run too.

Layers: H = 256, I = 192 (1 or 3 partitions); FP8 with group 128 (two groups along H, a partial last group in a
partition of I) and 32 (one step a group); MXFP4 with scales that fold into the bf16 weights and with 2^-127 and
2^-126 among them (those tasks' groups scaled apart); NVFP4 with zero, subnormal and 448 block scales and tensor
scales not 1. 1, 17 and 300 tokens, top-k 1 and 8, -1 ids. FP8 (DeepSeek-V4's E8M0 `.scale` blocks) and MXFP4 with
E8M0 scales 254 and 0 in every row, on tokens that keep AMX's products normal (`tests/stored_experts.py`).

Tolerance (as tests/test_cpu_fp8.py's): 1e-5 of the largest output, plus, per output element, what rounding act =
silu(gate) * up to bf16 can move it where act lies within float32 error of a bf16 rounding midpoint (`flip_bound`).
"""

from __future__ import annotations

import numpy as np
import pytest
import stored_experts
import torch
from cpu_features import features

from cpu_experts import formats, prefill_amx_float
from cpu_experts.expert_file import ALLOWED_SCALES, ExpertLayerSpec, dequantize_matrix
from cpu_experts.operator import CpuMoE, route
from cpu_experts.packed import PackedLayer
from cpu_experts.prefill import DequantBackend, Prefill, Workspace
from cpu_experts.reference import moe_reference

E, H, I = 8, 256, 192  # noqa: E741 (the shape letters of the project)
WIDE_H, WIDE_I = 800, 288
REL_TOL = 1e-5
SUM_ERR = 8  # float32 steps of sum |w x| a gate or up sum of H = 256 terms may be off by
SILU_ERR = 16  # float32 steps of act that silu (`kernels.fast_exp`, 5e-7) and the product may add
LAYERS = [("fp8", 128, "plain"), ("fp8", 32, "plain"), ("mxfp4", 32, "plain"), ("mxfp4", 32, "extreme"),
          ("nvfp4", 16, "plain")]


def stored_layer(fmt: str, group: int, scales_kind: str, partitions: int, seed: int = 0, hidden: int = H,
                 inter: int = I):
    """A layer as a checkpoint stores it (every code in every row) and its dequantized gate, up, down."""
    gen = torch.Generator().manual_seed(seed)
    spec = ExpertLayerSpec(E, hidden, inter, fmt, group, ALLOWED_SCALES[fmt][0])
    tensors, deq = {}, []
    for role in ("gate", "up", "down"):
        n, k = spec.matrix_shape(role)
        groups = -(-k // group)
        if fmt == "fp8":
            codes = torch.randint(0, 0x7F, (E, n, k), generator=gen) | (torch.randint(0, 2, (E, n, k),
                                                                                      generator=gen) << 7)
            tensors[f"{role}.weight"] = codes.to(torch.uint8)
            tensors[f"{role}.scales"] = 2.0 ** torch.randint(-12, -6, (E, n, groups), generator=gen) * (
                1 + torch.rand(E, n, groups, generator=gen))
        else:
            codes = torch.randint(0, 16, (E, n, k), generator=gen)
            codes[:, :, :16] = torch.arange(16)
            tensors[f"{role}.weight"] = torch.stack([formats.pack_fp4(codes[e]) for e in range(E)])
            if fmt == "mxfp4":
                scales = torch.randint(118, 128, (E, n, groups), generator=gen)
                if scales_kind == "extreme":  # 2^-127 and 2^-126 in about one group in ten: too small to fold
                    pick = torch.rand(scales.shape, generator=gen) < 0.1
                    scales[pick] = torch.randint(0, 2, (int(pick.sum()),), generator=gen)
            else:
                scales = torch.randint(0x28, 0x40, (E, n, groups), generator=gen)
                pick = torch.rand(scales.shape, generator=gen) < 0.25
                special = torch.tensor([0x00, 0x01, 0x05, 0x07, 0x7E])
                scales[pick] = special[torch.randint(0, 5, (int(pick.sum()),), generator=gen)]
                tensors[f"{role}.tensor_scale"] = torch.rand(E, generator=gen) * 0.01 + 0.003
            tensors[f"{role}.scales"] = scales.to(torch.uint8)
        ts = tensors.get(f"{role}.tensor_scale")
        deq.append(torch.stack([dequantize_matrix(tensors[f"{role}.weight"][e], tensors[f"{role}.scales"][e], role,
                                                  spec, None if ts is None else ts[e]) for e in range(E)]))
    return PackedLayer.from_file_tensors(tensors, spec, partitions), deq


def routing(num_tokens: int, top_k: int, seed: int):
    """Random distinct experts per token, about a quarter of the slots -1, the first token's all -1."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=gen)[:top_k] for _ in range(num_tokens)])
    ids[torch.rand(ids.shape, generator=gen) < 0.25] = -1
    if num_tokens > 1:
        ids[0] = -1
    return ids, torch.rand(num_tokens, top_k, generator=gen)


def flip_bound(x, gate, up, down, ids, weights) -> torch.Tensor:
    """[T, H]: the most that act's bf16 rounding can move each output element beyond float32 summation order
    (tests/test_cpu_fp8.py's `act_flip_bound`, with this module's error allowances). Every expert's sums for every
    token ([T, E, I]) are taken once and picked per slot: gathering each token's [I, H] weights per slot in float64
    was most of these tests' time."""
    xb = x.bfloat16().double()
    eps = 2.0 ** -24
    wg, wu, wd = gate.double(), up.double(), down.double().abs()  # [E, I, H], [E, I, H], [E, H, I]
    g_all, v_all = torch.einsum("eih,th->tei", wg, xb), torch.einsum("eih,th->tei", wu, xb)
    g_err_all = SUM_ERR * eps * torch.einsum("eih,th->tei", wg.abs(), xb.abs())
    v_err_all = SUM_ERR * eps * torch.einsum("eih,th->tei", wu.abs(), xb.abs())
    rows = torch.arange(x.shape[0])
    bound = torch.zeros(x.shape, dtype=torch.float64)
    for k in range(ids.shape[1]):
        e = ids[:, k].clamp(min=0)
        g, v, g_err, v_err = (t[rows, e] for t in (g_all, v_all, g_err_all, v_err_all))  # [T, I] each
        silu = g * torch.sigmoid(g)
        act = silu * v
        err = 1.1 * g_err * v.abs() + silu.abs() * v_err + SILU_ERR * eps * act.abs()
        step = 2.0 ** (torch.floor(torch.log2(act.abs().clamp(min=1e-300))) - 7)
        to_midpoint = ((act / step) - torch.floor(act / step) - 0.5).abs() * step
        flips = (to_midpoint <= err) & (ids[:, k, None] >= 0)
        moved = torch.zeros(x.shape, dtype=torch.float64)
        for expert in e.unique().tolist():
            hit = e == expert
            moved[hit] = (flips[hit] * step[hit]) @ wd[expert].T
        bound += weights[:, k, None].double() * moved
    return bound


def assert_close(got, want, bound, what) -> None:
    allowed = REL_TOL * max(float(want.abs().max()), 1e-30) + bound
    excess = (got.double() - want.double()).abs() - allowed
    assert float(excess.max()) <= 0, f"{what}: error {float((got - want).abs().max()):.3e}, max |ref| " \
                                     f"{float(want.abs().max()):.3e}"


@pytest.fixture(scope="module")
def kernels():
    return prefill_amx_float.reference_kernels()


@pytest.fixture(scope="module")
def layers():
    cache = {}

    def get(fmt, group, kind, partitions):
        key = (fmt, group, kind, partitions)
        if key not in cache:
            cache[key] = stored_layer(fmt, group, kind, partitions, seed=len(cache))
        return cache[key]
    return get


@pytest.mark.parametrize("partitions", [1, 3])
@pytest.mark.parametrize("fmt,group,kind", LAYERS)
@pytest.mark.parametrize("is_amx", [False, True])
def test_matches_reference(kernels, layers, is_amx, fmt, group, kind, partitions):
    if is_amx and not prefill_amx_float.has_amx_bf16():
        pytest.skip("this CPU has no AMX-BF16")
    layer, (gate, up, down) = layers(fmt, group, kind, partitions)
    assert prefill_amx_float.is_supported(layer)
    op = prefill_op(layer, None if is_amx else kernels)
    check_calls(op, (gate, up, down), H, [(1, 1), (1, 8), (17, 1), (17, 8), (300, 1), (300, 8)], seed=5)


def prefill_op(layer, kernels) -> Prefill:
    return Prefill(prefill_amx_float.AmxFloatBackend(layer, kernels), Workspace())


def check_calls(op, weights, hidden_size: int, calls, seed: int) -> None:
    """`op` against `moe_reference` (bf16 activations) for each (tokens, top-k) call, within the act flips' bound."""
    gate, up, down = weights
    gen = torch.Generator().manual_seed(seed)
    for routing_seed, (num_tokens, top_k) in enumerate(calls):
        ids, w = routing(num_tokens, top_k, routing_seed)
        x = torch.randn(num_tokens, hidden_size, generator=gen)
        want = moe_reference(x, gate, up, down, ids, w, bf16_activations=True)
        got = op(x, route(ids.numpy(), w.numpy(), E))
        assert_close(got, want, flip_bound(x, gate, up, down, ids, w), f"{num_tokens} tokens, top-{top_k}")


@pytest.fixture(scope="module")
def wide_layers():
    cache = {}

    def get(fmt, group, kind):
        if (fmt, group, kind) not in cache:
            cache[fmt, group, kind] = stored_layer(fmt, group, kind, 2, seed=10 + len(cache), hidden=WIDE_H,
                                                   inter=WIDE_I)
        return cache[fmt, group, kind]
    return get


@pytest.mark.parametrize("fmt,group,kind", [("fp8", 128, "plain"), ("fp8", 96, "plain"), ("fp8", 384, "plain"),
                                            ("mxfp4", 32, "plain"), ("mxfp4", 32, "extreme"), ("nvfp4", 16, "plain")])
@pytest.mark.parametrize("is_amx", [False, True])
def test_chunks_across_groups(kernels, wide_layers, is_amx, fmt, group, kind):
    """H = 800: gate/up rows in chunks of 512 and 288 columns (`prefill_amx_float.CHUNK`), FP8 groups that end
    inside a chunk (96), run over two (384: their C tiles reloaded) or end with the row (128: a last group of 32);
    NVFP4's and folded MXFP4's one group across both chunks, unfolded MXFP4's groups of one step; I = 288 in two
    partitions (one for FP8 group 384). 1, 3, 17 and 300 tokens (300 at top-2: 2-3 passes of two column tiles an
    expert). On the tile reference, and with AMX-BF16 on the real tiles."""
    if is_amx and not prefill_amx_float.has_amx_bf16():
        pytest.skip("this CPU has no AMX-BF16")
    layer, (gate, up, down) = wide_layers(fmt, group, kind)
    assert prefill_amx_float.is_supported(layer)
    op = prefill_op(layer, None if is_amx else kernels)
    check_calls(op, (gate, up, down), WIDE_H, [(1, 8), (3, 2), (17, 8), (300, 2)], seed=6)


@pytest.fixture(scope="module")
def extreme_layers():
    """DeepSeek-V4's FP8 (E8M0 `.scale` blocks, I = 384: three partitions of a block) and MXFP4 experts with E8M0
    scales at 254 and 0 (`stored_experts`), in three partitions."""
    built = {"fp8": stored_experts.extreme_fp8_layer(H, 384), "mxfp4": stored_experts.extreme_mxfp4_layer(H, I)}
    return {fmt: (PackedLayer.from_file_tensors(tensors, spec, 3), reference)
            for fmt, (tensors, spec, reference) in built.items()}


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
@pytest.mark.parametrize("is_amx", [False, True])
def test_e8m0_extremes(kernels, extreme_layers, is_amx, fmt):
    """E8M0 scales 254 (2^127) and 0 (2^-127) beside 250-253 and 1-4 in every row: FP8's group sums scaled apart,
    MXFP4's tasks holding them not folded (2^-127 as a float32 factor), with tokens whose products and sums stay
    normal floats (README: AMX-BF16 flushes those below 2^-126), each compared on its own scale."""
    if is_amx and not prefill_amx_float.has_amx_bf16():
        pytest.skip("this CPU has no AMX-BF16")
    layer, (gate, up, down) = extreme_layers[fmt]
    assert prefill_amx_float.is_supported(layer) and len(layer.partitions) == 3
    op = prefill_op(layer, None if is_amx else kernels)
    for seed, (num_tokens, top_k) in enumerate([(1, 1), (3, 2), (17, 8), (300, 2)]):
        x, ids, w = stored_experts.class_tokens(num_tokens, H, top_k, seed)
        want = moe_reference(x, gate, up, down, ids, w, bf16_activations=True)
        scale = stored_experts.per_token_scale(want)
        got = op(x, route(ids.numpy(), w.numpy(), gate.shape[0]))
        assert_close(got.double() * scale, want.double() * scale, flip_bound(x, gate, up, down, ids, w) * scale,
                     f"{num_tokens} tokens, top-{top_k}")


@pytest.mark.parametrize("fmt,group,hidden,inter", [("fp8", 128, 80, 192), ("fp8", 128, 256, 96 + 16),
                                                    ("fp8", 48, 192, 192), ("mxfp4", 32, 272, 192),
                                                    ("nvfp4", 16, 256, 200)])
def test_refuses_sizes_off_the_tiles(fmt, group, hidden, inter):
    """H or a partition's I not a multiple of 32 (a tile step), or an FP8 group that is not whole steps: refused,
    and `CpuMoE` keeps the dequantizing prefill whatever the CPU."""
    layer, _ = stored_layer(fmt, group, "plain", 1, hidden=hidden, inter=inter)
    assert not prefill_amx_float.is_supported(layer)
    with pytest.raises(ValueError, match="multiples of 32"):
        prefill_amx_float.AmxFloatBackend(layer)
    assert isinstance(CpuMoE(layer).prefill.backend, DequantBackend)


def test_launcher_checks_its_inputs(layers):
    layer, _ = layers("nvfp4", 16, "plain", 1)
    op = prefill_op(layer, (None, None))  # never reaches a kernel
    ids, w = routing(4, 2, 0)
    r = route(ids.numpy(), w.numpy(), E)
    with pytest.raises(ValueError, match=f"float32 \\[T, {H}\\]"):
        op(torch.zeros(4, H + prefill_amx_float.STEP), r)
    with pytest.raises(ValueError, match="pair_token"):
        op(torch.zeros(2, H), r)  # the routing's tokens 2 and 3 are not there
    layer.partitions[0].down_tensor_scale = None
    with pytest.raises(ValueError, match="down of partition"):
        prefill_amx_float.AmxFloatBackend(layer)
    layer.partitions[0].down_tensor_scale = np.ones(E, dtype=np.float32)


@pytest.mark.parametrize("is_amx_bf16", [False, True])
def test_operator_takes_the_path_on_amx_bf16(kernels, layers, monkeypatch, is_amx_bf16):
    """`CpuMoE` on a float-format layer: with AMX-BF16, from AMX_PREFILL_MIN_TOKENS tokens through
    `AmxFloatBackend` (here with the tile reference), `is_w8a8` False; without, the dequantizing prefill."""
    from cpu_experts import kernel_table

    # the backend's own check of the CPU, which refuses the real tiles here (replaced by the reference below)
    monkeypatch.setattr(prefill_amx_float, "has_amx_bf16", lambda: is_amx_bf16)
    layer, (gate, up, down) = layers("fp8", 128, "plain", 3)
    op = CpuMoE(layer, features=features(has_amx_bf16=is_amx_bf16))
    assert not op.is_w8a8
    if not is_amx_bf16:
        assert isinstance(op.prefill.backend, DequantBackend)
        assert op.prefill_min_tokens == kernel_table.PREFILL_MIN_TOKENS["fp8"]
        return
    assert isinstance(op.prefill.backend, prefill_amx_float.AmxFloatBackend) and op.kernels.prefill == "amx-bf16"
    assert op.prefill_min_tokens == kernel_table.AMX_PREFILL_MIN_TOKENS["fp8"] == 32
    op.prefill.backend.gate_up_kernel, op.prefill.backend.down_kernel = kernels
    calls = []
    real = op.prefill.__call__
    monkeypatch.setattr(op, "prefill", lambda x, r: calls.append(len(x)) or real(x, r))
    ids, w = routing(40, 8, 7)
    x = torch.randn(40, H, generator=torch.Generator().manual_seed(7))
    got = op(x, ids, w)
    assert calls == [40]
    want = moe_reference(x, gate, up, down, ids, w, bf16_activations=True)
    assert_close(got, want, flip_bound(x, gate, up, down, ids, w), "through CpuMoE")


def test_tile_kernels_need_the_permission(layers, monkeypatch):
    """Without AMX-BF16 or the tile permission the default kernels are refused with a message, not run (an illegal
    instruction ends the process)."""
    layer, _ = layers("nvfp4", 16, "plain", 1)
    monkeypatch.setattr(prefill_amx_float, "has_amx_bf16", lambda: False)
    with pytest.raises(RuntimeError, match="tile permission"):
        prefill_amx_float.AmxFloatBackend(layer)
