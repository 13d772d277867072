"""Device check of tensor parallelism on 2 GPUs (NCCL, CUDA graphs with the collectives captured), run by hand on a
multi-GPU host (a helper, not a test module): `python3 tests/tp_device_check.py [OUT_DIR]`.

1. Parity, bf16: a Qwen3-MoE (GQA, KV heads split) and a DeepSeek-V3 (MLA) of small sizes with large-spread weights
   (`checkpoints.make_checkpoint`): tp=2 against tp=1, the eager prefill's logits (relative to the largest) and
   the greedy tokens of an engine decoding 4 requests through CUDA graphs (both sizes must replay graphs).
2. Decode tokens/s at tp=1 and tp=2, batch 1 and 16, of a synthetic Qwen3-30B-A3B of 4 layers (bf16, every expert on
   the GPUs, `hybrid.synthetic`), measured through the engine from outside.
Prints one JSON line per result and writes them all to OUT_DIR/tp_check.json; exit status 1 where parity fails.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers as T

sys.path.insert(0, str(Path(__file__).parent))

from checkpoints import make_checkpoint, prompt  # noqa: E402

from hybrid import LLM  # noqa: E402
from hybrid.engine import Engine  # noqa: E402
from hybrid.synthetic import write_synthetic_checkpoint  # noqa: E402

VOCAB = 2048
LOGIT_TOLERANCE = 3e-2  # bf16 weights and activations, summed in another order over the ranks
COMMON = dict(vocab_size=VOCAB, hidden_size=512, num_attention_heads=8, num_hidden_layers=3, intermediate_size=1024,
              moe_intermediate_size=256, num_experts_per_tok=4, max_position_embeddings=4096, rms_norm_eps=1e-6,
              tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def qwen3_moe() -> T.Qwen3MoeConfig:
    return T.Qwen3MoeConfig(**COMMON, num_key_value_heads=4, head_dim=64, num_experts=16, norm_topk_prob=True,
                            mlp_only_layers=[0], decoder_sparse_step=1,
                            rope_parameters={"rope_type": "default", "rope_theta": 1e6})


def deepseek_v3() -> T.DeepseekV3Config:
    return T.DeepseekV3Config(**COMMON, num_key_value_heads=8, q_lora_rank=256, kv_lora_rank=512,
                              qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, first_k_dense_replace=1,
                              n_routed_experts=16, n_shared_experts=1, n_group=4, topk_group=2, norm_topk_prob=True,
                              routed_scaling_factor=2.5, num_nextn_predict_layers=0,
                              rope_parameters={"rope_type": "default", "rope_theta": 1e4})


def parity_run(path, tp: int) -> dict:
    llm = LLM(path, device="cuda", dtype="bfloat16", expert_placement="device", tensor_parallel_size=tp,
              max_model_len=512)
    try:
        logits = llm.prefill_logits(prompt(40, seed=1, vocab=VOCAB)).cpu()
        engine = Engine(llm, max_num_seqs=4)
        tokens = engine.generate([prompt(n, seed=n, vocab=VOCAB) for n in (5, 17, 33, 64)], max_tokens=24,
                                 ignore_eos=True)
        graphs = engine.runner.graphs
        replays = graphs.num_replays if graphs is not None else 0
        engine.close()
    finally:
        llm.close()
    return {"logits": logits, "tokens": tokens, "graph_replays": replays}


def parity(name: str, cfg, workdir: Path) -> dict:
    path = workdir / name
    make_checkpoint(cfg, path, seed=1, dtype=torch.bfloat16)
    one, two = parity_run(path, 1), parity_run(path, 2)
    scale = float(one["logits"].abs().max())
    error = float((one["logits"] - two["logits"]).abs().max()) / scale
    same = sum(a == b for x, y in zip(one["tokens"], two["tokens"], strict=True) for a, b in zip(x, y, strict=True))
    total = sum(len(x) for x in one["tokens"])
    # bf16 sums in another order may flip a near-tie late in a sequence: the first tokens must agree, all of them
    # should (`tokens_equal`)
    ok = (error < LOGIT_TOLERANCE and [t[0] for t in one["tokens"]] == [t[0] for t in two["tokens"]]
          and min(one["graph_replays"], two["graph_replays"]) > 0)
    return {"check": f"parity {name}", "ok": ok, "logit_rel_error": error,
            "tokens_equal": one["tokens"] == two["tokens"], "same_tokens": f"{same}/{total}",
            "graph_replays": [one["graph_replays"], two["graph_replays"]]}


def decode_rate(path, tp: int, batches=(1, 16), num_tokens: int = 64) -> list[dict]:
    llm = LLM(path, device="cuda", dtype="bfloat16", expert_placement="device", tensor_parallel_size=tp,
              max_model_len=1024)
    rows = []
    try:
        for batch in batches:
            engine = Engine(llm, max_num_seqs=batch)
            ids = [engine.add_request(prompt(64, seed=i, vocab=llm.config.vocab_size), max_tokens=num_tokens + 1,
                                      ignore_eos=True) for i in range(batch)]
            while not all(engine.requests[i].output_ids for i in ids):  # prefill, and the first token
                engine.step()
            torch.cuda.synchronize()
            start, steps = time.perf_counter(), 0
            while engine.has_work():
                engine.step()
                steps += 1
            seconds = time.perf_counter() - start
            graphs = engine.runner.graphs
            rows.append({"check": "decode qwen3-30b-a3b 4 layers", "tp": tp, "batch": batch,
                         "tokens_per_s": batch * num_tokens / seconds, "step_ms": seconds / steps * 1e3,
                         "graph_replays": graphs.num_replays if graphs is not None else 0})
            engine.close()
    finally:
        llm.close()
    return rows


def main() -> int:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(".")
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        for name, cfg in (("qwen3_moe", qwen3_moe()), ("deepseek_v3", deepseek_v3())):
            rows.append(parity(name, cfg, workdir))
            print(json.dumps(rows[-1]), flush=True)
        synthetic = workdir / "qwen3-30b-a3b-4l"
        write_synthetic_checkpoint(synthetic, "qwen3-30b-a3b", 4)
        for tp in (1, 2):
            for row in decode_rate(synthetic, tp):
                rows.append(row)
                print(json.dumps(row), flush=True)
    (out / "tp_check.json").write_text(json.dumps(rows, indent=1))
    return 0 if all(r.get("ok", True) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
