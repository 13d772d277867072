"""`hybrid-bench load` and the FP8 synthetic checkpoint it starts from (the timing itself is not tested)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from checkpoints import FP8_QUANTIZATION_CONFIG, is_fp8_quantized_name
from safetensors.torch import load_file

from hybrid.bench import main
from hybrid.synthetic import SHAPES, shape_config, write_synthetic_checkpoint

# DeepSeek-V3 shrunk to ~3 MB: 2-3 FP8 blocks per dimension, some partial (the 192-row kv_b / q_b outputs).
TINY_DEEPSEEK = dict(SHAPES["deepseek-v3"], vocab_size=512, hidden_size=256, intermediate_size=384,
                     moe_intermediate_size=128, n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
                     num_attention_heads=4, num_key_value_heads=4, q_lora_rank=192, kv_lora_rank=128,
                     qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32)


@pytest.fixture
def tiny(monkeypatch):
    monkeypatch.setitem(SHAPES, "tiny", TINY_DEEPSEEK)
    return "tiny"


def stored_tensors(path) -> dict[str, torch.Tensor]:
    tensors = {}
    for shard in sorted(path.glob("*.safetensors")):
        tensors.update(load_file(str(shard)))
    return tensors


def test_fp8_synthetic_checkpoint_is_deepseeks_layout_and_loads_as_stored(tmp_path, tiny):
    """The FP8 writer stores in FP8 exactly the tensors DeepSeek-V3's release does (the test suite's own choice,
    `is_fp8_quantized_name`), with float32 128 x 128 block scales and no NaN codes; the directory loads with its
    routed experts kept as FP8 on the CPU operator, and its logits are finite."""
    from cpu_experts.module import CpuExperts
    from hybrid import LLM

    assert write_synthetic_checkpoint(tmp_path, tiny, num_layers=3, fp8=True, num_dense_layers=1) > 0
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["quantization_config"] == FP8_QUANTIZATION_CONFIG and config["first_k_dense_replace"] == 1
    tensors = stored_tensors(tmp_path)
    weights = {n: t for n, t in tensors.items() if not n.endswith("_scale_inv")}
    expected = {n for n, t in weights.items() if is_fp8_quantized_name(n, t)}
    assert {n for n, t in weights.items() if t.dtype == torch.float8_e4m3fn} == expected
    assert {n.removesuffix("_scale_inv") for n in tensors if n.endswith("_scale_inv")} == expected
    assert "model.layers.2.mlp.experts.7.down_proj.weight" in expected
    assert "model.layers.0.self_attn.kv_a_proj_with_mqa.weight" in expected
    for name in expected:
        scale = tensors[name + "_scale_inv"]
        assert scale.dtype == torch.float32
        assert tuple(scale.shape) == tuple(math.ceil(d / 128) for d in weights[name].shape)
        assert torch.isfinite(weights[name].float()).all(), name
    llm = LLM(tmp_path, dtype="float32", expert_placement="cpu", max_model_len=64)
    assert [m.op.spec.dtype for m in llm.model.modules() if isinstance(m, CpuExperts)] == ["fp8", "fp8"]
    logits = llm.prefill_logits([5, 6, 7])
    assert logits.shape == (3, 512) and torch.isfinite(logits).all()
    llm.close()


def test_dense_layer_count_of_a_synthetic_shape():
    """DeepSeek-V3 at 4 layers keeps the released order (3 dense, 1 MoE) unless told; a shape without dense layers
    refuses any; GLM's per-layer list follows the count."""
    assert shape_config("deepseek-v3", 4)["first_k_dense_replace"] == 3
    assert shape_config("deepseek-v3", 4, num_dense_layers=1)["first_k_dense_replace"] == 1
    assert shape_config("glm-4.7-flash", 3, num_dense_layers=2)["mlp_layer_types"] == ["dense", "dense", "sparse"]
    assert "first_k_dense_replace" not in shape_config("qwen3-30b-a3b", 2, num_dense_layers=0)
    with pytest.raises(ValueError, match="has no dense layers"):
        shape_config("qwen3-30b-a3b", 2, num_dense_layers=1)
    with pytest.raises(ValueError, match="must be in 0..4"):
        shape_config("deepseek-v3", 4, num_dense_layers=5)


def test_load_benchmark_prints_its_row(tmp_path, tiny, capsys):
    """`hybrid-bench load --synthetic --fp8` writes the checkpoint (1 dense layer, then MoE), reads it cold and
    warm, starts the model in a child with its experts as stored on the CPU, and prints one JSON row whose phases add
    up to the time to ready."""
    assert main(["load", "--synthetic", tiny, "--layers", "3", "--fp8", "--workdir", str(tmp_path),
                 "--device", "cpu", "--dtype", "float32", "--json"]) == 0
    row = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    path = tmp_path / "hybrid-bench-load" / "tiny-3l-1d-fp8"
    assert row["model"] == str(path) and row["expert_formats"] == ["fp8"]
    assert row["checkpoint_gb"] == pytest.approx(sum(p.stat().st_size for p in path.glob("*.safetensors")) / 1e9)
    for key in ("cold_read_gb_s", "warm_read_gb_s", "load_gb_s", "of_cold_read", "of_warm_read", "ready_s",
                "import_s", "experts_s", "expert_gb", "peak_rss_gb", "child_s"):
        assert row[key] > 0, key
    assert row["pin_s"] == row["pinned_gb"] == 0  # nothing is page-locked off CUDA
    phases = row["build_s"] + row["dense_s"] + row["experts_s"] + row["pin_s"] + row["finish_s"]
    assert phases == pytest.approx(row["ready_s"], abs=1e-6)
    assert row["load_gb_s"] == pytest.approx(row["checkpoint_gb"] / row["ready_s"])


def test_load_benchmark_names_a_bad_model_directory(tmp_path, capsys):
    assert main(["load", "--model", str(tmp_path / "missing"), "--device", "cpu"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("hybrid-bench load: error: --model ") and "config.json" in err[0]
