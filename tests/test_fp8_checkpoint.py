"""DeepSeek-style FP8 checkpoints (float8_e4m3fn weights with float32 128x128 block `weight_scale_inv`), read and
dequantized on the CPU.

The checkpoint is written here by quantizing a tiny DeepSeek-V3 whose dimensions are not multiples of 128 (so there
are several blocks per matrix and partial blocks at the edges); each 128x128 block of every quantized weight is first
multiplied by its own random factor so that the block scales differ and a mis-broadcast scale shows. The reference is
transformers' model holding the dequantized weights.
"""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
import transformers
from checkpoints import (
    FP8_BLOCK,
    FP8_QUANTIZATION_CONFIG,
    build_model,
    fp8_config,
    fp8_dequantize,
    fp8_minimax_config,
    fp8_quantize,
    hf_generate,
    hf_greedy_no_cache,
    hf_logits,
    is_fp8_quantized_name,
    prompt,
    write_config,
)
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from hybrid import LLM

transformers.logging.set_verbosity_error()

REL_TOL = 1e-4
SEED = 17
MINIMAX_SEED = 3


def block_factors(shape, gen) -> torch.Tensor:
    """A random factor in [e^-1, e] per 128x128 block, expanded to `shape`."""
    nr, nc = math.ceil(shape[0] / FP8_BLOCK), math.ceil(shape[1] / FP8_BLOCK)
    f = torch.exp(torch.rand(nr, nc, generator=gen) * 2 - 1)
    return f.repeat_interleave(FP8_BLOCK, 0)[: shape[0]].repeat_interleave(FP8_BLOCK, 1)[:, : shape[1]]


def load_reference(cfg, tensors: dict[str, torch.Tensor], tmp_dir) -> torch.nn.Module:
    """transformers' model holding exactly `tensors` (checkpoint names), loaded through its own checkpoint reader so
    that its checkpoint-to-module name mapping (e.g. fused experts) is the library's own."""
    save_file({n: t.contiguous() for n, t in tensors.items()}, str(tmp_dir / "model.safetensors"),
              metadata={"format": "pt"})
    cfg.save_pretrained(tmp_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_dir, dtype=torch.float32,
                                                              attn_implementation="eager")
    return model.eval()


def build_fp8_checkpoint(cfg, seed: int, tmp_path_factory, tag: str, *, publish=None, **llm_options) -> dict:
    """The FP8 checkpoint of `cfg` (seeded weights, every FP8 tensor's blocks scaled apart), its tensors stored,
    dequantized and raw (FP8 values without their scales), the reference and our LLM on it (`llm_options` beside
    device cpu and dtype float32). `publish(tensors)`: the saved tensors as the release lays them out (extra layers
    such as an MTP one), applied before quantizing."""
    model = build_model(cfg, seed=seed)
    src = tmp_path_factory.mktemp(f"{tag}_src")
    model.save_pretrained(src)
    original = load_file(str(src / "model.safetensors"))
    if publish is not None:
        original = publish(original)

    gen = torch.Generator().manual_seed(seed)
    stored, dequantized, raw = {}, {}, {}
    for name in sorted(original):
        tensor = original[name]
        if is_fp8_quantized_name(name, tensor):
            q, scale_inv = fp8_quantize(tensor * block_factors(tensor.shape, gen))
            stored[name], stored[name + "_scale_inv"] = q, scale_inv
            dequantized[name] = fp8_dequantize(q, scale_inv)
            raw[name] = q.float()
        else:
            stored[name] = dequantized[name] = raw[name] = tensor

    path = tmp_path_factory.mktemp(tag)
    for file in ("config.json", "generation_config.json"):
        shutil.copy(src / file, path / file)
    save_file(stored, str(path / "model.safetensors"), metadata={"format": "pt"})
    write_config(path, {"quantization_config": dict(FP8_QUANTIZATION_CONFIG)})

    ref = load_reference(cfg, dequantized, tmp_path_factory.mktemp(f"{tag}_ref"))
    return {"cfg": cfg, "path": path, "stored": stored, "dequantized": dequantized, "raw": raw, "ref": ref,
            "llm": LLM(path, device="cpu", dtype="float32", **llm_options)}


@pytest.fixture(scope="module")
def fp8(tmp_path_factory):
    return build_fp8_checkpoint(fp8_config(), SEED, tmp_path_factory, "fp8")


@pytest.fixture(scope="module")
def fp8_minimax(tmp_path_factory):
    """MiniMax-M2 as released: FP8 attention projections and experts (w1/w2/w3), router, norms (q_norm/k_norm over
    the whole projection) and the block's correction bias in float32."""
    return build_fp8_checkpoint(fp8_minimax_config(), MINIMAX_SEED, tmp_path_factory, "fp8_minimax")


# --- the checkpoint itself is what it should be (so the tests below cannot pass vacuously) ----------------------

def test_quantizer_round_trips():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(300, 136, generator=gen) * block_factors((300, 136), gen)
    q, s = fp8_quantize(w)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32 and tuple(s.shape) == (3, 2)
    deq = fp8_dequantize(q, s)
    assert not torch.equal(deq, w)  # lossy
    assert (deq - w).norm() <= 0.04 * w.norm()  # e4m3: 3 mantissa bits
    # each block uses the full FP8 range, so its largest element is exact
    for i in range(3):
        for j in range(2):
            blk = (slice(i * 128, (i + 1) * 128), slice(j * 128, (j + 1) * 128))
            assert q[blk].float().abs().max() == 448.0
            assert torch.isclose(deq[blk].abs().max(), w[blk].abs().max(), rtol=1e-6)


def test_checkpoint_layout_matches_deepseek_fp8(fp8):
    path, stored = fp8["path"], fp8["stored"]
    config = json.loads((path / "config.json").read_text())
    assert config["quantization_config"] == FP8_QUANTIZATION_CONFIG
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        dtypes = {n: f.get_slice(n).get_dtype() for n in f.keys()}  # noqa: SIM118
    fp8_names = {n for n, d in dtypes.items() if d == "F8_E4M3"}
    for must in ("model.layers.0.mlp.gate_proj.weight", "model.layers.0.self_attn.q_a_proj.weight",
                 "model.layers.0.self_attn.q_b_proj.weight", "model.layers.0.self_attn.kv_a_proj_with_mqa.weight",
                 "model.layers.0.self_attn.kv_b_proj.weight", "model.layers.0.self_attn.o_proj.weight",
                 "model.layers.1.mlp.shared_experts.down_proj.weight", "model.layers.2.mlp.experts.7.up_proj.weight"):
        assert must in fp8_names, must
        assert dtypes[must + "_scale_inv"] == "F32"
    for plain in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight",
                  "model.layers.1.mlp.gate.weight", "model.layers.1.mlp.gate.e_score_correction_bias",
                  "model.layers.1.self_attn.kv_a_layernorm.weight"):
        assert dtypes[plain] == "F32", plain
    # several blocks and partial edge blocks: kv_b_proj [256, 136] -> [2, 2]; down_proj of a dense layer
    # [160, 288] -> [2, 3]; routed expert gate_proj [136, 160] -> [2, 2]
    assert tuple(stored["model.layers.0.self_attn.kv_b_proj.weight"].shape) == (256, 136)
    assert tuple(stored["model.layers.0.self_attn.kv_b_proj.weight_scale_inv"].shape) == (2, 2)
    assert tuple(stored["model.layers.0.mlp.down_proj.weight_scale_inv"].shape) == (2, 3)
    assert tuple(stored["model.layers.1.mlp.experts.0.gate_proj.weight_scale_inv"].shape) == (2, 2)
    # the block scales really differ, so a scale applied to the wrong block changes the weights
    s = stored["model.layers.0.mlp.down_proj.weight_scale_inv"]
    assert s.max() / s.min() > 1.5


def test_reference_holds_dequantized_weights(fp8):
    ref, deq = fp8["ref"], fp8["dequantized"]
    assert torch.equal(ref.model.layers[0].self_attn.kv_b_proj.weight, deq["model.layers.0.self_attn.kv_b_proj.weight"])
    assert torch.equal(ref.lm_head.weight, deq["lm_head.weight"])
    bias = ref.model.layers[1].mlp.gate.e_score_correction_bias
    assert torch.equal(bias, deq["model.layers.1.mlp.gate.e_score_correction_bias"]) and bias.abs().max() > 0


def test_scales_matter(fp8, tmp_path_factory):
    """Ignoring the scales, or applying one scale per tensor instead of per block, gives materially different logits:
    the parity tests below would catch either."""
    cfg, ids = fp8["cfg"], prompt(33, seed=33)
    good = hf_logits(fp8["ref"], ids)
    raw = load_reference(cfg, fp8["raw"], tmp_path_factory.mktemp("fp8_raw"))
    per_tensor = dict(fp8["dequantized"])
    for name, tensor in fp8["stored"].items():
        if tensor.dtype == torch.float8_e4m3fn:
            per_tensor[name] = tensor.float() * fp8["stored"][name + "_scale_inv"].mean()
    uniform = load_reference(cfg, per_tensor, tmp_path_factory.mktemp("fp8_uniform"))
    for wrong in (raw, uniform):
        assert (hf_logits(wrong, ids) - good).abs().max() > 100 * REL_TOL * good.abs().max()


# --- parity ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("length", [1, 7, 33])
def test_fp8_prefill_logits_match_dequantized_reference(fp8, length):
    ids = prompt(length, seed=length + 50)
    ours, ref = fp8["llm"].prefill_logits(ids), hf_logits(fp8["ref"], ids)
    assert ours.dtype == torch.float32 and tuple(ours.shape) == tuple(ref.shape)
    err, scale = float((ours - ref).abs().max()), float(ref.abs().max())
    assert err <= REL_TOL * scale, f"max |ours - hf| = {err:.3e} > {REL_TOL} * {scale:.3e}"


def test_fp8_greedy_matches_dequantized_reference(fp8):
    ids = prompt(7, seed=7)
    expected = hf_generate(fp8["ref"], ids, 32)
    assert len(expected) == 32
    recomputed, margins = hf_greedy_no_cache(fp8["ref"], ids, 32)
    assert expected == recomputed
    llm = fp8["llm"]
    before = llm.num_forward_tokens
    ours = llm.generate(ids, max_new_tokens=32, ignore_eos=True)
    assert ours == expected, f"ours {ours}\nhf   {expected}\nmin HF margin {min(margins):.2e}"
    assert llm.num_forward_tokens - before == len(ids) + 32 - 1


def test_fp8_checkpoint_with_mtp_layer_loads(fp8, tmp_path):
    """Released DeepSeek-V3 checkpoints carry a multi-token-prediction layer after the last decoder layer
    (`model.layers.{num_hidden_layers}.*`, FP8 like the others); inference skips it and the result is unchanged."""
    n = fp8["cfg"].num_hidden_layers
    tensors = dict(fp8["stored"])
    for name, tensor in fp8["stored"].items():
        if name.startswith(f"model.layers.{n - 1}."):
            tensors[name.replace(f"model.layers.{n - 1}.", f"model.layers.{n}.", 1)] = tensor.clone()
    tensors[f"model.layers.{n}.enorm.weight"] = torch.ones(160)
    tensors[f"model.layers.{n}.hnorm.weight"] = torch.ones(160)
    tensors[f"model.layers.{n}.eh_proj.weight"], tensors[f"model.layers.{n}.eh_proj.weight_scale_inv"] = \
        fp8_quantize(torch.randn(160, 320))
    tensors[f"model.layers.{n}.shared_head.head.weight"] = torch.randn(256, 160)
    for file in ("config.json", "generation_config.json"):
        shutil.copy(fp8["path"] / file, tmp_path / file)
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    ids = prompt(7, seed=8)
    ours, ref = LLM(tmp_path, device="cpu", dtype="float32").prefill_logits(ids), hf_logits(fp8["ref"], ids)
    assert (ours - ref).abs().max() <= REL_TOL * ref.abs().max()


# --- MiniMax-M2 FP8 (its published form) ----------------------------------------------------------------------------

def test_minimax_checkpoint_layout_is_the_published_fp8(fp8_minimax):
    with safe_open(str(fp8_minimax["path"] / "model.safetensors"), framework="pt") as f:
        dtypes = {n: f.get_slice(n).get_dtype() for n in f.keys()}  # noqa: SIM118
    for must in ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
                 "model.layers.0.self_attn.o_proj.weight", "model.layers.2.block_sparse_moe.experts.7.w1.weight",
                 "model.layers.2.block_sparse_moe.experts.7.w2.weight",
                 "model.layers.2.block_sparse_moe.experts.7.w3.weight"):
        assert dtypes[must] == "F8_E4M3" and dtypes[must + "_scale_inv"] == "F32", must
    for plain in ("model.layers.0.block_sparse_moe.gate.weight",
                  "model.layers.0.block_sparse_moe.e_score_correction_bias", "model.layers.0.self_attn.q_norm.weight",
                  "model.embed_tokens.weight", "lm_head.weight"):
        assert dtypes[plain] == "F32", plain
    # q_proj [192, 160] and the experts' w2 [160, 136]: 2 x 2 blocks, partial at the edges
    assert tuple(fp8_minimax["stored"]["model.layers.0.self_attn.q_proj.weight_scale_inv"].shape) == (2, 2)
    assert tuple(fp8_minimax["stored"]["model.layers.1.block_sparse_moe.experts.0.w2.weight_scale_inv"].shape) == (2, 2)


@pytest.mark.parametrize("length", [1, 7, 33])
def test_minimax_fp8_prefill_logits_match_dequantized_reference(fp8_minimax, length):
    ids = prompt(length, seed=length + 60)
    ours, ref = fp8_minimax["llm"].prefill_logits(ids), hf_logits(fp8_minimax["ref"], ids)
    err, scale = float((ours - ref).abs().max()), float(ref.abs().max())
    assert err <= REL_TOL * scale, f"max |ours - hf| = {err:.3e} > {REL_TOL} * {scale:.3e}"


def test_minimax_fp8_scales_matter(fp8_minimax, tmp_path):
    """The FP8 values without their block scales give materially different logits (so the parity above is not
    vacuous)."""
    ids = prompt(33, seed=93)
    good = hf_logits(fp8_minimax["ref"], ids)
    raw = load_reference(fp8_minimax["cfg"], fp8_minimax["raw"], tmp_path)
    assert (hf_logits(raw, ids) - good).abs().max() > 100 * REL_TOL * good.abs().max()


def test_minimax_fp8_greedy_matches_dequantized_reference(fp8_minimax):
    ids = prompt(7, seed=7)
    expected = hf_generate(fp8_minimax["ref"], ids, 32)
    recomputed, margins = hf_greedy_no_cache(fp8_minimax["ref"], ids, 32)
    assert expected == recomputed and len(expected) == 32
    ours = fp8_minimax["llm"].generate(ids, max_new_tokens=32, ignore_eos=True)
    assert ours == expected, f"ours {ours}\nhf   {expected}\nmin HF margin {min(margins):.2e}"
