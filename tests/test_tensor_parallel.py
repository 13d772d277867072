"""Tensor parallelism on the CPU (gloo, float32, separate processes): the model split over 2 and 3 ranks gives the
logits of one process within float32 rounding and the same greedy tokens, for GQA (gpt-oss at tp=2: KV heads split,
q/k/v/o biases, sinks, sliding windows, biased experts; Qwen2-MoE at tp=3: one KV head replicated on 3 ranks, a
gated shared expert, the vocabulary padded) and MLA (DeepSeek-V3 with attention biases at tp=2 and 3); the engine at
tp=2 gives the tokens of tp=1 under batching and prefix caching; a dead worker, or one that fails, is an error in
rank 0; what is not split is refused.
Each (model, size) LLM is started once per module: spawning ranks is the slow part."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import pytest
import torch
import transformers as T
from checkpoints import VOCAB, make_checkpoint, prompt
from test_gpt_oss import make_gpt_oss

from hybrid import LLM, parallel
from hybrid.cli_args import add_arguments, from_namespace
from hybrid.engine import Engine
from hybrid.engine_config import EngineConfig
from hybrid.errors import ConfigError
from hybrid.models import load_model_config

HIDDEN, HEADS = 48, 6
PROMPTS = [prompt(n, seed=700 + n) for n in (1, 7, 19)]
NUM_GREEDY = 8
# the engine scenario: requests of different lengths sharing a 2-page prefix, batched in chunks of 24 tokens
PREFIX = prompt(32, seed=800)
REQUESTS = [PREFIX + prompt(n, seed=810 + n) for n in (3, 11, 1, 20)]
MAX_TOKENS = [6, 3, 8, 5]


def _common(**kwargs) -> dict:
    return dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_attention_heads=HEADS, num_hidden_layers=3,
                max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False, intermediate_size=96,
                moe_intermediate_size=48, num_experts_per_tok=3, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                **kwargs)


def qwen2_moe(num_kv_heads: int) -> T.Qwen2MoeConfig:
    # layer 1 MoE (gated shared expert), layers 0 and 2 dense; q/k/v biases
    return T.Qwen2MoeConfig(**_common(
        num_key_value_heads=num_kv_heads, num_experts=8, shared_expert_intermediate_size=48, norm_topk_prob=False,
        decoder_sparse_step=2, qkv_bias=True, rope_parameters={"rope_type": "default", "rope_theta": 1e6}))


def deepseek_v3() -> T.DeepseekV3Config:
    # layer 0 dense; q LoRA; grouped sigmoid routing; attention biases (q_a, kv_a replicated; o_proj's once)
    return T.DeepseekV3Config(**_common(
        num_key_value_heads=HEADS, q_lora_rank=24, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16,
        v_head_dim=24, first_k_dense_replace=1, n_routed_experts=8, n_shared_experts=1, n_group=4, topk_group=2,
        norm_topk_prob=True, routed_scaling_factor=2.5, attention_bias=True, num_nextn_predict_layers=0,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4}))


@dataclass
class Run:
    logits: list[torch.Tensor]
    greedy: list[int]
    engine: list[list[int]] | None = None
    num_cached: list[int] | None = None
    beside: torch.Tensor | None = None  # a one-process LLM's logits, built while the tensor-parallel one is open


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """Every rank of a run computes on one thread (the ranks set theirs so); tp=1 too, so that it does not wait on
    a second thread spinning against the other processes on a 2-core machine."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def engine_scenario(llm) -> tuple[list[list[int]], list[int]]:
    """The first request alone (its prefix pages published), then the rest together in chunks of 24 tokens."""
    engine = Engine(llm, max_num_batched_tokens=24, max_num_seqs=3)
    first = engine.generate(REQUESTS[:1], max_tokens=MAX_TOKENS[0], ignore_eos=True)
    ids = [engine.add_request(r, max_tokens=m, ignore_eos=True) for r, m in zip(REQUESTS[1:], MAX_TOKENS[1:],
                                                                                strict=True)]
    while engine.has_work():
        engine.step()
    requests = [engine.requests[i] for i in ids]
    assert engine.blocks.num_free == engine.blocks.num_blocks
    engine.close()
    return first + [r.output_ids for r in requests], [r.num_cached for r in requests]


def run(path, tp: int, *, with_engine: bool = False, kill_worker: bool = False, fail_worker: bool = False,
        **options) -> Run:
    llm = LLM(path, device="cpu", dtype="float32", tensor_parallel_size=tp, **options)
    try:
        result = Run([llm.prefill_logits(p) for p in PROMPTS], llm.generate(PROMPTS[2], NUM_GREEDY, ignore_eos=True))
        if with_engine:
            result.engine, result.num_cached = engine_scenario(llm)
            alone = LLM(path, device="cpu", dtype="float32")
            result.beside = alone.prefill_logits(PROMPTS[2])
            alone.close()
        if kill_worker:  # a worker gone: the next step is an error naming it, not a hang
            llm.workers.processes[-1].kill()
            llm.workers.processes[-1].join()
            with pytest.raises(RuntimeError, match=f"tensor-parallel rank {tp - 1} exited"):
                llm.prefill_logits(PROMPTS[1])
        if fail_worker:  # a worker that raises: its own error, raised in rank 0 at the next step
            llm.workers.send(("no such command",))
            with pytest.raises(RuntimeError, match="rank 1 failed: RuntimeError: unknown tensor-parallel command"):
                llm.prefill_logits(PROMPTS[1])
    finally:
        llm.close()
    assert not parallel.is_initialized()
    return result


@pytest.fixture(scope="module")
def gqa_runs(tmp_path_factory):
    """gpt-oss at tp=2 (KV heads split; q/k/v/o biases, sinks, sliding-window layers, biased experts; with the
    engine scenario) and Qwen2-MoE at tp=3 (one KV head replicated on 3 ranks, gated shared expert)."""
    oss = tmp_path_factory.mktemp("gpt_oss")
    make_gpt_oss(oss)
    qwen = tmp_path_factory.mktemp("qwen2_moe_kv1")
    make_checkpoint(qwen2_moe(1), qwen, seed=4)
    return {"gpt_oss": (run(oss, 1, with_engine=True), run(oss, 2, with_engine=True)),
            "qwen2_moe": (run(qwen, 1), run(qwen, 3, kill_worker=True))}


@pytest.fixture(scope="module")
def mla_runs(tmp_path_factory):
    path = tmp_path_factory.mktemp("deepseek_v3")
    make_checkpoint(deepseek_v3(), path, seed=1)
    runs = {tp: run(path, tp, fail_worker=tp == 2) for tp in (1, 2, 3)}
    # the CPU operator's experts (int8, quantized at load) with 3 experts a layer on the "GPUs" (here the ranks'
    # devices): each rank computes its slice of I of the other experts and its share of the resident ones
    cpu_experts = dict(expert_placement="cpu", gpu_experts=3, numa_partitions=2)
    runs |= {("cpu", tp): run(path, tp, **cpu_experts) for tp in (1, 2)}
    return runs


def assert_same_run(got: Run, want: Run) -> None:
    for g, w in zip(got.logits, want.logits, strict=True):
        scale = float(w.abs().max())
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5 * scale)
        top = w[-1].topk(2).values  # the greedy comparison means something only without near-ties
        assert float(top[0] - top[1]) > 1e-4 * scale
    assert got.greedy == want.greedy


@pytest.mark.parametrize("model", ["gpt_oss", "qwen2_moe"], ids=["kv_split_tp2", "kv_replicated_tp3"])
def test_gqa_matches_one_process(gqa_runs, model):
    want, got = gqa_runs[model]
    assert_same_run(got, want)


@pytest.mark.parametrize("tp", [2, 3])
def test_mla_matches_one_process(mla_runs, tp):
    assert_same_run(mla_runs[tp], mla_runs[1])


def test_cpu_experts_split_over_ranks_match_one_process(mla_runs):
    """Rank r drives its slice of I of every CPU-resident expert (2 partitions each) and its share of the resident
    ones, dealt over the ranks; the MoE block's one all-reduce sums the slices and shares."""
    assert_same_run(mla_runs["cpu", 2], mla_runs["cpu", 1])


def test_engine_batching_and_prefix_cache_match_one_process(gqa_runs):
    want, got = gqa_runs["gpt_oss"]
    assert torch.equal(got.beside, want.logits[2])  # rank 0 builds one-process models as before
    assert got.engine == want.engine
    assert got.num_cached == want.num_cached and min(got.num_cached) == 32  # the shared prefix's 2 pages


def test_shard_targets_take_this_ranks_part():
    full = torch.arange(6 * 4 * 3, dtype=torch.float32).view(24, 3)  # 6 heads of 4 rows
    for rank, first_head in ((0, 0), (1, 0), (2, 1), (3, 1)):  # 2 KV heads replicated on 4 ranks
        local = torch.empty(4, 3)
        target = parallel.ShardTarget(local, parallel.heads(2), parallel.TensorParallel(rank, 4))
        assert target.shape == (8, 3)
        target.copy_(full[:8])
        assert torch.equal(local, full[4 * first_head:4 * first_head + 4])
    local = torch.empty(3, 3)  # 7 vocabulary rows on 3 ranks: 3, 3, 1 and two zero rows
    target = parallel.ShardTarget(local, parallel.vocab(7), parallel.TensorParallel(2, 3))
    assert target.shape == (7, 3)
    target.copy_(full[:7])
    assert torch.equal(local[0], full[6]) and not local[1:].any()
    bias = torch.empty(3)
    parallel.ShardTarget(bias, parallel.ONCE, parallel.TensorParallel(1, 2)).copy_(torch.ones(3))
    assert not bias.any()


def test_unsplit_settings_are_refused(tmp_path):
    def check(cfg, **engine):
        cfg.architectures = [type(cfg).__name__.replace("Config", "ForCausalLM")]
        cfg.save_pretrained(tmp_path)
        _, config = load_model_config(tmp_path)
        parallel.check_tensor_parallel(config, EngineConfig(**engine), False)

    with pytest.raises(ConfigError, match="num_attention_heads 6 is not divisible by tensor_parallel_size 4"):
        check(qwen2_moe(2), tensor_parallel_size=4)
    with pytest.raises(ConfigError, match="num_key_value_heads 2 and tensor_parallel_size 3"):
        check(qwen2_moe(2), tensor_parallel_size=3)
    with pytest.raises(ConfigError, match="qk_norm over the whole projection"):
        check(T.MiniMaxM2Config(**_common(num_key_value_heads=2, head_dim=8, num_local_experts=8)),
              tensor_parallel_size=2)
    with pytest.raises(ConfigError, match="defer_experts"):
        check(qwen2_moe(2), tensor_parallel_size=2, defer_experts=1)


def test_tp_flag_and_its_alias():
    parser = argparse.ArgumentParser()
    add_arguments(parser, EngineConfig)
    assert from_namespace(EngineConfig, parser.parse_args(["--tp", "3"])).tensor_parallel_size == 3
    assert from_namespace(EngineConfig, parser.parse_args([])).tensor_parallel_size == 1
    with pytest.raises(ConfigError, match="tensor_parallel_size must be >= 1"):
        EngineConfig(tensor_parallel_size=0)
