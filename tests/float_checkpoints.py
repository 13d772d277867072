"""Tiny checkpoints whose routed experts are stored the way 2026's releases publish theirs (a helper module, not a
test module): FP8 e4m3 with block scales (DeepSeek's float32 `weight_scale_inv`, DeepSeek-V4's E8M0 `.scale`),
compressed-tensors FP8 (per channel or in blocks), DeepSeek-V4's MXFP4 experts (int8-packed e2m1 + E8M0 `.scale` per
32), NVFP4 as NVIDIA ModelOpt writes it (`weight` uint8, `weight_scale` e4m3, `weight_scale_2`, `input_scale`, with
`hf_quant_config.json`) and as compressed-tensors does (`nvfp4-pack-quantized`, packed and scaled by the installed
compressed-tensors library itself), and gpt-oss's fused MXFP4 expert tensors.

`write_layout` starts from a float checkpoint that `checkpoints.make_checkpoint` saved, quantizes only the routed
experts (every other tensor stays as saved, like the releases' attention in BF16) and returns every tensor as the
float32 values it stands for, for `int4_checkpoints.load_reference`: transformers' model holding them is the
reference. Block scales are spread apart by a random factor per block, so a mis-broadcast scale shows.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from checkpoints import write_config
from compressed_tensors.compressors import BaseCompressor
from compressed_tensors.quantization import QuantizationScheme
from compressed_tensors.quantization.quant_scheme import NVFP4
from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam
from safetensors.torch import load_file, save_file

from cpu_experts import formats

ROUTED_EXPERT = re.compile(r"\.(mlp|block_sparse_moe)\.experts\.\d+\.(gate_proj|up_proj|down_proj|w1|w2|w3)\.weight$")
LAYOUTS = ("fp8-block", "fp8-e8m0", "fp8-ct-channel", "fp8-ct-block", "mxfp4-e8m0", "nvfp4-modelopt", "nvfp4-ct")
# the expert file format each layout is read into (dtype, group, scale dtype), for block [32, 32]
EXPECTED_FORMAT = {"fp8-block": ("fp8", 32, "float32"), "fp8-e8m0": ("fp8", 32, "float32"),
                   "fp8-ct-channel": ("fp8", 128, "float32"), "fp8-ct-block": ("fp8", 32, "float32"),
                   "mxfp4-e8m0": ("mxfp4", 32, "e8m0"), "nvfp4-modelopt": ("nvfp4", 16, "e4m3"),
                   "nvfp4-ct": ("nvfp4", 16, "e4m3")}
BLOCK = (32, 32)  # tiny models: several blocks per matrix (DeepSeek's releases use 128 x 128)
FP8_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(BLOCK)}
# nvidia/*-NVFP4 releases: hf_quant_config.json beside a config.json without quantization_config
MODELOPT_CONFIG = {"producer": {"name": "modelopt", "version": "0.33.0"},
                   "quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": 16,
                                    "exclude_modules": ["lm_head", "*self_attn*", "*mlp.gate", "*mlp.shared*"]}}
CT_NVFP4_SCHEME = QuantizationScheme(targets=["Linear"], weights=NVFP4["weights"], format="nvfp4-pack-quantized")


def ct_config(fmt: str, weights: dict) -> dict:
    """A compressed-tensors quantization_config whose one group targets the routed experts."""
    return {"quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": [r"re:.*\.experts\.\d+\..*"], "weights": weights,
                                          "input_activations": None, "output_activations": None}},
            "ignore": ["lm_head"], "kv_cache_scheme": None}


CT_FP8_WEIGHTS = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False}
CONFIGS = {
    "fp8-block": FP8_CONFIG, "fp8-e8m0": FP8_CONFIG | {"scale_fmt": "ue8m0"}, "mxfp4-e8m0": FP8_CONFIG,
    "fp8-ct-channel": ct_config("float-quantized", CT_FP8_WEIGHTS | {"strategy": "channel"}),
    "fp8-ct-block": ct_config("float-quantized", CT_FP8_WEIGHTS | {"strategy": "block",
                                                                   "block_structure": list(BLOCK)}),
    "nvfp4-ct": ct_config("nvfp4-pack-quantized", NVFP4["weights"].model_dump(mode="json")),
}


def block_factors(shape, gen: torch.Generator, block: tuple[int, int] = BLOCK) -> torch.Tensor:
    """A random factor in [e^-1, e] per block, expanded to `shape`."""
    rows, cols = -(-shape[0] // block[0]), -(-shape[1] // block[1])
    f = torch.exp(torch.rand(rows, cols, generator=gen) * 2 - 1)
    return f.repeat_interleave(block[0], 0)[: shape[0]].repeat_interleave(block[1], 1)[:, : shape[1]]


def _fp8_blocks(w: torch.Tensor, *, is_e8m0: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [N, K] -> (float8_e4m3fn codes, block scales [ceil(N/bn), ceil(K/bk)] float32, dequantized values);
    E8M0 scales are the power of two at or above amax / 448."""
    bn, bk = BLOCK
    rows, cols = w.shape
    padded = torch.nn.functional.pad(w, (0, -cols % bk, 0, -rows % bn))
    tiles = padded.unflatten(0, (-1, bn)).unflatten(2, (-1, bk))  # [R, bn, C, bk]
    scale = tiles.abs().amax(dim=(1, 3)).clamp(min=1e-12) / formats.E4M3_MAX
    if is_e8m0:
        scale = torch.pow(2.0, torch.ceil(torch.log2(scale)))
    expanded = scale.repeat_interleave(bn, 0)[:rows].repeat_interleave(bk, 1)[:, :cols]
    codes = (w / expanded).to(torch.float8_e4m3fn)
    return codes, scale, codes.float() * expanded


def _fp8_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    scale = w.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / formats.E4M3_MAX  # [N, 1]
    codes = (w / scale).to(torch.float8_e4m3fn)
    return codes, scale, codes.float() * scale


def ct_nvfp4_values(parts: dict[str, torch.Tensor], cols: int) -> torch.Tensor:
    """compressed-tensors' own dequantization convention, e2m1 * (scale / global_scale), in float32."""
    codes = formats.unpack_fp4(parts["weight_packed"], cols)
    scale = parts["weight_scale"].float() / parts["weight_global_scale"].float()
    return formats.e2m1_to_float(codes) * scale.repeat_interleave(16, 1)


def _nvfp4_ct(w: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """compressed-tensors' own NVFP4: its global scale, block scales and packing. The values returned are the
    runtime's, e2m1 * scale * float32(1 / global_scale) (`hybrid.stored_matrix`), within one float32 rounding of
    `ct_nvfp4_values`: the difference is small, but an expert input that bfloat16 rounds differently because of
    it shows in the logits (the float formats' contract rounds every expert input to bfloat16)."""
    args = NVFP4["weights"]
    global_scale = generate_gparam(w.min(), w.max())
    groups = w.unflatten(-1, (-1, args.group_size))
    scale, zero_point = calculate_qparams(groups.amin(-1), groups.amax(-1), args, global_scale=global_scale)
    compressor = BaseCompressor.get_value_from_registry("nvfp4-pack-quantized")
    parts = compressor.compress({"weight": w, "weight_scale": scale, "weight_global_scale": global_scale,
                                 "weight_zero_point": zero_point}, CT_NVFP4_SCHEME)
    tensor_scale = (1.0 / global_scale.reshape(())).float()
    values = formats.dequantize_nvfp4(parts["weight_packed"], parts["weight_scale"].view(torch.uint8), tensor_scale,
                                      w.shape[1])
    parts["input_global_scale"] = torch.tensor([1.0])  # W4A4 checkpoints store one; the reader ignores it
    return parts, values


def quantize_layout(layout: str, w: torch.Tensor, gen: torch.Generator) -> tuple[dict[str, torch.Tensor],
                                                                                 torch.Tensor]:
    """One float32 expert projection [N, K] -> (stored parts by suffix, the float32 values they stand for)."""
    if layout in ("fp8-block", "fp8-e8m0", "fp8-ct-block"):
        codes, scale, values = _fp8_blocks(w * block_factors(w.shape, gen), is_e8m0=layout == "fp8-e8m0")
        part = {"fp8-block": "weight_scale_inv", "fp8-e8m0": "scale", "fp8-ct-block": "weight_scale"}[layout]
        scale = scale.to(torch.float8_e8m0fnu) if layout == "fp8-e8m0" else scale
        return {"weight": codes, part: scale}, values
    if layout == "fp8-ct-channel":
        codes, scale, values = _fp8_channel(w)
        return {"weight": codes, "weight_scale": scale}, values
    if layout == "mxfp4-e8m0":
        packed, scales = formats.quantize_mxfp4(w)
        return ({"weight": packed.view(torch.int8), "scale": scales.view(torch.float8_e8m0fnu)},
                formats.dequantize_mxfp4(packed, scales, w.shape[1]))
    if layout == "nvfp4-modelopt":
        packed, scales, tensor_scale = formats.quantize_nvfp4(w)
        parts = {"weight": packed, "weight_scale": scales.view(torch.float8_e4m3fn),
                 "weight_scale_2": tensor_scale.reshape(()), "input_scale": torch.tensor(1.0)}
        return parts, formats.dequantize_nvfp4(packed, scales, tensor_scale, w.shape[1])
    if layout == "nvfp4-ct":
        return _nvfp4_ct(w)
    raise ValueError(layout)


def write_layout(path: Path, layout: str, seed: int = 0) -> dict[str, torch.Tensor]:
    """Rewrites the float checkpoint at `path` (one `model.safetensors`) with its routed experts stored in `layout`
    and the config that goes with it; returns checkpoint name -> the float32 values every tensor stands for."""
    path = Path(path)
    gen = torch.Generator().manual_seed(seed)
    stored, values = {}, {}
    for name, tensor in load_file(str(path / "model.safetensors")).items():
        if not ROUTED_EXPERT.search(name):
            stored[name], values[name] = tensor, tensor.float()
            continue
        parts, values[name] = quantize_layout(layout, tensor.float(), gen)
        module = name.removesuffix(".weight")
        stored.update({f"{module}.{suffix}": t.contiguous() for suffix, t in parts.items()})
    save_file(stored, str(path / "model.safetensors"), metadata={"format": "pt"})
    if layout == "nvfp4-modelopt":
        (path / "hf_quant_config.json").write_text(json.dumps(MODELOPT_CONFIG, indent=2))
    else:
        write_config(path, {"quantization_config": CONFIGS[layout]})
    return values


def gpt_oss_experts(num_experts: int, hidden: int, inter: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """gpt-oss's fused MXFP4 expert tensors of one layer, as published: `gate_up_proj_blocks` uint8
    [E, 2I, H/32, 16] (gate and up rows interleaved), `gate_up_proj_scales` E8M0 [E, 2I, H/32], `down_proj_*`
    likewise [E, H, I/32, ...], and the biases; random codes, scales around 2^0."""
    def blocks(rows: int, cols: int) -> torch.Tensor:
        return torch.randint(0, 256, (num_experts, rows, cols // 32, 16), generator=gen, dtype=torch.uint8)

    def scales(rows: int, cols: int) -> torch.Tensor:
        return torch.randint(120, 131, (num_experts, rows, cols // 32), generator=gen, dtype=torch.uint8)

    return {"gate_up_proj_blocks": blocks(2 * inter, hidden), "gate_up_proj_scales": scales(2 * inter, hidden),
            "down_proj_blocks": blocks(hidden, inter), "down_proj_scales": scales(hidden, inter),
            "gate_up_proj_bias": torch.randn(num_experts, 2 * inter, generator=gen),
            "down_proj_bias": torch.randn(num_experts, hidden, generator=gen)}


def bf16_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """transformers' fused-experts forward (Qwen3-MoE, DeepSeek-V3: `gate_up_proj` [E, 2I, H], `down_proj`
    [E, H, I]) with each matmul's input rounded to bfloat16 first: the float formats' contract for the CPU
    experts (`cpu_experts.reference.moe_reference(bf16_activations=True)`); patched into a reference model."""
    out = torch.zeros_like(hidden_states)
    for expert in torch.unique(top_k_index).tolist():
        token_idx, slot = torch.where(top_k_index == expert)
        x = hidden_states[token_idx].to(torch.bfloat16).float()
        gate, up = torch.nn.functional.linear(x, self.gate_up_proj[expert]).chunk(2, dim=-1)
        h = (self.act_fn(gate) * up).to(torch.bfloat16).float()
        y = torch.nn.functional.linear(h, self.down_proj[expert]) * top_k_weights[token_idx, slot, None]
        out.index_add_(0, token_idx, y.to(out.dtype))
    return out


def round_expert_inputs(model: torch.nn.Module) -> torch.nn.Module:
    """`model` with every fused-experts module computing through `bf16_experts_forward`."""
    import types

    patched = 0
    for module in model.modules():
        if hasattr(module, "gate_up_proj") and hasattr(module, "down_proj") and hasattr(module, "act_fn"):
            module.forward = types.MethodType(bf16_experts_forward, module)
            patched += 1
    assert patched, "no fused experts module found"
    return model
