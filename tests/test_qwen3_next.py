"""Qwen3-Next and Qwen3.5-MoE: parity with transformers on tiny random checkpoints that transformers writes (the
Qwen3.5 one through its multimodal wrapper, with a tiny vision tower), the parsed layer specs, the (1 + w) norms,
the gated attention, fused expert storage, and the engine's recurrent-state slots (batching with chunked prefill,
preemption, cancellation, an exhausted slot pool)."""

from __future__ import annotations

import logging
import shutil

import pytest
import torch
from qwen3_next_support import (
    CHUNK,
    MAX_MODEL_LEN,
    NUM_GREEDY,
    NUM_LAYERS,
    PROMPT_LENS,
    TEXT,
    check_parity,
    make_llm,
    random_prompt,
    run_together,
    solo_tokens,
    write_qwen3_5,
    write_qwen3_next,
)
from safetensors.torch import load_file, save_file

from hybrid.engine import Engine
from hybrid.forward_batch import ForwardBatch, SequenceSlice
from hybrid.layers.norm import OffsetRMSNorm
from hybrid.models import load_model_config
from hybrid.routed_experts import RoutedExperts

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def qwen3_next(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_next")
    return path, write_qwen3_next(transformers, path)


@pytest.fixture(scope="module")
def qwen3_5(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_5")
    return path, write_qwen3_5(transformers, path)


@pytest.fixture(scope="module")
def qwen3_5_fused(qwen3_5, tmp_path_factory):
    """The Qwen3.5 checkpoint with its experts stored as the released one stores them: fused 3-D tensors."""
    path, _ = qwen3_5
    tensors = load_file(str(path / "model.safetensors"))
    fused = {name: t for name, t in tensors.items() if ".mlp.experts." not in name}
    experts = range(TEXT["num_experts"])
    for layer in range(NUM_LAYERS):
        prefix = f"model.language_model.layers.{layer}.mlp.experts"
        fused[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat((tensors[f"{prefix}.{e}.gate_proj.weight"],
                                                                  tensors[f"{prefix}.{e}.up_proj.weight"]))
                                                       for e in experts])
        fused[f"{prefix}.down_proj"] = torch.stack([tensors[f"{prefix}.{e}.down_proj.weight"] for e in experts])
    out = tmp_path_factory.mktemp("qwen3_5_fused")
    save_file(fused, str(out / "model.safetensors"))
    shutil.copy(path / "config.json", out / "config.json")
    return out


def _reference_greedy(model, prompt: list[int]) -> list[int]:
    """Greedy tokens from transformers' uncached forward over the whole sequence at each step: its cached decode
    (5.17) leaves its own uncached logits after a 200-token prompt (the third token differs), ours does not."""
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(NUM_GREEDY):
            tokens.append(int(model(torch.tensor([tokens])).logits[0, -1].argmax()))
    return tokens[len(prompt):]


@pytest.fixture(scope="module")
def next_llm(qwen3_next):
    return make_llm(qwen3_next[0])


@pytest.mark.parametrize("arch", ["qwen3_next", "qwen3_5"])
def test_parity_with_transformers(arch, request):
    path, model = request.getfixturevalue(arch)
    llm = request.getfixturevalue("next_llm") if arch == "qwen3_next" else make_llm(path)
    engine = Engine(llm, max_num_batched_tokens=CHUNK, max_num_seqs=1)  # prompts in chunks, states carried over
    try:
        for length in PROMPT_LENS:
            prompt = random_prompt(length, seed=length)
            with torch.no_grad():
                ref = model(torch.tensor([prompt])).logits[0].float()
            ours = llm.prefill_logits(prompt)
            assert (ours - ref).abs().max() <= 1e-4 * ref.abs().max(), f"{arch}: prefill of {length} tokens"
            tokens = engine.generate([prompt], max_tokens=NUM_GREEDY, ignore_eos=True)[0]
            assert tokens == _reference_greedy(model, prompt), f"{arch}: greedy after a prompt of {length} tokens"
    finally:
        engine.close()


def test_config_parsed_into_layer_specs(qwen3_next, qwen3_5):
    _, config = load_model_config(qwen3_next[0])
    assert [spec.is_recurrent for spec in config.layers] == [True, True, True, False]
    linear = config.layers[0].linear
    assert (linear.num_k_heads, linear.num_v_heads, linear.head_k_dim, linear.head_v_dim, linear.conv_kernel) == \
        (2, 4, 16, 8, 4)
    assert linear.projection == "qkvz_ba" and linear.conv_dim == 2 * 2 * 16 + 4 * 8
    full = config.layers[3]
    assert full.attention.has_output_gate and full.attention.qk_norm == "per_head"
    assert full.rope.rotary_dim == 4  # partial rotary: a quarter of head_dim 16
    assert config.has_offset_norms and config.moe.has_shared_gate and config.moe.norm_topk_prob
    assert not config.moe.has_fused_storage
    _, config = load_model_config(qwen3_5[0])
    assert config.architecture == "Qwen3_5MoeForConditionalGeneration"
    assert config.layers[0].linear.projection == "qkv_z_b_a" and all(config.moe_layers)


def test_offset_norm_scales_by_one_plus_w():
    norm = transformers.models.qwen3_next.modeling_qwen3_next.Qwen3NextRMSNorm(16, eps=1e-6)
    ours = OffsetRMSNorm(16, 1e-6)
    with torch.no_grad():
        norm.weight.normal_()
        ours.weight.copy_(norm.weight)
    x = torch.randn(5, 16, dtype=torch.bfloat16)
    assert torch.equal(ours(x), norm(x))


def test_gated_attention_matches_transformers(qwen3_next, next_llm):
    """Layer 3's attention alone: the query's gate half, sigmoid(gate) on the output, the (1 + w) q/k norms."""
    _, model = qwen3_next
    captured = {}
    handle = model.model.layers[3].self_attn.register_forward_hook(
        lambda module, args, kwargs, out: captured.update(x=kwargs["hidden_states"], out=out[0]), with_kwargs=True)
    prompt = random_prompt(21, seed=3)
    with torch.no_grad():
        model(torch.tensor([prompt]))
    handle.remove()
    blocks = next_llm.blocks
    tables = blocks.new_tables()
    blocks.allocate(tables, len(prompt))
    try:
        batch = ForwardBatch.build([SequenceSlice(0, len(prompt), tables)], blocks.block_size, "cpu")
        with torch.no_grad():
            ours = next_llm.model.model.layers[3].self_attn(captured["x"][0], batch)
    finally:
        blocks.free(tables)
    torch.testing.assert_close(ours, captured["out"][0], rtol=1e-5, atol=1e-5)


def test_fused_expert_storage_loads(qwen3_5, qwen3_5_fused):
    plain, fused = make_llm(qwen3_5[0]), make_llm(qwen3_5_fused)
    assert fused.config.moe.has_fused_storage and not plain.config.moe.has_fused_storage
    prompt = random_prompt(9, seed=9)
    assert torch.equal(fused.prefill_logits(prompt), plain.prefill_logits(prompt))


@pytest.mark.parametrize("gpu_experts", [0, 2])
def test_fused_experts_on_the_cpu_operator(qwen3_5, qwen3_5_fused, gpu_experts):
    """expert_placement=cpu reads the fused 3-D experts expert by expert and quantizes them (int8 here, float
    activations) exactly as it quantizes the per-expert checkpoint; with GPU-resident experts their slots come from
    the same fused tensors."""
    options = dict(expert_placement="cpu", expert_activations="float", gpu_experts=gpu_experts)
    plain, fused = make_llm(qwen3_5[0], **options), make_llm(qwen3_5_fused, **options)
    prompt = random_prompt(9, seed=10)
    want = plain.prefill_logits(prompt)
    assert torch.equal(fused.prefill_logits(prompt), want)
    layers = [m for m in fused.model.modules() if isinstance(m, RoutedExperts)]
    assert layers and all(m.cpu_experts.op.spec.dtype == "int8" and len(m.gpu_expert_ids) == gpu_experts
                          for m in layers)
    assert not torch.equal(want, make_llm(qwen3_5[0]).prefill_logits(prompt))  # int8 experts, not the float ones


# --- Qwen3.5-MoE as text only, with interleaved MRoPE, with MTP weights ---


def test_text_only_qwen3_5_moe_parity(tmp_path):
    """`Qwen3_5MoeForCausalLM`: the text model's names at the top (`model.*`), every layer MoE."""
    model = write_qwen3_5(transformers, tmp_path, is_released=False)
    llm = make_llm(tmp_path)
    assert llm.config.architecture == "Qwen3_5MoeForCausalLM" and all(llm.config.moe_layers)
    check_parity(model, llm, "Qwen3_5MoeForCausalLM")


# As Qwen3.5 publishes its RoPE (`mrope_section` [11, 11, 10] over a rotary 64 of head 256), scaled down: rotary 8
# of head 32, frequencies of sections T 2, H 1, W 1 interleaved (T H W T); text positions are equal in all three
INTERLEAVED_MROPE = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                     "mrope_section": [2, 1, 1], "mrope_interleaved": True}


def test_interleaved_mrope_is_1d_rope_for_text(tmp_path, caplog):
    """The released wrapper with interleaved MRoPE parses into plain NeoX RoPE on the rotary quarter and matches
    transformers; loading it says, once, that the vision tower is skipped."""
    model = write_qwen3_5(transformers, tmp_path, head_dim=32, rope_parameters=INTERLEAVED_MROPE)
    with caplog.at_level(logging.WARNING, logger="hybrid.models.qwen3_next"):
        llm = make_llm(tmp_path)
    assert caplog.text.count("the Qwen3.5 vision tower (model.visual.*) is not loaded") == 1
    rope = llm.config.layers[3].rope
    assert (rope.rotary_dim, rope.is_interleaved) == (8, False)
    check_parity(model, llm, "interleaved MRoPE")


# The released checkpoints' multi-token-prediction head (Qwen3.5: per-expert MTP experts, Qwen3.6: fused ones)
MTP_SHAPES = {"mtp.fc.weight": (64, 128), "mtp.pre_fc_norm_embedding.weight": (64,),
              "mtp.pre_fc_norm_hidden.weight": (64,), "mtp.norm.weight": (64,),
              "mtp.layers.0.self_attn.q_proj.weight": (128, 64),
              "mtp.layers.0.mlp.experts.0.gate_proj.weight": (32, 64),
              "mtp.layers.0.mlp.experts.gate_up_proj": (8, 64, 64), "mtp.layers.0.mlp.experts.down_proj": (8, 64, 32)}


def test_mtp_tensors_ignored(qwen3_5, tmp_path):
    """MTP tensors beside the text weights are not loaded, and fused ones do not make the per-expert main layers
    read as fused."""
    path, model = qwen3_5
    tensors = load_file(str(path / "model.safetensors"))
    gen = torch.Generator().manual_seed(5)
    save_file(tensors | {name: torch.randn(shape, generator=gen) for name, shape in MTP_SHAPES.items()},
              str(tmp_path / "model.safetensors"))
    shutil.copy(path / "config.json", tmp_path / "config.json")
    llm = make_llm(tmp_path)
    assert not llm.config.moe.has_fused_storage
    check_parity(model, llm, "with MTP tensors", lengths=(7, 33))


# --- the engine's state slots ---


def _slots_match_running(engine):
    stats = engine.stats()
    assert stats.num_state_slots - stats.num_free_state_slots == stats.num_running


def test_batched_chunked_prefill_gives_solo_tokens(next_llm):
    prompts = [random_prompt(n, seed=n) for n in (5, 60, 130, 17)]
    solo = solo_tokens(next_llm, prompts, 12)
    engine = Engine(next_llm, max_num_batched_tokens=CHUNK, max_num_seqs=4)
    try:
        assert run_together(engine, prompts, 12, _slots_match_running) == solo
        stats = engine.stats()
        assert stats.num_free_state_slots == stats.num_state_slots == 4
    finally:
        engine.close()


def test_preemption_frees_slots_and_recomputes(qwen3_next):
    llm = make_llm(qwen3_next[0], kv_cache_tokens=MAX_MODEL_LEN)  # 16 pages: two 140-token requests need 18
    prompts = [random_prompt(110, seed=s) for s in (1, 2, 3)]
    solo = solo_tokens(llm, prompts, 30)
    engine = Engine(llm, max_num_batched_tokens=CHUNK, max_num_seqs=3)
    preempted = []
    preempt = engine.scheduler.preempt
    engine.scheduler.preempt = lambda r: (preempted.append(r.request_id), preempt(r))
    try:
        assert run_together(engine, prompts, 30, _slots_match_running) == solo
        assert preempted
        assert engine.stats().num_snapshot_hits  # a preempted request resumed from its own state snapshot
        assert engine.stats().num_free_state_slots == engine.stats().num_state_slots
    finally:
        engine.close()


def test_cancel_frees_the_slot(next_llm):
    prompts = [random_prompt(30, seed=7), random_prompt(12, seed=8)]
    solo = solo_tokens(next_llm, prompts[1:], 8)
    engine = Engine(next_llm, max_num_batched_tokens=CHUNK, max_num_seqs=2)
    try:
        first, second = (engine.add_request(p, max_tokens=8, ignore_eos=True) for p in prompts)
        engine.step()
        assert engine.stats().num_free_state_slots == engine.stats().num_state_slots - 2
        engine.cancel(first)
        assert engine.stats().num_free_state_slots == engine.stats().num_state_slots - 1
        while engine.has_work():
            engine.step()
        assert engine.requests[second].output_ids == solo[0]
        assert engine.stats().num_free_state_slots == engine.stats().num_state_slots
    finally:
        engine.close()


def test_exhausted_slot_pool_queues_requests(qwen3_next):
    llm = make_llm(qwen3_next[0], max_num_seqs=2)  # two state slots
    prompts = [random_prompt(n, seed=n) for n in (9, 14, 3, 22)]
    solo = solo_tokens(llm, prompts, 6)
    engine = Engine(llm, max_num_batched_tokens=CHUNK, max_num_seqs=4)
    try:
        ids = [engine.add_request(p, max_tokens=6, ignore_eos=True) for p in prompts]
        engine.step()
        stats = engine.stats()
        assert (stats.num_running, stats.num_waiting, stats.num_free_state_slots) == (2, 2, 0)
        while engine.has_work():
            engine.step()
        assert [engine.requests[i].output_ids for i in ids] == solo
        assert all(engine.requests[i].finish_reason == "length" for i in ids)
    finally:
        engine.close()


@pytest.fixture(scope="module")
def qwen3_next_kernel_dims(tmp_path_factory):
    """Qwen3-Next with head dims the kernels take (GDN 64 / 64, attention 64), two v heads per k head."""
    path = tmp_path_factory.mktemp("qwen3_next_kernels")
    return path, write_qwen3_next(transformers, path, head_dim=64, linear_key_head_dim=64, linear_value_head_dim=64,
                                  linear_num_key_heads=1, linear_num_value_heads=2)


def test_kernel_path_matches_transformers(qwen3_next_kernel_dims):
    """`kernels="triton"` (under the interpreter without a GPU): the Gated DeltaNet's conv and delta-rule kernels
    (`gpu_layers.delta_net`, prefill resuming from the slots across chunks, then decode) and the attention kernels."""
    from gpu_support import DEVICE

    path, model = qwen3_next_kernel_dims
    llm = make_llm(path, device=str(DEVICE), kernels="triton")
    assert llm.backends.attention.name == "triton" and llm.backends.attention.has_linear_kernels
    for length in (1, 7, 33):
        prompt = random_prompt(length, seed=50 + length)
        with torch.no_grad():
            ref = model.to(DEVICE)(torch.tensor([prompt], device=DEVICE)).logits[0].float()
        ours = llm.prefill_logits(prompt)
        assert (ours - ref).abs().max() <= 1e-4 * ref.abs().max(), f"kernels: prefill of {length} tokens"
    engine = Engine(llm, max_num_batched_tokens=16, max_num_seqs=2)  # a 33-token prompt in three chunks
    try:
        prompt = random_prompt(33, seed=83)
        tokens = engine.generate([prompt], max_tokens=8, ignore_eos=True)[0]
    finally:
        engine.close()
    reference = list(prompt)
    with torch.no_grad():
        for _ in range(8):
            reference.append(int(model(torch.tensor([reference], device=DEVICE)).logits[0, -1].argmax()))
    assert tokens == reference[len(prompt):]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_graph_decode_equals_eager(qwen3_next_kernel_dims):
    """Decode steps replayed as CUDA graphs read and write the recurrent states by slot (static slot buffers, padded
    rows skipped): the graph engine generates what the eager engine does over 100 steps, batched with chunked
    prefill."""
    path, _ = qwen3_next_kernel_dims
    prompts = [random_prompt(n, seed=90 + n) for n in (1, 9, 21, 40)]  # a one-token prompt starts its state eagerly
    outputs = {}
    for is_graph in (False, True):
        llm = make_llm(path, device="cuda", dtype="bfloat16", kernels="triton", cuda_graph=is_graph)
        engine = Engine(llm, max_num_batched_tokens=16, max_num_seqs=4)
        try:
            outputs[is_graph] = engine.generate(prompts, max_tokens=100, ignore_eos=True)
            assert (engine.runner.graphs is not None and engine.runner.graphs.num_replays > 0) == is_graph
        finally:
            engine.close()
    assert outputs[True] == outputs[False]
