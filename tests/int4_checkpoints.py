"""Tiny checkpoints whose routed experts are compressed-tensors INT4, as Kimi-K2-Thinking, K2.5 and K2.6 publish
theirs (a helper module, not a test module).

Kimi's `quantization_config`: `pack-quantized`, one config group of symmetric 4-bit integer weights in groups of
32 along K, targets `Linear`, and an `ignore` list that leaves attention, the shared experts, dense MLPs and
`lm_head` in bfloat16, so that only the routed experts are packed. The experts here are quantized and packed by
compressed-tensors itself: its `calculate_qparams` gives each group's bfloat16 scale (absmax / 7.5, so a group's
most negative weight can round to the -8 code) and its `pack-quantized` compressor writes `weight_packed`,
`weight_scale` and `weight_shape`, which is what llm-compressor runs for this scheme. The dequantized weights come
from the same library's decompressor (with the scales widened to float32, so the products are exact).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
import transformers
from checkpoints import make_checkpoint, write_config
from compressed_tensors.compressors import BaseCompressor
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
from compressed_tensors.quantization.utils import calculate_qparams
from safetensors.torch import load_file, save_file

INT4_GROUP = 32
# moonshotai/Kimi-K2-Thinking's config.json (the fields a reader uses; observer settings elided)
KIMI_QUANTIZATION_CONFIG = {
    "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
    "config_groups": {"group_0": {
        "targets": ["Linear"], "input_activations": None, "output_activations": None,
        "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": INT4_GROUP,
                    "dynamic": False, "actorder": None, "observer": "minmax", "observer_kwargs": {}}}},
    "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", r"re:.*mlp\.(gate|up|gate_up|down)_proj.*"],
    "kv_cache_scheme": None,
}
ROUTED_EXPERT = re.compile(r"\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$")


def int4_scheme(group: int = INT4_GROUP) -> QuantizationScheme:
    args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=group)
    return QuantizationScheme(targets=["Linear"], weights=args, format="pack-quantized")


def compress_int4(weight: torch.Tensor, scheme: QuantizationScheme) -> dict[str, torch.Tensor]:
    """weight [N, K] (bfloat16) -> compressed-tensors' parts `weight_packed`, `weight_scale`, `weight_shape`."""
    groups = weight.unflatten(-1, (-1, scheme.weights.group_size))
    scale, zero_point = calculate_qparams(groups.amin(-1), groups.amax(-1), scheme.weights)
    compressor = BaseCompressor.get_value_from_registry("pack-quantized")
    return compressor.compress({"weight": weight, "weight_scale": scale, "weight_zero_point": zero_point}, scheme)


def decompress_int4(parts: dict[str, torch.Tensor], scheme: QuantizationScheme) -> torch.Tensor:
    """compressed-tensors' own dequantization, in float32 (exact: a 4-bit code times a bfloat16 scale)."""
    compressor = BaseCompressor.get_value_from_registry("pack-quantized")
    state = dict(parts, weight_scale=parts["weight_scale"].float())
    return compressor.decompress(state, scheme)["weight"].float()


def make_int4_checkpoint(cfg, path: Path, *, seed: int, group: int = INT4_GROUP) -> dict[str, torch.Tensor]:
    """A bfloat16 checkpoint of `cfg` (`checkpoints.make_checkpoint`) at `path` with its routed experts replaced by
    compressed-tensors INT4 parts and Kimi's `quantization_config`; returns every tensor as the float32 values it
    stands for (checkpoint names, experts dequantized), for `load_reference`."""
    make_checkpoint(cfg, path, seed=seed, dtype=torch.bfloat16)
    scheme = int4_scheme(group)
    quant = json.loads(json.dumps(KIMI_QUANTIZATION_CONFIG))
    quant["config_groups"]["group_0"]["weights"]["group_size"] = group
    stored, values = {}, {}
    for name, tensor in load_file(str(path / "model.safetensors")).items():
        if ROUTED_EXPERT.search(name):
            parts = compress_int4(tensor, scheme)
            stored.update({f"{name}{suffix[len('weight'):]}": t for suffix, t in parts.items()})
            values[name] = decompress_int4(parts, scheme)
        else:
            stored[name] = tensor
            values[name] = tensor.float()
    save_file(stored, str(path / "model.safetensors"), metadata={"format": "pt"})
    write_config(path, {"quantization_config": quant})
    return values


def load_reference(path: Path, values: dict[str, torch.Tensor], tmp: Path) -> torch.nn.Module:
    """transformers' model (float32) holding `values`, loaded through its own checkpoint reader with the config of
    the checkpoint at `path` minus its quantization (if it has one in config.json)."""
    tmp.mkdir(parents=True, exist_ok=True)
    save_file({n: t.contiguous() for n, t in values.items()}, str(tmp / "model.safetensors"),
              metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config.pop("quantization_config", None)
    (tmp / "config.json").write_text(json.dumps(config))
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32, attn_implementation="eager")
    return model.eval()
