"""Routed experts read as published (`hybrid.stored_matrix`, `hybrid.native_experts`): FP8 block scales (DeepSeek's
float32 `weight_scale_inv`, V4's E8M0 `.scale`), compressed-tensors FP8 (channel, block), V4's MXFP4 experts, NVFP4
from ModelOpt and compressed-tensors, gpt-oss's fused MXFP4 tensors. The reader's output is the stored bits; the
dequantized checkpoint is the model the release stands for (transformers' forward on those values); NaN codes and
scales are refused naming the tensor and its file; `hybrid-convert` copies these experts as stored.

Sources: the tiny Qwen3-MoE of `checkpoints` (hidden 64, expert intermediate 32, 8 experts, layers 1-3 MoE) with its
routed experts rewritten by `float_checkpoints` (FP8 blocks 32 x 32, so every matrix has several).
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from checkpoints import SEEDS, hf_logits, make_checkpoint, prompt, qwen3_moe_config
from convert_support import fails, manifest
from float_checkpoints import (
    BLOCK,
    CONFIGS,
    EXPECTED_FORMAT,
    LAYOUTS,
    MODELOPT_CONFIG,
    ct_nvfp4_values,
    gpt_oss_experts,
    write_layout,
)
from int4_checkpoints import load_reference
from safetensors.torch import load_file, save_file
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from convert.cli import main
from convert.plan import build_plan
from convert.verify import verify
from cpu_experts.expert_file import ExpertLayerSpec, dequantize_matrix
from hybrid import LLM
from hybrid.checkpoint import Checkpoint
from hybrid.direct_experts import expert_format, read_layer
from hybrid.errors import CheckpointError, ConfigError
from hybrid.fused_experts import INTERLEAVED_MXFP4, FusedExperts, read_fused_layer

REL_TOL = 1e-4
CT_NVFP4_REL = 2.0 ** -22  # e2m1 * scale * float32(1 / g) against compressed-tensors' e2m1 * (scale / g)


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """layout -> {'path', 'values' (float32 values of every tensor), 'stored', 'plan'} (built once per module)."""
    cache = {}

    def get(layout: str) -> dict:
        if layout not in cache:
            path = tmp_path_factory.mktemp(layout) / "src"
            make_checkpoint(qwen3_moe_config(), path, seed=SEEDS["qwen3_moe"], dtype=torch.bfloat16)
            values = write_layout(path, layout, seed=1)
            cache[layout] = {"path": path, "values": values, "plan": build_plan(path),
                             "stored": load_file(str(path / "model.safetensors"))}
        return cache[layout]

    return get


def expert_names(plan):
    cfg = plan.config
    return [(layer, e, role, plan.expert_name(layer, e, role)) for layer in cfg.moe_layer_indices
            for e in range(cfg.moe.num_experts) for role in ("gate", "up", "down")]


def expected_scales(layout: str, stored: dict, module: str, rows: int, cols: int) -> torch.Tensor:
    """What the expert file's `scales` of one projection must hold: the stored scale as the kernels read it."""
    if layout in ("fp8-block", "fp8-e8m0", "fp8-ct-block"):
        part = {"fp8-block": "weight_scale_inv", "fp8-e8m0": "scale", "fp8-ct-block": "weight_scale"}[layout]
        return stored[f"{module}.{part}"].float().repeat_interleave(BLOCK[0], 0)[:rows]
    if layout == "fp8-ct-channel":
        return stored[f"{module}.weight_scale"].expand(rows, -(-cols // 128))
    if layout == "mxfp4-e8m0":
        return stored[f"{module}.scale"].view(torch.uint8)
    return stored[f"{module}.weight_scale"].view(torch.uint8)


# --- the sources are what the releases publish (so the tests below cannot pass vacuously) ----------------------------

@pytest.mark.parametrize("layout", LAYOUTS)
def test_source_is_the_published_layout(source, layout):
    src = source(layout)
    stored = src["stored"]
    names = expert_names(src["plan"])
    module = names[0][3].removesuffix(".weight")
    parts = {n.removeprefix(module + ".") for n in stored if n.startswith(module + ".")}
    assert parts == {
        "fp8-block": {"weight", "weight_scale_inv"}, "fp8-e8m0": {"weight", "scale"},
        "fp8-ct-channel": {"weight", "weight_scale"}, "fp8-ct-block": {"weight", "weight_scale"},
        "mxfp4-e8m0": {"weight", "scale"},
        "nvfp4-modelopt": {"weight", "weight_scale", "weight_scale_2", "input_scale"},
        "nvfp4-ct": {"weight_packed", "weight_scale", "weight_global_scale", "input_global_scale"}}[layout]
    weight = stored.get(module + ".weight", stored.get(module + ".weight_packed"))
    assert weight.dtype == {"mxfp4-e8m0": torch.int8, "nvfp4-modelopt": torch.uint8,
                            "nvfp4-ct": torch.uint8}.get(layout, torch.float8_e4m3fn)
    if layout in ("fp8-e8m0", "mxfp4-e8m0"):
        assert stored[module + ".scale"].dtype == torch.float8_e8m0fnu
    if layout.startswith("nvfp4"):
        assert stored[module + ".weight_scale"].dtype == torch.float8_e4m3fn
    if layout == "nvfp4-modelopt":
        assert json.loads((src["path"] / "hf_quant_config.json").read_text()) == MODELOPT_CONFIG
        assert "quantization_config" not in json.loads((src["path"] / "config.json").read_text())
    # the dense weights stay as saved
    assert stored["model.layers.1.self_attn.q_proj.weight"].dtype == torch.bfloat16


# --- the reader: the stored bits, as the kernels read them -----------------------------------------------------------

@pytest.mark.parametrize("layout", LAYOUTS)
def test_reader_copies_the_stored_bits(source, layout):
    src = source(layout)
    plan, stored = src["plan"], src["stored"]
    fmt = expert_format(plan.model, plan.ckpt, "auto")
    assert (fmt.dtype, fmt.group_size, fmt.scale_dtype) == EXPECTED_FORMAT[layout] and fmt.is_passthrough
    spec = fmt.spec(plan.config)
    layers = {layer: read_layer(plan.ckpt, plan.model, layer, spec, True, num_threads=2)
              for layer in plan.config.moe_layer_indices}
    for layer, expert, role, name in expert_names(plan):
        module = name.removesuffix(".weight")
        rows, cols = spec.matrix_shape(role)
        tensors = layers[layer]
        weight = stored.get(name, stored.get(module + ".weight_packed"))
        assert torch.equal(tensors[f"{role}.weight"][expert], weight.view(torch.uint8)), name
        assert torch.equal(tensors[f"{role}.scales"][expert], expected_scales(layout, stored, module, rows, cols))
        tensor_scale = tensors.get(f"{role}.tensor_scale")
        if layout == "nvfp4-modelopt":
            assert torch.equal(tensor_scale[expert], stored[module + ".weight_scale_2"])
        elif layout == "nvfp4-ct":
            assert tensor_scale[expert] == torch.tensor(1.0) / stored[module + ".weight_global_scale"][0]
        else:
            assert tensor_scale is None
        got = dequantize_matrix(tensors[f"{role}.weight"][expert], tensors[f"{role}.scales"][expert], role, spec,
                                None if tensor_scale is None else tensor_scale[expert])
        assert torch.equal(got, src["values"][name]), name
        if layout == "nvfp4-ct":  # compressed-tensors' own convention divides by the global scale
            parts = {p: stored[f"{module}.{p}"] for p in ("weight_packed", "weight_scale", "weight_global_scale")}
            want = ct_nvfp4_values(parts, cols)
            assert float((got - want).abs().max()) <= CT_NVFP4_REL * float(want.abs().max()), name


@pytest.mark.parametrize("layout", LAYOUTS)
def test_dequantized_checkpoint_matches_reference(source, layout, tmp_path):
    """Read on the engine's device (`Checkpoint.read` dequantizes each expert): the logits of the model the release
    stands for."""
    src = source(layout)
    ref = load_reference(src["path"], src["values"], tmp_path)
    llm = LLM(src["path"], dtype="float32")
    ids = prompt(24, seed=5)
    want = hf_logits(ref, ids)
    err = float((llm.prefill_logits(ids) - want).abs().max())
    assert err <= REL_TOL * float(want.abs().max()), f"{layout}: {err:.3e}"


def test_gpt_oss_fused_mxfp4_layout(tmp_path):
    """gpt-oss's `*_blocks` / `*_scales` read as stored, gate and up de-interleaved; dequantized, they are what
    transformers' own gpt-oss dequantization makes of them."""
    num_experts, hidden, inter = 4, 64, 96
    tensors = gpt_oss_experts(num_experts, hidden, inter, torch.Generator().manual_seed(0))
    prefix = "model.layers.0.mlp.experts"
    save_file({f"{prefix}.{n}": t for n, t in tensors.items()}, str(tmp_path / "model.safetensors"))
    spec = ExpertLayerSpec(num_experts, hidden, inter, "mxfp4", 32, "e8m0")
    out = read_fused_layer(Checkpoint.open(tmp_path), FusedExperts(prefix, INTERLEAVED_MXFP4), spec, True)
    assert {n: (tuple(t.shape), t.dtype) for n, t in out.items()} == \
        {n: s for n, s in spec.tensor_shapes().items()}
    gate_up = convert_moe_packed_tensors(tensors["gate_up_proj_blocks"], tensors["gate_up_proj_scales"],
                                         dtype=torch.float32).transpose(1, 2)  # [E, 2I, H]
    down = convert_moe_packed_tensors(tensors["down_proj_blocks"], tensors["down_proj_scales"],
                                      dtype=torch.float32).transpose(1, 2)  # [E, H, I]
    for e in range(num_experts):
        for role, want in (("gate", gate_up[e, 0::2]), ("up", gate_up[e, 1::2]), ("down", down[e])):
            got = dequantize_matrix(out[f"{role}.weight"][e], out[f"{role}.scales"][e], role, spec)
            assert torch.equal(got, want), (e, role)
    assert not torch.equal(out["gate.weight"], out["up.weight"])


# --- NaN codes and scales, shapes that do not fit --------------------------------------------------------------------

def _plant(src: dict, tmp_path, part: str, edit) -> tuple:
    """A copy of the source with one stored part of layer 1 (the first MoE layer), expert 5's down projection
    edited."""
    import shutil

    path = tmp_path / "src"
    shutil.copytree(src["path"], path)
    stored = dict(src["stored"])
    name = f"model.layers.1.mlp.experts.5.down_proj.{part}"
    stored[name] = edit(stored[name].clone())
    save_file(stored, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path, name


def _set_code(tensor: torch.Tensor, code: int) -> torch.Tensor:
    tensor.view(torch.uint8).view(-1)[-1] = code
    return tensor


NAN_PLANTS = [("fp8-block", "weight", lambda t: _set_code(t, 0x7F)),
              ("fp8-block", "weight_scale_inv", lambda t: t.fill_(math.nan)),
              ("fp8-e8m0", "scale", lambda t: _set_code(t, 255)),
              ("mxfp4-e8m0", "scale", lambda t: _set_code(t, 255)),
              ("fp8-ct-channel", "weight", lambda t: _set_code(t, 0xFF)),
              ("nvfp4-modelopt", "weight_scale", lambda t: _set_code(t, 0xFF)),
              ("nvfp4-modelopt", "weight_scale_2", lambda t: t.fill_(math.inf)),
              ("nvfp4-ct", "weight_global_scale", lambda t: t.fill_(0.0))]


@pytest.mark.parametrize("layout,part,edit", NAN_PLANTS, ids=[f"{p[0]}-{p[1]}" for p in NAN_PLANTS])
def test_nan_is_refused_naming_tensor_and_file(source, tmp_path, layout, part, edit):
    path, name = _plant(source(layout), tmp_path, part, edit)
    with pytest.raises(CheckpointError) as info:
        LLM(path, dtype="float32", expert_placement="cpu", expert_dtype="auto")
    message = str(info.value)
    assert f"'{name}'" in message and str(path / "model.safetensors") in message and "NaN" in message, message
    assert len(message.splitlines()) == 1


def test_converter_refuses_nan_codes(source, tmp_path, capsys):
    path, name = _plant(source("mxfp4-e8m0"), tmp_path, "scale", lambda t: _set_code(t, 255))
    line = fails(capsys, path, tmp_path / "out")
    assert f"tensor '{name}' holds NaN or inf" in line, line


def test_scale_of_the_wrong_shape_is_named(source, tmp_path):
    path, name = _plant(source("nvfp4-modelopt"), tmp_path, "weight_scale", lambda t: t[:, :1].contiguous())
    with pytest.raises(CheckpointError, match=rf"'{name}' is float8_e4m3fn \(64, 1\), expected float8_e4m3fn "
                                              r"\(64, 2\)"):
        LLM(path, dtype="float32", expert_placement="cpu", expert_dtype="auto")


@pytest.mark.parametrize("quant,expected", [
    ({"quantization": {"quant_algo": "FP8"}}, "ModelOpt quant_algo 'FP8' is not supported; supported: NVFP4"),
    ({"quantization": {"quant_algo": "NVFP4", "group_size": 32}}, "NVFP4 groups are 16")])
def test_modelopt_config_errors(source, tmp_path, quant, expected):
    import shutil

    path = tmp_path / "src"
    shutil.copytree(source("nvfp4-modelopt")["path"], path)
    (path / "hf_quant_config.json").write_text(json.dumps(quant))
    with pytest.raises(ConfigError, match=expected) as info:
        LLM(path, dtype="float32")
    assert "hf_quant_config.json" in str(info.value)


# --- hybrid-convert keeps them ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("layout", ["fp8-block", "fp8-ct-channel", "mxfp4-e8m0", "nvfp4-modelopt", "nvfp4-ct"])
def test_converter_copies_native_experts(source, tmp_path, capsys, layout):
    """`--expert-dtype auto` copies them bit for bit (the same tensors the runtime reads), `verify --source` measures
    no error; an explicit other format re-quantizes and says so."""
    src = source(layout)
    dst = tmp_path / "out"
    capsys.readouterr()
    assert main([str(src["path"]), str(dst), "--threads", "2"]) == 0
    dtype, group, scale_dtype = EXPECTED_FORMAT[layout]
    assert f"the source's {dtype.upper()} (group {group}, {scale_dtype} scales) copied as stored" in \
        capsys.readouterr().out
    experts = manifest(dst)["experts"]
    assert (experts["dtype"], experts["group_size"], experts["scale_dtype"]) == (dtype, group, scale_dtype)
    assert experts["is_copied_from_source"] is True
    plan = src["plan"]
    spec = ExpertLayerSpec(8, 64, 32, dtype, group, scale_dtype)
    for layer in plan.config.moe_layer_indices:
        written = load_file(str(dst / experts["files"][str(layer)]))
        read = read_layer(plan.ckpt, plan.model, layer, spec, True)
        assert written.keys() == read.keys()
        assert all(torch.equal(written[n], read[n]) for n in read), layer
    report = verify(dst, src["path"])
    assert report.ok and all(v == 0.0 for errors in report.expert_error.values() for v in errors.values())
    assert main([str(src["path"]), str(tmp_path / "int8"), "--expert-dtype", "int8"]) == 0
    out = capsys.readouterr().out
    assert f"the source's {dtype.upper()} (group {group}) re-quantized to int8" in out, out
    assert manifest(tmp_path / "int8")["experts"]["is_copied_from_source"] is False


def test_converter_group_size_for_fixed_group_formats(source, tmp_path, capsys):
    line = fails(capsys, source("nvfp4-ct")["path"], tmp_path / "out", "--expert-dtype", "nvfp4", "--group-size",
                 "32")
    assert "--group-size applies to int8/int4/fp8 experts; drop it for --expert-dtype nvfp4" in line, line


@pytest.mark.parametrize("dtype,group,scale_dtype", [("fp8", 128, "float32"), ("mxfp4", 32, "e8m0"),
                                                     ("nvfp4", 16, "e4m3")])
def test_converter_quantizes_float_sources_to_the_float_formats(tmp_path, dtype, group, scale_dtype):
    make_checkpoint(qwen3_moe_config(), tmp_path / "src", seed=SEEDS["qwen3_moe"], dtype=torch.bfloat16)
    assert main([str(tmp_path / "src"), str(tmp_path / "out"), "--expert-dtype", dtype]) == 0
    experts = manifest(tmp_path / "out")["experts"]
    assert (experts["dtype"], experts["group_size"], experts["scale_dtype"]) == (dtype, group, scale_dtype)
    assert experts["is_copied_from_source"] is False
    errors = [v for layer in verify(tmp_path / "out", tmp_path / "src").expert_error.values() for v in layer.values()]
    assert all(0 < v < {"fp8": 0.05, "mxfp4": 0.2, "nvfp4": 0.15}[dtype] for v in errors), errors


def test_compressed_tensors_nvfp4_config():
    from hybrid import compressed_tensors

    quant = CONFIGS["nvfp4-ct"]
    scheme = compressed_tensors.parse(quant, "config.json")
    assert scheme.format == "nvfp4-pack-quantized" and scheme.group_size == 16
    bad = json.loads(json.dumps(quant))
    bad["config_groups"]["group_0"]["weights"]["group_size"] = 32
    with pytest.raises(ValueError, match="config.json: nvfp4-pack-quantized weights in groups of 32"):
        compressed_tensors.parse(bad, "config.json")
