"""`hybrid-convert` output against its references, and its layout on disk.

Parity: every quantized conversion must match the fake-quantized HF reference to float32 rounding (checked inside
the `metrics` fixture) and stay within loose KL / top-1 bounds of the unquantized model; bf16 experts are exact.
Layout: the manifest, the index, the copied small files and the expert files are checked against `docs/format.md`,
the expert bytes against `quantize_matrix` of the source weights.
"""

from __future__ import annotations

import hashlib
import json
import math

import pytest
import torch
from checkpoints import FP8_QUANTIZATION_CONFIG, SEEDS, VARIANTS, hf_logits, make_checkpoint
from convert_support import (  # noqa: F401 (fixtures: converted, fp8, fp8_float_ref, keep_torch_threads, metrics, source)
    CASES,
    EXTRA_FILES,
    FAKE_QUANT_REL_TOL,
    INT4_OVER_INT8_KL,
    KL_MAX,
    PARITY_VARIANTS,
    PROMPTS,
    TOP1_MIN,
    all_files,
    converted,
    digests,
    expert_names,
    fails,
    fake_quant_reference,
    fp8,
    fp8_float_ref,
    keep_torch_threads,
    kl_and_top1,
    manifest,
    metrics,
    source,
    write_fp8_checkpoint,
)
from safetensors import safe_open
from safetensors.torch import load_file

from convert.cli import main
from convert.plan import build_plan
from cpu_experts.expert_file import ExpertLayerSpec, quantize_matrix
from hybrid import LLM
from hybrid.safetensors_io import read_header

QUANTIZED = ("int8", "int8-g32", "int4", "int4-g32")
INDEX = "model.safetensors.index.json"


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().reshape(-1).view(torch.uint8)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(as_bytes(a), as_bytes(b))


def layer_spec(plan, dtype: str, group: int) -> ExpertLayerSpec:
    cfg = plan.config
    return ExpertLayerSpec(cfg.moe.num_experts, cfg.hidden_size, cfg.moe.intermediate_size, dtype, group)


# --- parity -----------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("variant", PARITY_VARIANTS)
@pytest.mark.parametrize("case", QUANTIZED)
def test_quantized_experts_parity(metrics, variant, case):  # noqa: F811
    kl, top1 = metrics(variant, case)  # also: logits == the fake-quantized reference's, to float32 rounding
    dtype = CASES[case][1]
    print(f"{variant} {case}: mean KL {kl:.3e}, top-1 agreement {top1:.4f}")
    assert 0 < kl < KL_MAX[dtype]
    if dtype == "int8":
        assert top1 >= TOP1_MIN["int8"]


@pytest.mark.parametrize("variant", PARITY_VARIANTS)
def test_int4_costs_more_than_int8(metrics, variant):  # noqa: F811
    for int8, int4 in (("int8", "int4"), ("int8-g32", "int4-g32")):
        kl8, kl4 = metrics(variant, int8)[0], metrics(variant, int4)[0]
        print(f"{variant}: KL {int8} {kl8:.3e}, {int4} {kl4:.3e} ({kl4 / kl8:.1f}x)")
        assert kl8 * INT4_OVER_INT8_KL < kl4


@pytest.mark.parametrize("variant", PARITY_VARIANTS)
def test_bf16_experts_are_exact(source, converted, variant):  # noqa: F811
    ours = LLM(converted(variant, "bf16"), dtype="float32")
    original = LLM(source(variant).path, dtype="float32")
    for ids in PROMPTS:
        assert torch.equal(ours.prefill_logits(ids), original.prefill_logits(ids))


def test_fake_quantized_reference_is_not_vacuous(source, converted, tmp_path):  # noqa: F811
    """The strict reference can fail: the int8 fake-quantized model is far from int4 experts' logits (and from the
    unquantized model's), while the int8 conversion matches it."""
    src = source("qwen3_moe")
    tensors = {n: t.float() for n, t in load_file(str(src.path / "model.safetensors")).items()}
    fake8 = fake_quant_reference(src.path, tensors, "int8", 0, tmp_path)
    int8 = LLM(converted("qwen3_moe", "int8"), dtype="float32", expert_activations="float")
    int4 = LLM(converted("qwen3_moe", "int4"), dtype="float32", expert_activations="float")
    for ids, unquantized in zip(PROMPTS[:2], src.ref_logits[:2], strict=True):
        want = hf_logits(fake8, ids)
        scale = float(want.abs().max())
        err8 = float((int8.prefill_logits(ids) - want).abs().max())
        err4 = float((int4.prefill_logits(ids) - want).abs().max())
        err_ref = float((unquantized - want).abs().max())
        print(f"max |diff| / max |logit|: int8 {err8 / scale:.2e}, int4 {err4 / scale:.2e}, "
              f"unquantized {err_ref / scale:.2e}")
        assert err8 <= FAKE_QUANT_REL_TOL * scale
        assert err4 > 100 * FAKE_QUANT_REL_TOL * scale
        assert err_ref > 10 * FAKE_QUANT_REL_TOL * scale


# --- FP8-block (DeepSeek-V3) source -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def fp8_converted(fp8, tmp_path_factory):  # noqa: F811
    """case -> the conversion of the FP8 source (int8 asked for: `auto` keeps the source's FP8 experts)."""
    cache = {}

    def get(case: str):
        if case not in cache:
            dst = tmp_path_factory.mktemp(f"fp8_dst_{case}") / "out"
            assert main([str(fp8["path"]), str(dst), "--expert-dtype", CASES[case][1]]) == 0
            cache[case] = dst
        return cache[case]

    return get


@pytest.mark.parametrize("case", ["int8", "bf16"])
def test_fp8_source_parity(fp8_converted, fp8_float_ref, case):  # noqa: F811
    llm = LLM(fp8_converted(case), dtype="float32")
    kl, top1 = kl_and_top1(fp8_float_ref, [llm.prefill_logits(ids) for ids in PROMPTS])
    print(f"fp8 source, {case} experts: mean KL {kl:.3e}, top-1 agreement {top1:.4f}")
    assert kl < (KL_MAX["int8"] if case == "int8" else 1e-3)
    if case == "int8":
        assert top1 >= TOP1_MIN["int8"]


def test_fp8_gpu_weights_pass_through(fp8, fp8_converted):  # noqa: F811
    dst = fp8_converted("int8")
    assert manifest(dst)["experts"]["dtype"] == "int8"  # --expert-dtype int8 on an FP8 source
    weight_map = json.loads((dst / INDEX).read_text())["weight_map"]
    gpu: dict[str, torch.Tensor] = {}
    for file in sorted(set(weight_map.values())):
        tensors = load_file(str(dst / file))
        assert {n for n, f in weight_map.items() if f == file} == set(tensors)
        gpu.update(tensors)
    routed = set(expert_names(build_plan(fp8["path"])))
    stored = fp8["stored"]
    assert set(gpu) == {n for n in stored if n not in routed and n.removesuffix("_scale_inv") not in routed}
    fp8_weights = [n for n, t in stored.items() if t.dtype == torch.float8_e4m3fn and n in gpu]
    assert "model.layers.1.self_attn.o_proj.weight" in fp8_weights
    assert any(".shared_experts." in n for n in fp8_weights) and any(".layers.0.mlp." in n for n in fp8_weights)
    for name in fp8_weights:
        assert gpu[name].dtype == torch.float8_e4m3fn, name
        assert same_bytes(gpu[name], stored[name]), name
        assert same_bytes(gpu[name + "_scale_inv"], stored[name + "_scale_inv"]), name
    for name, tensor in gpu.items():  # everything else (norms, embeddings, routers) as stored too
        assert same_bytes(tensor, stored[name]), name
    config = json.loads((dst / "config.json").read_text())
    assert config["quantization_config"] == FP8_QUANTIZATION_CONFIG
    assert config == json.loads((fp8["path"] / "config.json").read_text())


@pytest.mark.parametrize("breakage", ["wrong shape", "missing"])
def test_fp8_bad_gpu_scale_is_rejected(fp8, capsys, tmp_path, breakage):  # noqa: F811
    name = "model.layers.1.self_attn.o_proj.weight_scale_inv"
    stored = dict(fp8["stored"])
    assert name in stored
    if breakage == "wrong shape":
        stored[name] = torch.ones(3, 3)
    else:
        del stored[name]
    src = tmp_path / "src"
    write_fp8_checkpoint(src, stored, fp8["plain"])
    line = fails(capsys, src, tmp_path / "out")
    assert name in line, line


@pytest.mark.parametrize("name, code", [
    ("model.layers.1.self_attn.o_proj.weight", 0x7F),  # FP8, copied as stored: its NaN codes, either sign
    ("model.layers.0.mlp.down_proj.weight", 0xFF),
    ("model.layers.1.self_attn.o_proj.weight_scale_inv", None),
    ("model.layers.2.mlp.experts.6.gate_proj.weight", 0xFF),  # dequantized and quantized for the CPU
])
def test_fp8_nonfinite_is_rejected(fp8, capsys, tmp_path, name, code):  # noqa: F811
    stored = dict(fp8["stored"])
    tensor = stored[name].clone()
    if code is None:
        tensor.view(-1)[-1] = math.inf
    else:
        tensor.view(torch.uint8)[1, 2] = code
    stored[name] = tensor
    src = tmp_path / "src"
    write_fp8_checkpoint(src, stored, fp8["plain"])
    line = fails(capsys, src, tmp_path / "out")
    assert f"tensor '{name}' holds NaN or inf" in line, line


# --- layout -----------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("case", ["int8", "int4", "bf16"])
def test_output_layout(source, converted, case):  # noqa: F811
    src = source("qwen3_moe").path
    dst = converted("qwen3_moe", case)
    _, dtype, group = CASES[case]
    plan = build_plan(src)
    cfg = plan.config
    src_tensors = load_file(str(src / "model.safetensors"))
    files = all_files(dst)

    # the manifest: every other file listed with its size and sha256
    m = manifest(dst)
    assert m["format"] == "hybrid-converted" and m["format_version"] == 1
    assert m["experts"]["dtype"] == dtype and m["experts"]["group_size"] == group
    listed = {entry["path"]: entry for entry in m["files"]}
    assert len(listed) == len(m["files"])
    assert set(listed) == set(files) - {"hybrid.json"}
    for rel, entry in listed.items():
        data = files[rel].read_bytes()
        assert entry["size"] == len(data), rel
        assert entry["sha256"] == hashlib.sha256(data).hexdigest(), rel

    # small files copied as they are
    for name in ("config.json", "generation_config.json", *EXTRA_FILES):
        assert (dst / name).read_bytes() == (src / name).read_bytes(), name

    # the index: the GPU weights only, covering every GPU file, each tensor as stored in the source
    routed = set(expert_names(plan))
    weight_map = json.loads((dst / INDEX).read_text())["weight_map"]
    assert set(weight_map) == set(src_tensors) - routed
    gpu_files = sorted(rel for rel in files if rel.startswith("gpu-"))
    assert gpu_files == ["gpu-embed.safetensors"] + [f"gpu-layer-{i:03d}.safetensors" for i in range(cfg.num_layers)]
    assert sorted(set(weight_map.values())) == gpu_files
    for file in gpu_files:
        tensors = load_file(str(dst / file))
        assert set(tensors) == {n for n, f in weight_map.items() if f == file}, file
        for name, tensor in tensors.items():
            assert same_bytes(tensor, src_tensors[name]), name

    # one expert file per MoE layer (Qwen3's layer 0 is dense)
    moe_layers = [i for i in range(cfg.num_layers) if cfg.moe_layers[i]]
    assert moe_layers == [1, 2, 3]
    expert_files = [f"experts/layer-{i:03d}.safetensors" for i in moe_layers]
    assert sorted(rel for rel in files if rel.startswith("experts/")) == expert_files
    assert m["experts"]["files"] == {str(i): rel for i, rel in zip(moe_layers, expert_files, strict=True)}
    spec = layer_spec(plan, dtype, group)
    for layer, rel in zip(moe_layers, expert_files, strict=True):
        with safe_open(str(dst / rel), "pt") as f:
            assert f.metadata() == spec.metadata(layer)
        header, _ = read_header(dst / rel)
        assert sorted(header, key=lambda n: header[n].begin) == list(spec.tensor_shapes())  # file order
        tensors = load_file(str(dst / rel))
        assert {n: (tuple(t.shape), t.dtype) for n, t in tensors.items()} == spec.tensor_shapes()
        for expert, role in ((0, "gate"), (3, "up"), (7, "down"), (5, "gate")):
            want = quantize_matrix(src_tensors[plan.expert_name(layer, expert, role)], spec)
            assert set(want) == ({"weight"} if dtype == "bf16" else {"weight", "scales"})
            for part, tensor in want.items():
                assert same_bytes(tensors[f"{role}.{part}"][expert], tensor), (rel, expert, role, part)

    for rel in files:
        if rel.endswith(".safetensors"):
            load_file(str(dst / rel))


def test_mixtral_expert_roles(source, converted):  # noqa: F811
    """Mixtral's w1 / w3 / w2 are the gate / up / down projections."""
    src = source("mixtral").path
    dst = converted("mixtral", "int8")
    src_tensors = load_file(str(src / "model.safetensors"))
    spec = layer_spec(build_plan(src), "int8", 0)
    for layer in range(3):
        tensors = load_file(str(dst / f"experts/layer-{layer:03d}.safetensors"))
        for expert in (0, 4, 7):
            for role, hf_name in (("gate", "w1"), ("up", "w3"), ("down", "w2")):
                name = f"model.layers.{layer}.block_sparse_moe.experts.{expert}.{hf_name}.weight"
                want = quantize_matrix(src_tensors[name], spec)
                assert same_bytes(tensors[f"{role}.weight"][expert], want["weight"]), name
                assert same_bytes(tensors[f"{role}.scales"][expert], want["scales"]), name
            assert not torch.equal(tensors["gate.weight"][expert], tensors["up.weight"][expert])


def test_threads_do_not_change_the_output(source, tmp_path):  # noqa: F811
    src = source("qwen3_moe").path
    outs = []
    for threads in ("1", "2"):
        dst = tmp_path / f"threads{threads}"
        assert main([str(src), str(dst), "--expert-dtype", "int4", "--group-size", "32", "--threads", threads]) == 0
        outs.append(digests(dst))
    assert outs[0] == outs[1]
    assert any(rel.startswith("experts/") for rel in outs[0])


@pytest.mark.parametrize("variant", sorted(set(VARIANTS) - set(PARITY_VARIANTS)))
def test_the_other_families_convert_exactly(tmp_path, variant):
    """Qwen2-MoE (gated shared expert), DeepSeek-V2 (both routings) and Kimi-K2 naming and layout: bf16 experts give
    exactly the logits of the source loaded directly."""
    make_checkpoint(VARIANTS[variant](), tmp_path / "src", seed=SEEDS[variant], dtype=torch.bfloat16)
    assert main([str(tmp_path / "src"), str(tmp_path / "dst"), "--expert-dtype", "bf16"]) == 0
    ids = PROMPTS[0]
    want = LLM(tmp_path / "src", dtype="float32").prefill_logits(ids)
    assert torch.equal(LLM(tmp_path / "dst", dtype="float32").prefill_logits(ids), want)


def test_float16_source(tmp_path):
    """An fp16 checkpoint converts (GPU weights kept in fp16, experts quantized from fp16) and stays close."""
    ref = make_checkpoint(VARIANTS["qwen2_moe"](), tmp_path / "src", seed=SEEDS["qwen2_moe"], dtype=torch.float16)
    assert main([str(tmp_path / "src"), str(tmp_path / "dst")]) == 0
    tensors, _ = read_header(tmp_path / "dst" / "gpu-layer-000.safetensors")
    assert tensors["model.layers.0.self_attn.q_proj.weight"].dtype == torch.float16
    kl, _ = kl_and_top1([hf_logits(ref, ids) for ids in PROMPTS],
                        [LLM(tmp_path / "dst", dtype="float32").prefill_logits(ids) for ids in PROMPTS])
    assert 0 < kl < KL_MAX["int8"]
