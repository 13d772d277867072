"""gpt-oss (`GptOssForCausalLM`) against transformers' own modeling_gpt_oss on the CPU reference path.

The tiny checkpoint is what `save_pretrained` writes (fused experts `gate_up_proj` [E, H, 2I] + biases, router with a
bias, `self_attn.sinks`), with random sinks (transformers zero-initialises them), sliding and full layers in an
irregular order, a window (5) shorter than the longer prompts, YaRN with `truncate: false`, and the experts' gate/up
scaled up so that the clamp at 7 is reached. Checked: float32 prefill logits (1, 7 and 33 tokens, crossing KV pages
of 16) within 1e-4 of max |logit|, 32 greedy tokens against `generate`, and the pieces one at a time (sinks and
windows through both attention backends, the activation, the router). The experts' kernel path (bf16 through
`gpu_layers.fused_moe`, under Triton's interpreter without a GPU): its reference against transformers' experts, the
restacked layout, and the model's logits.
"""

from __future__ import annotations

import copy
import json
import logging
import types

import pytest
import torch
import transformers
from checkpoints import build_model, hf_generate, hf_logits, prompt
from test_models_parity import GEN_PROMPT, NEW_TOKENS, PREFILL_LENGTHS, assert_logits_close, assert_same_tokens

from cpu_experts import formats
from cpu_experts.module import CpuExperts
from gpu_layers import fused_moe as fm
from gpu_layers import reference
from hybrid import LLM
from hybrid.errors import ConfigError
from hybrid.forward_batch import ForwardBatch, SequenceSlice
from hybrid.layers.backends import TorchAttentionBackend, TritonAttentionBackend
from hybrid.layers.ops import dense_ops_for
from hybrid.models import load_model_config
from hybrid.models.gpt_oss import SWIGLU_ALPHA, SWIGLU_LIMIT, GptOssExperts, GptOssForCausalLM, restack_gate_up

transformers.logging.set_verbosity_error()

SEED = 2020
LAYER_TYPES = ["sliding_attention", "full_attention", "full_attention", "sliding_attention", "sliding_attention"]
WINDOW = 5
GATE_UP_GAIN = 4.0  # puts a good share of gate/up values past the clamp at 7
# bf16-rounded activations into every expert matmul (the float formats' contract) against float32 ones, five layers


def gpt_oss_config(**overrides) -> transformers.GptOssConfig:
    values = dict(
        vocab_size=256, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_hidden_layers=len(LAYER_TYPES), layer_types=LAYER_TYPES, sliding_window=WINDOW, num_local_experts=8,
        num_experts_per_tok=2, intermediate_size=32, max_position_embeddings=256, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 64},
    )
    values.update(overrides)
    return transformers.GptOssConfig(**values)


def make_gpt_oss(path, **overrides):
    model = build_model(gpt_oss_config(**overrides), seed=SEED)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.experts.gate_up_proj.mul_(GATE_UP_GAIN)
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpt_oss")
    ref = make_gpt_oss(path)
    return ref, LLM(path, dtype="float32", expert_placement="device")


def test_config_follows_the_checkpoint(gpt_oss):
    _, llm = gpt_oss
    cfg = llm.config
    assert [spec.attention.sliding_window for spec in cfg.layers] == [
        WINDOW if t == "sliding_attention" else None for t in LAYER_TYPES]
    windows = [layer.self_attn.cfg.sliding_window for layer in llm.model.model.layers]
    assert windows == [WINDOW if t == "sliding_attention" else None for t in LAYER_TYPES]
    assert cfg.attention.has_sinks and cfg.attention.has_qkv_bias and cfg.attention.has_o_bias
    assert cfg.rope.scaling_type == "yarn" and cfg.rope.truncate is False


@pytest.mark.parametrize("length", PREFILL_LENGTHS)
def test_prefill_logits_match_transformers(gpt_oss, length):
    ref, llm = gpt_oss
    ids = prompt(length, seed=300 + length)
    assert_logits_close(llm.prefill_logits(ids), hf_logits(ref, ids), f"gpt-oss prefill of {length}")


def test_greedy_generation_matches_transformers(gpt_oss):
    ref, llm = gpt_oss
    expected = hf_generate(ref, GEN_PROMPT, NEW_TOKENS)
    ours = llm.generate(GEN_PROMPT, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    assert_same_tokens(ours, expected, None, "gpt-oss greedy")


def test_clamp_is_reached(gpt_oss):
    """The checkpoint exercises the clamp: some gate/up pre-activations of the prompt lie beyond 7."""
    ref, _ = gpt_oss
    seen = []
    hook = ref.model.layers[0].mlp.experts.register_forward_hook(
        lambda mod, args, out: seen.append(args[0] @ mod.gate_up_proj[0] + mod.gate_up_proj_bias[0]))
    try:
        hf_logits(ref, prompt(7, seed=307))
    finally:
        hook.remove()
    assert (seen[0].abs() > 7).float().mean() > 0.05


def test_activation_matches_transformers():
    experts = transformers.models.gpt_oss.modeling_gpt_oss.GptOssExperts(gpt_oss_config())
    gate_up = torch.linspace(-20, 20, 2 * 40).reshape(2, 40)[:, torch.randperm(40, generator=torch.Generator()
                                                                                  .manual_seed(1))]
    assert torch.equal(GptOssExperts.activation(gate_up), experts._apply_gate(gate_up))


def _paged_case(num_tokens: int, num_heads: int = 4, num_kv_heads: int = 2, head_dim: int = 64, block: int = 16,
                device: torch.device | str = "cpu"):
    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(num_tokens, h, head_dim, generator=gen).to(device)
               for h in (num_heads, num_kv_heads, num_kv_heads))
    num_blocks = -(-num_tokens // block)
    caches = tuple(torch.zeros(num_blocks, block, num_kv_heads, head_dim, device=device) for _ in range(2))
    batch = ForwardBatch.build([SequenceSlice(0, num_tokens, [list(range(num_blocks))])], block, device)
    sinks = (torch.randn(num_heads, generator=gen) * 2).to(device)
    return q, k, v, caches, batch, sinks


def test_backends_pass_sinks_to_the_attention():
    """Both backends apply the sinks they are given (the Triton one under the interpreter here); without sinks the
    output differs, so a backend that dropped them would fail."""
    q, k, v, caches, batch, sinks = _paged_case(20)
    expected = reference.causal_attention(q, k, v, 0.125, WINDOW, sinks)
    torch_out = TorchAttentionBackend().gqa(q, k, v, caches, batch, 0.125, WINDOW, sinks)
    torch.testing.assert_close(torch_out, expected)
    assert not torch.allclose(TorchAttentionBackend().gqa(q, k, v, caches, batch, 0.125, WINDOW), expected)
    from gpu_support import DEVICE

    q, k, v, caches, batch, sinks = _paged_case(20, device=DEVICE)  # the GPU where there is one, else interpreted
    triton_out = TritonAttentionBackend().gqa(q, k, v, caches, batch, 0.125, WINDOW, sinks)
    torch.testing.assert_close(triton_out, expected.to(DEVICE), atol=2e-5, rtol=1e-4)


def test_layer_types_are_checked(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(gpt_oss_config().to_dict() | {
        "architectures": ["GptOssForCausalLM"], "layer_types": ["sliding_attention", "chunked_attention"]}))
    with pytest.raises(ConfigError, match="layer_types.*one type per layer"):
        load_model_config(tmp_path)
    config = gpt_oss_config().to_dict() | {"architectures": ["GptOssForCausalLM"]}
    config["layer_types"] = ["chunked_attention"] * len(LAYER_TYPES)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="chunked_attention.*not supported"):
        load_model_config(tmp_path)


def test_default_layer_types_alternate_and_hidden_act_is_ignored(tmp_path):
    config = gpt_oss_config().to_dict() | {"architectures": ["GptOssForCausalLM"], "hidden_act": "gelu"}
    del config["layer_types"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    cls, parsed = load_model_config(tmp_path)
    assert cls is GptOssForCausalLM
    assert [spec.attention.sliding_window for spec in parsed.layers] == [
        parsed.attention.sliding_window if i % 2 == 0 else None for i in range(len(LAYER_TYPES))]


def _requantized(ref, quantize, dequantize):
    """A copy of `ref` whose experts' weights are their values after the CPU experts' quantization (rows per
    expert and projection, gate/up de-interleaved as the operator holds them)."""
    model = copy.deepcopy(ref)
    with torch.no_grad():
        for layer in model.model.layers:
            experts = layer.mlp.experts
            for e in range(experts.gate_up_proj.shape[0]):
                gate_up = experts.gate_up_proj[e].t()  # [2I, H]
                for rows in (slice(0, None, 2), slice(1, None, 2)):
                    gate_up[rows] = dequantize(*quantize(gate_up[rows]), gate_up.shape[1])
                experts.gate_up_proj[e] = gate_up.t()
                down = experts.down_proj[e].t()  # [H, I]
                experts.down_proj[e] = dequantize(*quantize(down), down.shape[1]).t()
    return model


def test_cpu_experts_from_bf16_match_transformers(tmp_path):
    """expert_placement="cpu" on the float checkpoint: the experts quantized to int8 at load, run by the CPU
    operator with gpt-oss's activation and biases; float activations, so exact to transformers' forward on the
    same int8 values (prefill logits within 1e-4 of max |logit|, 32 greedy tokens equal)."""
    ref = _requantized(make_gpt_oss(tmp_path), lambda w: formats.quantize_int8(w),
                       lambda q, s, _cols: formats.dequantize_int8(q, s))
    llm = LLM(tmp_path, dtype="float32", expert_placement="cpu", expert_dtype="int8", expert_activations="float")
    assert all(isinstance(layer.mlp.experts.cpu_experts, CpuExperts) for layer in llm.model.model.layers)
    for length in PREFILL_LENGTHS:
        ids = prompt(length, seed=300 + length)
        assert_logits_close(llm.prefill_logits(ids), hf_logits(ref, ids), f"gpt-oss cpu int8 prefill of {length}")
    ours = llm.generate(GEN_PROMPT, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    assert_same_tokens(ours, hf_generate(ref, GEN_PROMPT, NEW_TOKENS), None, "gpt-oss cpu int8 greedy")


def _write_mxfp4(path, ref) -> None:
    """The checkpoint in gpt-oss's published layout: each layer's experts as `gate_up_proj_blocks` [E, 2I, H/32, 16]
    (gate and up rows interleaved), `down_proj_blocks` [E, H, I/32, 16], E8M0 `*_scales`, quantized by the repo's
    own MXFP4 quantizer, plus the biases; everything else as `save_pretrained` wrote it."""
    from safetensors.torch import load_file, save_file

    tensors = {}
    for file in sorted(path.glob("*.safetensors")):
        tensors |= load_file(file)
        file.unlink()
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        stored = tensors.pop(name)  # [E, K, N]
        packed, scales = zip(*(formats.quantize_mxfp4(stored[e].t()) for e in range(stored.shape[0])), strict=True)
        packed = torch.stack(packed)
        tensors[f"{name}_blocks"] = packed.reshape(*packed.shape[:2], -1, 16).contiguous()
        tensors[f"{name}_scales"] = torch.stack(scales).contiguous()
    (path / "model.safetensors.index.json").unlink(missing_ok=True)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def _bf16_matmul_inputs(ref) -> None:
    """The float formats' contract in transformers' model: each expert matmul's input rounded to bf16 (the layer's
    input and the activation), the rest of transformers' forward as it is. Against plain float32 the rounding alone
    flips near-tied router choices a few layers on (33 tokens: 28% of max |logit|), so the float reference cannot
    tell a kernel error from that; this one leaves only summation order."""

    def forward(self, hidden_states, router_indices=None, routing_weights=None):
        x, out = hidden_states.bfloat16().float(), torch.zeros_like(hidden_states)
        for e in router_indices.unique().tolist():
            tokens = torch.where((router_indices == e).any(-1))[0]
            gate_up = x[tokens] @ self.gate_up_proj[e] + self.gate_up_proj_bias[e]
            act = GptOssExperts.activation(gate_up).bfloat16().float()
            weight = (routing_weights * (router_indices == e)).sum(-1)[tokens, None]
            out[tokens] += (act @ self.down_proj[e] + self.down_proj_bias[e]) * weight
        return out

    for layer in ref.model.layers:
        layer.mlp.experts.forward = types.MethodType(forward, layer.mlp.experts)


def test_cpu_experts_from_published_mxfp4_match_transformers(tmp_path):
    """A checkpoint with the published MXFP4 experts, served as stored by the CPU operator: against transformers'
    forward on the dequantized weights with the float formats' bf16 matmul inputs (`_bf16_matmul_inputs`), within
    1e-4 of max |logit|; 32 greedy tokens equal."""
    ref = make_gpt_oss(tmp_path)
    _write_mxfp4(tmp_path, ref)
    ref = _requantized(ref, formats.quantize_mxfp4, formats.dequantize_mxfp4)
    _bf16_matmul_inputs(ref)
    llm = LLM(tmp_path, dtype="float32", expert_placement="cpu")
    assert llm.model.model.layers[0].mlp.experts.cpu_experts.op.spec.dtype == "mxfp4"
    for length in PREFILL_LENGTHS:
        ids = prompt(length, seed=300 + length)
        assert_logits_close(llm.prefill_logits(ids), hf_logits(ref, ids), f"mxfp4 prefill {length}")
    assert_same_tokens(llm.generate(GEN_PROMPT, NEW_TOKENS, ignore_eos=True), hf_generate(ref, GEN_PROMPT, NEW_TOKENS),
                       None, "gpt-oss mxfp4 greedy")


def test_device_experts_refuse_gpu_expert_split(tmp_path, caplog):
    """A count is refused, naming the setting; "auto" places none on the device (said in the log), not an error."""
    make_gpt_oss(tmp_path)
    with pytest.raises(ConfigError, match="gpu_experts=0"):
        LLM(tmp_path, dtype="float32", expert_placement="cpu", gpu_experts=2)
    with caplog.at_level(logging.INFO, logger="hybrid.llm"):
        llm = LLM(tmp_path, dtype="float32", expert_placement="cpu", gpu_experts="auto")
    assert llm.num_gpu_experts == 0 and "gpu_experts=auto places none" in caplog.text
    llm.close()


def test_kernel_path_matches_transformers(tmp_path):
    """`kernels="triton"` (under the interpreter without a GPU): the prefill and split-K decode attention kernels
    with sinks and per-layer windows, head_dim 64 as the kernels take it; the 19-token prompt crosses a KV page and
    the 4 greedy tokens decode past the window (5) of the sliding layers."""
    from gpu_support import DEVICE

    ref = make_gpt_oss(tmp_path, head_dim=64).to(DEVICE)
    llm = LLM(tmp_path, device=str(DEVICE), dtype="float32", kernels="triton", expert_placement="device")
    assert all(isinstance(layer.self_attn.backend, TritonAttentionBackend) for layer in llm.model.model.layers)
    ids = prompt(19, seed=4)
    assert_logits_close(llm.prefill_logits(ids), hf_logits(ref, ids).to(DEVICE), "gpt-oss kernels prefill")
    assert llm.generate(ids, 4, ignore_eos=True) == hf_generate(ref, ids, 4)


def _random_experts(num_experts=4, hidden_size=64, inter=48, seed=11) -> dict[str, torch.Tensor]:
    """Checkpoint-layout expert tensors (float32) whose gate/up values cross the clamp at 7."""
    gen = torch.Generator().manual_seed(seed)
    return {
        "gate_up_proj": torch.randn(num_experts, hidden_size, 2 * inter, generator=gen) * 4 / hidden_size**0.5,
        "gate_up_proj_bias": torch.randn(num_experts, 2 * inter, generator=gen) * 2,
        "down_proj": torch.randn(num_experts, inter, hidden_size, generator=gen) / inter**0.5,
        "down_proj_bias": torch.randn(num_experts, hidden_size, generator=gen),
    }


def _routing(num_tokens, top_k, num_experts, seed=12):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.rand(num_tokens, num_experts, generator=gen).argsort(dim=1)[:, :top_k]
    return ids, torch.softmax(torch.randn(num_tokens, top_k, generator=gen), dim=1)


def _kernel_layout(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """fused_moe's arguments for checkpoint-layout weights: gate rows then up rows."""
    bias = weights["gate_up_proj_bias"]
    return {"w_gate_up": torch.stack([restack_gate_up(w) for w in weights["gate_up_proj"]]),
            "w_down": weights["down_proj"].transpose(1, 2).contiguous(),
            "w_gate_up_bias": torch.cat((bias[:, 0::2], bias[:, 1::2]), dim=1).contiguous(),
            "w_down_bias": weights["down_proj_bias"]}


def test_fused_moe_reference_matches_transformers_experts():
    """fused_moe's reference with the swiglu_oai activation and both biases, on the restacked weights, computes
    transformers' GptOssExperts (float32); the clamp is crossed."""
    weights = _random_experts()
    hf = transformers.models.gpt_oss.modeling_gpt_oss.GptOssExperts(
        gpt_oss_config(num_local_experts=4, hidden_size=64, intermediate_size=48))
    with torch.no_grad():
        for name, tensor in weights.items():
            getattr(hf, name).copy_(tensor)
    hidden = torch.randn(23, 64, generator=torch.Generator().manual_seed(13))
    ids, routing = _routing(23, 2, 4)
    assert (hidden @ weights["gate_up_proj"][0]).abs().gt(SWIGLU_LIMIT).float().mean() > 0.05
    kernel = _kernel_layout(weights)
    activation = fm.Activation("swiglu_oai", alpha=SWIGLU_ALPHA, limit=SWIGLU_LIMIT)
    assert activation == fm.SWIGLU_OAI
    ours = fm.fused_moe_reference(hidden, kernel.pop("w_gate_up"), kernel.pop("w_down"), ids, routing,
                                  activation=activation, **kernel)
    with torch.no_grad():
        expected = hf(hidden, ids, routing)
    torch.testing.assert_close(ours, expected, atol=1e-5 * expected.abs().max().item(), rtol=1e-5)


def test_fuse_restacks_the_experts_in_place():
    """With the Triton ops in bf16 the loaded experts are rewritten into fused_moe's layout in their own storage
    (no second copy), the checkpoint names still read the checkpoint's values, and the kernel computes what the
    PyTorch loop does. Without the Triton ops, or in float32, nothing changes."""
    from gpu_support import DEVICE

    weights = {name: t.bfloat16().to(DEVICE) for name, t in _random_experts().items()}

    def experts(kernels: str, dtype=torch.bfloat16) -> GptOssExperts:
        module = GptOssExperts(4, 64, 48, dense_ops_for(DEVICE, kernels)).to(DEVICE)
        with torch.no_grad():
            for name, tensor in weights.items():
                getattr(module, name).copy_(tensor)
        return module.to(dtype)

    for unfused in (experts("torch"), experts("triton", torch.float32)):
        unfused.fuse_gate_up()
        assert unfused.w_gate_up is None
    plain, fused = experts("torch"), experts("triton")
    storage = fused.gate_up_proj.data_ptr(), fused.down_proj.data_ptr()
    fused.fuse_gate_up()
    assert (fused.w_gate_up.data_ptr(), fused.w_down.data_ptr()) == storage
    assert fused.w_gate_up.shape == (4, 96, 64) and fused.w_down.shape == (4, 64, 48)
    assert torch.equal(fused.w_gate_up[2, :48], weights["gate_up_proj"][2, :, 0::2].T)
    assert torch.equal(fused.w_gate_up[2, 48:], weights["gate_up_proj"][2, :, 1::2].T)
    assert torch.equal(fused.gate_up_proj.flatten(2), weights["gate_up_proj"])
    assert torch.equal(fused.down_proj, weights["down_proj"])
    hidden = (torch.randn(9, 64, generator=torch.Generator().manual_seed(14))).bfloat16().to(DEVICE)
    ids, routing = _routing(9, 2, 4)
    ids[3, 1] = -1
    ids, routing = ids.to(DEVICE), routing.to(DEVICE)
    with torch.no_grad():
        got, want = fused(hidden, ids, routing), plain(hidden, ids, routing)
    assert float((got.float() - want.float()).norm() / want.float().norm()) < 2e-2


def test_bf16_kernel_path_runs_the_experts_through_fused_moe(tmp_path, monkeypatch):
    """`kernels="triton"` in bf16: every layer's experts call fused_moe on the restacked weights, and the logits are
    as close to transformers' float32 ones as the PyTorch path's bf16 computation (within 1.5x of its error)."""
    from gpu_support import DEVICE

    ref = make_gpt_oss(tmp_path).to(DEVICE)
    ids = prompt(19, seed=5)
    expected = hf_logits(ref, ids).to(DEVICE)
    calls = []
    kernel = fm.fused_moe
    monkeypatch.setattr(fm, "fused_moe", lambda *args, **kwargs: calls.append(kwargs) or kernel(*args, **kwargs))

    def error(kernels: str) -> float:
        llm = LLM(tmp_path, device=str(DEVICE), dtype="bfloat16", kernels=kernels, expert_placement="device")
        experts = [layer.mlp.experts for layer in llm.model.model.layers]
        assert all((e.w_gate_up is not None) == (kernels == "triton") for e in experts)
        logits = llm.prefill_logits(ids)
        return float((logits - expected).norm() / expected.norm())

    ours = error("triton")
    assert len(calls) == len(LAYER_TYPES) and all(c["activation"].kind == "swiglu_oai" for c in calls)
    plain = error("torch")
    assert len(calls) == len(LAYER_TYPES)
    assert ours <= 1.5 * plain + 1e-3, (ours, plain)
