"""The plain-PyTorch path on CUDA: bf16 and float32 models against transformers on the same device.
Skipped where no GPU is present (CI); run on the device machine."""

import pytest
import torch
import transformers as T

from hybrid import LLM

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

CONFIGS = {
    "qwen3_moe": lambda: T.Qwen3MoeConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
        mlp_only_layers=[0], norm_topk_prob=True),
    "deepseek_v3": lambda: T.DeepseekV3Config(
        vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, n_group=2, topk_group=1,
        num_experts_per_tok=2, first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=16,
        qk_nope_head_dim=16, v_head_dim=16),
    "glm4_moe": lambda: T.Glm4MoeConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, n_routed_experts=8, n_group=2, topk_group=1,
        num_experts_per_tok=2, first_k_dense_replace=1, use_qk_norm=True, attention_bias=True),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_cuda_float32_matches_transformers(tmp_path, name):
    torch.manual_seed(0)
    model = T.AutoModelForCausalLM.from_config(CONFIGS[name](), attn_implementation="eager").eval()
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.15) if param.dim() > 1 else param.normal_(1, 0.1)
        for buf_name, buf in model.named_buffers():
            if "e_score" in buf_name:
                buf.normal_(0, 0.1)
    model.save_pretrained(tmp_path)
    model = model.cuda()
    ids = [3, 17, 5, 99, 42, 7, 1, 64, 23]
    llm = LLM(tmp_path, device="cuda", dtype="float32")
    with torch.no_grad():
        ref = model(torch.tensor([ids], device="cuda")).logits[0].float()
    ours = llm.prefill_logits(ids)
    assert ours.device.type == "cuda"
    assert (ours - ref).abs().max() <= 1e-4 * ref.abs().max()
    expected = model.generate(torch.tensor([ids], device="cuda"), max_new_tokens=16, min_new_tokens=16,
                              do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
    assert llm.generate(ids, 16, ignore_eos=True) == expected
    bf16 = LLM(tmp_path, device="cuda", dtype="bfloat16")
    assert len(bf16.generate(ids, 8, temperature=0.8, seed=1)) == 8
