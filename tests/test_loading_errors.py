"""Unusable checkpoints fail at `LLM(...)` with the documented error class and a message naming what is at fault.

Each case starts from a valid tiny checkpoint written by transformers, copies it and breaks one thing: config.json's
architecture, a missing file, or one tensor removed, added or reshaped (safetensors edited with load_file/save_file).
"""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
import transformers
from checkpoints import SEEDS, VARIANTS, hf_logits, make_checkpoint, prompt, write_config
from safetensors.torch import load_file, save_file

from hybrid import LLM
from hybrid.errors import CheckpointError, ConfigError, HybridError
from hybrid.models import SUPPORTED_ARCHITECTURES

transformers.logging.set_verbosity_error()

REGISTERED = {"Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM", "MixtralForCausalLM", "DeepseekV3ForCausalLM",
              "DeepseekV2ForCausalLM", "Glm4MoeForCausalLM", "KimiK25ForConditionalGeneration", "MiniMaxM2ForCausalLM",
              "Glm4MoeLiteForCausalLM", "GptOssForCausalLM", "MiMoV2FlashForCausalLM", "Qwen3NextForCausalLM",
              "Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration", "DeepseekV32ForCausalLM",
              "GlmMoeDsaForCausalLM", "Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration"}


@pytest.fixture(scope="module")
def valid(tmp_path_factory):
    """name -> (a valid checkpoint directory, its reference model)."""
    out = {}
    for name in ("qwen3_moe", "deepseek_v3"):
        path = tmp_path_factory.mktemp(f"valid_{name}")
        out[name] = (path, make_checkpoint(VARIANTS[name](), path, seed=SEEDS[name]))
    return out


def copy_of(valid, name, dst):
    src = valid[name][0]
    dst.mkdir(parents=True, exist_ok=True)
    for file in src.iterdir():
        shutil.copy(file, dst / file.name)
    return dst


def edit_tensors(path, edit) -> None:
    file = path / "model.safetensors"
    tensors = load_file(str(file))
    edit(tensors)
    file.unlink()
    save_file(tensors, str(file), metadata={"format": "pt"})


def mentions_shape(message: str, shape: tuple[int, ...]) -> bool:
    """`shape` written as (a, b), [a, b], torch.Size([a, b]) or axb inside `message`."""
    pattern = r"(?<!\d)" + r"\s*(?:,|x|×)\s*".join(str(d) for d in shape) + r"(?!\d)"
    if len(shape) == 1:
        pattern = r"[\[(]\s*" + str(shape[0]) + r"\s*,?\s*[\])]"
    return re.search(pattern, message) is not None


def load(path):
    return LLM(path, device="cpu", dtype="float32")


def test_error_classes():
    for cls in (ConfigError, CheckpointError):
        assert issubclass(cls, HybridError) and issubclass(cls, ValueError)
    assert not issubclass(ConfigError, CheckpointError) and not issubclass(CheckpointError, ConfigError)


def test_supported_architectures_are_the_registered_ones():
    assert isinstance(SUPPORTED_ARCHITECTURES, tuple)
    assert set(SUPPORTED_ARCHITECTURES) == REGISTERED and len(SUPPORTED_ARCHITECTURES) == len(REGISTERED)


def test_the_valid_checkpoints_load(valid):
    for path, ref in valid.values():
        ids = prompt(7, seed=7)
        ours, expected = load(path).prefill_logits(ids), hf_logits(ref, ids)
        assert (ours - expected).abs().max() <= 1e-4 * expected.abs().max()


# --- config.json and files ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen3MoeForSequenceClassification", "DeepseekV4ForCausalLM"])
def test_unsupported_architecture(valid, tmp_path, arch):
    path = copy_of(valid, "qwen3_moe", tmp_path / "ckpt")
    write_config(path, {"architectures": [arch]})
    with pytest.raises(ConfigError) as info:
        load(path)
    message = str(info.value)
    assert arch in message
    for supported in REGISTERED:
        assert supported in message, f"supported architecture {supported} not listed in: {message}"


def test_missing_config_json(valid, tmp_path):
    path = copy_of(valid, "qwen3_moe", tmp_path / "ckpt")
    (path / "config.json").unlink()
    with pytest.raises(ConfigError, match=r"config\.json"):
        load(path)


def test_nonexistent_directory(tmp_path):
    path = tmp_path / "no_such_checkpoint"
    with pytest.raises(ConfigError) as info:
        load(path)
    assert "no_such_checkpoint" in str(info.value)


def test_no_safetensors(valid, tmp_path):
    path = copy_of(valid, "qwen3_moe", tmp_path / "ckpt_without_weights")
    (path / "model.safetensors").unlink()
    with pytest.raises(CheckpointError) as info:
        load(path)
    message = str(info.value)
    assert "ckpt_without_weights" in message and "safetensors" in message


def test_missing_shard_of_sharded_checkpoint(tmp_path):
    make_checkpoint(VARIANTS["qwen3_moe"](), tmp_path, seed=SEEDS["qwen3_moe"], max_shard_size="200KB")
    weight_map = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    shards = sorted(set(weight_map.values()))
    assert len(shards) > 1
    (tmp_path / shards[1]).unlink()
    with pytest.raises(CheckpointError) as info:
        load(tmp_path)
    assert shards[1] in str(info.value)


# --- tensors --------------------------------------------------------------------------------------------------------

MISSING = [
    ("deepseek_v3", "model.layers.1.mlp.gate.weight"),
    ("deepseek_v3", "model.layers.1.mlp.gate.e_score_correction_bias"),
    ("deepseek_v3", "model.layers.2.mlp.experts.5.down_proj.weight"),
    ("deepseek_v3", "model.layers.3.mlp.shared_experts.up_proj.weight"),
    ("deepseek_v3", "model.layers.0.mlp.gate_proj.weight"),
    ("deepseek_v3", "model.layers.2.self_attn.kv_b_proj.weight"),
    ("deepseek_v3", "model.layers.0.self_attn.q_a_layernorm.weight"),
    ("deepseek_v3", "lm_head.weight"),
    ("qwen3_moe", "model.layers.1.mlp.gate.weight"),
    ("qwen3_moe", "model.layers.3.mlp.experts.7.gate_proj.weight"),
    ("qwen3_moe", "model.layers.2.self_attn.k_norm.weight"),
    ("qwen3_moe", "model.norm.weight"),
    ("qwen3_moe", "model.embed_tokens.weight"),
]


@pytest.mark.parametrize("variant,tensor", MISSING, ids=[f"{v}:{t}" for v, t in MISSING])
def test_missing_tensor(valid, tmp_path, variant, tensor):
    path = copy_of(valid, variant, tmp_path / "ckpt")

    def drop(tensors):
        assert tensor in tensors, f"test setup: {tensor} not in the checkpoint"
        del tensors[tensor]

    edit_tensors(path, drop)
    with pytest.raises(CheckpointError) as info:
        load(path)
    assert tensor in str(info.value)


UNEXPECTED = [
    ("qwen3_moe", "model.layers.1.mlp.experts.8.up_proj.weight", (32, 64)),  # expert index past num_experts
    ("qwen3_moe", "model.layers.0.mlp.gate.weight", (8, 64)),  # router on the dense layer
    ("qwen3_moe", "model.layers.4.input_layernorm.weight", (64,)),  # a layer past num_hidden_layers
    ("qwen3_moe", "model.layers.1.self_attn.q_proj.bias", (96,)),  # bias on a bias-free projection
    ("deepseek_v3", "model.layers.0.mlp.shared_experts.up_proj.weight", (32, 64)),  # shared expert on dense layer
    ("deepseek_v3", "model.extra_projection.weight", (64, 64)),
]


@pytest.mark.parametrize("variant,tensor,shape", UNEXPECTED, ids=[f"{v}:{t}" for v, t, _ in UNEXPECTED])
def test_unexpected_tensor(valid, tmp_path, variant, tensor, shape):
    path = copy_of(valid, variant, tmp_path / "ckpt")

    def add(tensors):
        assert tensor not in tensors
        tensors[tensor] = torch.randn(shape)

    edit_tensors(path, add)
    with pytest.raises(CheckpointError) as info:
        load(path)
    assert tensor in str(info.value)


WRONG_SHAPE = [
    ("qwen3_moe", "model.layers.0.self_attn.o_proj.weight", (96, 64), (64, 96)),  # transposed
    ("qwen3_moe", "model.layers.2.mlp.experts.3.down_proj.weight", (64, 31), (64, 32)),
    ("qwen3_moe", "model.norm.weight", (65,), (64,)),
    ("deepseek_v3", "model.layers.1.self_attn.kv_a_proj_with_mqa.weight", (40, 64), (48, 64)),
    ("deepseek_v3", "model.layers.3.mlp.gate.weight", (7, 64), (8, 64)),
    ("deepseek_v3", "lm_head.weight", (255, 64), (256, 64)),
]


@pytest.mark.parametrize("variant,tensor,bad,good", WRONG_SHAPE, ids=[f"{v}:{t}" for v, t, _, _ in WRONG_SHAPE])
def test_wrong_shaped_tensor(valid, tmp_path, variant, tensor, bad, good):
    path = copy_of(valid, variant, tmp_path / "ckpt")

    def reshape(tensors):
        assert tuple(tensors[tensor].shape) == good, f"test setup: {tensor} is {tuple(tensors[tensor].shape)}"
        tensors[tensor] = torch.randn(bad)

    edit_tensors(path, reshape)
    with pytest.raises(CheckpointError) as info:
        load(path)
    message = str(info.value)
    assert tensor in message
    assert mentions_shape(message, bad), f"shape {bad} not in: {message}"
    assert mentions_shape(message, good), f"shape {good} not in: {message}"
