"""Quantized dense weights through the GEMM kernels (`kernels="triton"`, bf16): a DeepSeek-V3 FP8 checkpoint (128x128
block scales) and compressed-tensors FP8 / W4A16 checkpoints written by `hybrid-convert --gpu-quant` keep their
quantized Linear weights as stored (`QuantizedLinear`, `gpu_layers.linear`) instead of dequantizing them at load.

Without a GPU the kernels run under Triton's interpreter on the CPU (tests/conftest.py), on a GPU as compiled. The
oracle is the same checkpoint dequantized at load, in float32 through the PyTorch path: neither bf16 path equals it,
and the kernels (which also quantize the activations to FP8 for the FP8 GEMM) must stay within a modest factor of
the PyTorch bf16 path's own error. float32, or the PyTorch ops, keep today's plain Linear holding dequantized
weights.
"""

from __future__ import annotations

import shutil

import pytest
import torch
import transformers
from checkpoints import (
    FP8_QUANTIZATION_CONFIG,
    SEEDS,
    VARIANTS,
    build_model,
    fp8_config,
    fp8_quantize,
    is_fp8_quantized_name,
    make_checkpoint,
    prompt,
    write_config,
)
from gpu_support import DEVICE
from safetensors.torch import load_file, save_file
from torch import nn

from gpu_layers.linear import fp8_quantize_reference
from hybrid import LLM
from hybrid.layers.quantized_linear import MatrixLinear, QuantizedLinear

transformers.logging.set_verbosity_error()
# Model logits against the float32 dequantized model, as a factor of the PyTorch bf16 path's error. Both paths hold
# the same quantized weights; the FP8 GEMMs also round the activations to e4m3 (3 mantissa bits, ~3.6% rms per
# element against bf16's ~0.2%), which dominates where bf16 alone is nearly exact (Qwen3: ~6x measured, DeepSeek,
# whose bf16 error is already large, ~2.7x). W4A16 keeps 16-bit activations: as close as the PyTorch path.
ERROR_FACTOR = {"deepseek_fp8": 4.0, "fp8": 8.0, "w4a16": 1.5}
LAYER_TOL = 1e-2  # one layer's bf16 output against its float32 reference (bf16 rounding, float32 accumulation)
W4_GROUP = 32


@pytest.fixture(scope="module")
def deepseek_fp8(tmp_path_factory):
    """A tiny DeepSeek-V3 whose Linear weights are FP8 with 128x128 block scales (as tests/test_fp8_checkpoint.py)."""
    # the fused-MoE kernel needs 2I % 32 == 0: moe_intermediate 144; q_lora_rank 136 leaves q_b_proj's K (136) one
    # the FP8 kernel does not take (K % 16), so it stays a plain Linear
    cfg = fp8_config()
    cfg = type(cfg)(**(cfg.to_dict() | {"moe_intermediate_size": 144, "q_lora_rank": 136}))
    src = tmp_path_factory.mktemp("ds_src")
    build_model(cfg, seed=17).save_pretrained(src)
    stored = {}
    for name, tensor in sorted(load_file(str(src / "model.safetensors")).items()):
        if is_fp8_quantized_name(name, tensor):
            stored[name], stored[name + "_scale_inv"] = fp8_quantize(tensor)
        else:
            stored[name] = tensor
    path = tmp_path_factory.mktemp("ds_fp8")
    for file in ("config.json", "generation_config.json"):
        shutil.copy(src / file, path / file)
    save_file(stored, str(path / "model.safetensors"), metadata={"format": "pt"})
    write_config(path, {"quantization_config": dict(FP8_QUANTIZATION_CONFIG)})
    return path


@pytest.fixture(scope="module")
def qwen3_source(tmp_path_factory):
    """Qwen3-MoE with head_dim 64 (K of every projection a multiple of 32): q/k/v/o and the dense MLP quantize."""
    values = VARIANTS["qwen3_moe"]().to_dict() | {"head_dim": 64}
    cfg = type(VARIANTS["qwen3_moe"]())(**values)
    path = tmp_path_factory.mktemp("qwen3_src")
    make_checkpoint(cfg, path, seed=SEEDS["qwen3_moe"], dtype=torch.bfloat16)
    return path


def _converted(src, tmp_path_factory, scheme: str):
    pytest.importorskip("llmcompressor", reason="--gpu-quant needs the quant extra (installed by make test)")
    from convert.cli import main

    dst = tmp_path_factory.mktemp(scheme) / "dst"
    assert main([str(src), str(dst), "--gpu-quant", scheme, "--gpu-group-size", str(W4_GROUP)]) == 0
    return dst


def _errors(path, ids) -> tuple[float, float, dict[str, LLM]]:
    """Relative-norm error of the kernel and the PyTorch bf16 paths against the float32 dequantized model."""
    # a plain checkpoint's experts on the GPU too (expert_placement: auto would put them on the CPU operator)
    options = {"device": str(DEVICE), "expert_placement": "device"}
    llms = {"ref": LLM(path, dtype="float32", kernels="torch", **options),
            "kernel": LLM(path, dtype="bfloat16", kernels="triton", **options),
            "plain": LLM(path, dtype="bfloat16", kernels="torch", **options)}
    ref = llms["ref"].prefill_logits(ids)

    def error(llm: LLM) -> float:
        return float((llm.prefill_logits(ids) - ref).norm() / ref.norm())

    return error(llms["kernel"]), error(llms["plain"]), llms


def _check_layer(llms: dict[str, LLM], name: str, fp8_group: int | None, is_fp8: bool = True) -> None:
    """One QuantizedLinear against the float32 weight the loader dequantized for the reference model (an independent
    path): x quantized to FP8 per token (per 128 columns with block scales) as the kernel does, or the weight
    rounded to bf16 for W4A16. Decode-sized T = 5 (split-K); the prefill regime runs in the model."""
    module = llms["kernel"].model.get_submodule(name)
    weight = llms["ref"].model.get_submodule(name).weight
    x = torch.randn(5, module.in_features, generator=torch.Generator().manual_seed(0)).to(DEVICE, torch.bfloat16)
    if is_fp8:
        group = fp8_group or module.in_features
        q, scale = fp8_quantize_reference(x, group)
        want = (q.float() * scale.repeat_interleave(group, 1)[:, :module.in_features]) @ weight.T
    else:
        want = x.float() @ weight.to(torch.bfloat16).float().T
    got = module(x)
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    assert (got.float() - want).abs().max() <= LAYER_TOL * want.abs().max(), name


def _linears(llm: LLM, cls) -> set[str]:
    return {name for name, module in llm.model.named_modules() if type(module) is cls}


def test_deepseek_fp8_runs_block_scaled_weights_through_the_kernel(deepseek_fp8):
    ours, plain, llms = _errors(deepseek_fp8, prompt(20, seed=3))
    kernel, torch_llm = llms["kernel"], llms["plain"]
    quantized = _linears(kernel, QuantizedLinear)
    attn = "model.layers.0.self_attn"
    for name in (f"{attn}.q_a_proj", f"{attn}.kv_a_proj_with_mqa", f"{attn}.o_proj", "model.layers.0.mlp.gate_proj",
                 "model.layers.0.mlp.down_proj", "model.layers.2.mlp.shared_experts.down_proj"):
        assert name in quantized, name
    module = kernel.model.get_submodule(f"{attn}.o_proj")
    assert module.weight.dtype == torch.float8_e4m3fn and module.weight_scale_inv.dtype == torch.float32
    # kept plain: kv_b_proj (its weight feeds the attention kernels), q_b_proj (K = 136: the FP8 kernel needs
    # K % 16 == 0), the unquantized lm_head
    assert type(kernel.model.get_submodule(f"{attn}.kv_b_proj")) is MatrixLinear
    assert type(kernel.model.get_submodule(f"{attn}.q_b_proj")) is nn.Linear
    assert type(kernel.model.lm_head) is nn.Linear
    assert not _linears(torch_llm, QuantizedLinear)
    for name in (f"{attn}.o_proj", "model.layers.0.mlp.down_proj", "model.layers.1.mlp.shared_experts.gate_proj"):
        _check_layer(llms, name, fp8_group=128)
    assert ours <= ERROR_FACTOR["deepseek_fp8"] * plain + 1e-3, (ours, plain)


@pytest.mark.parametrize("scheme", ["fp8", "w4a16"])
def test_compressed_tensors_weights_run_through_the_kernels(qwen3_source, tmp_path_factory, scheme):
    dst = _converted(qwen3_source, tmp_path_factory, scheme)
    ours, plain, llms = _errors(dst, prompt(20, seed=4))
    kernel, torch_llm = llms["kernel"], llms["plain"]
    quantized = _linears(kernel, QuantizedLinear)
    expected = {f"model.layers.{i}.self_attn.{p}_proj" for i in range(4) for p in "qkvo"}
    expected |= {f"model.layers.0.mlp.{p}_proj" for p in ("gate", "up", "down")}
    assert quantized == expected
    parts = {"fp8": {"weight", "weight_scale"}, "w4a16": {"weight_packed", "weight_scale", "weight_shape"}}[scheme]
    assert {n for n, _ in kernel.model.get_submodule("model.layers.0.mlp.down_proj").named_buffers()} == parts
    assert not _linears(torch_llm, QuantizedLinear)
    for name in ("model.layers.0.self_attn.o_proj", "model.layers.0.mlp.down_proj"):
        _check_layer(llms, name, fp8_group=None, is_fp8=scheme == "fp8")
    assert ours <= ERROR_FACTOR[scheme] * plain + 1e-3, (ours, plain)


def test_float32_keeps_dequantized_linears(deepseek_fp8):
    llm = LLM(deepseek_fp8, device=str(DEVICE), dtype="float32", kernels="triton", expert_placement="device")
    assert not _linears(llm, QuantizedLinear)
    weight = llm.model.get_submodule("model.layers.0.self_attn.o_proj").weight
    assert weight.dtype == torch.float32
