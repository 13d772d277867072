"""The dense Qwen3.5 (`Qwen3_5ForConditionalGeneration` as released, `Qwen3_5ForCausalLM` text only): Qwen3.5-MoE's
Gated DeltaNet and gated-attention layers with one gated MLP each. Parity with transformers on tiny random
checkpoints that transformers writes (the released one through its multimodal wrapper with a tiny vision tower, the
text-only one with tied embeddings), the parsed config (no MoE), a model with no routed experts asked to place them
on the CPU, and the engine's continuous batching."""

from __future__ import annotations

import logging

import pytest
import torch
from qwen3_next_support import (
    CHUNK,
    NUM_LAYERS,
    check_parity,
    make_llm,
    random_prompt,
    run_together,
    solo_tokens,
    write_qwen3_5_dense,
)
from safetensors import safe_open

from convert.plan import build_plan
from hybrid.engine import Engine
from hybrid.errors import ConfigError
from hybrid.layers.mlp import GatedMLP
from hybrid.models import load_model_config
from hybrid.routed_experts import RoutedExperts

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def released(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_5_dense")
    return path, write_qwen3_5_dense(transformers, path)


@pytest.fixture(scope="module")
def text_only(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_5_dense_text")
    return path, write_qwen3_5_dense(transformers, path, is_released=False, tie_word_embeddings=True)


@pytest.fixture(scope="module")
def released_llm(released):
    return make_llm(released[0])


def test_checkpoints_as_published(released, text_only):
    """The released layout (text under `model.language_model.*`, a vision tower beside it) and the text-only one
    (`model.*`, no lm_head: tied)."""
    with safe_open(str(released[0] / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "model.language_model.layers.0.mlp.gate_proj.weight" in names and "lm_head.weight" in names
    assert any(n.startswith("model.visual.") for n in names) and not any(".experts." in n for n in names)
    with safe_open(str(text_only[0] / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "model.layers.3.self_attn.q_proj.weight" in names and "lm_head.weight" not in names


@pytest.mark.parametrize("arch", ["released", "text_only"])
def test_parity_with_transformers(arch, request):
    path, model = request.getfixturevalue(arch)
    check_parity(model, request.getfixturevalue("released_llm") if arch == "released" else make_llm(path), arch)


def test_config_has_no_experts(released, text_only):
    for path, architecture in ((released[0], "Qwen3_5ForConditionalGeneration"), (text_only[0], "Qwen3_5ForCausalLM")):
        _, config = load_model_config(path)
        assert config.architecture == architecture and config.moe is None and config.num_moe_layers == 0
        assert [spec.mlp for spec in config.layers] == ["dense"] * NUM_LAYERS and config.intermediate_size == 96
        assert [spec.is_recurrent for spec in config.layers] == [True, True, True, False]
        assert config.layers[0].linear.projection == "qkv_z_b_a" and config.has_offset_norms
        assert config.layers[3].attention.has_output_gate and config.layers[3].rope.rotary_dim == 4
    assert load_model_config(text_only[0])[1].tie_word_embeddings


def test_no_experts_to_place_on_the_cpu(released, released_llm, caplog):
    """expert_placement=cpu (what auto means on CUDA) on a model without routed experts: a log line says so, no CPU
    executor starts, and every layer runs as the device placement runs it."""
    with caplog.at_level(logging.INFO, logger="hybrid.llm"):
        llm = make_llm(released[0], expert_placement="cpu", gpu_experts=2)
    assert "Qwen3_5ForConditionalGeneration has no routed experts" in caplog.text
    assert llm.cpu_executor is None and llm.num_gpu_experts == 0
    assert not any(isinstance(m, RoutedExperts) for m in llm.model.modules())
    assert sum(isinstance(m, GatedMLP) for m in llm.model.modules()) == NUM_LAYERS
    prompt = random_prompt(20, seed=4)
    assert torch.equal(llm.prefill_logits(prompt), released_llm.prefill_logits(prompt))


@pytest.mark.parametrize(("options", "message"), [
    ({"defer_experts": 1}, r"defer_experts 1 must be below the model's top-k routing \(0: no routed experts\)"),
    ({"record_routing": "routing.json"}, "record_routing: Qwen3_5ForConditionalGeneration has no routed experts"),
])
def test_expert_options_refused(released, options, message):
    with pytest.raises(ConfigError, match=message):
        make_llm(released[0], **options)


def test_converter_refuses_a_model_without_experts(released):
    with pytest.raises(ConfigError, match="has no routed experts, so there is nothing to convert"):
        build_plan(released[0])


def test_batched_chunked_prefill_gives_solo_tokens(released_llm):
    prompts = [random_prompt(n, seed=n) for n in (5, 60, 130, 17)]
    solo = solo_tokens(released_llm, prompts, 12)
    engine = Engine(released_llm, max_num_batched_tokens=CHUNK, max_num_seqs=4)
    try:
        assert run_together(engine, prompts, 12) == solo
        stats = engine.stats()
        assert stats.num_free_state_slots == stats.num_state_slots == 4
    finally:
        engine.close()
