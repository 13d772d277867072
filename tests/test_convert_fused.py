"""`hybrid-convert` on checkpoints whose routed experts are stored fused per layer (`hybrid.fused_experts`): gpt-oss
as transformers saves it (`gate_up_proj` [E, H, 2I] with gate and up interleaved, `down_proj` [E, I, H], biases),
gpt-oss's published MXFP4 (`*_blocks` / `*_scales`, `quant_method: mxfp4`), and Qwen3.5's fused 3-D experts
(`gate_up_proj` [E, 2I, H], `down_proj` [E, H, I]), float or block FP8 as transformers holds FP8 experts (`*_scale_inv`
[E, ceil(N / 24), ceil(K / 24)]: 24-row blocks, so gate and up share the block across row I = 32, and K = 32 ends in
a partial one).

Checked, for every `--expert-dtype`: the expert files hold exactly what the direct-serving loader puts in memory
(`hybrid.direct_experts.read_layer`, bit for bit) and what an independent reading of the source gives (the test's
own de-interleave, transformers' MXFP4 dequantization, Qwen3.5's per-expert tensors, the test's FP8 dequantization,
quantized by `quantize_matrix`; MXFP4 and FP8 under `auto`: the stored bits, FP8's block scales spread per row);
gpt-oss's biases and activation are in the files. Served, the converted directory's logits equal the directly served
checkpoint's, and transformers' within the format's contract (int8 with float activations: its fake-quantized
model; MXFP4: bf16 matmul inputs).
"""

from __future__ import annotations

import json

import pytest
import torch
from checkpoints import fp8_dequantize, fp8_quantize, hf_logits, prompt
from convert_support import fails, keep_torch_threads, manifest  # noqa: F401 (fixtures)
from safetensors.torch import load_file, save_file
from test_gpt_oss import _bf16_matmul_inputs, _requantized, _write_mxfp4, make_gpt_oss
from test_models_parity import PREFILL_LENGTHS, assert_logits_close
from test_qwen3_next import TEXT, qwen3_5, qwen3_5_fused  # noqa: F401 (fixtures)
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from convert.cli import main
from convert.verify import verify
from cpu_experts import formats
from cpu_experts.expert_file import SWIGLU_OAI, ExpertLayerSpec, quantize_matrix
from hybrid import LLM
from hybrid.checkpoint import Checkpoint
from hybrid.direct_experts import expert_format, read_layer
from hybrid.models import load_model_config
from hybrid.safetensors_io import SafetensorsFile

# the published gpt-oss config's quantization_config
MXFP4_CONFIG = {"quant_method": "mxfp4", "modules_to_not_convert": [
    "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
FP8_BLOCK = 24  # Qwen3.5 FP8's block: I = 32 rows of gate, then up, share the second block of gate_up's rows


@pytest.fixture(scope="module")
def sources(tmp_path_factory, qwen3_5_fused):  # noqa: F811
    """name -> (checkpoint directory, transformers' float32 model of it or None)."""
    bf16 = tmp_path_factory.mktemp("gpt_oss") / "src"
    ref = make_gpt_oss(bf16)
    mxfp4 = tmp_path_factory.mktemp("gpt_oss_mxfp4") / "src"
    mxfp4_ref = make_gpt_oss(mxfp4)
    _write_mxfp4(mxfp4, mxfp4_ref)
    config = json.loads((mxfp4 / "config.json").read_text())
    (mxfp4 / "config.json").write_text(json.dumps(config | {"quantization_config": MXFP4_CONFIG}))
    fp8 = tmp_path_factory.mktemp("qwen3_5_fp8") / "src"
    _write_fused_fp8(qwen3_5_fused, fp8)
    return {"gpt_oss": (bf16, ref), "gpt_oss_mxfp4": (mxfp4, mxfp4_ref), "qwen3_5": (qwen3_5_fused, None),
            "qwen3_5_fp8": (fp8, None)}


def _write_fused_fp8(fused, dst) -> None:
    """The fused Qwen3.5 checkpoint with its experts quantized to FP8 in FP8_BLOCK blocks per expert, as
    transformers' FP8 experts hold them (`*_scale_inv` [E, blocks of N, blocks of K])."""
    tensors = load_file(str(fused / "model.safetensors"))
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        codes, scales = zip(*(fp8_quantize(w, FP8_BLOCK) for w in tensors[name]), strict=True)
        tensors[name], tensors[f"{name}_scale_inv"] = torch.stack(codes), torch.stack(scales)
    dst.mkdir()
    save_file(tensors, str(dst / "model.safetensors"))
    config = json.loads((fused / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": [FP8_BLOCK, FP8_BLOCK]}
    (dst / "config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module")
def converted(sources, tmp_path_factory):
    """(source name, expert dtype) -> a finished conversion."""
    cache = {}

    def get(name: str, dtype: str):
        if (name, dtype) not in cache:
            dst = tmp_path_factory.mktemp(f"{name}_{dtype}") / "out"
            assert main([str(sources[name][0]), str(dst), "--threads", "2", "--expert-dtype", dtype]) == 0
            cache[name, dtype] = dst
        return cache[name, dtype]

    return get


def _source_values(name: str, tensors: dict, layer: int, num_experts: int) -> dict[str, torch.Tensor]:
    """The test's own reading of one layer of `tensors` (for Qwen3.5: the per-expert checkpoint the fused one was
    made from): gate, up [E, I, H], down [E, H, I] float32, and gpt-oss's biases."""
    if name == "qwen3_5":
        prefix = f"model.language_model.layers.{layer}.mlp.experts"
        return {role: torch.stack([tensors[f"{prefix}.{e}.{role}_proj.weight"].float() for e in range(num_experts)])
                for role in ("gate", "up", "down")}
    if name == "qwen3_5_fp8":  # the test's own block dequantization, expert by expert, then gate / up split
        prefix = f"model.language_model.layers.{layer}.mlp.experts"
        gate_up, down = (torch.stack([fp8_dequantize(q, s, FP8_BLOCK) for q, s in
                                      zip(tensors[f"{prefix}.{p}"], tensors[f"{prefix}.{p}_scale_inv"], strict=True)])
                         for p in ("gate_up_proj", "down_proj"))
        inter = down.shape[2]
        return {"gate": gate_up[:, :inter], "up": gate_up[:, inter:], "down": down}
    prefix = f"model.layers.{layer}.mlp.experts"
    if name == "gpt_oss_mxfp4":  # transformers' own dequantization: [E, H, 2I] and [E, I, H]
        gate_up = convert_moe_packed_tensors(tensors[f"{prefix}.gate_up_proj_blocks"],
                                             tensors[f"{prefix}.gate_up_proj_scales"], dtype=torch.float32)
        down = convert_moe_packed_tensors(tensors[f"{prefix}.down_proj_blocks"], tensors[f"{prefix}.down_proj_scales"],
                                          dtype=torch.float32)
    else:
        gate_up, down = tensors[f"{prefix}.gate_up_proj"].float(), tensors[f"{prefix}.down_proj"].float()
    bias = tensors[f"{prefix}.gate_up_proj_bias"].float()
    return {"gate": gate_up[..., 0::2].transpose(1, 2), "up": gate_up[..., 1::2].transpose(1, 2),
            "down": down.transpose(1, 2), "gate.bias": bias[:, 0::2], "up.bias": bias[:, 1::2],
            "down.bias": tensors[f"{prefix}.down_proj_bias"].float()}


CASES = [("gpt_oss", d) for d in ("int8", "int4", "fp8", "mxfp4", "nvfp4")] + \
    [("gpt_oss_mxfp4", d) for d in ("auto", "int8", "int4", "fp8", "nvfp4")] + \
    [("qwen3_5", d) for d in ("auto", "int4", "fp8")] + [("qwen3_5_fp8", d) for d in ("auto", "int8")]


@pytest.mark.parametrize("name,dtype", CASES)
def test_expert_files_are_the_direct_load_and_the_source(sources, converted, qwen3_5, name, dtype):  # noqa: F811
    path = sources[name][0]
    dst = converted(name, dtype)
    cls, config = load_model_config(path)
    with torch.device("meta"):
        model = cls(config)
    ckpt = Checkpoint.open(path, config.fp8_block_size, prefixes=model.checkpoint_prefixes)
    fmt = expert_format(model, ckpt, dtype)
    spec = fmt.model_spec(model)
    is_gpt_oss = name.startswith("gpt_oss")
    assert fmt.is_passthrough == (name in ("gpt_oss_mxfp4", "qwen3_5_fp8") and dtype == "auto")
    assert manifest(dst)["experts"]["is_copied_from_source"] == fmt.is_passthrough
    assert spec.activation == SWIGLU_OAI and spec.has_bias if is_gpt_oss else spec.is_plain
    source = load_file(str(path / "model.safetensors"))
    values_source = load_file(str(qwen3_5[0] / "model.safetensors")) if name == "qwen3_5" else source
    plain = ExpertLayerSpec(spec.num_experts, spec.hidden_size, spec.intermediate_size, spec.dtype, spec.group_size,
                            spec.scale_dtype)
    for layer in config.moe_layer_indices:
        file = SafetensorsFile(dst / f"experts/layer-{layer:03d}.safetensors")
        assert ExpertLayerSpec.from_metadata(file.metadata) == spec
        stored = {n: file.read(n) for n in spec.tensor_shapes()}
        direct = read_layer(ckpt, model, layer, spec, fmt.is_passthrough)
        assert stored.keys() == direct.keys()
        for n, tensor in stored.items():
            assert torch.equal(tensor.view(torch.uint8), direct[n].view(torch.uint8)), (layer, n)
        values = _source_values(name, values_source, layer, spec.num_experts)
        for e in range(spec.num_experts):
            for role in ("gate", "up", "down"):
                if fmt.is_passthrough:  # the stored bits, de-interleaved or split by the test
                    want = (_fp8_bits if name == "qwen3_5_fp8" else _published_bits)(source, layer, e, role, spec)
                else:
                    want = quantize_matrix(values[role][e], plain)
                for part, tensor in want.items():
                    assert torch.equal(stored[f"{role}.{part}"][e], tensor), (layer, e, role, part)
        if is_gpt_oss:
            for role in ("gate", "up", "down"):
                assert torch.equal(stored[f"{role}.bias"], values[f"{role}.bias"]), (layer, role)


def _published_bits(tensors, layer: int, e: int, role: str, spec) -> dict[str, torch.Tensor]:
    prefix = f"model.layers.{layer}.mlp.experts"
    if role == "down":
        blocks, scales = tensors[f"{prefix}.down_proj_blocks"][e], tensors[f"{prefix}.down_proj_scales"][e]
    else:
        rows = slice(0, None, 2) if role == "gate" else slice(1, None, 2)
        blocks, scales = tensors[f"{prefix}.gate_up_proj_blocks"][e, rows], tensors[f"{prefix}.gate_up_proj_scales"][e,
                                                                                                                    rows]
    cols = spec.matrix_shape(role)[1]
    return {"weight": blocks.reshape(blocks.shape[0], -1)[:, : -(-cols // 2)], "scales": scales}


def _fp8_bits(tensors, layer: int, e: int, role: str, spec) -> dict[str, torch.Tensor]:
    """Qwen3.5 FP8's codes of `role` and their block scales repeated over each block's rows."""
    prefix = f"model.language_model.layers.{layer}.mlp.experts"
    name = f"{prefix}.down_proj" if role == "down" else f"{prefix}.gate_up_proj"
    codes, scales = tensors[name][e], tensors[f"{name}_scale_inv"][e]
    scales = scales.repeat_interleave(FP8_BLOCK, 0)[:codes.shape[0]]
    inter = spec.intermediate_size
    rows = {"gate": slice(0, inter), "up": slice(inter, 2 * inter), "down": slice(None)}[role]
    return {"weight": codes[rows].view(torch.uint8), "scales": scales[rows]}


def _logits(path, vocab: int = 256, **options) -> list[torch.Tensor]:
    llm = LLM(path, dtype="float32", **options)
    try:
        return [llm.prefill_logits(prompt(n, seed=300 + n, vocab=vocab)) for n in PREFILL_LENGTHS]
    finally:
        llm.close()


def test_gpt_oss_int8_conversion_serves_as_the_checkpoint(sources, converted):
    """bf16 gpt-oss converted to int8 (float activations): the logits of the checkpoint served directly, exactly,
    and transformers' on the fake-quantized experts within 1e-4 of max |logit|; `verify` measures the rounding."""
    path, ref = sources["gpt_oss"]
    dst = converted("gpt_oss", "int8")
    ours = _logits(dst, expert_activations="float")
    direct = _logits(path, expert_placement="cpu", expert_dtype="int8", expert_activations="float")
    fake = _requantized(ref, formats.quantize_int8, lambda q, s, _cols: formats.dequantize_int8(q, s))
    for n, got, want in zip(PREFILL_LENGTHS, ours, direct, strict=True):
        assert torch.equal(got, want), n
        assert_logits_close(got, hf_logits(fake, prompt(n, seed=300 + n)), f"converted gpt-oss int8, {n} tokens")
    report = verify(dst, path)
    errors = [e for layer in report.expert_error.values() for e in layer.values()]
    assert report.ok and len(errors) == 3 * 5 and all(0 < e < 0.02 for e in errors), report.expert_error


def test_gpt_oss_published_mxfp4_conversion_serves_as_the_checkpoint(sources, converted):
    """Published MXFP4 under `auto`: copied as stored; served, the logits of the checkpoint served directly, exactly,
    and transformers' with the format's bf16 matmul inputs within 1e-4 of max |logit|. The output's config drops
    the `mxfp4` quantization_config, whose tensors are now the expert files."""
    path, ref = sources["gpt_oss_mxfp4"]
    dst = converted("gpt_oss_mxfp4", "auto")
    assert "quantization_config" not in json.loads((dst / "config.json").read_text())
    ours = _logits(dst)
    direct = _logits(path, expert_placement="cpu")
    ref = _requantized(ref, formats.quantize_mxfp4, formats.dequantize_mxfp4)
    _bf16_matmul_inputs(ref)
    for n, got, want in zip(PREFILL_LENGTHS, ours, direct, strict=True):
        assert torch.equal(got, want), n
        assert_logits_close(got, hf_logits(ref, prompt(n, seed=300 + n)), f"converted gpt-oss mxfp4, {n} tokens")


def test_qwen3_5_fused_conversion_equals_the_per_expert_one(sources, converted, qwen3_5, tmp_path):  # noqa: F811
    """Qwen3.5's fused 3-D experts converted to int8: the same logits as the per-expert checkpoint's conversion and
    as the fused checkpoint served directly."""
    plain = tmp_path / "plain"
    assert main([str(qwen3_5[0]), str(plain), "--threads", "2"]) == 0
    options = dict(expert_activations="float", vocab=TEXT["vocab_size"], max_model_len=256, max_num_seqs=4)
    ours = _logits(converted("qwen3_5", "auto"), **options)
    for n, got, want, direct in zip(PREFILL_LENGTHS, ours, _logits(plain, **options),
                                    _logits(sources["qwen3_5"][0], expert_placement="cpu", **options), strict=True):
        assert torch.equal(got, want) and torch.equal(got, direct), n


def test_qwen3_5_fused_fp8_conversion_serves_as_the_checkpoint(sources, converted):
    """Qwen3.5's fused FP8 experts converted under `auto` (kept as stored) and to int8: the logits of the
    checkpoint served directly with the same expert dtype, exactly."""
    path = sources["qwen3_5_fp8"][0]
    options = dict(expert_activations="float", vocab=TEXT["vocab_size"], max_model_len=256, max_num_seqs=4)
    for dtype in ("auto", "int8"):
        ours = _logits(converted("qwen3_5_fp8", dtype), **options)
        direct = _logits(path, expert_placement="cpu", expert_dtype=dtype, **options)
        for n, got, want in zip(PREFILL_LENGTHS, ours, direct, strict=True):
            assert torch.equal(got, want), (dtype, n)


def test_nonfinite_and_misshapen_fused_experts_are_one_line(sources, tmp_path, capsys):
    path = sources["gpt_oss"][0]
    tensors = load_file(str(path / "model.safetensors"))
    name = "model.layers.2.mlp.experts.gate_up_proj"
    for edit, message in ((lambda t: t.index_fill_(0, torch.tensor([3]), float("nan")), "holds NaN or inf"),
                          (lambda t: t[:, :, :-2].contiguous(), "expected a float dtype")):
        src = tmp_path / f"src{len(message)}"
        src.mkdir()
        (src / "config.json").write_text((path / "config.json").read_text())
        save_file(tensors | {name: edit(tensors[name].clone())}, str(src / "model.safetensors"))
        line = fails(capsys, src, tmp_path / f"dst{len(message)}", "--expert-dtype", "int8")
        assert f"'{name}'" in line and message in line, line


def test_fused_fp8_scales_nonfinite_or_misshapen_are_one_line(sources, tmp_path, capsys):
    """A fused FP8 expert's block scales holding NaN (copied as stored), or of the wrong shape: one line naming the
    scale tensor."""
    path = sources["qwen3_5_fp8"][0]
    tensors = load_file(str(path / "model.safetensors"))
    name = "model.language_model.layers.1.mlp.experts.down_proj_scale_inv"
    for key, edit, message, dtype in ((
            "nan", lambda t: t.index_fill_(0, torch.tensor([5]), float("nan")), "holds NaN or inf", "auto"),
            ("shape", lambda t: t[:, :1].contiguous(), "has shape", "int8")):
        src = tmp_path / f"src_{key}"
        src.mkdir()
        (src / "config.json").write_text((path / "config.json").read_text())
        save_file(tensors | {name: edit(tensors[name].clone())}, str(src / "model.safetensors"))
        line = fails(capsys, src, tmp_path / f"dst_{key}", "--expert-dtype", dtype)
        assert f"'{name.replace('language_model.', '')}'" in line and message in line, line  # the model's name
