"""`hybrid-bench` dispatch and the synthetic shapes its benchmarks build (the timing itself is not tested)."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from hybrid.bench import main
from hybrid.models import MODEL_REGISTRY, load_model_config
from hybrid.synthetic import SHAPES, shape_config, write_synthetic_checkpoint

# At the released layer counts the synthetic configs have the released models' total sizes, in billions, counting every
# routed expert (MTP layers and vision towers excluded). Where each published figure comes from:
# - kimi-k2.5: Kimi-K2.5 is Kimi-K2-Base continued (its model card); the Kimi K2 technical report (arXiv:2507.20534)
#   gives 1.04 trillion total / 32 billion activated parameters for that text model.
# - minimax-m2: MiniMax-M2's model card: 230 billion total / 10 billion active parameters.
# - glm-4.7-flash: GLM-4.7-Flash's model card: "a 30B-A3B MoE model" (30 billion total, 3 billion active).
# - mimo-v2-flash: MiMo-V2-Flash's model card: 309 billion total / 15 billion active parameters.
# - gpt-oss-120b / gpt-oss-20b: the gpt-oss model card: 116.8 and 20.9 billion total parameters.
# - qwen3-next-80b-a3b, qwen3.6-35b-a3b, qwen3.5-397b-a17b: the model cards' 80, 35 and 397 billion (the last two
#   counting a vision tower of under a billion, which the synthetic text model leaves out).
RELEASED = {"qwen3-30b-a3b": (48, 30.5), "qwen3-235b-a22b": (94, 235.1), "deepseek-v3": (61, 671.0),
            "kimi-k2.5": (61, 1040.0), "minimax-m2": (62, 230.0), "glm-4.7-flash": (47, 30.0),
            "mimo-v2-flash": (48, 309.0), "gpt-oss-120b": (36, 116.8), "gpt-oss-20b": (24, 20.9),
            "qwen3-next-80b-a3b": (48, 80.0), "qwen3.6-35b-a3b": (40, 35.0), "qwen3.5-397b-a17b": (60, 397.0),
            # V3.2: V3's 671B main model plus the indexers (0.9B; the 685B of its card counts the MTP layer)
            "deepseek-v3.2": (61, 671.0), "glm-5": (78, 744.0)}


def test_usage_lists_the_benchmarks(capsys):
    assert main([]) == 2
    assert main(["no-such-benchmark"]) == 2
    assert "convert" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without a GPU")
def test_kernels_benchmark_needs_a_gpu(capsys):
    assert main(["kernels"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().out


def test_every_kernel_module_has_bench_cases():
    """`hybrid-bench kernels` covers every kernel module of gpu_layers (a new one must join its list)."""
    import importlib
    import pkgutil

    import gpu_layers
    from gpu_layers.bench import MODULES

    with_cases = {m.name for m in pkgutil.iter_modules(gpu_layers.__path__)
                  if hasattr(importlib.import_module(f"gpu_layers.{m.name}"), "bench_cases")}
    assert with_cases == set(MODULES)


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_synthetic_shapes_are_the_released_models(tmp_path, shape):
    architecture = SHAPES[shape]["architectures"][0]
    if architecture not in MODEL_REGISTRY:  # GLM-4.7-Flash's family lands from another branch; then this runs
        pytest.skip(f"{architecture} is not registered yet")
    layers, billions = RELEASED[shape]
    (tmp_path / "config.json").write_text(json.dumps(shape_config(shape, layers)))
    cls, config = load_model_config(tmp_path)
    assert config.num_layers == layers
    with torch.device("meta"):
        model = cls(config)
    total = sum(p.numel() for p in model.parameters()) / 1e9
    assert abs(total - billions) / billions < 0.015, f"{shape}: {total:.1f}B parameters, released {billions}B"


def test_synthetic_checkpoint_loads(tmp_path, monkeypatch):
    """A synthetic checkpoint is a valid checkpoint (shrunk here: the real shapes are gigabytes per layer)."""
    small = dict(SHAPES["qwen3-30b-a3b"], vocab_size=512, hidden_size=64, intermediate_size=96,
                 moe_intermediate_size=32, num_experts=8, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    monkeypatch.setitem(SHAPES, "tiny", small)
    total = write_synthetic_checkpoint(tmp_path, "tiny", num_layers=2)
    assert total > 0
    from hybrid import LLM

    logits = LLM(tmp_path, dtype="float32").prefill_logits([5, 6, 7])
    assert logits.shape == (3, 512) and torch.isfinite(logits).all()


@pytest.mark.parametrize("dtype, group", [("int8", 0), ("int4", 32)])
def test_synthetic_converted_model_without_a_source(tmp_path, monkeypatch, dtype, group):
    """`--no-source`: a converted directory written directly, one expert file for every MoE layer; the runtime
    loads it as it loads hybrid-convert's output, each layer's experts in memory of its own, and its logits are
    finite (the codes' scales keep the weights near std 0.02)."""
    from cpu_experts.module import CpuExperts
    from hybrid import LLM
    from hybrid.synthetic import write_synthetic_converted

    small = dict(SHAPES["qwen3-30b-a3b"], vocab_size=512, hidden_size=64, intermediate_size=96,
                 moe_intermediate_size=64, num_experts=8, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    monkeypatch.setitem(SHAPES, "tiny", small)
    assert write_synthetic_converted(tmp_path, "tiny", num_layers=3, expert_dtype=dtype, group_size=group) > 0
    assert sorted(p.name for p in (tmp_path / "experts").iterdir()) == ["shared.safetensors"]
    llm = LLM(tmp_path, dtype="float32")
    modules = [m for m in llm.model.modules() if isinstance(m, CpuExperts)]
    assert len(modules) == 3
    logits = llm.prefill_logits([5, 6, 7])
    assert logits.shape == (3, 512) and torch.isfinite(logits).all()
    llm.close()


# The released shapes shrunk to a few MiB: the wrapper's and MiniMax's own keys stay, the sizes go.
SMALL = {
    "kimi-k2.5": {"text_config": dict(vocab_size=512, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                                      n_routed_experts=8, num_attention_heads=4, num_key_value_heads=4,
                                      q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16,
                                      v_head_dim=16)},
    "minimax-m2": dict(vocab_size=512, hidden_size=64, intermediate_size=32, num_local_experts=8,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=32, rotary_dim=16),
}


@pytest.mark.parametrize("shape", sorted(SMALL))
def test_synthetic_checkpoint_of_a_new_family_loads(tmp_path, monkeypatch, shape):
    """Kimi-K2.5's synthetic checkpoint is written in its published layout (the text model under `language_model.`,
    the layer count in `text_config`); MiniMax-M2's from its published keys; both load and run."""
    small = copy.deepcopy(SHAPES[shape])
    for key, value in SMALL[shape].items():
        small[key] = small[key] | value if isinstance(value, dict) else value
    monkeypatch.setitem(SHAPES, "tiny", small)
    assert write_synthetic_checkpoint(tmp_path, "tiny", num_layers=3) > 0
    names = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    if shape == "kimi-k2.5":
        config = json.loads((tmp_path / "config.json").read_text())
        assert config["text_config"]["num_hidden_layers"] == 3 and "num_hidden_layers" not in config
        assert all(n.startswith(("language_model.model.", "language_model.lm_head.")) for n in names)
        assert names["language_model.model.layers.2.mlp.experts.7.up_proj.weight"] == "model-layer-002.safetensors"
    from hybrid import LLM

    llm = LLM(tmp_path, dtype="float32")
    assert llm.config.num_layers == 3
    logits = llm.prefill_logits([5, 6, 7])
    assert logits.shape == (3, 512) and torch.isfinite(logits).all()


def test_engine_benchmarks_run_on_a_converted_model(tmp_path, capsys):
    """`hybrid-bench decode/prefill --model DIR` on a tiny converted checkpoint (the timing itself is not tested)."""
    from checkpoints import SEEDS, VARIANTS, make_checkpoint

    from convert.cli import main as convert

    make_checkpoint(VARIANTS["qwen3_moe"](), tmp_path / "src", seed=SEEDS["qwen3_moe"])
    assert convert([str(tmp_path / "src"), str(tmp_path / "dst")]) == 0
    capsys.readouterr()
    for mode, tokens in (("decode", "4"), ("prefill", "40")):
        assert main([mode, "--model", str(tmp_path / "dst"), "--device", "cpu", "--dtype", "float32",
                     "--tokens", tokens, "--json"]) == 0
        row = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert row["mode"] == mode and row["tokens_per_s"] > 0 and row["of_bound"] > 0
        assert row["split_cpu_fraction"] is None and row["split_rates"] is None  # nothing streams off CUDA
        # on the CPU nothing overlaps the experts: the bound adds the rest of the step to the experts' reads
        assert 0 < row["physical_bound_ms"] < row["bound_ms"], row
        assert row["of_physical_bound"] == pytest.approx(row["physical_bound_ms"] / row["step_ms"])
        assert 1 <= row["num_physical_cores"] <= row["num_cpus"]
    # tensor parallel (gloo here): the engine over 2 ranks, each with its slice of the CPU experts
    assert main(["decode", "--model", str(tmp_path / "dst"), "--device", "cpu", "--dtype", "float32",
                 "--tokens", "4", "--json", "--tp", "2"]) == 0
    row = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert row["tokens_per_s"] > 0
    # each rank's own CPU experts over the timed steps (their rows of the ranks' table), rank 0 first
    ranks = row["rank_cpu_experts_ms"]
    assert len(ranks) == 2 and min(ranks) > 0 and row["max_rank_cpu_experts_ms"] == max(ranks), row


def test_read_bandwidth_by_pinned_threads_and_by_openmp():
    """The bound's read rate, measured by pinned threads (the decode pool's) or numba's team: both read it all."""
    import numpy as np

    from cpu_experts.bench import ReadBandwidth, _read_all, _sum

    assert _sum(np.arange(1001, dtype=np.int64)) == _read_all(np.arange(1001, dtype=np.int64)) == 500500
    for cpus in ((0, 0, 0), None):  # three threads sharing a CPU: each share timed to the last one's end
        rate = ReadBandwidth(3 << 20, cpus)()
        assert 1e8 < rate < 1e13


def test_synthetic_gpt_oss_without_a_source(tmp_path, monkeypatch):
    """gpt-oss's converted directory: its fused expert tensors are not written as dense weights, and the expert file
    carries the model's activation and biases, in the published MXFP4 format."""
    from hybrid import LLM
    from hybrid.synthetic import write_synthetic_converted

    small = dict(SHAPES["gpt-oss-20b"], vocab_size=512, hidden_size=64, intermediate_size=64, num_local_experts=8,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    monkeypatch.setitem(SHAPES, "tiny", small)
    assert write_synthetic_converted(tmp_path, "tiny", num_layers=2, expert_dtype="mxfp4") > 0
    llm = LLM(tmp_path, dtype="float32")
    spec = llm.model.model.layers[0].mlp.experts.cpu_experts.op.spec
    assert spec.dtype == "mxfp4" and spec.activation.kind == "swiglu_oai" and spec.has_bias
    logits = llm.prefill_logits([5, 6, 7])
    assert logits.shape == (3, 512) and torch.isfinite(logits).all()
    llm.close()


def test_synthetic_qwen3_5_without_a_source(tmp_path, monkeypatch):
    """Qwen3.5's wrapper with Gated DeltaNet and full layers: a source-less converted directory loads (state slots,
    CPU experts) and its logits are finite."""
    from hybrid import LLM
    from hybrid.synthetic import write_synthetic_converted

    text = dict(SHAPES["qwen3.6-35b-a3b"]["text_config"], vocab_size=512, hidden_size=64, num_attention_heads=4,
                head_dim=16, moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=8,
                num_experts_per_tok=2, linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
                linear_value_head_dim=16)
    monkeypatch.setitem(SHAPES, "tiny", dict(SHAPES["qwen3.6-35b-a3b"], text_config=text))
    assert write_synthetic_converted(tmp_path, "tiny", num_layers=4, expert_dtype="int8") > 0
    llm = LLM(tmp_path, dtype="float32")
    logits = llm.prefill_logits([5, 6, 7])
    assert logits.shape == (3, 512) and torch.isfinite(logits).all()
    llm.close()


def test_synthetic_tokenizer_is_a_deterministic_byte_level_bpe():
    """The tokenizer a synthetic model gets for guided decoding: the vocabulary's size less the padding, the same
    for the same seed, any text round trips, and xgrammar reads it as byte-level and constrains with it."""
    import xgrammar

    from hybrid.guided import GrammarCache
    from hybrid.sampling import GuidedSpec
    from hybrid.synthetic_tokenizer import PADDED_TOKENS, build_synthetic_tokenizer

    tokenizer = build_synthetic_tokenizer(2048)
    assert tokenizer.get_vocab() == build_synthetic_tokenizer(2048).get_vocab()
    assert tokenizer.get_vocab() != build_synthetic_tokenizer(2048, seed=1).get_vocab()
    assert len(tokenizer) == 2048 - PADDED_TOKENS and tokenizer.eos_token_id == len(tokenizer) - 1
    assert max(len(token) for token in tokenizer.get_vocab()) > 4  # merged pieces, not bytes alone
    text = '{"name": "Grüße\n\t", "n": [1, 2.5e3]} ✓ 東京'
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text and len(ids) < len(text.encode())
    info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=2048)
    assert info.vocab_type == xgrammar.VocabType.BYTE_LEVEL
    matcher = xgrammar.GrammarMatcher(GrammarCache(2048, tokenizer).get(GuidedSpec("json_schema", json.dumps(
        {"type": "object", "properties": {"name": {"type": "string"}, "n": {"type": "array"}}}))))
    assert all(matcher.accept_token(i) for i in tokenizer.encode('{"name": "Grüße", "n": [1, 2.5e3]}'))
    assert not matcher.accept_token(tokenizer.encode(" x")[0])


def test_decode_benchmark_with_a_json_schema(tmp_path, capsys):
    """`hybrid-bench decode --guided-json`: both rates on the same steps; a schema that ends before --tokens is
    refused, its run being shorter than the one it is set against."""
    from checkpoints import SEEDS, VARIANTS, make_checkpoint

    from convert.cli import main as convert
    from hybrid.synthetic_tokenizer import write_synthetic_tokenizer

    config = VARIANTS["qwen3_moe"]()
    config.vocab_size = 640  # room for a byte-level vocabulary
    make_checkpoint(config, tmp_path / "src", seed=SEEDS["qwen3_moe"])
    assert convert([str(tmp_path / "src"), str(tmp_path / "dst")]) == 0
    write_synthetic_tokenizer(tmp_path / "dst", config.vocab_size)
    capsys.readouterr()
    decode = ["decode", "--model", str(tmp_path / "dst"), "--device", "cpu", "--dtype", "float32", "--tokens", "6",
              "--batch", "2", "--json", "--guided-json"]
    assert main(decode) == 0
    row = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert row["plain_tokens_per_s"] > 0 and row["guided_tokens_per_s"] > 0
    assert row["guided_ratio"] == pytest.approx(row["guided_tokens_per_s"] / row["plain_tokens_per_s"])
    host = row["host_ms_per_step"]  # the engine's own phases: only the constrained runs fill masks
    assert set(host["plain"]) == {"schedule", "run", "masks", "sample", "update"} and host["plain"]["run"] > 0
    assert host["guided"]["masks"] > 0 and host["plain"]["masks"] < host["guided"]["masks"]
    with pytest.raises(SystemExit, match="ended a request after"):
        main([*decode, '{"enum": ["a", "b"]}'])


def test_decode_benchmark_with_skewed_routing_and_hot_experts(tmp_path, monkeypatch, capsys):
    """`--skewed-routing`: the synthetic model (shrunk here) is written with skewed, drifting routing
    (`hybrid.synthetic_routing`) under its own name, and `--hot-experts-interval` moves experts during the timed
    decode (the row counts the swaps); a directory given with --model is refused."""
    small = dict(SHAPES["qwen3-30b-a3b"], vocab_size=512, hidden_size=64, intermediate_size=96,
                 moe_intermediate_size=32, num_experts=16, num_experts_per_tok=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16)
    monkeypatch.setitem(SHAPES, "tiny", small)
    args = ["decode", "--synthetic", "tiny", "--layers", "2", "--no-source", "--workdir", str(tmp_path), "--device",
            "cpu", "--dtype", "float32", "--tokens", "24", "--json", "--gpu-experts", "5"]
    assert main([*args, "--skewed-routing", "8", "--hot-experts-interval", "2"]) == 0
    row = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert row["hot_expert_swaps"] > 0 and "skew8" in row["model"]
    with pytest.raises(SystemExit, match="leave out --model"):
        main(["decode", "--model", row["model"], "--skewed-routing"])
