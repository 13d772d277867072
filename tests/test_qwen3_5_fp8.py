"""Block-FP8 releases of Qwen3.5 / Qwen3.6: a tiny Qwen3.5 written by transformers, its routed experts then quantized
by hand to float8_e4m3fn with float32 `*_scale_inv` blocks (`quantization_config.weight_block_size`), in the two
layouts FP8 experts come in: one tensor per expert and projection as Qwen publishes its FP8 releases
(`experts.{e}.gate_proj.weight` + `weight_scale_inv`), and fused 3-D as transformers holds FP8 experts
(`experts.gate_up_proj` [E, 2I, H] + `gate_up_proj_scale_inv` [E, 2I / bn, H / bk], `down_proj` likewise).

The experts' intermediate size (48) is not a multiple of the 32 x 32 blocks: in the fused layout gate and up share a
block of rows, and down's input ends in a partial group. Each block is scaled by its own random factor first, so a
mis-broadcast scale shows. The reference is transformers' model holding the dequantized experts: the engine's
device path (dequantized at load) within the models' parity contract, the CPU operator's FP8 experts (kept as stored)
within the float formats' contract (inputs rounded to bfloat16), and the fused FP8 experts re-quantized to int8 equal
to the int8 experts quantized from the dequantized values."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
from checkpoints import fp8_dequantize, fp8_quantize, hf_logits
from float_checkpoints import round_expert_inputs
from qwen3_next_support import NUM_LAYERS, TEXT, make_llm, random_prompt, write_qwen3_5
from safetensors.torch import load_file, save_file

from cpu_experts.module import CpuExperts

transformers = pytest.importorskip("transformers")

BLOCK = 32
INTER = 48  # moe_intermediate_size
LAYOUTS = ("per_expert", "fused")
PARITY_TOL = 1e-4  # the models' float32 parity contract, of the largest |logit|
FLOAT_FORMAT_TOL = 5e-3  # bfloat16-rounded expert inputs (see tests/test_direct_serving.py)
PROMPTS = [random_prompt(n, seed=40 + n) for n in (7, 33)]


def _scaled_blocks(weight: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """`weight` with each BLOCK x BLOCK block multiplied by its own random factor in [e^-1, e]."""
    rows, cols = weight.shape
    factors = torch.exp(torch.rand(math.ceil(rows / BLOCK), math.ceil(cols / BLOCK), generator=gen) * 2 - 1)
    return weight * factors.repeat_interleave(BLOCK, 0)[:rows].repeat_interleave(BLOCK, 1)[:, :cols]


def _quantized(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(float8 codes, float32 block scale_inv, dequantized float32) of one matrix."""
    codes, scale_inv = fp8_quantize(weight, BLOCK)
    return codes, scale_inv, fp8_dequantize(codes, scale_inv, BLOCK)


def _layer_experts(tensors, prefix: str, gen: torch.Generator):
    """One layer's experts in both layouts: {layout: (stored tensors, dequantized gate_up [E, 2I, H], down)}."""
    experts = range(TEXT["num_experts"])
    weights = {(e, role): _scaled_blocks(tensors[f"{prefix}.{e}.{role}_proj.weight"].float(), gen)
               for e in experts for role in ("gate", "up", "down")}
    per_expert, deq = {}, {}
    for (e, role), weight in weights.items():
        codes, scale_inv, deq[e, role] = _quantized(weight)
        per_expert[f"{prefix}.{e}.{role}_proj.weight"] = codes
        per_expert[f"{prefix}.{e}.{role}_proj.weight_scale_inv"] = scale_inv
    gate_up = [_quantized(torch.cat((weights[e, "gate"], weights[e, "up"]))) for e in experts]  # [2I, H] blocks
    down = [_quantized(weights[e, "down"]) for e in experts]
    fused = {f"{prefix}.gate_up_proj": torch.stack([q for q, _, _ in gate_up]),
             f"{prefix}.gate_up_proj_scale_inv": torch.stack([s for _, s, _ in gate_up]),
             f"{prefix}.down_proj": torch.stack([q for q, _, _ in down]),
             f"{prefix}.down_proj_scale_inv": torch.stack([s for _, s, _ in down])}
    return {"per_expert": (per_expert, torch.stack([torch.cat((deq[e, "gate"], deq[e, "up"])) for e in experts]),
                           torch.stack([deq[e, "down"] for e in experts])),
            "fused": (fused, torch.stack([d for _, _, d in gate_up]), torch.stack([d for _, _, d in down]))}


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    """{layout: (FP8 checkpoint dir, reference model)}, and "fused_float": the fused layout's dequantized experts
    stored as fused float32 tensors (no quantization)."""
    source = tmp_path_factory.mktemp("qwen3_5_fp8_source")
    model = write_qwen3_5(transformers, source, moe_intermediate_size=INTER)
    tensors = load_file(str(source / "model.safetensors"))
    config = json.loads((source / "config.json").read_text())
    base = {name: t for name, t in tensors.items() if ".mlp.experts." not in name}
    stored = {layout: dict(base) for layout in LAYOUTS}
    references = {layout: copy.deepcopy(model) for layout in LAYOUTS}
    fused_float = dict(base)
    gen = torch.Generator().manual_seed(5)
    for layer in range(NUM_LAYERS):
        prefix = f"model.language_model.layers.{layer}.mlp.experts"
        for layout, (parts, gate_up, down) in _layer_experts(tensors, prefix, gen).items():
            stored[layout] |= parts
            experts = references[layout].model.language_model.layers[layer].mlp.experts
            with torch.no_grad():
                experts.gate_up_proj.copy_(gate_up)
                experts.down_proj.copy_(down)
            if layout == "fused":
                fused_float |= {f"{prefix}.gate_up_proj": gate_up, f"{prefix}.down_proj": down}
    out = {}
    for layout in LAYOUTS:
        path = tmp_path_factory.mktemp(f"qwen3_5_fp8_{layout}")
        save_file(stored[layout], str(path / "model.safetensors"))
        fp8_config = config | {"quantization_config": {"quant_method": "fp8", "fmt": "e4m3",
                                                       "activation_scheme": "dynamic",
                                                       "weight_block_size": [BLOCK, BLOCK]}}
        (path / "config.json").write_text(json.dumps(fp8_config))
        out[layout] = path, references[layout]
    path = tmp_path_factory.mktemp("qwen3_5_fused_float")
    save_file(fused_float, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(config))
    out["fused_float"] = path
    return out


def _close(got: torch.Tensor, want: torch.Tensor, tol: float, what: str) -> None:
    err, scale = float((got - want).abs().max()), float(want.abs().max())
    assert err <= tol * scale, f"{what}: max |ours - reference| = {err:.3e} > {tol} * {scale:.3e}"


def test_fused_layout_as_transformers_holds_it(release):
    """The fused FP8 checkpoint's tensors have the shapes transformers' FP8 experts take (blocks per expert)."""
    from safetensors import safe_open

    with safe_open(str(release["fused"][0] / "model.safetensors"), "pt") as f:
        prefix = "model.language_model.layers.0.mlp.experts"
        e, h = TEXT["num_experts"], TEXT["hidden_size"]
        assert f.get_slice(f"{prefix}.gate_up_proj").get_shape() == [e, 2 * INTER, h]
        assert f.get_slice(f"{prefix}.gate_up_proj_scale_inv").get_shape() == [e, 3, 2]  # 96 rows, 64 cols
        assert f.get_slice(f"{prefix}.down_proj_scale_inv").get_shape() == [e, 2, 2]  # 64 rows, 48 cols
        assert f.get_tensor(f"{prefix}.down_proj").dtype == torch.float8_e4m3fn


@pytest.mark.parametrize("layout", LAYOUTS)
def test_device_path_equals_dequantized_reference(release, layout):
    path, reference = release[layout]
    llm = make_llm(path)
    with torch.no_grad():
        for ids in PROMPTS:
            _close(llm.prefill_logits(ids), hf_logits(reference, ids), PARITY_TOL, f"{layout}: device experts")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_cpu_fp8_experts_as_stored(release, layout):
    """expert_placement=cpu keeps the FP8 experts as stored (the default expert_dtype auto): the CPU operator's FP8
    format with the checkpoint's group, against the reference with bfloat16-rounded expert inputs."""
    path, reference = release[layout]
    llm = make_llm(path, expert_placement="cpu")
    try:
        specs = {(m.op.spec.dtype, m.op.spec.group_size) for m in llm.model.modules() if isinstance(m, CpuExperts)}
        assert specs == {("fp8", BLOCK)}
        rounded = round_expert_inputs(copy.deepcopy(reference))
        with torch.no_grad():
            for ids in PROMPTS:
                _close(llm.prefill_logits(ids), hf_logits(rounded, ids), FLOAT_FORMAT_TOL, f"{layout}: CPU FP8")
    finally:
        llm.close()


def test_fused_fp8_requantized_to_int8(release):
    """--expert-dtype int8 over the fused FP8 experts quantizes their dequantized values: the same int8 experts, and
    logits, as quantizing the same values stored as fused float tensors."""
    options = dict(expert_placement="cpu", expert_dtype="int8", expert_activations="float")
    got, want = make_llm(release["fused"][0], **options), make_llm(release["fused_float"], **options)
    try:
        for ids in PROMPTS:
            assert torch.equal(got.prefill_logits(ids), want.prefill_logits(ids))
    finally:
        got.close()
        want.close()
