"""Every registered architecture against transformers' own forward: float32 prefill logits and 32 greedy tokens."""

import copy
import json

import pytest
import torch
from tiny_models import VARIANTS, build_reference

from hybrid import LLM

PROMPTS = [[7], [3, 17, 5, 99, 42, 7, 1], list(range(11, 44))]


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def reference(request, tmp_path_factory):
    model = build_reference(request.param)
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    return request.param, model, path


def hf_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def test_prefill_logits_match(reference):
    name, model, path = reference
    llm = LLM(path, device="cpu", dtype="float32")
    for ids in PROMPTS:
        ours, ref = llm.prefill_logits(ids), hf_logits(model, ids)
        assert ours.shape == ref.shape and ours.dtype == torch.float32
        err = (ours - ref).abs().max() / ref.abs().max()
        assert err <= 1e-4, f"{name}: prompt of {len(ids)} tokens, relative error {err:.2e}"


def test_greedy_generate_matches_with_kv_cache(reference):
    name, model, path = reference
    llm = LLM(path, device="cpu", dtype="float32", block_size=4)  # 32 tokens cross several pages
    prompt = [3, 17, 5, 99, 42]
    expected = model.generate(torch.tensor([prompt]), max_new_tokens=32, min_new_tokens=32, do_sample=False,
                              eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    assert len(expected) == 32
    before = llm.num_forward_tokens
    assert llm.generate(prompt, max_new_tokens=32, ignore_eos=True) == expected, name
    # One prefill of the prompt, then one token per step: the cache, not recomputation, carries the context.
    assert llm.num_forward_tokens - before == len(prompt) + 32 - 1


def test_generation_stops_at_eos(reference):
    name, model, path = reference
    llm = LLM(path, device="cpu", dtype="float32")
    free_run = llm.generate([9, 8, 7], max_new_tokens=12, ignore_eos=True)
    eos = free_run[5]
    config = json.loads((path / "config.json").read_text())
    stopped = llm.generate([9, 8, 7], max_new_tokens=12, stop_token_ids=[eos])
    assert stopped == free_run[: free_run.index(eos) + 1]
    assert config["architectures"][0] in type(llm.model).__name__


def test_sharded_bf16_checkpoint(tmp_path):
    reference = build_reference("deepseek_v3_yarn", seed=3)
    with torch.no_grad():
        for param in reference.parameters():
            param.copy_(param.bfloat16().float())  # the reference computes in float32 on bf16-representable values
    # A bf16 copy for the checkpoint; casting the reference itself would also round its RoPE frequency buffer.
    copy.deepcopy(reference).to(torch.bfloat16).save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    llm = LLM(tmp_path, device="cpu", dtype="float32")
    ids = [1, 2, 3, 250, 17]
    ours, ref = llm.prefill_logits(ids), hf_logits(reference, ids)
    assert (ours - ref).abs().max() <= 1e-4 * ref.abs().max()
