"""MiMo-V2-Flash (`MiMoV2FlashForCausalLM`) against transformers' own modeling_mimo_v2_flash.

The tiny checkpoint is what `save_pretrained` writes (the released layout: per-expert tensors, the router's
`e_score_correction_bias`, sliding layers' `self_attn.attention_sink_bias`), with random sinks (transformers initialises
them near zero), full and sliding layers in an irregular order (sliding: twice the KV heads, sinks), dense layers
among the MoE ones, a window (5) shorter than the longer prompts, grouped routing, q/k heads of 192 and v heads of
128 (the released dims, which the attention kernels take), partial rotary with a theta per kind and the V scale.
Checked: float32 prefill logits (1, 7 and 33 tokens, crossing KV pages of 16) within 1e-4 of max |logit| and 32
greedy tokens against `generate` on the CPU path (14 through the Triton kernels, under the interpreter without a
GPU: decode into the second page); the config in transformers' and in the released spelling and its errors; the
FP8 checkpoint as published. The engine over the two cache groups (full layers' pages of one KV head, sliding
layers' of two, window 12, pages of 4): batched and chunked, prefix-cached and preempted requests get their solo
tokens, and the sliding group holds only its window's pages (test_cache_groups.py's scenarios for gpt-oss).
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from cache_groups_support import (
    BLOCK,
    batched_outputs,
    make_llm,
    pages_in_use,
    preempted_outputs,
    prefix_hit,
    solo_outputs,
)
from checkpoints import build_model, hf_generate, hf_logits, prompt
from safetensors.torch import load_file, save_file
from test_direct_serving import FLOAT_FORMAT_TOL
from test_fp8_checkpoint import REL_TOL, build_fp8_checkpoint, load_reference
from test_models_parity import GEN_PROMPT, NEW_TOKENS, PREFILL_LENGTHS, assert_logits_close, assert_same_tokens

from hybrid import LLM
from hybrid.errors import ConfigError
from hybrid.layers.backends import TritonAttentionBackend
from hybrid.models import load_model_config
from hybrid.models.mimo_v2_flash import MiMoV2FlashForCausalLM
from hybrid.synthetic import SHAPES, has_dense_layers, shape_config, write_synthetic_checkpoint

transformers.logging.set_verbosity_error()

SEED = 2026
F, S = "full_attention", "sliding_attention"
LAYER_TYPES = [F, S, S, F, S, S]
MLP_LAYER_TYPES = ["dense", "sparse", "sparse", "dense", "sparse", "sparse"]
WINDOW = 5
NUM_KERNEL_TOKENS = 14  # greedy tokens through the interpreted kernels: decode into the second KV page
KV_HEADS = 1


def mimo_config(**overrides) -> transformers.MiMoV2FlashConfig:
    values = dict(
        vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=len(LAYER_TYPES), layer_types=LAYER_TYPES, mlp_layer_types=MLP_LAYER_TYPES,
        num_attention_heads=4, num_key_value_heads=KV_HEADS, head_dim=192, v_head_dim=128, sliding_window=WINDOW,
        n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1, routed_scaling_factor=1.5,
        max_position_embeddings=256, attention_value_scale=0.707,
        rope_parameters={F: {"rope_type": "default", "rope_theta": 5e6, "partial_rotary_factor": 0.334},
                         S: {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.334}},
        bos_token_id=0, eos_token_id=1,
    )
    values.update(overrides)
    return transformers.MiMoV2FlashConfig(**values)


def make_mimo(path, **overrides):
    model = build_model(mimo_config(**overrides), seed=SEED)
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="module")
def mimo(tmp_path_factory):
    path = tmp_path_factory.mktemp("mimo")
    return path, make_mimo(path), LLM(path, dtype="float32", expert_placement="device")


@pytest.fixture(scope="module")
def mimo_kernels(mimo):
    from gpu_support import DEVICE

    path, ref, _ = mimo
    llm = LLM(path, device=str(DEVICE), dtype="float32", kernels="triton", expert_placement="device")
    return ref.to(DEVICE), llm, DEVICE


def test_checkpoint_is_the_released_layout(mimo):
    path, _, _ = mimo
    names = set(load_file(str(path / "model.safetensors")))
    assert "model.layers.1.self_attn.attention_sink_bias" in names
    assert "model.layers.0.self_attn.attention_sink_bias" not in names  # full layers have no sinks
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in names
    assert "model.layers.1.mlp.gate.e_score_correction_bias" in names


def test_config_follows_the_checkpoint(mimo):
    _, _, llm = mimo
    specs = llm.config.layers
    assert [s.attention.sliding_window for s in specs] == [WINDOW if t == S else None for t in LAYER_TYPES]
    assert [s.attention.num_kv_heads for s in specs] == [2 * KV_HEADS if t == S else KV_HEADS for t in LAYER_TYPES]
    assert [s.attention.has_sinks for s in specs] == [t == S for t in LAYER_TYPES]
    assert [s.mlp for s in specs] == ["moe" if t == "sparse" else "dense" for t in MLP_LAYER_TYPES]
    assert {(s.attention.head_dim, s.attention.v_head_dim, s.attention.value_scale) for s in specs} == {
        (192, 128, 0.707)}
    assert [(s.rope.theta, s.rope.rotary_dim) for s in specs[:2]] == [(5e6, 64), (1e4, 64)]
    assert llm.config.rms_norm_eps == 1e-5 and llm.config.moe.shared_intermediate_size == 0
    kv_heads = [2 * KV_HEADS if t == S else KV_HEADS for t in LAYER_TYPES]
    layers = llm.model.model.layers
    assert [layer.self_attn.kv_cache_shapes() for layer in layers] == [((h, 192), (h, 128)) for h in kv_heads]
    assert [tuple(t.shape[2:]) for layer in layers for t in layer.self_attn.kv_cache] == [
        shape for h in kv_heads for shape in ((h, 192), (h, 128))]


@pytest.mark.parametrize("length", PREFILL_LENGTHS)
def test_prefill_logits_match_transformers(mimo, length):
    _, ref, llm = mimo
    ids = prompt(length, seed=400 + length)
    assert_logits_close(llm.prefill_logits(ids), hf_logits(ref, ids), f"MiMo prefill of {length}")


def test_greedy_generation_matches_transformers(mimo):
    _, ref, llm = mimo
    expected = hf_generate(ref, GEN_PROMPT, NEW_TOKENS)
    ours = llm.generate(GEN_PROMPT, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    assert_same_tokens(ours, expected, None, "MiMo greedy")


def test_the_value_scale_and_the_sinks_matter(mimo):
    """The reference's output moves with the V scale and the sinks, so the parity above checks both."""
    _, ref, _ = mimo
    ids = prompt(33, seed=433)
    good = hf_logits(ref, ids)
    for layer in ref.model.layers:
        layer.self_attn.v_scale = 1.0
    try:
        assert (hf_logits(ref, ids) - good).abs().max() > 1e-2 * good.abs().max()
    finally:
        for layer in ref.model.layers:
            layer.self_attn.v_scale = 0.707
    sinks = ref.model.layers[1].self_attn.sinks
    saved = sinks.detach().clone()
    with torch.no_grad():
        sinks.fill_(-1e4)
    try:
        assert (hf_logits(ref, ids) - good).abs().max() > 1e-3 * good.abs().max()
    finally:
        with torch.no_grad():
            sinks.copy_(saved)


@pytest.mark.parametrize("length", PREFILL_LENGTHS)
def test_kernel_prefill_matches_transformers(mimo_kernels, length):
    """`kernels="triton"`: the prefill and split-K decode attention kernels with q/k 192 and v 128, sinks and
    windows on the sliding layers, the V scale before the cache."""
    ref, llm, device = mimo_kernels
    assert all(isinstance(layer.self_attn.backend, TritonAttentionBackend) for layer in llm.model.model.layers)
    ids = prompt(length, seed=400 + length)
    assert_logits_close(llm.prefill_logits(ids), hf_logits(ref, ids).to(device), f"MiMo kernels prefill of {length}")


def test_kernel_greedy_matches_transformers(mimo_kernels):
    """Interpreted kernels cost seconds a token: the CPU path's prompt with 14 tokens, decode past the window from
    its first step and into the second KV page (the 11th token's step writes position 16, three steps follow);
    the CPU path's test above generates all 32."""
    ref, llm, _ = mimo_kernels
    expected = hf_generate(ref, GEN_PROMPT, NUM_KERNEL_TOKENS)
    assert_same_tokens(llm.generate(GEN_PROMPT, max_new_tokens=NUM_KERNEL_TOKENS, ignore_eos=True), expected, None,
                       "MiMo kernels greedy")


# --- config ---------------------------------------------------------------------------------------------------------

# The released config.json's spelling of the same model (XiaomiMiMo/MiMo-V2-Flash's keys)
RELEASED_KEYS = {
    "hybrid_layer_pattern": [0 if t == F else 1 for t in LAYER_TYPES],
    "moe_layer_freq": [1 if t == "sparse" else 0 for t in MLP_LAYER_TYPES],
    "swa_num_attention_heads": 4, "swa_num_key_value_heads": 2 * KV_HEADS, "swa_head_dim": 192,
    "swa_v_head_dim": 128, "rope_theta": 5e6, "swa_rope_theta": 1e4, "partial_rotary_factor": 0.334,
    "add_full_attention_sink_bias": False, "add_swa_attention_sink_bias": True, "sliding_window_size": WINDOW,
    "layernorm_epsilon": 1e-5, "scoring_func": "sigmoid", "topk_method": "noaux_tc", "n_shared_experts": None,
    "routed_scaling_factor": 1.5,
}
TRANSFORMERS_ONLY = ("layer_types", "mlp_layer_types", "rope_parameters", "rms_norm_eps", "sliding_window")


def write_mimo_config(path, update: dict | None = None, remove: tuple[str, ...] = ()) -> None:
    config = mimo_config().to_dict() | {"architectures": ["MiMoV2FlashForCausalLM"]} | (update or {})
    for key in remove:
        config.pop(key, None)
    (path / "config.json").write_text(json.dumps(config))


def test_released_config_spelling_gives_the_same_layers(mimo, tmp_path):
    _, _, llm = mimo
    write_mimo_config(tmp_path, RELEASED_KEYS, remove=TRANSFORMERS_ONLY)
    cls, config = load_model_config(tmp_path)
    assert cls is MiMoV2FlashForCausalLM
    assert config.layers == llm.config.layers and config.moe == llm.config.moe
    assert config.rms_norm_eps == llm.config.rms_norm_eps


def test_defaults_are_transformers(tmp_path):
    """Without the per-layer lists: full attention on layer 0 and every sixth layer, one dense layer first; a null V
    scale is no scale, a missing one 0.707."""
    write_mimo_config(tmp_path, {"num_hidden_layers": 13, "attention_value_scale": None},
                      remove=("layer_types", "mlp_layer_types"))
    _, config = load_model_config(tmp_path)
    assert [i for i, s in enumerate(config.layers) if s.attention.sliding_window is None] == [0, 5, 11]
    assert config.moe_layers == (False,) + (True,) * 12
    assert {s.attention.value_scale for s in config.layers} == {1.0}
    write_mimo_config(tmp_path, remove=("attention_value_scale",))
    assert load_model_config(tmp_path)[1].attention.value_scale == 0.707


@pytest.mark.parametrize("update, remove, message", [
    ({"layer_types": [F, "chunked_attention", S, F, S, S]}, (), "'layer_types' entries 'chunked_attention'"),
    ({"layer_types": [F, S]}, (), "'layer_types' must list one entry per layer \\(6\\)"),
    ({"hybrid_layer_pattern": [0, 1, 2, 0, 1, 1]}, ("layer_types",), "'hybrid_layer_pattern' entries 2"),
    ({"moe_layer_freq": 1}, ("mlp_layer_types",), "'moe_layer_freq' must list one entry per layer"),
    ({"mlp_layer_types": ["dense"] + ["moe"] * 5}, (), "'mlp_layer_types' entries 'moe'"),
    ({"rope_parameters": {F: {"rope_theta": 5e6}}}, (), "rope_parameters.*none for 'sliding_attention'"),
    ({"scoring_func": "softmax"}, (), "scoring_func 'softmax' is not supported"),
    ({"swa_num_key_value_heads": 3}, (), "multiple of num_key_value_heads"),
])
def test_config_errors_name_the_key(tmp_path, update, remove, message):
    write_mimo_config(tmp_path, update, remove)
    with pytest.raises(ConfigError, match=message):
        load_model_config(tmp_path)


def test_mtp_layers_are_ignored(mimo, tmp_path):
    """The released checkpoint carries its multi-token-prediction layers as `model.mtp.*`."""
    path, ref, _ = mimo
    tensors = load_file(str(path / "model.safetensors"))
    for name, tensor in list(tensors.items()):
        if name.startswith("model.layers.1."):
            tensors[name.replace("model.layers.1.", "model.mtp.layers.0.", 1)] = tensor.clone()
    tensors["model.mtp.layers.0.enorm.weight"] = torch.ones(64)
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "config.json").write_bytes((path / "config.json").read_bytes())
    ids = prompt(7, seed=407)
    llm = LLM(tmp_path, device="cpu", dtype="float32", expert_placement="device")
    assert_logits_close(llm.prefill_logits(ids), hf_logits(ref, ids), "MiMo with MTP")


# --- FP8 (the released checkpoint's format) -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def mimo_fp8(tmp_path_factory):
    return build_fp8_checkpoint(mimo_config(), SEED, tmp_path_factory, "mimo_fp8")


def test_fp8_checkpoint_matches_the_dequantized_reference(mimo_fp8):
    stored = mimo_fp8["stored"]
    for name in ("model.layers.1.self_attn.q_proj.weight", "model.layers.0.mlp.gate_proj.weight",
                 "model.layers.1.mlp.experts.3.up_proj.weight"):
        assert stored[name].dtype == torch.float8_e4m3fn and stored[name + "_scale_inv"].dtype == torch.float32
    assert mimo_fp8["llm"].config.fp8_block_size == (128, 128)
    for length in (7, 33):
        ids = prompt(length, seed=500 + length)
        ours, ref = mimo_fp8["llm"].prefill_logits(ids), hf_logits(mimo_fp8["ref"], ids)
        err, scale = float((ours - ref).abs().max()), float(ref.abs().max())
        assert err <= REL_TOL * scale, f"max |ours - hf| = {err:.3e} > {REL_TOL} * {scale:.3e}"


def test_fp8_experts_run_as_stored_on_the_cpu_operator(mimo_fp8, tmp_path):
    from float_checkpoints import round_expert_inputs  # needs compressed-tensors (the test extra)

    from cpu_experts.module import CpuExperts

    ref = round_expert_inputs(load_reference(mimo_fp8["cfg"], mimo_fp8["dequantized"], tmp_path))
    llm = LLM(mimo_fp8["path"], dtype="float32", expert_placement="cpu")
    try:
        assert {m.op.spec.dtype for m in llm.model.modules() if isinstance(m, CpuExperts)} == {"fp8"}
        ids = prompt(24, seed=524)
        ours, want = llm.prefill_logits(ids), hf_logits(ref, ids)
        assert (ours - want).abs().max() <= FLOAT_FORMAT_TOL * want.abs().max()
    finally:
        llm.close()


# --- the synthetic shape (hybrid-bench --synthetic mimo-v2-flash) ---------------------------------------------------

def test_synthetic_shape_cuts_its_per_layer_lists():
    config = shape_config("mimo-v2-flash", 7)
    assert config["hybrid_layer_pattern"] == [0, 1, 1, 1, 1, 0, 1] and config["moe_layer_freq"] == [0] + [1] * 6
    assert has_dense_layers("mimo-v2-flash")
    assert shape_config("mimo-v2-flash", 3, num_dense_layers=2)["moe_layer_freq"] == [0, 0, 1]


def test_synthetic_fp8_checkpoint_loads_with_fp8_cpu_experts(tmp_path, monkeypatch):
    """The released layout at a tiny size: FP8 with block scales, sinks under their released name; the routed experts
    stay FP8 on the CPU operator."""
    from cpu_experts.module import CpuExperts

    tiny = dict(SHAPES["mimo-v2-flash"], vocab_size=512, hidden_size=64, intermediate_size=96,
                moe_intermediate_size=32, n_routed_experts=8, num_attention_heads=4, swa_num_attention_heads=4,
                num_key_value_heads=1, swa_num_key_value_heads=2)
    monkeypatch.setitem(SHAPES, "tiny-mimo", tiny)
    assert write_synthetic_checkpoint(tmp_path, "tiny-mimo", num_layers=3, fp8=True) > 0
    assert json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"].keys() >= {
        "model.layers.1.self_attn.attention_sink_bias", "model.layers.1.self_attn.q_proj.weight_scale_inv"}
    llm = LLM(tmp_path, dtype="float32", expert_placement="cpu", max_model_len=64)
    try:
        assert [m.op.spec.dtype for m in llm.model.modules() if isinstance(m, CpuExperts)] == ["fp8", "fp8"]
        logits = llm.prefill_logits([5, 6, 7])
        assert logits.shape == (3, 512) and torch.isfinite(logits).all()
    finally:
        llm.close()


# --- the engine over two cache groups (test_cache_groups.py's scenarios for gpt-oss) --------------------------------

ENGINE_WINDOW = 12
ENGINE_PROMPTS = [prompt(n, seed=800 + n) for n in (3, 11, 13, 29, 40)]  # around pages (4) and the window (12)
ENGINE_MAX_TOKENS = [12, 8, 5, 10, 6]


@pytest.fixture(scope="module")
def mimo_engine_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("mimo_engine")
    make_mimo(path, sliding_window=ENGINE_WINDOW, max_position_embeddings=512)
    return path


@pytest.fixture(scope="module")
def mimo_engine_llm(mimo_engine_path):
    return make_llm(mimo_engine_path, max_model_len=128)


@pytest.fixture(scope="module")
def mimo_solo(mimo_engine_llm):
    return solo_outputs(mimo_engine_llm, ENGINE_PROMPTS, ENGINE_MAX_TOKENS)


def test_engine_groups_differ_in_page_shape(mimo_engine_llm):
    """Full layers (one KV head, q/k 192 and v 128) and sliding ones (two KV heads): one pool each."""
    groups = mimo_engine_llm.blocks.groups
    assert [(g.layer_indices, g.sliding_window, g.page_shapes) for g in groups] == [
        ((0, 3), None, ((KV_HEADS, 192), (KV_HEADS, 128))),
        ((1, 2, 4, 5), ENGINE_WINDOW, ((2 * KV_HEADS, 192), (2 * KV_HEADS, 128)))]


@pytest.fixture(scope="module")
def mimo_engine_uncached(mimo_engine_path):
    return make_llm(mimo_engine_path, max_model_len=128, enable_prefix_caching=False)


def test_engine_batching_and_chunked_prefill_match_solo(mimo_engine_uncached, mimo_solo):
    """Chunks of a 10-token budget cross pages and windows beside other requests' decodes, released sliding pages
    poisoned after every step: each request gets its solo tokens."""
    outputs, num_mixed = batched_outputs(mimo_engine_uncached, ENGINE_PROMPTS, ENGINE_MAX_TOKENS,
                                         max_num_batched_tokens=10, max_num_seqs=4)
    assert num_mixed > 0
    assert outputs == mimo_solo


def test_engine_prefix_hit_gives_identical_output(mimo_engine_llm, mimo_engine_uncached):
    request, alone = prefix_hit(mimo_engine_llm, mimo_engine_uncached, ENGINE_PROMPTS[4], ENGINE_MAX_TOKENS[4],
                                [7, 9, 11], 5)
    assert request.num_cached == 40  # every page of the conversation's prompt, the sliding group's window of them
    assert request.output_ids == alone


def test_engine_preemption_and_resume_are_exact(mimo_engine_path, mimo_solo):
    """Pools of 16 full and 6 sliding pages cannot hold the requests together (31 full pages at the end)."""
    llm = make_llm(mimo_engine_path, max_model_len=128)
    chosen = [0, 1, 3, 4]
    outputs, preempted = preempted_outputs(llm, [ENGINE_PROMPTS[i] for i in chosen],
                                           [ENGINE_MAX_TOKENS[i] for i in chosen], {None: 16, ENGINE_WINDOW: 6})
    assert preempted
    assert outputs == [mimo_solo[i] for i in chosen]


def test_engine_sliding_layers_keep_only_their_window(mimo_engine_path):
    """A 400-token request in chunks of 64: the sliding group holds the pages from the window of each step's first
    token to its last token, the full group every page of the context."""
    from hybrid.block_manager import blocks_needed

    llm = make_llm(mimo_engine_path, max_model_len=512, max_num_seqs=1, max_num_batched_tokens=64)
    used = pages_in_use(llm, prompt(400, seed=840), 4)
    assert all(num_full == blocks_needed(num_computed, BLOCK) for num_computed, _, num_full in used)
    assert used[-1] == (402, 4, 101)  # the last decode: the token at 401 sees 390..401, pages 97-100 of 0-100
