"""Tiny random HuggingFace checkpoints for the parity tests (a helper module, not a test module).

Each `*_config()` returns a small `transformers` config of one supported family: a few layers, dense and MoE layers
mixed where the family has dense layers, hidden 64, 4 heads, vocab 256, 8 experts. `make_checkpoint` builds the HF
model from it with a fixed seed, re-initialises the weights with a large spread (so greedy decoding and expert
routing have no near-ties and routing biases change the result), saves it with `save_pretrained` and returns the
HF model as the float32 reference. Nothing is downloaded. Kimi-K2.5 is written in its published layout, which is not
the one transformers saves (`publish_kimi_k25_layout`).
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import torch
import transformers as T
from safetensors.torch import load_file, save_file

VOCAB = 256
HIDDEN = 64
HEADS = 4
LAYERS = 4
EXPERTS = 8
MOE_INTERMEDIATE = 32
DENSE_INTERMEDIATE = 96

# Large-spread initialisation (HF's default std 0.02 gives nearly flat logits and routing scores).
MATRIX_STD = 0.15
EMBED_STD = 1.0
BIAS_STD = 0.1
NORM_MEAN, NORM_STD = 1.0, 0.1
SCORE_BIAS_STD = 0.1  # e_score_correction_bias: comparable to the spread of sigmoid router scores
SINK_STD = 1.0  # attention sinks (gpt-oss): logits as large as the attention scores, so that they matter

FP8_BLOCK = 128
FP8_MAX = 448.0  # largest finite float8_e4m3fn value


def _common(**kwargs):
    base = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_attention_heads=HEADS, num_hidden_layers=LAYERS,
                max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False)
    base.update(kwargs)
    return base


def qwen3_moe_config() -> T.Qwen3MoeConfig:
    # head_dim 24 != hidden / heads (as in the released Qwen3 MoE models); layer 0 dense, layers 1-3 MoE.
    return T.Qwen3MoeConfig(**_common(
        num_key_value_heads=2, head_dim=24, intermediate_size=DENSE_INTERMEDIATE,
        moe_intermediate_size=MOE_INTERMEDIATE, num_experts=EXPERTS, num_experts_per_tok=3, norm_topk_prob=True,
        mlp_only_layers=[0], decoder_sparse_step=1, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        bos_token_id=1, eos_token_id=2, pad_token_id=0))


def qwen2_moe_config() -> T.Qwen2MoeConfig:
    # decoder_sparse_step 2: layers 1 and 3 MoE, layers 0 and 2 dense; gated shared expert; qkv bias.
    return T.Qwen2MoeConfig(**_common(
        num_key_value_heads=4, intermediate_size=DENSE_INTERMEDIATE, moe_intermediate_size=MOE_INTERMEDIATE,
        shared_expert_intermediate_size=48, num_experts=EXPERTS, num_experts_per_tok=4, norm_topk_prob=False,
        decoder_sparse_step=2, mlp_only_layers=[], qkv_bias=True, use_sliding_window=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6}, bos_token_id=1, eos_token_id=2,
        pad_token_id=0))


def mixtral_config() -> T.MixtralConfig:
    # All layers MoE (Mixtral has no dense layers).
    return T.MixtralConfig(**_common(
        num_hidden_layers=3, num_key_value_heads=2, intermediate_size=MOE_INTERMEDIATE, num_local_experts=EXPERTS,
        num_experts_per_tok=2, sliding_window=None, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6}, bos_token_id=1, eos_token_id=2,
        pad_token_id=0))


YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
        "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}


def _mla(**kwargs):
    # MLA dims: q/k head 16 (nope) + 16 (rope), v head 24 (differs from the q/k head on purpose).
    base = dict(num_key_value_heads=HEADS, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16,
                v_head_dim=24, intermediate_size=DENSE_INTERMEDIATE, moe_intermediate_size=MOE_INTERMEDIATE,
                first_k_dense_replace=1, bos_token_id=0, eos_token_id=1, pad_token_id=2)
    base.update(kwargs)
    return _common(**base)


def deepseek_v3_config() -> T.DeepseekV3Config:
    # YaRN rope, grouped routing (4 groups of 2 experts, best 2 groups), q LoRA, sigmoid + correction bias.
    return T.DeepseekV3Config(**_mla(
        q_lora_rank=48, n_routed_experts=EXPERTS, n_shared_experts=1, num_experts_per_tok=3, n_group=4,
        topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5, rope_parameters=dict(YARN),
        num_nextn_predict_layers=1))


def kimi_k2_config() -> T.DeepseekV3Config:
    # Kimi-K2: DeepSeek-V3 architecture with one expert group.
    return T.DeepseekV3Config(**_mla(
        q_lora_rank=48, n_routed_experts=EXPERTS, n_shared_experts=1, num_experts_per_tok=2, n_group=1,
        topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.827,
        rope_parameters=dict(YARN, rope_theta=50000.0, beta_fast=1.0, beta_slow=1.0), num_nextn_predict_layers=1))


# Kimi-K2.5's vision tower and projector, as small as they go: present so that the loader and the converter must skip
# them, never run.
KIMI_VISION = dict(patch_size=2, pos_emb_height=4, pos_emb_width=4, pos_emb_time=2, num_attention_heads=2,
                   num_hidden_layers=1, hidden_size=16, intermediate_size=32)
KIMI_K25_ARCHITECTURE = "KimiK25ForConditionalGeneration"  # the Hub's spelling (transformers' class: Kimi_K25...)


def kimi_k25_config() -> T.Kimi_K25Config:
    # Kimi-K2.5: the Kimi-K2 text model (model_type kimi_k2, which transformers remaps to deepseek_v3) under
    # `text_config`, without an MTP layer, beside a vision config; the LM head is not tied (the wrapper's default is).
    text = kimi_k2_config().to_dict() | {"model_type": "kimi_k2", "num_nextn_predict_layers": 0}
    return T.Kimi_K25Config(text_config=text, vision_config=dict(KIMI_VISION), projection_hidden_size=16,
                            tie_word_embeddings=False)


def minimax_m2_config() -> T.MiniMaxM2Config:
    # QK RMSNorm over the whole q/k projection, partial rotary (12 of head 24), every layer MoE with sigmoid routing
    # chosen with the block's correction bias.
    return T.MiniMaxM2Config(**_common(
        num_key_value_heads=2, head_dim=24, intermediate_size=MOE_INTERMEDIATE, num_local_experts=EXPERTS,
        num_experts_per_tok=3, rope_parameters={"rope_type": "default", "rope_theta": 5e6,
                                                "partial_rotary_factor": 0.5},
        bos_token_id=1, eos_token_id=2, pad_token_id=0))


def deepseek_v2_group_config() -> T.DeepseekV2Config:
    # DeepSeek-V2: no q LoRA, softmax routing limited to the best groups.
    return T.DeepseekV2Config(**_mla(
        q_lora_rank=None, n_routed_experts=EXPERTS, n_shared_experts=2, num_experts_per_tok=3, n_group=4,
        topk_group=2, topk_method="group_limited_greedy", norm_topk_prob=False, routed_scaling_factor=1.5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}))


def deepseek_v2_greedy_config() -> T.DeepseekV2Config:
    # DeepSeek-V2-Lite style: no q LoRA, greedy softmax routing, YaRN with mscale 0.707.
    yarn = dict(YARN, mscale=0.707, mscale_all_dim=0.707)
    return T.DeepseekV2Config(**_mla(
        q_lora_rank=None, n_routed_experts=EXPERTS, n_shared_experts=2, num_experts_per_tok=2, n_group=1,
        topk_group=1, topk_method="greedy", norm_topk_prob=False, routed_scaling_factor=1.0, rope_parameters=yarn))


def glm4_moe_config() -> T.Glm4MoeConfig:
    # Partial rotary (default factor 0.5), QK norm, qkv bias; head_dim 24 != hidden / heads.
    return T.Glm4MoeConfig(**_common(
        num_key_value_heads=2, head_dim=24, intermediate_size=DENSE_INTERMEDIATE,
        moe_intermediate_size=MOE_INTERMEDIATE, n_routed_experts=EXPERTS, n_shared_experts=1, num_experts_per_tok=3,
        n_group=1, topk_group=1, first_k_dense_replace=1, norm_topk_prob=True, routed_scaling_factor=2.5,
        use_qk_norm=True, attention_bias=True, rms_norm_eps=1e-5, num_nextn_predict_layers=1,
        bos_token_id=1, eos_token_id=2, pad_token_id=0))


def glm4_moe_lite_config() -> T.Glm4MoeLiteConfig:
    # GLM-4.7-Flash: MLA whose dims are none of them powers of two (nope 24, rope 8, v 40, latent 48; the release
    # has nope 192, v 256), so the kernels' in-kernel padding is exercised; GLM's sigmoid + bias router in one
    # group; dense layers only from `mlp_layer_types` (layer 2 dense too, which first_k_dense_replace cannot say);
    # an MTP layer declared past the last.
    return T.Glm4MoeLiteConfig(**_common(
        num_key_value_heads=HEADS, q_lora_rank=40, kv_lora_rank=48, qk_nope_head_dim=24, qk_rope_head_dim=8,
        v_head_dim=40, intermediate_size=DENSE_INTERMEDIATE, moe_intermediate_size=MOE_INTERMEDIATE,
        n_routed_experts=EXPERTS, n_shared_experts=1, num_experts_per_tok=3, n_group=1, topk_group=1,
        norm_topk_prob=True, routed_scaling_factor=1.8, mlp_layer_types=["dense", "sparse", "dense", "sparse"],
        rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        num_nextn_predict_layers=1, bos_token_id=0, eos_token_id=1, pad_token_id=2))


VARIANTS = {
    "qwen3_moe": qwen3_moe_config,
    "qwen2_moe": qwen2_moe_config,
    "mixtral": mixtral_config,
    "deepseek_v3": deepseek_v3_config,
    "kimi_k2": kimi_k2_config,
    "deepseek_v2_group_limited": deepseek_v2_group_config,
    "deepseek_v2_greedy": deepseek_v2_greedy_config,
    "glm4_moe": glm4_moe_config,
    "glm4_moe_lite": glm4_moe_lite_config,
    "kimi_k25": kimi_k25_config,
    "minimax_m2": minimax_m2_config,
}


# Weight seed per variant, chosen (by checking, not by luck) so that over the prompts the parity tests use, every
# greedy step's top-2 logit margin is > 1.5e-3 of max|logit| and every router's k-th/(k+1)-th score gap is > 1e-4:
# float32 rounding (~1e-6) cannot flip a token or an expert choice.
SEEDS = {
    "qwen3_moe": 6,
    "qwen2_moe": 4,
    "mixtral": 5,
    "deepseek_v3": 1,
    "kimi_k2": 2,
    "deepseek_v2_group_limited": 4,
    "deepseek_v2_greedy": 1,
    "glm4_moe": 3,
    "glm4_moe_lite": 13,
    "kimi_k25": 2,
    "minimax_m2": 2,
}


def build_model(cfg, *, seed: int) -> torch.nn.Module:
    """The HF model of `cfg` in float32 eval mode, weights re-initialised with a large spread (seeded)."""
    torch.manual_seed(seed)
    auto = T.AutoModelForImageTextToText if getattr(cfg, "text_config", None) is not None else T.AutoModelForCausalLM
    model = auto.from_config(cfg, attn_implementation="eager", dtype=torch.float32)
    reinitialize(model, seed=seed)
    return model.eval()


@torch.no_grad()
def reinitialize(model: torch.nn.Module, *, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)

    def normal(t, mean, std):
        t.copy_(torch.randn(t.shape, generator=gen, dtype=torch.float32) * std + mean)

    for name, param in sorted(model.named_parameters()):
        if "embed_tokens" in name:
            normal(param, 0.0, EMBED_STD)
        elif param.dim() >= 2:
            normal(param, 0.0, MATRIX_STD)
        elif "norm" in name:
            normal(param, NORM_MEAN, NORM_STD)
        elif name.endswith("bias"):
            normal(param, 0.0, BIAS_STD)
        elif name.endswith(".sinks"):  # transformers initialises them to zero (no effect on the output): set them
            normal(param, 0.0, SINK_STD)
        else:
            raise AssertionError(f"no initialisation rule for parameter {name} {tuple(param.shape)}")
    for name, buf in sorted(model.named_buffers()):
        if name.endswith("e_score_correction_bias"):
            normal(buf, 0.0, SCORE_BIAS_STD)


def make_checkpoint(cfg, path, *, seed: int, dtype: torch.dtype = torch.float32, max_shard_size=None):
    """Builds the HF model of `cfg` (seeded, large-spread weights), saves it to `path` in `dtype` (sharded with an
    index when `max_shard_size` is given) and returns the float32 eval-mode reference holding exactly the saved
    weights (upcast from `dtype`)."""
    path = Path(path)
    model = build_model(cfg, seed=seed)
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    if dtype == torch.float32:
        model.save_pretrained(path, **kwargs)
        _publish_layout(cfg, path)
        return model
    with torch.no_grad():  # the reference computes in float32 on exactly the values the checkpoint holds
        for param in model.parameters():
            param.copy_(param.to(dtype).float())
    # Save a cast copy: casting the reference itself would also round its RoPE frequency buffers. As in released
    # checkpoints, the routing correction bias stays float32.
    stored = copy.deepcopy(model).to(dtype)
    for name, buf in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            stored.get_buffer(name).data = buf.detach().clone()
    stored.save_pretrained(path, **kwargs)
    _publish_layout(cfg, path)
    return model


def _publish_layout(cfg, path: Path) -> None:
    if cfg.model_type == "kimi_k25":
        publish_kimi_k25_layout(path)


# transformers 5.17 saves Kimi-K2.5 in a layout of its own: text layers `language_model.model.blocks.N` (its load-time
# rename of `blocks` to `layers`, for the vision tower, reversed on every name) and the projector's norm under
# `model.mm_projector`; the published checkpoints say `layers.N` and `mm_projector`.
KIMI_K25_PUBLISHED_NAMES = (("language_model.model.blocks.", "language_model.model.layers."),
                            ("model.mm_projector.", "mm_projector."))


def publish_kimi_k25_layout(path) -> None:
    """Rewrites a Kimi-K2.5 checkpoint that transformers saved into the published layout: tensor names (every shard
    and the index), `architectures` as the Hub spells it and the text model's `model_type` kimi_k2."""
    path = Path(path)

    def published(name: str) -> str:
        for saved, released in KIMI_K25_PUBLISHED_NAMES:
            if name.startswith(saved):
                return released + name[len(saved):]
        return name

    for shard in sorted(path.glob("*.safetensors")):
        tensors = load_file(str(shard))
        save_file({published(n): t for n, t in tensors.items()}, str(shard), metadata={"format": "pt"})
    index = path / "model.safetensors.index.json"
    if index.is_file():
        data = json.loads(index.read_text())
        data["weight_map"] = {published(n): f for n, f in data["weight_map"].items()}
        index.write_text(json.dumps(data, indent=2))
    config = json.loads((path / "config.json").read_text())
    config["architectures"] = [KIMI_K25_ARCHITECTURE]
    config["text_config"]["model_type"] = "kimi_k2"
    (path / "config.json").write_text(json.dumps(config, indent=2))


def prompt(length: int, seed: int, vocab: int = VOCAB) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (length,), generator=gen).tolist()


# --- references ---------------------------------------------------------------------------------------------------

@torch.no_grad()
def hf_logits(model, ids: list[int]) -> torch.Tensor:
    return model(torch.tensor([ids], device=model.device)).logits[0].float()


@torch.no_grad()
def hf_greedy_no_cache(model, ids: list[int], n: int) -> tuple[list[int], list[float]]:
    """Greedy continuation by full recomputation (no KV cache, no EOS handling), with each step's top-2 margin
    relative to the largest |logit|."""
    seq, out, margins = list(ids), [], []
    for _ in range(n):
        logits = hf_logits(model, seq)[-1]
        top = logits.topk(2).values
        margins.append(float((top[0] - top[1]) / logits.abs().max()))
        token = int(logits.argmax())
        out.append(token)
        seq.append(token)
    return out, margins


@torch.no_grad()
def hf_generate(model, ids: list[int], n: int) -> list[int]:
    """transformers' own greedy generate with its KV cache, made to run exactly `n` steps: no EOS id (so it never
    stops early and `min_new_tokens` suppresses nothing), a pad id to silence the warning."""
    out = model.generate(torch.tensor([ids], device=model.device), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                         eos_token_id=None, pad_token_id=0, generation_config=_plain_generation_config(model))
    return out[0, len(ids):].tolist()


def _plain_generation_config(model):
    gc = T.GenerationConfig.from_dict(model.generation_config.to_dict())
    gc.eos_token_id = None
    gc.pad_token_id = 0
    gc.do_sample = False
    gc.temperature = None
    gc.top_p = None
    gc.top_k = None
    return gc


# --- routing margins (used to check the helpers themselves) ---------------------------------------------------------

def routing_gaps(model, ids: list[int]) -> list[float]:
    """For every MoE router call over `ids`, the smallest gap between the k-th and (k+1)-th selection score, as the
    family selects them; a near-zero gap would let rounding flip expert choice."""
    gaps: list[float] = []
    hooks = []
    cfg = getattr(model.config, "text_config", None) or model.config
    k = cfg.num_experts_per_tok
    modules = dict(model.named_modules())
    for name, module in modules.items():
        if not name.endswith("mlp.gate") or not hasattr(module, "weight"):
            continue
        # DeepSeek-V3 / GLM keep the correction bias on the router, MiniMax-M2 on the MoE block
        bias = getattr(module, "e_score_correction_bias", None)
        bias = bias if bias is not None else getattr(modules[name.rpartition(".")[0]], "e_score_correction_bias", None)

        def hook(mod, inputs, output, bias=bias):
            x = inputs[0].reshape(-1, inputs[0].shape[-1]).float()
            logits = x @ mod.weight.float().t()
            if bias is not None:  # sigmoid + bias, top-2-sum groups
                scores = logits.sigmoid() + bias
                group_score = lambda g: g.topk(2, dim=-1).values.sum(-1)
            else:
                scores = logits.softmax(-1)
                group_score = lambda g: g.max(dim=-1).values
            ng, tg = getattr(cfg, "n_group", None) or 1, getattr(cfg, "topk_group", None) or 1
            if getattr(cfg, "topk_method", "group_limited_greedy") == "greedy":
                ng = tg = 1
            if tg < ng:
                per = scores.shape[-1] // ng
                gscore = group_score(scores.view(-1, ng, per))
                gs = gscore.sort(dim=-1, descending=True).values
                gaps.append(float((gs[:, tg - 1] - gs[:, tg]).min()))
                mask = torch.zeros_like(gscore).scatter_(1, gscore.topk(tg, dim=-1).indices, 1).bool()
                scores = scores.masked_fill(~mask.repeat_interleave(per, dim=1), float("-inf"))
            s = scores.sort(dim=-1, descending=True).values
            gaps.append(float((s[:, k - 1] - s[:, k]).min()))

        hooks.append(module.register_forward_hook(hook))
    try:
        hf_logits(model, ids)
    finally:
        for h in hooks:
            h.remove()
    return gaps


# --- FP8 (DeepSeek block format) ------------------------------------------------------------------------------------

def fp8_quantize(weight: torch.Tensor, block: int = FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] float -> (float8_e4m3fn [out, in], float32 scale_inv [ceil(out/b), ceil(in/b)]) such that
    dequantized = fp8.float() * scale_inv expanded over b x b blocks (cropped at the edges)."""
    rows, cols = weight.shape
    nr, nc = math.ceil(rows / block), math.ceil(cols / block)
    scale = torch.empty(nr, nc, dtype=torch.float32)
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    for i in range(nr):
        for j in range(nc):
            tile = weight[i * block:(i + 1) * block, j * block:(j + 1) * block].float()
            s = tile.abs().max().clamp(min=1e-12) / FP8_MAX
            scale[i, j] = s
            q[i * block:(i + 1) * block, j * block:(j + 1) * block] = (tile / s).to(torch.float8_e4m3fn)
    return q, scale


def fp8_dequantize(q: torch.Tensor, scale_inv: torch.Tensor, block: int = FP8_BLOCK) -> torch.Tensor:
    rows, cols = q.shape
    expanded = scale_inv.repeat_interleave(block, 0)[:rows].repeat_interleave(block, 1)[:, :cols]
    return q.float() * expanded


def fp8_config() -> T.DeepseekV3Config:
    # hidden 160, intermediate 288, moe_intermediate 136, q_lora 144, kv_lora 136, q_b out 192, kv_b out 256:
    # 2-3 blocks per dimension, most with a partial last block.
    return T.DeepseekV3Config(
        vocab_size=256, hidden_size=160, intermediate_size=288, moe_intermediate_size=136, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=144, kv_lora_rank=136, qk_nope_head_dim=32,
        qk_rope_head_dim=16, v_head_dim=32, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=3,
        n_group=4, topk_group=2, first_k_dense_replace=1, norm_topk_prob=True, routed_scaling_factor=2.5,
        max_position_embeddings=256, tie_word_embeddings=False, num_nextn_predict_layers=1,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0,
                         "mscale_all_dim": 1.0},
        bos_token_id=0, eos_token_id=1, pad_token_id=2)


def fp8_minimax_config() -> T.MiniMaxM2Config:
    # hidden 160, q 4 x 48 = 192, k/v 2 x 48 = 96, expert intermediate 136: 1-2 blocks per dimension, most partial.
    return T.MiniMaxM2Config(
        vocab_size=256, hidden_size=160, intermediate_size=136, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=48, num_local_experts=8, num_experts_per_tok=3, max_position_embeddings=256,
        tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 5e6,
                                                    "partial_rotary_factor": 0.5},
        bos_token_id=1, eos_token_id=2, pad_token_id=0)


FP8_QUANTIZATION_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                           "weight_block_size": [FP8_BLOCK, FP8_BLOCK]}


def is_fp8_quantized_name(name: str, tensor: torch.Tensor) -> bool:
    """The tensors that released DeepSeek-V3 (and MiniMax-M2) FP8 checkpoints store in FP8: every 2-D Linear weight of
    attention, dense MLPs, shared and routed experts; not embeddings, lm_head, norms, the router (`*.gate`) or the DSA
    indexer's head weights (`indexer.weights_proj`, 16-bit in DeepSeek-V3.2's and GLM-5's releases)."""
    return (tensor.dim() == 2 and name.endswith(".weight") and ".layers." in name and "norm" not in name
            and not name.endswith(".gate.weight") and "embed_tokens" not in name
            and not name.endswith("indexer.weights_proj.weight"))


def write_config(path, update: dict | None = None, remove: tuple[str, ...] = ()) -> dict:
    file = Path(path) / "config.json"
    cfg = json.loads(file.read_text())
    cfg.update(update or {})
    for key in remove:
        cfg.pop(key, None)
    file.write_text(json.dumps(cfg, indent=2))
    return cfg


# Variants whose own head dims the kernels take as they are (padded inside the MLA kernels): kept, to test that.
KERNEL_NATIVE_VARIANTS = ("glm4_moe_lite",)


def kernel_config(name: str):
    """The variant with head dims the kernels take: GQA head_dim 64; MLA latent 64, nope 32, rope 16, v 32 (in the
    text model's config, for a wrapper such as Kimi-K2.5; the KERNEL_NATIVE_VARIANTS keep theirs)."""
    cfg = VARIANTS[name]()
    if name in KERNEL_NATIVE_VARIANTS:
        return cfg
    values = cfg.to_dict()
    if getattr(cfg, "text_config", None) is not None:
        values["text_config"] = _kernel_values(cfg.text_config.to_dict())
        return type(cfg)(**values)
    return type(cfg)(**_kernel_values(values))


def _kernel_values(values: dict) -> dict:
    if "kv_lora_rank" in values:
        values.update(kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32)
        for derived in ("qk_head_dim", "head_dim"):
            values.pop(derived, None)
    else:
        values.update(head_dim=64)
    return values
